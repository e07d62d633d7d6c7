"""Engine configuration: one dataclass per concern, each field documented.

Cross-field checks raise ``ValueError`` with a message that says how to fix the setting.
Environment variables are read in ``engine/envs.py`` only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import ClassVar, Optional

from engine.models.config_facts import sharded_sizes
from engine.reasoning.registry import REASONING_PARSERS

SUPPORTED_DTYPES = ("auto", "float32", "float16", "bfloat16")
ENCODER_CACHE_BUDGETS = 4
"""Default encoder cache size in per-step encoder budgets: 20 shared 1344x896 images (1,536 embeddings
each) stay cached under Qwen2-VL's default budget of 16,384 (benchmarks/RESULTS.md, "Vision": encoder
cache)."""
SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass
class ModelConfig:
    """What model to run and how to read it."""

    model: str
    """HF directory (config.json + safetensors), a .gguf file, or a directory holding one .gguf."""
    tokenizer: Optional[str] = None
    """Tokenizer directory; defaults to ``model``."""
    dtype: str = "auto"
    """auto (checkpoint dtype on CUDA, float32 on CPU), float32, float16 or bfloat16."""
    max_model_len: Optional[int] = None
    """Prompt + output tokens per request; defaults to the config's max_position_embeddings."""
    seed: int = 0
    """Seed for random weights (``load_format=dummy``) and for unseeded sampling."""
    served_model_name: Optional[str] = None
    """Name shown in /v1/models and checked against the request's ``model`` field."""
    load_format: str = "auto"
    """auto (read the checkpoint) or dummy (random weights from the config alone)."""
    chat_template: Optional[str] = None
    """Jinja chat template (a file path or the template text) overriding the tokenizer's."""
    max_logprobs: int = 20
    """Largest ``logprobs``/``prompt_logprobs`` a request may ask for."""
    logprobs_mode: str = "raw_logprobs"
    """raw_logprobs (model log-softmax, as vLLM; a constrained request's grammar is not applied to them) or
    processed_logprobs (after the grammar mask, penalties and temperature)."""
    quantization: Optional[str] = None
    """Weight format in memory. None (auto): a quantized checkpoint (``quantization_config``: FP8, GPTQ, AWQ,
    compressed-tensors; ``engine.quantization``) stays quantized, and a GGUF file's quantized tensors stay
    quantized on CPU (4-bit types as int4, 5- to 8-bit types as int8; ``engine.layers.quantized``);
    everything else is dequantized to ``dtype``; adapters run beside quantized weights. "none": always
    dequantized (exact against transformers on the dequantized weights). "int8" / "int4": weight-only quantization of any Llama-family checkpoint on CPU; "fp16":
    float16 weights through fbgemm (x86 CPUs), within ~1e-3 of float32; "fp8": FP8 weights with
    per-channel scales quantized at load (``engine.layers.fp8``). Quantized weights give faster decode
    (RESULTS.md) and outputs close to, not equal to, the float weights'."""
    cpu_float_copy: Optional[bool] = None
    """With int8 / int4 weights on CPU: also keep each quantized weight as float copies for steps of more rows
    than the packed kernels serve well (decode batches, prefill): fbgemm float16 (2 bytes per weight), or on
    CPUs with AMX ``kernels.cpu_amx_gemm``'s tiles (0.75 bytes per int4 weight, 1 per int8; packed bfloat16,
    2, where it does not build) and float32 for bf16-product GEMMs (4; ``engine.layers.quantized``).
    None (auto): kept when the copies take at most a quarter of the machine's memory."""

    def __post_init__(self) -> None:
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported; use one of {SUPPORTED_DTYPES}.")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format={self.load_format!r}: use 'auto' or 'dummy'.")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len} must be at least 2.")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs={self.max_logprobs} must be >= 0.")
        if self.quantization not in QUANTIZATION_FLAGS:
            raise ValueError(f"quantization={self.quantization!r}: use 'int8', 'int4' or 'fp16' (weights, CPU), "
                             "'fp8' (weights quantized at load, per channel), 'none' (float weights: a quantized "
                             "checkpoint dequantized) or leave it unset (a checkpoint's own quantization; a GGUF "
                             "file's on CPU).")
        if self.logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
            raise ValueError(
                f"logprobs_mode={self.logprobs_mode!r}: use 'raw_logprobs' or 'processed_logprobs'.")


