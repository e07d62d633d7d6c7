"""Tensor parallelism over torch.distributed (NCCL on CUDA, gloo on CPU).

Low level, imported by the layers: ``group`` (``TensorParallelGroup``: rank, size, collectives) and
``sharding`` (which rows / columns each rank holds). High level, imported by the engine core only:
``rank`` (what every rank builds), ``worker`` (ranks 1..N-1), ``executor`` (rank 0's handle on them)
and ``messages`` (the per-step broadcast). This file imports none of them, so a layer importing
``engine.distributed.group`` never pulls in the engine.
"""
