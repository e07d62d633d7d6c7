"""Serving load generator for any OpenAI-compatible server (like ``vllm bench serve``).

Sends ``--num-prompts`` streamed requests, arriving as a Poisson process at ``--request-rate``
(``inf``: all at once) and/or capped at ``--max-concurrency`` in flight, and reports requests/s,
output tokens/s, TTFT, TPOT, ITL and end-to-end latency (mean / median / p99) as a table and JSON.

    python benchmarks/serve.py --base-url http://127.0.0.1:8000 --num-prompts 64 \\
        --max-concurrency 8 --input-len 128 --output-len 64 --out result.json

Prompts: random ones of ``--input-len`` tokens (exact with ``--tokenizer``; otherwise calibrated
through the server's ``/tokenize`` when it has one, else ~1.3 tokens per word), or ``--dataset``:
a .jsonl with ``{"prompt": ..., "output_len": ...}`` per line, a .json list of strings or such
objects, or a text file with one prompt per line.

Definitions (vLLM's): TTFT = request sent -> first chunk with a choice; ITL = gaps between
successive such chunks; TPOT = (latency - TTFT) / (output tokens - 1), per request; output tokens come from
the final usage chunk (``stream_options.include_usage``).

Is the client the limit? Each client process reports its own CPU time over the timed run
(``getrusage``); a process near 100% of a core cannot send or read faster. ``--num-clients N``
splits the requests over N processes (each takes every N-th request, the arrival rate / N and
``--max-concurrency`` / N): the same throughput with more clients means the server is the limit.
``--offline-json`` takes a ``benchmarks/throughput.py`` JSON of the same requests (its
``--save-workload`` file, sent here with ``--dataset``) and reports served / offline output tok/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import random
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Union

import httpx

WORDS = ("the of and to in is was for on that with as by at from his her it an were are which this be "
         "or has had not but one all their they its new first can more two other after time would "
         "there been who so if only most over into some years many where these may city state world "
         "water music house river paper model cache block token engine batch adapter prefix step").split()


# ----------------------------------------------------------------------------------------
# Prompts
# ----------------------------------------------------------------------------------------
@dataclass
class BenchPrompt:
    prompt: Union[str, list[int]]
    """Text, or token ids (``/v1/completions`` only)."""
    output_len: int
    input_len: Optional[int] = None
    """Prompt tokens if known up front (the server's usage is reported anyway)."""


def load_dataset(path: str, default_output_len: int, num_prompts: int) -> list[BenchPrompt]:
    items: list[Any]
    with open(path, encoding="utf-8") as f:
        if path.endswith(".jsonl"):
            items = [json.loads(line) for line in f if line.strip()]
        elif path.endswith(".json"):
            items = json.load(f)
        else:
            items = [line.rstrip("\n") for line in f if line.strip()]
    prompts = []
    for it in items:
        if isinstance(it, str):
            prompts.append(BenchPrompt(it, default_output_len))
        else:
            prompt = it["prompt"]
            prompts.append(BenchPrompt(prompt, int(it.get("output_len", default_output_len)),
                                       len(prompt) if isinstance(prompt, list) else None))
    if not prompts:
        raise SystemExit(f"{path}: no prompts")
    return [prompts[i % len(prompts)] for i in range(num_prompts)]


def random_prompts_with_tokenizer(tokenizer_path: str, num: int, input_len: int, output_len: int,
                                  rng: random.Random) -> list[BenchPrompt]:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    special = set(tok.all_special_ids)
    vocab = [i for i in range(len(tok)) if i not in special]
    out = []
    for _ in range(num):
        ids = [rng.choice(vocab) for _ in range(input_len)]
        text = tok.decode(ids)
        ids = tok.encode(text, add_special_tokens=False)[:input_len]  # re-tokenization may drift
        text = tok.decode(ids)
        out.append(BenchPrompt(text, output_len, len(tok.encode(text, add_special_tokens=False))))
    return out


async def random_prompts_calibrated(client: httpx.AsyncClient, model: str, num: int, input_len: int,
                                    output_len: int, rng: random.Random) -> list[BenchPrompt]:
    """Word salad sized with the server's /tokenize when available (Chorus and vLLM have it)."""
    tokens_per_word = 1.3
    probe = " ".join(rng.choice(WORDS) for _ in range(200))
    try:
        r = await client.post("/tokenize",
                              json={"model": model, "prompt": probe, "add_special_tokens": False})
        if r.status_code == 200:
            tokens_per_word = max(r.json()["count"], 1) / 200
    except httpx.HTTPError:
        pass
    num_words = max(1, round(input_len / tokens_per_word))
    return [BenchPrompt(" ".join(rng.choice(WORDS) for _ in range(num_words)), output_len)
            for _ in range(num)]


# ----------------------------------------------------------------------------------------
# One request
# ----------------------------------------------------------------------------------------
@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    start_s: float = 0.0
    """Send time, relative to the benchmark start."""


def build_body(args: argparse.Namespace, model: str, p: BenchPrompt) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True},
                            "temperature": args.temperature, "max_tokens": p.output_len}
    if args.ignore_eos:
        body["ignore_eos"] = True  # vLLM / Chorus extension: fixed output lengths
    if args.top_p is not None:
        body["top_p"] = args.top_p
    if is_chat(args.endpoint):
        body["messages"] = [{"role": "user", "content": p.prompt}]
    else:
        body["prompt"] = p.prompt
    return body