QUANTIZATION_FLAGS = (None, "none", "int8", "int4", "fp16", "fp8")
"""``ModelConfig.quantization`` values (``--quantization`` takes them all)."""
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")
"""``CacheConfig.cache_dtype`` values of the FP8 (e4m3) cache: vLLM's ``fp8`` and its spelled-out form."""
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16") + FP8_KV_CACHE_DTYPES
"""``CacheConfig.cache_dtype`` values (``--kv-cache-dtype``)."""


@dataclass
class CacheConfig:
    """Paged KV cache sizing and prefix caching."""

    block_size: int = 16
    """Tokens per KV block."""
    gpu_memory_utilization: float = 0.9
    """Fraction of GPU memory the engine may use (weights + activations + KV) on CUDA."""
    kv_cache_space: float = 4.0
    """GiB of host memory for the KV cache on CPU."""
    num_gpu_blocks_override: Optional[int] = None
    """Exact number of KV blocks; overrides both budgets above (tests use it to force preemption)."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of earlier requests that share a prefix (and adapter, media, salt)."""
    cache_dtype: str = "auto"
    """KV cache element type: auto (the model's dtype; on CPU bfloat16 where the weights multiply in
    bfloat16, i.e. the AMX copies of quantized weights: the decode step then reads half the bytes), float32,
    bfloat16 or float16. On CUDA only auto, the model's dtype, or fp8 / fp8_e4m3: e4m3 with per-layer
    k_scale / v_scale from the checkpoint (1.0 where it has none), twice the tokens of a bfloat16 cache in the
    same memory (compute capability 8.9+; not on CPU)."""

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size} must be a power of two (e.g. 16).")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1], e.g. 0.9.")
        if self.kv_cache_space <= 0:
            raise ValueError(f"kv_cache_space={self.kv_cache_space} GiB must be > 0.")
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.cache_dtype!r}: use one of {', '.join(KV_CACHE_DTYPES)}.")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override={self.num_gpu_blocks_override} must be >= 1.")


@dataclass
class SchedulerConfig:
    """One token budget per step."""

    max_num_batched_tokens: int = 8192
    """Tokens (prefill chunks + decodes) computed per step."""
    max_num_seqs: int = 256
    """Requests running at once."""
    policy: str = "fcfs"
    """fcfs (arrival order) or priority (lower ``priority`` value first, then arrival)."""
    long_prefill_token_threshold: int = 0
    """Cap on one request's prefill chunk per step (0: only the budget caps it)."""
    async_scheduling: bool = True
    """Schedule step N+1 before step N's sampled ids are read (output placeholders), so host work
    overlaps the device's; off: schedule -> run -> update, one step at a time."""
    max_num_encoder_input_tokens: Optional[int] = None
    """Encoder embeddings (media placeholder tokens) encoded per step; None: max(max_num_batched_tokens,
    the largest item the model can produce). Always raised to that largest item."""
    encoder_cache_size: Optional[int] = None
    """Encoder embeddings the encoder cache holds; None: ENCODER_CACHE_BUDGETS x the per-step encoder
    budget (vLLM keeps just one budget, which a few large images fill). Always raised to that budget,
    so any item the model can produce fits."""

    def encoder_budgets(self, max_embeds_per_item: int) -> tuple[int, int]:
        """(per-step encoder compute budget, encoder cache size), in embeddings, for a model whose
        largest media item has ``max_embeds_per_item`` embeddings (0: a text-only model)."""
        budget = self.max_num_encoder_input_tokens
        if budget is None:
            budget = max(self.max_num_batched_tokens, max_embeds_per_item)
        budget = max(budget, max_embeds_per_item)
        cache_size = self.encoder_cache_size or ENCODER_CACHE_BUDGETS * budget
        return budget, max(cache_size, budget)

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= 1.")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be >= 1.")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy {self.policy!r}: use one of {SCHEDULING_POLICIES}.")
        for name in ("max_num_encoder_input_tokens", "encoder_cache_size"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name}={v} must be >= 1 (or unset for the default).")


