"""Resolve a checkpoint, build our model class for it, and fill in its weights."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from engine.config import ModelConfig, ParallelConfig
from engine.distributed.group import TensorParallelGroup
from engine.layers.linear import deferred_weights
from engine.kv_scales import KVScales, attention_scale_name, kv_scales_from_checkpoint
from engine.models.registry import get_model_class
from engine.quantization.scheme import FP8, CheckpointQuantization, read_checkpoint_quantization
from engine.quantization.slices import QuantizedTensorStream

logger = logging.getLogger("chorus.models")


@dataclass
class LoadedModel:
    model: torch.nn.Module
    hf_config: Any
    tokenizer: Any
    dtype: torch.dtype
    max_model_len: int
    """Resolved context length (user value checked against the checkpoint's)."""
    model_name: str
    """Default served name: the default model's name or the path given."""
    eos_token_ids: set[int]
    """Tokenizer eos + config eos + generation_config eos."""
    default_sampling: dict
    """Sampling fields the checkpoint's generation_config.json sets (temperature, top_p, ...):
    vLLM's ``--generation-config auto`` defaults for requests that leave them unset."""
    transcriber: Optional[Any] = None
    """Whisper: plans and assembles transcriptions (``engine.transcription.Transcriber``); None otherwise."""
    mm_processor: Optional[Any] = None
    """Media -> encoder inputs: an ``ImagePromptProcessor`` (vision models, placeholder tokens) or an
    ``AudioPromptProcessor`` (Whisper); None for text-only models."""
    kv_scales: dict[int, KVScales] = field(default_factory=dict)
    """The checkpoint's FP8 KV cache scales by decoder layer (``engine.kv_scales``); empty: none."""


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def resolve_max_model_len(hf_config, requested: int | None) -> int:
    if getattr(hf_config, "is_encoder_decoder", False):
        limit = hf_config.max_target_positions   # the decoder's learned positions (Whisper: 448)
        if requested is not None and requested > limit:
            raise ValueError(f"max_model_len={requested} is larger than the decoder's {limit} positions "
                             f"(max_target_positions); lower --max-model-len.")
        return requested or limit
    hf_config = hf_config.get_text_config()
    limit = getattr(hf_config, "max_position_embeddings", None) or 2048
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"max_model_len={requested} is larger than the model's limit of {limit} tokens "
                         f"(max_position_embeddings); lower --max-model-len.")
    return requested


def _eos_ids(hf_config, tokenizer, resolved) -> set[int]:
    ids: set[int] = set()

    def add(v):
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(x for x in v if isinstance(x, int))

    add(getattr(hf_config, "eos_token_id", None))
    add(getattr(hf_config.get_text_config(), "eos_token_id", None))
    add(getattr(tokenizer, "eos_token_id", None))
    if resolved.kind == "hf":
        try:
            from transformers import GenerationConfig
            add(GenerationConfig.from_pretrained(resolved.path).eos_token_id)
        except Exception:  # no generation_config.json
            pass
    return ids


_SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                  "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def default_sampling_from_generation_config(resolved) -> dict:
    """The sampling fields generation_config.json sets explicitly, under SamplingParams' names."""
    import json
    path = resolved.path / "generation_config.json" if resolved.kind == "hf" else None
    if path is None or not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {ours: raw[theirs] for theirs, ours in _SAMPLING_KEYS.items() if raw.get(theirs) is not None}