def is_chat(endpoint: str) -> bool:
    return "chat" in endpoint


async def send_one(client: httpx.AsyncClient, args: argparse.Namespace, model: str, p: BenchPrompt,
                   t0: float) -> RequestResult:
    res = RequestResult(start_s=time.monotonic() - t0)
    body = build_body(args, model, p)
    chat = is_chat(args.endpoint)
    start = time.perf_counter()
    last = start
    num_chunks = 0
    try:
        async with client.stream("POST", args.endpoint, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = json.dumps(chunk["error"])[:200]
                    return res
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
                    res.output_tokens = chunk["usage"].get("completion_tokens", 0)
                for choice in chunk.get("choices") or []:
                    # As vLLM's client: every chunk with a choice counts (its text may still be
                    # empty, e.g. a partial UTF-8 character); for chat, every delta with content.
                    if chat and (choice.get("delta") or {}).get("content") is None:
                        continue
                    now = time.perf_counter()
                    if num_chunks == 0:
                        res.ttft_s = now - start
                    else:
                        res.itl_s.append(now - last)
                    last = now
                    num_chunks += 1
        res.latency_s = time.perf_counter() - start
        if res.output_tokens == 0:
            res.output_tokens = num_chunks
        res.prompt_tokens = res.prompt_tokens or (p.input_len or 0)
        res.success = num_chunks > 0
        if not res.success:
            res.error = "never received a chunk to time the first token"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


# ----------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------
async def arrival_times(num: int, request_rate: float, burstiness: float, rng: random.Random):
    """Yield once per request, spaced by Gamma(burstiness, 1/(rate*burstiness)) gaps (Poisson at 1)."""
    for i in range(num):
        yield i
        if math.isinf(request_rate) or i == num - 1:
            continue
        theta = 1.0 / (request_rate * burstiness)
        await asyncio.sleep(rng.gammavariate(burstiness, theta))


@dataclass
class ClientRun:
    """One client process's share of the timed run."""

    results: list[RequestResult]
    end_s: float
    """Its last response done, seconds after the common start."""
    cpu_s: float
    """User + system CPU seconds the client process spent over its share."""

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ClientRun":
        return cls([RequestResult(**r) for r in d["results"]], d["end_s"], d["cpu_s"])


def _http_client(args: argparse.Namespace, max_concurrency: Optional[int]) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # keepalive_expiry under the server's keep-alive (uvicorn's 5 s): no request on a closing connection
    limits = httpx.Limits(max_connections=max(max_concurrency or 0, 256), keepalive_expiry=2.0)
    return httpx.AsyncClient(base_url=args.base_url, headers=headers, limits=limits,
                             timeout=httpx.Timeout(args.timeout, connect=30))


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


async def prepare(args: argparse.Namespace) -> tuple[str, list[BenchPrompt]]:
    """The model name to request and the prompts; the warm-up requests sent."""
    rng = random.Random(args.seed)
    async with _http_client(args, args.max_concurrency) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        if args.dataset:
            prompts = load_dataset(args.dataset, args.output_len, args.num_prompts)
        elif args.tokenizer:
            prompts = random_prompts_with_tokenizer(args.tokenizer, args.num_prompts, args.input_len,
                                                    args.output_len, rng)
        else:
            prompts = await random_prompts_calibrated(client, model, args.num_prompts, args.input_len,
                                                      args.output_len, rng)
        for _ in range(args.num_warmups):
            warm = await send_one(client, args, model, BenchPrompt(prompts[0].prompt, 4), time.monotonic())
            if not warm.success:
                raise SystemExit(f"warm-up request failed: {warm.error}")
    return model, prompts


async def send_share(args: argparse.Namespace, model: str, prompts: list[BenchPrompt], request_rate: float,
                     max_concurrency: Optional[int], seed: int, start_at: Optional[float]) -> ClientRun:
    """Send ``prompts`` from ``start_at`` (``time.monotonic()``; None: now) on, Poisson-spaced at
    ``request_rate``, at most ``max_concurrency`` in flight."""
    rng = random.Random(seed)
    async with _http_client(args, max_concurrency) as client:
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None

        async def limited(p: BenchPrompt, t0: float) -> RequestResult:
            if sem is None:
                return await send_one(client, args, model, p, t0)
            async with sem:
                return await send_one(client, args, model, p, t0)

        if start_at is None:
            start_at = time.monotonic()
        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        cpu0 = _cpu_s()
        tasks = []
        async for i in arrival_times(len(prompts), request_rate, args.burstiness, rng):
            tasks.append(asyncio.ensure_future(limited(prompts[i], start_at)))
        results = await asyncio.gather(*tasks)
        return ClientRun(list(results), time.monotonic() - start_at, _cpu_s() - cpu0)


def run_clients(args: argparse.Namespace, model: str, prompts: list[BenchPrompt]) -> list[ClientRun]:
    """The timed run: in this process, or over ``--num-clients`` forked processes that start
    together, client i sending prompts i, i + N, ..."""
    n = args.num_clients
    if n == 1:
        return [asyncio.run(send_share(args, model, prompts, args.request_rate, args.max_concurrency,
                                       args.seed, None))]
    # NOTE: fork, so children need nothing pickled but their results (plain dicts).
    ctx = multiprocessing.get_context("fork")
    start_at = time.monotonic() + 0.5 + 0.05 * n
    rate = args.request_rate / n
    concurrency = math.ceil(args.max_concurrency / n) if args.max_concurrency else None
    readers, procs = [], []
    for i in range(n):
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_client_process, daemon=True, args=(
            writer, args, model, prompts[i::n], rate, concurrency, args.seed + i, start_at))
        proc.start()
        writer.close()
        readers.append(reader)
        procs.append(proc)
    replies = [r.recv() for r in readers]
    for proc in procs:
        proc.join()
    errors = [r["error"] for r in replies if "error" in r]
    if errors:
        raise SystemExit(f"a client process failed: {errors[0]}")
    return [ClientRun.from_dict(r) for r in replies]


