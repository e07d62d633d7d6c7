"""``EngineArgs``: the flat keyword arguments of ``LLM(...)`` / ``chorus serve`` -> ``EngineConfig``."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

from engine.config import (CacheConfig, EngineConfig, LoRAConfig, ModelConfig, MultiModalConfig,
                           ParallelConfig, SchedulerConfig, StructuredOutputsConfig)


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
    max_num_seqs: Optional[int] = None
    """None: 1024 on a CUDA GPU with >= 70 GiB that is not an A100, else 256 (vLLM's defaults)."""
    max_num_batched_tokens: Optional[int] = None
    """None: the usage context's default (``batch_defaults``), at least max_model_len so one step can
    hold a full-length prompt."""
    usage_context: str = "llm"
    """"llm" (offline ``LLM``) or "server" (``chorus serve``): picks the default step limits as vLLM's
    UsageContext does."""
    gpu_memory_utilization: float = 0.9
    kv_cache_space: float = 4.0
    kv_cache_dtype: str = "auto"
    """``CacheConfig.cache_dtype``."""
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
    quantization: Optional[str] = None
    cpu_float_copy: Optional[bool] = None
    """``ModelConfig.cpu_float_copy``."""
    long_prefill_token_threshold: int = 0
    async_scheduling: bool = True
    """Overlap scheduling / output processing of one step with the device work of the next."""
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: Optional[int] = None
    """None: the largest rank among adapters given at start-up (at least 16)."""
    max_cpu_loras: Optional[int] = None
    max_lora_pool_bytes: Optional[int] = None
    """``LoRAConfig.max_lora_pool_bytes``."""
    lora_dtype: str = "auto"
    enable_tower_connector_lora: bool = False
    """``LoRAConfig.enable_tower_connector_lora`` (needs enable_lora)."""
    limit_mm_per_prompt: Optional[dict[str, int]] = None
    allowed_local_media_path: Optional[str] = None
    allowed_media_domains: Optional[list[str]] = None
    allow_private_media_urls: bool = False
    max_image_pixels_per_request: Optional[int] = None
    """None: ``MultiModalConfig``'s default (as the two below)."""
    max_image_pixels_in_flight: Optional[int] = None
    max_media_bytes_in_flight: Optional[int] = None
    audio_chunking: str = "quiet"
    """``MultiModalConfig.audio_chunking``: "quiet" or "vad"."""
    max_num_encoder_input_tokens: Optional[int] = None
    encoder_cache_size: Optional[int] = None
    tensor_parallel_size: int = 1
    """Ranks the model is split over (``ParallelConfig.tensor_parallel_size``)."""
    structured_outputs_backend: str = "auto"
    """``StructuredOutputsConfig.backend``: auto, xgrammar or guidance."""
    reasoning_parser: Optional[str] = None
    """``StructuredOutputsConfig.reasoning_parser``: qwen3 or deepseek_r1 (constraints start after the
    reasoning)."""

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
        default_tokens, default_seqs = batch_defaults(self.device, self.usage_context)
        mnbt = self.max_num_batched_tokens
        if mnbt is None:
            mnbt = max(default_tokens, mml or 0)
        max_num_seqs = self.max_num_seqs if self.max_num_seqs is not None else default_seqs
        lora = None
        quantization = self.quantization
        if self.enable_tower_connector_lora and not self.enable_lora:
            raise ValueError("enable_tower_connector_lora adapts the vision tower with LoRA adapters: also pass "
                             "--enable-lora (or --lora-modules).")
        if self.enable_lora:
            lora = LoRAConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank or 16,
                              max_cpu_loras=self.max_cpu_loras, lora_dtype=self.lora_dtype,
                              max_lora_pool_bytes=self.max_lora_pool_bytes,
                              enable_tower_connector_lora=self.enable_tower_connector_lora)
        return EngineConfig(
            model_config=ModelConfig(
                model=self.model, tokenizer=self.tokenizer, dtype=self.dtype, max_model_len=mml,
                seed=self.seed, served_model_name=self.served_model_name, load_format=self.load_format,
                chat_template=self.chat_template, max_logprobs=self.max_logprobs,
                logprobs_mode=self.logprobs_mode, quantization=quantization, cpu_float_copy=self.cpu_float_copy),
            cache_config=CacheConfig(
                block_size=self.block_size, gpu_memory_utilization=self.gpu_memory_utilization,
                kv_cache_space=self.kv_cache_space, num_gpu_blocks_override=self.num_gpu_blocks_override,
                enable_prefix_caching=self.enable_prefix_caching, cache_dtype=self.kv_cache_dtype),
            scheduler_config=SchedulerConfig(
                max_num_batched_tokens=mnbt, max_num_seqs=max_num_seqs, policy=self.scheduling_policy,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                async_scheduling=self.async_scheduling,
                max_num_encoder_input_tokens=self.max_num_encoder_input_tokens,
                encoder_cache_size=self.encoder_cache_size),
            lora_config=lora,
            mm_config=MultiModalConfig(limit_mm_per_prompt=dict(self.limit_mm_per_prompt or {}),
                                       allowed_local_media_path=self.allowed_local_media_path,
                                       allowed_media_domains=self.allowed_media_domains,
                                       allow_private_media_urls=self.allow_private_media_urls,
                                       audio_chunking=self.audio_chunking,
                                       **{name: getattr(self, name) for name in MEDIA_BUDGET_FIELDS
                                          if getattr(self, name) is not None}),
            parallel_config=ParallelConfig(tensor_parallel_size=self.tensor_parallel_size),
            structured_outputs_config=StructuredOutputsConfig(backend=self.structured_outputs_backend,
                                                              reasoning_parser=self.reasoning_parser),
            device=self.device, enforce_eager=self.enforce_eager,
            max_cudagraph_capture_size=self.max_cudagraph_capture_size)


MEDIA_BUDGET_FIELDS = ("max_image_pixels_per_request", "max_image_pixels_in_flight", "max_media_bytes_in_flight")
"""``MultiModalConfig`` fields an engine argument sets only when given (None keeps the config's default)."""

USAGE_CONTEXTS = ("llm", "server")

LARGE_GPU_GIB = 70
"""GPUs with at least this much memory (H100, H200, MI300X; not A100) get the large defaults."""


def batch_defaults(device: str, usage_context: str) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) when the user sets neither, as vLLM picks them.

    On a CUDA GPU with >= 70 GiB that is not an A100: 16384 tokens for the offline ``LLM`` class,
    8192 for the server, and 1024 requests per step (many short decodes share every weight read;
    benchmarks/RESULTS.md, "Launch configs and constants inside the kernels"). Elsewhere (smaller
    GPUs, CPU): 8192 tokens, 256 requests.
    """
    if usage_context not in USAGE_CONTEXTS:
        raise ValueError(f"usage_context={usage_context!r}: use one of {', '.join(USAGE_CONTEXTS)}.")
    if _is_large_gpu(device):
        return (16384 if usage_context == "llm" else 8192), 1024
    return 8192, 256


def _is_large_gpu(device: str) -> bool:
    import torch

    if device == "cpu" or not torch.cuda.is_available():
        return False
    props = torch.cuda.get_device_properties(0)
    return props.total_memory >= LARGE_GPU_GIB * (1 << 30) and "a100" not in props.name.lower()