def build_model(model_config: ModelConfig, device: torch.device, tp: Optional[TensorParallelGroup] = None,
                parallel_config: Optional[ParallelConfig] = None) -> LoadedModel:
    """Build and load the model; with ``tp`` of size > 1, this rank's shard of it (read as such)."""
    from engine.loader import checkpoint_dtype, iter_weights, load_config, load_tokenizer, resolve_model
    from engine.device import resolve_dtype

    tp = tp or TensorParallelGroup.single()
    resolved = resolve_model(model_config.model, model_config.tokenizer)
    hf_config = load_config(resolved)
    model_cls = get_model_class(hf_config)
    if tp.size > 1:
        _check_tensor_parallel(model_cls, hf_config, model_config, parallel_config or ParallelConfig(tp.size))
    tokenizer = load_tokenizer(resolved, model_config.chat_template)
    max_model_len = resolve_max_model_len(hf_config, model_config.max_model_len)
    dtype = resolve_dtype(model_config.dtype, checkpoint_dtype(resolved), device)
    scheme = read_checkpoint_quantization(hf_config) if resolved.kind == "hf" else None
    _check_checkpoint_quantization(scheme, model_cls, model_config, tp, device)
    # A quantized checkpoint's projections never hold float weights (unless dequantized: --quantization none).
    defer = scheme is not None and model_config.quantization != "none" and model_config.load_format != "dummy"
    # Dummy weights with --quantization fp8: each projection is drawn and quantized in turn (``_init_dummy``).
    defer = defer or (model_config.load_format == "dummy" and model_config.quantization == "fp8")
    with _default_dtype(dtype), torch.device(device), (deferred_weights() if defer else contextlib.nullcontext()):
        model = model_cls(hf_config, max_position=max_model_len, **({"tp": tp} if tp.size > 1 else {}))
    kv_scales: dict[int, KVScales] = {}
    if model_config.load_format == "dummy":
        _init_dummy(model, hf_config, model_config.seed, fp8=model_config.quantization == "fp8")
    else:
        shard_of = model.checkpoint_shard if tp.size > 1 else None
        stream = QuantizedTensorStream(scheme) if scheme is not None else None

        def keep_dtype(name: str, tensor: torch.Tensor) -> bool:
            return attention_scale_name(name) is not None or (stream is not None and stream.belongs(name, tensor))

        def scale_shard_of(name: str):
            return None if attention_scale_name(name) is not None else shard_of(name)

        weights = iter_weights(resolved, dtype, device, shard_of=scale_shard_of if shard_of else None,
                               keep_dtype=keep_dtype)
        weights = _KVScaleSplitter(weights)
        model.load_weights(stream(weights) if stream is not None else weights)
        kv_scales = kv_scales_from_checkpoint(weights.scales)
        if stream is not None:
            _finish_quantized(model, dtype, dequantize=model_config.quantization == "none")
            unloaded = [n for n, p in model.named_parameters() if p.is_meta]
            if unloaded:
                raise ValueError(f"the checkpoint lacks {len(unloaded)} projection weights, e.g. {unloaded[:3]}")
            logger.info("%s: %s weights (%s checkpoint)%s.", resolved.path.name, scheme.kind, scheme.format,
                        ", dequantized (--quantization none)" if model_config.quantization == "none" else
                        _dequantized_experts_note(model, scheme))
    if model_config.quantization == "fp8":
        _quantize_fp8(model)
    if tp.size > 1:
        from engine.layers.parallel import RowParallelLinear
        for module in model.modules():
            if isinstance(module, RowParallelLinear):
                module.keep_bias_on_first_rank()
    # Sharded models run float weights (a GGUF's quantized tensors are dequantized: its quantized LM head
    # would bypass the vocab-parallel logits).
    plan = _quantization_plan(model, model_config.quantization, resolved, device) if tp.size == 1 else None
    if plan is not None:
        _quantize(model, plan, model_config.quantization or "auto", device)
        _keep_float_copies(model, model_config.cpu_float_copy)
    model.eval()
    if resolved.kind == "gguf":
        from engine.loader import checkpoint_dir
        logger.info("%s runs from its converted Hugging Face checkpoint %s: point transformers / PEFT at that "
                    "directory to train LoRA adapters for it.", resolved.path.name, checkpoint_dir(resolved))
    if model_config.model is None:
        from engine.loader.default_model import DEFAULT_MODEL_NAME
        name = DEFAULT_MODEL_NAME
    else:
        name = model_config.model
    mm_processor = None
    if model_cls.capabilities.multimodal:
        from engine.loader import checkpoint_dir
        mm_processor = model.make_prompt_processor(checkpoint_dir(resolved))
    transcriber = None
    if model_cls.capabilities.encoder_decoder:
        transcriber = _configure_whisper(model, hf_config, tokenizer, resolved, max_model_len, mm_processor)
    return LoadedModel(model=model, hf_config=hf_config, tokenizer=tokenizer, dtype=dtype,
                       max_model_len=max_model_len, model_name=model_config.served_model_name or name,
                       eos_token_ids=_eos_ids(hf_config, tokenizer, resolved),
                       default_sampling=default_sampling_from_generation_config(resolved),
                       mm_processor=mm_processor, transcriber=transcriber, kv_scales=kv_scales)


