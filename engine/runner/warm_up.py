"""Start-up work on CUDA that keeps compilation and tuning out of the first steps: the attention and LoRA
kernels of eager steps compiled, the stacked LoRA GEMMs' cover tuned, the step graphs captured."""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

import torch

from engine.attention import AttentionBackend, AttentionMetadata
from engine.cuda_graphs import StepGraphs
from engine.input_batch import StepBuffers
from engine.kernel_policy import KernelPolicy
from engine.models.interfaces import ModelForCausalLM

logger = logging.getLogger("chorus.runner")


def warm_up_attention(backend: AttentionBackend, model: ModelForCausalLM, dtype: torch.dtype) -> None:
    """Compile the attention kernels of eager steps (the KV cache is bound; ``dtype``: the queries')."""
    attn = model.attention_layers()[0]
    t0 = time.perf_counter()
    calls = backend.warm_up(attn.k_cache, attn.v_cache, attn.num_heads, attn.scale, model.rotary_dim,
                            q_dtype=dtype, qk_norm=attn.qk_norm.weights() if attn.qk_norm is not None else None)
    logger.info("Attention kernels for eager steps compiled (%d calls) in %.1f s", calls,
                time.perf_counter() - t0)


def warm_up_lora_kernels(lora_manager, model: ModelForCausalLM, first_eager_tokens: int,
                         max_tokens: int) -> None:
    """Compile the LoRA kernels of eager steps of ``first_eager_tokens``..``max_tokens`` tokens (those no CUDA
    graph covers), with the model's q/k/v consumer (``lora_qkv_warmup_consumer``)."""
    t0 = time.perf_counter()
    calls = lora_manager.warm_up_kernels(first_eager_tokens, max_tokens,
                                         qkv_consumer=model.lora_qkv_warmup_consumer())
    logger.info("LoRA kernels for eager steps of %d-%d tokens compiled (%d calls) in %.1f s",
                first_eager_tokens, max_tokens, calls, time.perf_counter() - t0)


def tune_lora_stacked_gemms(lora_manager, graph_batch_sizes: list[int]) -> None:
    """How many slots the few-adapters decode graphs' stacked GEMMs cover, timed before capture."""
    bound = lora_manager.few_adapters_bound(max(graph_batch_sizes))
    if bound is None:
        return
    t0 = time.perf_counter()
    chosen = lora_manager.tune_stacked_cover(graph_batch_sizes, bound)
    wider = {k: v for k, v in chosen.items() if v != bound}
    logger.info("LoRA stacked GEMMs of steps over %d slots: %d of %d (shape, batch) cases cover more "
                "slots (%s) (%.1f s)", bound, len(wider), len(chosen),
                ", ".join(f"{k[0][0]}->{'+'.join(map(str, k[0][1]))} at {k[1]} tokens: {v}"
                          for k, v in sorted(wider.items())[:8]) or "none",
                time.perf_counter() - t0)


def capture_cuda_graphs(model: ModelForCausalLM, buffers: StepBuffers, max_model_len: int,
                        graph_batch_sizes: list[int], graph_token_sizes: list[int], max_num_seqs: int,
                        lora_manager, policy: KernelPolicy,
                        cross_metadata: Optional[Callable[[int], AttentionMetadata]] = None) -> StepGraphs:
    """Capture the decode and mixed step graphs over the step buffers (``engine.cuda_graphs``);
    ``cross_metadata``: an encoder-decoder model's capture-time cross-attention metadata per batch size."""
    graphs = StepGraphs(model, buffers, max_model_len, graph_batch_sizes, graph_token_sizes, max_num_seqs,
                        lora_manager=lora_manager, policy=policy, cross_metadata=cross_metadata)
    graphs.capture()
    return graphs
