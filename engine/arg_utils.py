"""``EngineArgs``: the flat keyword arguments of ``LLM(...)`` / ``chorus serve`` -> ``EngineConfig``."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

from engine.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig


@dataclass
class EngineArgs:
    """Keyword names and defaults follow vLLM's ``EngineArgs``."""

    model: Optional[str] = None
    """Model path (HF dir or GGUF); None: the default SmolLM2-135M-Instruct."""
    tokenizer: Optional[str] = None
    dtype: str = "auto"
    max_model_len: Optional[int] = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: Optional[int] = None
    """None: max(8192, max_model_len) so one step can hold a full-length prompt."""
    gpu_memory_utilization: float = 0.9
    kv_cache_space: float = 4.0
    num_gpu_blocks_override: Optional[int] = None
    seed: int = 0
    served_model_name: Optional[str] = None
    chat_template: Optional[str] = None
    scheduling_policy: str = "fcfs"
    max_logprobs: int = 20
    logprobs_mode: str = "raw_logprobs"
    device: str = "auto"
    enforce_eager: bool = False
    max_cudagraph_capture_size: int = 2048
    """Largest step (tokens) with prefill chunks run as a CUDA graph; 0: those run eagerly."""
    load_format: str = "auto"
    long_prefill_token_threshold: int = 0
    async_scheduling: bool = True
    """Overlap scheduling / output processing of one step with the device work of the next."""
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: Optional[int] = None
    """None: the largest rank among adapters given at start-up (at least 16)."""
    max_cpu_loras: Optional[int] = None
    lora_dtype: str = "auto"

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineArgs":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(**kwargs)

    def create_engine_config(self, max_model_len: Optional[int] = None) -> EngineConfig:
        """Build the config; ``max_model_len`` (resolved from the checkpoint) may override ours."""
        mml = max_model_len or self.max_model_len
        mnbt = self.max_num_batched_tokens
        if mnbt is None:
            mnbt = max(8192, mml or 0)
        lora = None
        if self.enable_lora:
            lora = LoRAConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank or 16,
                              max_cpu_loras=self.max_cpu_loras, lora_dtype=self.lora_dtype)
        return EngineConfig(
            model_config=ModelConfig(
                model=self.model, tokenizer=self.tokenizer, dtype=self.dtype, max_model_len=mml,
                seed=self.seed, served_model_name=self.served_model_name, load_format=self.load_format,
                chat_template=self.chat_template, max_logprobs=self.max_logprobs,
                logprobs_mode=self.logprobs_mode),
            cache_config=CacheConfig(
                block_size=self.block_size, gpu_memory_utilization=self.gpu_memory_utilization,
                kv_cache_space=self.kv_cache_space, num_gpu_blocks_override=self.num_gpu_blocks_override,
                enable_prefix_caching=self.enable_prefix_caching),
            scheduler_config=SchedulerConfig(
                max_num_batched_tokens=mnbt, max_num_seqs=self.max_num_seqs, policy=self.scheduling_policy,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                async_scheduling=self.async_scheduling),
            lora_config=lora, device=self.device, enforce_eager=self.enforce_eager,
            max_cudagraph_capture_size=self.max_cudagraph_capture_size)