class _KVScaleSplitter:
    """Passes a checkpoint's tensors through, keeping its attention activation scales (``k_scale``,
    ``v_scale``, ...: ``engine.kv_scales``) aside in ``scales`` instead."""

    def __init__(self, weights) -> None:
        self._weights = weights
        self.scales: list[tuple[str, torch.Tensor]] = []
        """The scale tensors read, by checkpoint name."""

    def __iter__(self):
        for name, tensor in self._weights:
            if attention_scale_name(name) is not None:
                self.scales.append((name, tensor))
            else:
                yield name, tensor


def check_tensor_parallel(model_config: ModelConfig, parallel_config: ParallelConfig) -> None:
    """ValueError when the checkpoint's architecture or the settings cannot run at this
    tensor_parallel_size (reads only the config)."""
    from engine.loader import load_config, resolve_model

    hf_config = load_config(resolve_model(model_config.model, model_config.tokenizer))
    _check_tensor_parallel(get_model_class(hf_config), hf_config, model_config, parallel_config)


def _check_tensor_parallel(model_cls, hf_config, model_config: ModelConfig, parallel_config: ParallelConfig) -> None:
    """ValueError, saying what to change, for a model or setting that cannot run sharded."""
    n = parallel_config.tensor_parallel_size
    if not model_cls.capabilities.tensor_parallel:
        raise ValueError(f"{model_cls.__name__} cannot run with --tensor-parallel-size {n} yet; use "
                         "--tensor-parallel-size 1.")
    if model_config.quantization in ("int8", "int4", "fp16"):
        raise ValueError(f"--quantization {model_config.quantization} with --tensor-parallel-size {n} is not "
                         "supported; leave --quantization unset or use --tensor-parallel-size 1.")
    parallel_config.check_model(hf_config.get_text_config())


def _configure_whisper(model, hf_config, tokenizer, resolved, max_model_len: int, mm_processor):
    """Whisper's decoding rules (token suppression from generation_config.json, else config.json) on the
    model, and the ``Transcriber`` for its tokenizer."""
    import json
    from engine.transcription import Transcriber, token_ids_of

    ids = token_ids_of(tokenizer, hf_config.vocab_size)
    settings = {}
    path = resolved.path / "generation_config.json" if resolved.kind == "hf" else None
    if path is not None and path.is_file():
        try:
            settings = json.loads(path.read_text())
        except (OSError, ValueError):
            settings = {}

    def token_list(key: str) -> list[int]:
        value = settings.get(key, getattr(hf_config, key, None))
        return [int(t) for t in value or []]

    model.configure_decoding(ids, token_list("suppress_tokens"), token_list("begin_suppress_tokens"),
                             int(settings.get("max_initial_timestamp_index", 50) or 50),
                             alignment_heads=settings.get("alignment_heads"))
    return Transcriber(tokenizer, ids, max_model_len, mm_processor.sample_rate_hz, mm_processor.window_s,
                       audio_processor=mm_processor)


