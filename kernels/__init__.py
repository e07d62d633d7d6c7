"""Chorus's Triton kernels, each with a checked wrapper and a pure-torch twin.

Modules (import them directly; this package imports nothing, so ``import kernels`` is cheap
and never imports triton, whose TRITON_INTERPRET switch must be set before its first import):

- ``kernels.paged_attention``: attention over the paged KV cache for mixed prefill/decode batches.
- ``kernels.kv_write``: store this step's K/V rows at their cache slots.
- ``kernels.lora_meta``: per-step grouping of tokens by LoRA slot (pure torch).
- ``kernels.lora_shrink`` / ``kernels.lora_expand``: Punica-style grouped LoRA matmuls.
- ``kernels.reference``: the pure-torch twin of every kernel (the test oracle).

NOTE: the name ``kernels`` is also a PyPI distribution that transformers probes for; this
package deliberately exposes nothing that could be mistaken for it.
"""

__all__: list[str] = []
