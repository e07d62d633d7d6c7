"""Quantized checkpoints: what a checkpoint's ``quantization_config`` says and how its tensors become the
quantized weights of ``engine.layers.linear.Linear``.

One concept per module, imported by full path (this package module imports nothing):

- ``scheme``: ``CheckpointQuantization``, read from ``quantization_config`` (compressed-tensors FP8 and
  W4A16 ``pack-quantized``, GPTQ, AWQ, HF block-wise ``fp8``), with a one-line error naming the field, the
  value and what is supported for anything else;
- ``slices``: each format's tensors of one projection -> a canonical ``Int4Slice`` / ``Fp8Slice``, and
  ``QuantizedTensorStream``, which groups a checkpoint's tensors by projection as they are read.

The weights themselves (``W4A16Weight``, ``Fp8Weight``) live in ``engine/layers/w4a16.py`` and
``engine/layers/fp8.py``; their GPU kernels in ``kernels/w4a16.py`` and ``kernels/fp8_linear.py``.
"""
