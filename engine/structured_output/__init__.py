"""Constrained decoding: the sampled text of a request follows a JSON schema, a regex, a choice, a grammar
or a structural tag.

One concept per module, imported by full path (this package module imports nothing, so that
``engine.sampling_params`` can read ``params`` without loading torch or the grammar libraries):

- ``errors``: ``StructuredOutputError``, a ``ValueError`` carrying the compiler's reason (HTTP 400);
- ``params``: ``StructuredOutputsParams``, the request's constraint (vLLM's shape), and OpenAI's
  ``response_format`` read into it;
- ``spec``: ``GrammarSpec``, the canonical, hashable form of a constraint that backends compile;
- ``backend``: the protocols every backend implements (compile, per-request matcher);
- ``xgrammar_backend`` / ``guidance_backend``: the two backends (xgrammar, llguidance);
- ``json_schema_features``: the JSON schema keywords xgrammar does not enforce;
- ``selection``: ``auto|xgrammar|guidance`` and the auto backend's fallback;
- ``compiler``: the compile pool with its cache, and the synchronous ``validate`` for request processing;
- ``bitmask``: the host token bitmask and its application to logits (torch twin + xgrammar kernels);
- ``manager``: ``StructuredOutputManager``, the scheduler-side bookkeeping of per-request matchers
  (its docstring lists the engine's call points).
"""