def _client_process(writer, args, model, prompts, rate, concurrency, seed, start_at) -> None:
    try:
        run = asyncio.run(send_share(args, model, prompts, rate, concurrency, seed, start_at))
        writer.send(asdict(run))
    except BaseException as e:   # NOTE: the parent waits for a reply from every child
        writer.send({"error": f"{type(e).__name__}: {e}"})
    writer.close()


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    model, prompts = asyncio.run(prepare(args))
    return summarize(args, model, run_clients(args, model, prompts))


def _stats(values: list[float], percentiles: list[float], scale: float = 1000.0) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, **{f"p{_pname(q)}": 0.0 for q in percentiles}}
    v = sorted(values)
    out = {"mean": sum(v) / len(v) * scale}
    for q in percentiles:
        out[f"p{_pname(q)}"] = _percentile(v, q) * scale
    return out


def _pname(q: float) -> str:
    return str(int(q)) if float(q).is_integer() else str(q)


def _percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation, as numpy.percentile's default."""
    if len(sorted_values) == 1:
        return sorted_values[0]
    pos = (len(sorted_values) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(args: argparse.Namespace, model: str, runs: list[ClientRun]) -> dict[str, Any]:
    results = [r for run in runs for r in run.results]
    duration_s = max(run.end_s for run in runs)
    ok = [r for r in results if r.success]
    pct = [float(x) for x in args.percentiles.split(",")]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpot = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "base_url": args.base_url, "endpoint": args.endpoint, "model": model,
        "num_prompts": len(results), "request_rate": args.request_rate, "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency, "input_len": args.input_len, "output_len": args.output_len,
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.success})[:5],
        "duration_s": duration_s,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration_s if duration_s else 0.0,
        "output_throughput": out_tokens / duration_s if duration_s else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s if duration_s else 0.0,
        "ttft_ms": _stats([r.ttft_s for r in ok], pct),
        "tpot_ms": _stats(tpot, pct),
        "itl_ms": _stats([x for r in ok for x in r.itl_s], pct),
        "e2el_ms": _stats([r.latency_s for r in ok], pct),
        "num_clients": len(runs), "client_cpu_s": [run.cpu_s for run in runs],
        "client_cpu_fraction_max": max(run.cpu_s / run.end_s if run.end_s else 0.0 for run in runs),
        "requests": [asdict(r) for r in results] if args.save_requests else None,
    }