def _check_checkpoint_quantization(scheme: Optional[CheckpointQuantization], model_cls, model_config: ModelConfig,
                                   tp: TensorParallelGroup, device: torch.device) -> None:
    """ValueError, saying what to change, for quantization settings that cannot serve this checkpoint."""
    flag = model_config.quantization
    caps = model_cls.capabilities
    if flag == "fp8" and not (caps.weight_quantization or caps.fp8_weights):
        raise ValueError(f"--quantization fp8 supports Llama-family and MoE text models, their vision / audio "
                         f"language models and Whisper, not {model_cls.__name__}; leave --quantization unset.")
    if flag in ("int8", "int4", "fp16") and not caps.weight_quantization:
        raise ValueError(f"--quantization {flag} supports Llama-family text models, not {model_cls.__name__}; "
                         f"{'use --quantization fp8 or ' if caps.fp8_weights else ''}leave --quantization unset.")
    if flag == "fp8" and tp.size > 1:
        raise ValueError("--quantization fp8 with --tensor-parallel-size > 1 is not supported; use "
                         "--tensor-parallel-size 1.")
    if scheme is None:
        return
    if flag not in (None, "none"):
        raise ValueError(f"--quantization {flag}: the checkpoint is already quantized ({scheme.format}, "
                         f"{scheme.kind}); leave --quantization unset (or none for its dequantized weights).")
    if not caps.weight_quantization and caps.fp8_checkpoints and scheme.kind != FP8:
        raise ValueError(f"{model_cls.__name__} loads FP8 checkpoints, not 4-bit ones ({scheme.format}); serve an "
                         "FP8 or float checkpoint of it (--quantization fp8 quantizes a float one at load).")
    if not (caps.weight_quantization or caps.fp8_checkpoints):
        raise ValueError(f"{model_cls.__name__} cannot load a quantized ({scheme.format}) checkpoint; serve a "
                         f"float checkpoint of it{' (--quantization fp8 quantizes it at load)' if caps.fp8_weights else ''}.")
    if tp.size > 1:
        raise ValueError(f"a quantized ({scheme.format}) checkpoint with --tensor-parallel-size {tp.size} is "
                         "not supported; use --tensor-parallel-size 1.")
    if scheme.kind == FP8 and device.type == "cuda" and flag != "none" and torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise ValueError(f"quantization_config (FP8 weights) needs a GPU with FP8 (compute capability 8.9+: Ada, "
                         f"Hopper); {name} has {torch.cuda.get_device_capability(device)}. Use --quantization none "
                         "to serve its dequantized weights.")


def _dequantized_experts_note(model: torch.nn.Module, scheme: CheckpointQuantization) -> str:
    """The start-up line's words for a 4-bit MoE checkpoint on the GPU (its experts load dequantized)."""
    from engine.layers.moe import FusedMoE
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    if scheme.kind == FP8 or not experts or experts[0].cpu_quantized is not None:
        return ""
    gib = sum(t.numel() * t.element_size() for m in experts for t in (m.w13, m.w2)) / 2**30
    return (f"; the routed experts are held dequantized in {experts[0].w13.dtype} ({gib:.2f} GiB: no 4-bit "
            "expert kernel on the GPU), the other projections 4-bit")


@torch.no_grad()
def _finish_quantized(model: torch.nn.Module, dtype: torch.dtype, dequantize: bool) -> None:
    """Every projection of a quantized checkpoint: its quantized weight (``Linear.finish_quantized``), or with
    ``dequantize`` its float weight."""
    from engine.layers.linear import Linear
    from engine.layers.moe import FusedMoE
    for module in model.modules():
        if isinstance(module, FusedMoE):
            module.finish_quantized(dtype, dequantize)
            continue
        if not isinstance(module, Linear) or not module.quantized_slices:
            continue
        if dequantize:
            for idx, piece in sorted(module.quantized_slices.items()):
                module.load_slice("weight", idx, piece.dequantize().to(dtype))
            module.quantized_slices = {}
        else:
            module.finish_quantized(dtype)