@dataclass
class LoRAConfig:
    """Multi-adapter serving (see ``lora/``)."""

    max_loras: int = 4
    """GPU slots: distinct adapters in one step."""
    max_lora_rank: int = 16
    """Largest adapter rank accepted (a larger one is refused, 400); without max_lora_pool_bytes also the
    rank every slot is sized for (smaller adapters zero-padded)."""
    max_lora_pool_bytes: Optional[int] = None
    """Device bytes of the pool the resident adapters' weights share, by their own ranks (``lora.rank_pool``):
    adapters of ranks 8 and 128 hold 8 and 128 rows of it, none padded; an adapter that does not fit waits
    for idle ones to be evicted, as for a full slot table. It must hold one adapter of max_lora_rank. None:
    padded slots, max_loras of max_lora_rank (these keep the stacked decode GEMM, ``lora.layers``)."""
    max_cpu_loras: Optional[int] = None
    """Adapters kept in host memory (LRU); defaults to max(max_loras, 64)."""
    lora_dtype: str = "auto"
    """auto (the model dtype), float32, float16 or bfloat16."""
    enable_tower_connector_lora: bool = False
    """Adapters may also update a vision-language model's vision tower and projector (LLaVA, Qwen2-VL,
    Qwen2.5-VL): slot buffers on their projections too, and a request's image is encoded under its adapter
    when the adapter updates them. Off: such adapters are refused (400)."""

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras={self.max_loras} must be >= 1.")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank={self.max_lora_rank} must be >= 1.")
        if self.max_lora_pool_bytes is not None and self.max_lora_pool_bytes < 1:
            raise ValueError(f"max_lora_pool_bytes={self.max_lora_pool_bytes} must be >= 1 (or unset: room for "
                             "max_loras adapters of max_lora_rank).")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = max(self.max_loras, 64)
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras={self.max_cpu_loras} must be >= max_loras={self.max_loras}; "
                "raise --max-cpu-loras or lower --max-loras.")
        if self.lora_dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"lora_dtype={self.lora_dtype!r}: use one of {SUPPORTED_DTYPES}.")


@dataclass
class ParallelConfig:
    """How the model is spread over devices (``engine.distributed``)."""

    tensor_parallel_size: int = 1
    """Processes (one per GPU on CUDA; gloo processes on CPU) that each hold 1/N of every attention and
    MLP projection, of the vocabulary's embedding rows and of the LM head, and run every step together
    (one all-reduce per row-parallel layer). 1: one process, no collective anywhere."""
    distributed_timeout_s: float = 120.0
    """Seconds a collective may wait for a peer before it fails (a worker that hangs or died), which
    stops the engine instead of hanging it."""

    def __post_init__(self) -> None:
        if isinstance(self.tensor_parallel_size, bool) or not isinstance(self.tensor_parallel_size, int) \
                or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size!r}: use an integer >= 1 "
                             "(1 runs one process).")
        if self.distributed_timeout_s <= 0:
            raise ValueError(f"distributed_timeout_s={self.distributed_timeout_s} must be > 0 seconds.")

    def check_devices(self, device_type: str, num_gpus: int) -> None:
        """ValueError when a CUDA engine asks for more ranks than there are GPUs."""
        if device_type == "cuda" and self.tensor_parallel_size > num_gpus:
            raise ValueError(f"--tensor-parallel-size {self.tensor_parallel_size} needs {self.tensor_parallel_size} "
                             f"GPUs, but {num_gpus} are visible; lower it to at most {num_gpus} (or expose more "
                             "GPUs through CUDA_VISIBLE_DEVICES).")

    def check_model(self, text_config) -> None:
        """ValueError when the model's heads or MLP cannot be split over ``tensor_parallel_size`` ranks (the
        decoder's, for an encoder-decoder model: its encoder is replicated)."""
        n = self.tensor_parallel_size
        if n == 1:
            return
        sizes = sharded_sizes(text_config)
        heads, kv_heads = sizes.num_heads, sizes.num_kv_heads
        fix = f"use a --tensor-parallel-size that divides {heads} (one of {_divisors(heads)})"
        if heads % n:
            raise ValueError(f"num_attention_heads={heads} is not divisible by --tensor-parallel-size {n}: {fix}.")
        if kv_heads % n and n % kv_heads:
            raise ValueError(f"num_key_value_heads={kv_heads} and --tensor-parallel-size {n}: one must divide the "
                             f"other (KV heads are split, or replicated when fewer than the ranks); {fix} and "
                             f"{kv_heads} (one of {_divisors(kv_heads)}) or is a multiple of {kv_heads}.")
        mlp, inter = sizes.mlp_name, sizes.mlp_size
        if inter is not None and inter % n:
            raise ValueError(f"{mlp}={inter} is not divisible by --tensor-parallel-size {n}; use one of "
                             f"{[d for d in _divisors(inter) if heads % d == 0]}.")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


