"""Start-up work on CUDA that keeps compilation and tuning out of the first steps: the attention and LoRA
kernels of eager steps compiled, the stacked LoRA GEMMs' cover tuned, the step graphs captured, and each
media item a multimodal model declares (``SupportsMultiModal.media_warm_up``) encoded and prefilled once."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from engine.attention import AttentionBackend, AttentionMetadata
from engine.cuda_graphs import StepGraphs
from engine.input_batch import StepBuffers
from engine.kernel_policy import KernelPolicy
from engine.models.interfaces import MediaWarmUp, ModelForCausalLM
from engine.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from engine.request import MultiModalFeature, PlaceholderRange
from engine.sampling_params import SamplingParams

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


@dataclass(frozen=True)
class MediaWarmUpLimits:
    """What one warm-up step may hold: the limits the scheduler puts on a real step."""

    num_blocks: int
    """KV blocks of the cache (ids 1.. are free at start-up: no request holds one)."""
    block_size: int
    """Tokens per KV block."""
    num_kv_groups: int
    """KV cache groups (groups 1.. get the same block ids as group 0)."""
    max_step_tokens: int
    """Tokens one step may schedule (``max_num_batched_tokens``)."""
    max_model_len: int
    """The longest request."""
    encoder_budget: int
    """Embeddings one step may encode."""
    max_num_seqs: int
    """Requests one step may hold (the runner's rows)."""


def warm_up_media(items: list[MediaWarmUp], execute: Callable[[SchedulerOutput], object],
                  limits: MediaWarmUpLimits) -> int:
    """Run each of a multimodal model's warm-up items as a one-token request through ``execute`` (the runner's
    synchronous step): its encoder call (the encoder's CUDA graphs replay where captured), then its prefill
    with the media embeddings (or, for a cross-attention input, the cross K/V write and the decoder's first
    token); a second step finishes the request and frees its encoder output. Only runner state is touched:
    the blocks are ids no request holds (the scheduler's block pool never sees them), and the runner's rows,
    encoder cache and sampled ids are released as a finished request's are. An item over the encoder budget
    is skipped; one whose prompt does not fit a step (or the KV cache) is encoded without its prefill.
    Then the first item with placeholders is encoded as often as one step's encoder budget (and rows) allow,
    in one encoder call without a prefill: the allocator holds the largest call's activations before the
    first burst asks for them. Returns the declared items run."""
    t0 = time.perf_counter()
    params = SamplingParams(max_tokens=1, temperature=0.0)
    num_run = num_prefilled = 0
    for index, item in enumerate(items):
        if item.num_embeds > limits.encoder_budget:
            continue
        req_id, identifier = f"media-warm-up-{index}", f"media-warm-up-{index}"
        prompt = item.prompt_token_ids
        cross = item.placeholder_offset is None
        placeholder = None if cross else PlaceholderRange(item.placeholder_offset, item.num_embeds)
        feature = MultiModalFeature(item.modality, identifier, placeholder, item.data,
                                    num_cross_embeds=item.num_embeds if cross else 0)
        num_self_blocks = -(-(len(prompt) + 1) // limits.block_size)
        num_cross_blocks = -(-item.num_embeds // limits.block_size) if cross else 0
        prefill = (len(prompt) <= limits.max_step_tokens and len(prompt) < limits.max_model_len
                   and 1 + num_self_blocks + num_cross_blocks <= limits.num_blocks)
        if not prefill and cross:
            continue   # a cross-attention input is encoded by the step that computes token 0
        block_ids = tuple(range(1, 1 + num_self_blocks)) if prefill else ()
        cross_block_ids = tuple(range(1 + num_self_blocks, 1 + num_self_blocks + num_cross_blocks))
        new = NewRequestData(req_id=req_id, all_token_ids=prompt, num_prompt_tokens=len(prompt),
                             sampling_params=params, block_ids=block_ids, cross_block_ids=cross_block_ids,
                             num_computed_tokens=0, mm_features=(feature,),
                             group_block_ids=(block_ids,) * (limits.num_kv_groups - 1))
        scheduled = {req_id: len(prompt)} if prefill else {}
        execute(SchedulerOutput((new,), CachedRequestData(), scheduled, sum(scheduled.values()),
                                scheduled_encoder_inputs={req_id: (0,)}))
        execute(SchedulerOutput((), CachedRequestData(), {}, 0, finished_req_ids=frozenset({req_id}),
                                free_encoder_identifiers=(identifier,)))
        num_run += 1
        num_prefilled += int(prefill)
    full = next((it for it in items
                 if it.placeholder_offset is not None and it.num_embeds <= limits.encoder_budget), None)
    num_full = min(limits.encoder_budget // full.num_embeds, limits.max_num_seqs) if full is not None else 0
    if num_full > 1:
        _encode_only(full, num_full, execute, params, limits.num_kv_groups)
    logger.info("Media paths warmed up (%d of %d declared items encoded, %d prefilled; one encoder call of %d "
                "items) in %.1f s", num_run, len(items), num_prefilled, max(num_full, int(num_run > 0)),
                time.perf_counter() - t0)
    return num_run


def _encode_only(item: MediaWarmUp, count: int, execute: Callable[[SchedulerOutput], object],
                 params: SamplingParams, num_kv_groups: int) -> None:
    """``count`` requests of ``item`` (each its own identifier, no KV blocks) encoded in one step, none
    prefilled; a second step finishes them and frees their encoder outputs."""
    req_ids = [f"media-warm-up-batch-{k}" for k in range(count)]
    placeholder = PlaceholderRange(item.placeholder_offset, item.num_embeds)
    new = tuple(NewRequestData(req_id=r, all_token_ids=item.prompt_token_ids,
                               num_prompt_tokens=len(item.prompt_token_ids), sampling_params=params, block_ids=(),
                               cross_block_ids=(), num_computed_tokens=0,
                               mm_features=(MultiModalFeature(item.modality, r, placeholder, item.data),),
                               group_block_ids=((),) * (num_kv_groups - 1))
                for r in req_ids)
    execute(SchedulerOutput(new, CachedRequestData(), {}, 0, scheduled_encoder_inputs={r: (0,) for r in req_ids}))
    execute(SchedulerOutput((), CachedRequestData(), {}, 0, finished_req_ids=frozenset(req_ids),
                            free_encoder_identifiers=tuple(req_ids)))