@torch.no_grad()
def _quantize_fp8(model: torch.nn.Module) -> None:
    """``--quantization fp8``: every projection (not the embedding, the LM head or an MoE router:
    ``Linear.keep_float``) and an MoE's routed experts as FP8 per channel, but
    those of a multimodal model's encoder side (``VisionLanguageModel.float_parts``), which stay float
    (Whisper names none: its encoder's projections, where most of its FLOPs are, are FP8 too)."""
    from engine.layers.linear import Linear
    from engine.layers.moe import FusedMoE
    keep_float = _fp8_float_prefixes(model)
    for name, module in model.named_modules():
        if name.startswith(keep_float):
            continue
        if isinstance(module, Linear) and module.weight is not None and not module.keep_float:
            module.quantize_fp8()
        elif isinstance(module, FusedMoE):
            module.quantize_fp8()


def _fp8_float_prefixes(model: torch.nn.Module) -> tuple[str, ...]:
    """Module-name prefixes ``--quantization fp8`` keeps float: a multimodal model's encoder side."""
    return tuple(f"{part}." for part in getattr(model, "float_parts", ()))


def _quantization_plan(model: torch.nn.Module, quantization: Optional[str], resolved, device: torch.device):
    """What ``_quantize`` applies: "int8" / "int4", a GGUF file's own (checkpoint tensor name -> kind) when
    ``quantization`` is unset and the model runs on CPU, or None (float weights)."""
    if quantization in ("int8", "int4", "fp16"):
        return quantization
    if (quantization in ("none", "fp8") or resolved.kind != "gguf" or device.type != "cpu"
            or not model.capabilities.weight_quantization):
        return None
    from engine.layers.quantized import kind_for_gguf_type
    from engine.loader import checkpoint_dir
    from engine.loader.gguf_loader import stored_tensor_types
    plan = {name: kind_for_gguf_type(t) for name, t in stored_tensor_types(checkpoint_dir(resolved)).items()}
    if not any(plan.values()):
        return None
    logger.info("%s keeps its quantized tensors quantized on CPU (%s); --quantization none runs the float "
                "weights.", resolved.path.name, ", ".join(sorted({k for k in plan.values() if k})))
    return plan


@torch.no_grad()
def _quantize(model: torch.nn.Module, plan, flag: str, device: torch.device) -> None:
    """Weight-only quantized weights in memory (``engine.layers.quantized``)."""
    if device.type != "cpu":
        raise ValueError(f"--quantization {flag} runs on CPU (torch's weight-only kernels); on CUDA serve "
                         "the bfloat16 weights (leave --quantization unset).")
    if not model.capabilities.weight_quantization:
        raise ValueError(f"--quantization {flag} supports Llama-family text models, not {type(model).__name__}; "
                         "leave --quantization unset.")
    model.quantize(plan)


@torch.no_grad()
def _keep_float_copies(model: torch.nn.Module, wanted: Optional[bool], physical_bytes: Optional[int] = None,
                       amx: Optional[bool] = None) -> None:
    """The float copies of the int8 / int4 weights (``ModelConfig.cpu_float_copy``): where ``amx`` (default:
    the CPU has AMX) ``kernels.cpu_amx_gemm``'s tiles (or bf16 copies where it does not load) and float32
    copies for each projection, else fp16 ones; the LM head always keeps an fp16 one (float32 logits), and with
    AMX its tiles for batched logits. ``physical_bytes``: the machine's memory (default: read from the OS)."""
    import concurrent.futures
    import os

    from engine.layers.quantized import (AmxTiles, QuantizedEmbedding, cpu_has_amx, float_copies_fit,
                                         packed_weights)
    weights = packed_weights(model)
    if not weights or wanted is False:
        return
    if amx is None:
        amx = cpu_has_amx()
    heads = {id(m.weight_q) for m in model.modules() if isinstance(m, QuantizedEmbedding)}
    plan = [(w, amx and id(w) not in heads) for w in weights]
    amx_gemm = _amx_gemm() if amx else None
    head_tiles = [w for w in weights if id(w) in heads and w.fits_amx_gemm(amx_gemm)]
    nbytes = (sum(w.nbytes_float_copies(w_amx, amx_gemm) for w, w_amx in plan)
              + sum(w.nbytes_amx_tiles() for w in head_tiles))
    if physical_bytes is None:
        physical_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if wanted is None and not float_copies_fit(nbytes, physical_bytes):
        logger.info("Quantized weights: no float copies for batched steps (%.1f GiB would exceed a quarter of "
                    "this machine's memory; --cpu-float-copy keeps them anyway).", nbytes / (1 << 30))
        return
    # fbgemm's packing releases the GIL: one Python thread per torch thread packs them in parallel.
    with concurrent.futures.ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
        list(pool.map(lambda item: item[0].keep_float_copies(item[1], amx_gemm), plan))
    for w in head_tiles:          # batched logits from the AMX tiles, one row's from the fp16 copy (float32 both)
        w.amx_tiles = AmxTiles(amx_gemm, w)
    logger.info("Quantized weights: float copies for steps of several rows (%s; %.2f GiB; --no-cpu-float-copy "
                "drops them).", ("AMX: int4/int8 tiles and float32" if amx_gemm else "AMX: bf16 and float32")
                if amx else "fp16", nbytes / (1 << 30))