def print_table(s: dict[str, Any]) -> None:
    line = "=" * 56
    print(line)
    print(f"{' Serving Benchmark Result ':=^56}")
    rows = [("Model", s["model"]), ("Successful requests", s["completed"]), ("Failed requests", s["failed"]),
            ("Max concurrency", s["max_concurrency"] or "-"), ("Request rate (req/s)", s["request_rate"]),
            ("Benchmark duration (s)", f"{s['duration_s']:.2f}"),
            ("Total input tokens", s["total_input_tokens"]),
            ("Total generated tokens", s["total_output_tokens"]),
            ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{s['output_throughput']:.2f}"),
            ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.2f}"),
            ("Client processes", s["num_clients"]),
            ("Client CPU, busiest process (% core)", f"{100 * s['client_cpu_fraction_max']:.1f}")]
    if "offline_output_throughput" in s:
        rows += [("Offline output tok/s (same requests)", f"{s['offline_output_throughput']:.2f}"),
                 ("Served / offline output tok/s", f"{s['served_over_offline']:.3f}")]
    for k, v in rows:
        print(f"{k:<40}{v!s:>16}")
    for key, title in (("ttft_ms", "Time to First Token"),
                       ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                       ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):
        print(f"{' ' + title + ' ':-^56}")
        for stat, value in s[key].items():
            name = {"mean": "Mean", "p50": "Median"}.get(stat, stat.upper())
            print(f"{name + ' ' + key.split('_')[0].upper() + ' (ms)':<40}{value:>16.2f}")
    if s["errors"]:
        print("Errors:", *s["errors"], sep="\n  ")
    print(line)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="Server root (without /v1).")
    p.add_argument("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions.")
    p.add_argument("--model", default=None, help="Model or adapter name to request (default: the first "
                                                 "entry of /v1/models).")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Mean arrivals per second (Poisson); inf sends everything at once.")
    p.add_argument("--burstiness", type=float, default=1.0, help="Gamma shape of the gaps; 1 is Poisson.")
    p.add_argument("--max-concurrency", type=int, default=None, help="At most this many requests in flight.")
    p.add_argument("--input-len", type=int, default=128, help="Random prompts: tokens per prompt.")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens per request.")
    p.add_argument("--dataset", default=None, help=".jsonl / .json / .txt prompts instead of random ones.")
    p.add_argument("--tokenizer", default=None, help="HF tokenizer dir for exact random prompt lengths.")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="Ask for exactly --output-len tokens (vLLM's ignore_eos extension).")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--percentiles", default="50,99", help="Comma-separated percentiles to report.")
    p.add_argument("--num-warmups", type=int, default=1, help="Short requests sent before measuring.")
    p.add_argument("--timeout", type=float, default=600.0, help="Per-request read timeout (s).")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="Write the summary JSON here.")
    p.add_argument("--save-requests", action="store_true", help="Include per-request results in the JSON.")
    p.add_argument("--num-clients", type=int, default=1,
                   help="Client processes sharing the requests (rate and concurrency split evenly).")
    p.add_argument("--offline-json", default=None,
                   help="A benchmarks/throughput.py JSON of the same requests: report served / offline "
                        "output tok/s.")
    return p


def add_offline(summary: dict[str, Any], path: str) -> None:
    """Served vs offline output tok/s: ``path`` is a ``benchmarks/throughput.py`` JSON of the same
    requests (its first row is Chorus ``LLM.generate``)."""
    with open(path, encoding="utf-8") as f:
        offline = json.load(f)["rows"][0]
    summary["offline_output_throughput"] = offline["output_tok_s"]
    summary["served_over_offline"] = summary["output_throughput"] / offline["output_tok_s"]
    if offline["output_tokens"] != summary["total_output_tokens"]:
        print(f"NOTE: the offline run made {offline['output_tokens']} output tokens, this one "
              f"{summary['total_output_tokens']}: not the same requests.")


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    if args.num_clients < 1:
        raise SystemExit("--num-clients must be at least 1")
    summary = run_benchmark(args)
    if args.offline_json:
        add_offline(summary, args.offline_json)
    print_table(summary)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({k: v for k, v in summary.items() if v is not None}, f, indent=2)
        print(f"Wrote {args.out}")
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
