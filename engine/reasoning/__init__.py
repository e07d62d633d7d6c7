"""Reasoning: a reply's ``<think>...</think>`` part -> ``reasoning_content`` (whole replies and streamed
deltas), and where reasoning ends (a structured-output constraint starts there).

One concept per module, imported by full path (this package module imports nothing):

- ``parser``: the shared types (``ReasoningState``, ``ReasoningSplit``, ``ReasoningDelta``, ``ThinkTagIds``)
  and the ``ReasoningParser`` protocol;
- ``think_tags``: the think-tag state machine (text and token ids) both formats share;
- ``qwen3`` / ``deepseek_r1``: the ``--reasoning-parser`` formats;
- ``registry``: ``REASONING_PARSERS`` and ``get_reasoning_parser``;
- ``engine_gate``: ``ReasoningGate``, the per-request token trackers the engine gives constrained requests.

Server flag (vLLM's): ``--reasoning-parser qwen3|deepseek_r1``.
"""
