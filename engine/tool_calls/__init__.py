"""Tool calling: a model's text -> OpenAI ``tool_calls`` (whole replies and streamed deltas), and the
checks and JSON schemas of ``tools`` / ``tool_choice``.

One concept per module, imported by full path (this package module imports nothing):

- ``parser``: the shared types (``ToolCall``, ``ExtractedToolCalls``, ``DeltaToolCall``, ``StreamPiece``),
  the ``ToolParser`` protocol and ``StreamingToolParser``, the incremental base every format builds on;
- ``ids``: tool-call ids (OpenAI's ``call_`` + 24 characters, Mistral's 9 characters);
- ``json_scan``: an incremental scanner of one JSON object / value, fed text in any pieces;
- ``object_call``: one call written as a JSON object (``{"name": ..., "arguments": {...}}``) and a JSON
  list of them, reported as soon as the name is known, arguments streamed as they are written;
- ``hermes`` / ``llama3_json`` / ``mistral``: the ``--tool-call-parser`` formats;
- ``constrained``: the output of ``tool_choice`` ``required`` / a named function (schema-constrained);
- ``tool_choice``: validation of ``tools`` + ``tool_choice``, the constraining JSON schemas, and
  ``parse_constrained``;
- ``registry``: ``TOOL_PARSERS`` (the ``--tool-call-parser`` names) and ``get_tool_parser``.

Server flags (vLLM's): ``--enable-auto-tool-choice`` lets ``tool_choice: "auto"`` (the default when a
request has ``tools``) parse calls from free text with ``--tool-call-parser hermes|llama3_json|mistral``;
``required`` and named choices need neither flag: their output is constrained by the tools' schemas.
"""