def _amx_gemm():
    """``kernels.cpu_amx_gemm`` built and loaded for this host (KernelPolicy ``cpu_amx_gemm``), or None."""
    from engine import envs
    from engine.kernel_policy import KernelPolicy
    if not KernelPolicy.for_device(torch.device("cpu")).cpu_amx_gemm:
        return None
    from kernels.cpu_amx_gemm import CpuAmxGemm
    return CpuAmxGemm.load(envs.cpu_kernel_dir())


@torch.no_grad()
def _init_dummy(model: torch.nn.Module, hf_config, seed: int, fp8: bool = False) -> None:
    """Random weights from the config alone (``load_format='dummy'``), for speed measurements.

    Drawn where the parameters live, from one generator on that device (an 8B model fills in
    well under a second on a GPU); norms are ones and biases zeros. With ``fp8`` the projections and MoE
    experts were built deferred (meta, ``deferred_weights``): each gets memory, its values and its FP8 form
    (but on ``_fp8_float_prefixes`` and routers) before the next, so the float model is never whole in memory (a 70B model's
    FP8 weights fit one 141 GB GPU, its bf16 ones do not); the values are those drawn without ``fp8``.
    """
    from engine.layers.linear import Linear
    from engine.layers.moe import FusedMoE
    # parameter id -> (module name, module, its parameter's name): the deferred weights, in parameter order
    deferred = {}
    for name, m in model.named_modules():
        if fp8 and isinstance(m, Linear) and m.weight is not None and m.weight.is_meta:
            deferred[id(m.weight)] = (name, m, "weight")
        elif fp8 and isinstance(m, FusedMoE) and m.w13.is_meta:
            deferred[id(m.w13)], deferred[id(m.w2)] = (name, m, "w13"), (name, m, "w2")
    params = list(model.named_parameters())
    device = next((p.device for _, p in params if not p.is_meta), torch.device("cpu"))
    gen = torch.Generator(device=device).manual_seed(seed)
    std = float(getattr(hf_config, "initializer_range", 0.02))
    keep_float = _fp8_float_prefixes(model)
    for name, p in params:
        owner = deferred.get(id(p))
        if owner is not None:
            module_name, module, param_name = owner
            module.materialize(device)
            p = getattr(module, param_name)
        if name.endswith("norm.weight") or "layernorm" in name:
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.normal_(0.0, std, generator=gen)
        if owner is None or module_name.startswith(keep_float) or param_name == "w13":
            continue   # float, or an expert stack whose w2 is still to draw
        if param_name == "w2" or not module.keep_float:
            module.quantize_fp8()
    if deferred and device.type == "cuda":
        torch.cuda.empty_cache()   # the float weights' freed blocks: the KV cache budget reads the free memory
