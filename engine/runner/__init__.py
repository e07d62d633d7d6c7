"""The model runner (``engine.runner.runner.ModelRunner``) and the parts it runs a step with:

    runner.py           ModelRunner: construction, KV cache allocation, and the step
    state.py            the per-request state the scheduler's diffs keep, and the sampled ids in flight
    pending.py          PendingOutput: one step's result, possibly still on the device
    kv_cache.py         KV cache dtype, block size in bytes, block count, activation reserve, allocation
    media.py            media encoders, the encoder cache, the step's placeholder embeddings
    cross_attention.py  encoder-decoder models: cross-attention K/V writes and metadata
    row_calls.py        model calls on rows outside the step's tokens (encoders, cross K/V)
    sampling.py         logits rules, sampling metadata, sampling, prompt logprobs
    grammar_mask.py     the grammar bitmask of a step's constrained rows, filled while the forward runs
    warm_up.py          kernel warm-up, stacked GEMM tuning and CUDA graph capture at start-up
    step_observer.py    the hook a profiler uses to see each step's device work
"""
