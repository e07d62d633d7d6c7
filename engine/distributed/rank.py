"""What every rank builds the same way: its shard of the model, its ``ModelRunner``, its LoRA slots,
and a KV cache of the block count every rank can hold.

Rank 0 (``EngineCore.from_engine_args``) and ranks 1..N-1 (``engine.distributed.worker``) both call
``build_rank``, so the two can never drift apart, and the start-up collectives (the KV block count's
minimum) come in the same order on every rank.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from engine.arg_utils import EngineArgs
from engine.config import EngineConfig
from engine.distributed.group import TensorParallelGroup
from engine.kernel_policy import KernelPolicy
from engine.models.builder import LoadedModel, build_model
from engine.runner.kv_cache import max_blocks_needed
from engine.runner.runner import ModelRunner

logger = logging.getLogger("chorus.distributed")


@dataclass
class RankParts:
    """One rank's engine parts, built and sized (the KV cache allocated)."""

    config: EngineConfig
    """The resolved configs (identical on every rank)."""
    loaded: LoadedModel
    """This rank's shard of the model, its tokenizer and facts."""
    runner: ModelRunner
    """Executes ``SchedulerOutput``s on this rank's shard."""
    lora_manager: Optional[Any]
    """``lora.manager.LoRAManager`` with this rank's adapter shards, when LoRA is enabled."""
    num_blocks: int
    """KV blocks of every rank (the minimum over the ranks)."""
    max_embeds_per_item: int
    """Largest media item's embeddings (0: a text-only model)."""


def resolve_engine_config(engine_args: EngineArgs, max_model_len: Optional[int]) -> EngineConfig:
    """The engine config; at tensor_parallel_size > 1 with CUDA graphs off (logged). Async scheduling
    stays: every rank samples the same ids, so a worker running each broadcast step to completion fills
    the next step's placeholders exactly as rank 0 does."""
    cfg = engine_args.create_engine_config(max_model_len)
    if cfg.parallel_config.tensor_parallel_size > 1:
        if not cfg.enforce_eager:
            logger.info("Tensor parallelism: CUDA graphs are off (capturing the all-reduces inside graphs has "
                        "not been verified on GPUs yet); steps run eagerly.")
            cfg.enforce_eager = True
    return cfg


def build_rank(engine_args: EngineArgs, device: torch.device, tp: TensorParallelGroup,
               on_built: Optional[Callable[[], None]] = None) -> RankParts:
    """Build this rank's model shard, runner and LoRA slots, agree on the KV block count with the
    other ranks (one collective at size > 1) and allocate the KV cache. ``on_built`` runs between
    the two (a worker reports its progress; rank 0 waits for every worker's report, so a rank that
    failed to build is named with its cause instead of surfacing as a broken collective)."""
    probe = engine_args.create_engine_config()
    loaded = build_model(probe.model_config, device, tp, probe.parallel_config)
    cfg = resolve_engine_config(engine_args, loaded.max_model_len)
    policy = KernelPolicy.for_device(device)
    lora_manager = None
    if cfg.lora_config is not None:
        from lora.manager import LoRAManager
        lora_manager = LoRAManager(cfg.lora_config, loaded.model, device, loaded.dtype, policy=policy)
    max_embeds_per_item = loaded.mm_processor.max_embeds_per_item() if loaded.mm_processor else 0
    encoder_compute_budget = encoder_cache_size = 0
    if max_embeds_per_item:   # a media model: the encoder cache's outputs take memory beside the KV cache
        encoder_compute_budget, encoder_cache_size = cfg.scheduler_config.encoder_budgets(max_embeds_per_item)
    runner = ModelRunner(cfg, loaded.model, device, loaded.dtype, loaded.max_model_len, policy, lora_manager,
                         encoder_compute_budget, encoder_cache_size, kv_scales=loaded.kv_scales)
    # Encoder-decoder models: each request also holds cross-attention K/V of its encoder output.
    cross_tokens = max_embeds_per_item if loaded.model.capabilities.encoder_decoder else 0
    num_blocks = runner.determine_num_blocks(max_blocks_needed(
        cfg.scheduler_config.max_num_seqs, loaded.max_model_len, cfg.cache_config.block_size, cross_tokens,
        runner.kv_cache.groups.num_groups))
    if on_built is not None:
        on_built()
    num_blocks = tp.min_int(num_blocks)   # the scheduler's one block table must fit every rank
    runner.allocate_kv_cache(num_blocks)
    if tp.size > 1:
        # Every rank samples every row (the logits are all-gathered): the same seed keeps unseeded sampling
        # identical across ranks.
        torch.manual_seed(cfg.model_config.seed)
    return RankParts(cfg, loaded, runner, lora_manager, num_blocks, max_embeds_per_item)