MODALITIES = ("image", "audio")


@dataclass
class MultiModalConfig:
    """Media in prompts: how many, from where, how big (images for vision models, audio for Whisper)."""

    limit_mm_per_prompt: dict[str, int] = field(default_factory=dict)
    """Modality -> most items in one prompt; a modality left out allows ``DEFAULT_LIMIT_PER_PROMPT`` of
    it (16 images, 999 audios)."""
    allowed_local_media_path: Optional[str] = None
    """Directory whose files ``file://`` image URLs may name (None: file URLs are refused)."""
    allowed_media_domains: Optional[list[str]] = None
    """Hosts http(s) image URLs (and their redirects) may name, exactly; their addresses are trusted.
    None: any host whose addresses are all public (``multimodal.media``: no SSRF)."""
    allow_private_media_urls: bool = False
    """Let image URLs reach loopback, private, link-local and other non-public addresses."""
    media_fetch_timeout_s: float = 5.0
    """Timeout of one http(s) media download, seconds."""
    max_image_bytes: int = 20 << 20
    """Largest encoded image accepted (download, data URL or file), bytes."""
    max_image_pixels: int = 50_000_000
    """Largest width x height accepted, checked before decoding (decompression bombs)."""
    max_audio_bytes: int = 25 << 20
    """Largest encoded audio accepted (upload, bytes or file), bytes (OpenAI's 25 MB)."""
    max_audio_duration_s: float = 3600.0
    """Longest decoded audio, seconds; counted while decoding (a small compressed file cannot expand
    into hours of samples)."""
    max_image_pixels_per_request: int = 64_000_000
    """Decoded pixels (width x height, summed over its images) one request may have, checked from the
    headers before any image is decoded; beyond it the request is refused (400). 64M pixels is about
    190 MB of RGB."""
    max_image_pixels_in_flight: int = 256_000_000
    """Decoded pixels all requests being preprocessed may have at once (4 requests at the per-request
    limit); a request that does not fit now is refused with a retry (503), nothing of it decoded."""
    max_media_bytes_in_flight: int = 512 << 20
    """Encoded media bytes (downloads, data URLs, uploads) all requests being preprocessed may hold at
    once; beyond it a request is refused with a retry (503), or with a 400 if it alone needs more."""
    mm_processor_workers: int = field(default_factory=lambda: min(16, os.cpu_count() or 1))
    """Threads that validate, tokenize and load the media of requests off the event loop (default: the
    CPUs, at most 16)."""
    audio_chunking: str = "quiet"
    """How Whisper cuts audio longer than its 30 s window: "quiet" (contiguous windows cut at the quietest
    100 ms near each window's end) or "vad" (silero-vad's speech regions only, cut between utterances;
    needs ``pip install 'chorus[vad]'``)."""

    DEFAULT_LIMIT_PER_PROMPT: ClassVar[dict[str, int]] = {"image": 16, "audio": 999}
    """Items of a modality per prompt when ``limit_mm_per_prompt`` leaves it out."""

    def limit(self, modality: str) -> int:
        return self.limit_mm_per_prompt.get(modality, self.DEFAULT_LIMIT_PER_PROMPT.get(modality, 16))

    def __post_init__(self) -> None:
        for modality, n in self.limit_mm_per_prompt.items():
            if modality not in MODALITIES:
                raise ValueError(f"limit_mm_per_prompt: unknown modality {modality!r}; use one of {MODALITIES}.")
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"limit_mm_per_prompt[{modality!r}]={n!r} must be an integer >= 0.")
        for name in ("media_fetch_timeout_s", "max_image_bytes", "max_image_pixels", "max_audio_bytes",
                     "max_audio_duration_s", "mm_processor_workers", "max_image_pixels_per_request",
                     "max_image_pixels_in_flight", "max_media_bytes_in_flight"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0.")
        if self.audio_chunking not in ("quiet", "vad"):
            raise ValueError(f"audio_chunking={self.audio_chunking!r}: use 'quiet' or 'vad'.")
        if self.max_image_pixels_in_flight < self.max_image_pixels_per_request:
            raise ValueError(
                f"max_image_pixels_in_flight={self.max_image_pixels_in_flight} is below "
                f"max_image_pixels_per_request={self.max_image_pixels_per_request}: a request at the limit "
                "could never run; raise --max-image-pixels-in-flight or lower --max-image-pixels-per-request.")


STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar", "guidance")
"""``StructuredOutputsConfig.backend`` values (``--structured-outputs-backend``)."""


@dataclass
class StructuredOutputsConfig:
    """Constrained decoding (``response_format``, ``structured_outputs``): ``engine.structured_output``."""

    backend: str = "auto"
    """The grammar library: xgrammar, guidance (llguidance), or auto (xgrammar, and llguidance for what
    xgrammar does not enforce or compile: ``engine.structured_output.selection``)."""
    reasoning_parser: Optional[str] = None
    """``--reasoning-parser``: a constrained reply may reason first (its think part unconstrained, the
    constraint applying after the closing tag). None: the constraint applies from the first token."""

    def __post_init__(self) -> None:
        if self.backend not in STRUCTURED_OUTPUTS_BACKENDS:
            raise ValueError(f"structured_outputs_backend={self.backend!r}: use one of "
                             f"{', '.join(STRUCTURED_OUTPUTS_BACKENDS)}.")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser={self.reasoning_parser!r}: use one of "
                             f"{', '.join(sorted(REASONING_PARSERS))}.")


@dataclass
class EngineConfig:
    """Everything the engine needs, resolved once at start-up."""

    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    lora_config: Optional[LoRAConfig] = None
    """None: adapters disabled (requests naming one are rejected)."""
    mm_config: MultiModalConfig = field(default_factory=MultiModalConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    """Tensor parallelism (1 process by default)."""
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    """Constrained decoding's backend."""
    device: str = "auto"
    """auto (cuda when available, else cpu), cpu or cuda."""
    enforce_eager: bool = False
    """Disable CUDA graphs."""
    max_cudagraph_capture_size: int = 2048
    """Largest step (in tokens) with prefill chunks that runs as a CUDA graph (one graph per token
    bucket up to this size; larger steps run eagerly, 0 turns mixed-step graphs off). Decode-only
    steps have their own graphs per batch size up to max_num_seqs."""

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device={self.device!r}: use auto, cpu or cuda.")
        if not isinstance(self.max_cudagraph_capture_size, int) or self.max_cudagraph_capture_size < 0:
            raise ValueError(f"max_cudagraph_capture_size={self.max_cudagraph_capture_size!r}: use an integer "
                             f">= 0 (0 runs steps with prefill chunks eagerly).")
