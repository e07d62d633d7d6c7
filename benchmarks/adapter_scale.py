"""Adapters at scale: output throughput and TTFT against the number of distinct LoRA adapters, relative to the
base model, with the adapters resolved by name from a ``--lora-dir`` on first use.

Examples:
    # H200: Llama-3-8B shape, random bf16 weights (no download), 1 to 2,000 adapters, Zipf and uniform
    python benchmarks/adapter_scale.py --num-adapters 1,16,64,256,1000,2000 --popularity zipf,uniform
    # CPU smoke run on the tiny shape
    python benchmarks/adapter_scale.py --tiny

Workload: ``--num-prompts`` requests of ``--input-len`` random prompt tokens and ``--output-len`` new tokens
(greedy, EOS ignored), arriving as a Poisson process at ``--rate`` requests/s (default: the base model's
saturation rate, measured first: the same requests all at once on the base engine, requests over seconds).
Each row (N, popularity) draws every request's adapter from N distinct adapters, uniformly or by Zipf
(alpha ``--zipf-alpha``: adapter k has weight 1 / (k + 1) ** alpha); each adapter's rank is drawn from
``--ranks`` (seeded, S-LoRA's mix). Adapters are PEFT directories under ``--lora-dir`` (one per name) on all 7
projections (benchmarks/multi_lora.py's ``write_random_adapter``); each row names its own adapters, so every
row starts cold. Their weight files are hard links to ``--unique-adapter-files`` random files per rank:
2,000 adapters of the 8B shape would be ~300 GB written (5.2 MB per rank unit, mean rank ~29), and the engine
reads, pins and copies each one like a distinct file all the same (from the page cache, which holds files
just written).

Requests go through ``AsyncLLM`` (the engine core in a process of its own on CUDA, in a thread on CPU, as
``chorus serve`` does; ``--engine-process`` sets it) and ``OpenAIServingModels.resolve_lora_by_name`` with a
``FilesystemLoRAResolver``: the path a request naming an unknown adapter takes through the server, without HTTP.
TTFT is from a request's arrival (before its adapter is resolved) to its first token. "cold start" is the TTFT
of the requests whose adapter was not yet loaded when they arrived (read from disk on their path, or waiting for
that read); the JSON also has the part of it spent resolving and reading the adapter (``cold_resolve_ms``),
and the engine's own reads (its loader threads' counters: reads, GB, mean ms a read took on a thread and
waited for one). "bound" is the x base the row could reach were its adapters to cost only their bytes, read
once per step at HBM bandwidth (``HBM_BYTES_S``) on top of the base row's time: the steps' distinct adapters'
rank rows (the engine's ``num_lora_step_rank_rows``) times the model's bytes per rank row. The
base row runs the same arrivals on an engine without LoRA; "x base" is each row's output tok/s over it. Host
loads, slot loads and ``lora_reloads_while_running`` are the engine's counters over the row. Prints a table per
(N, popularity) and writes JSON (after every row).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.multi_lora import _dump, make_prompts, write_random_adapter  # noqa: E402
from benchmarks.serve import _stats, arrival_times  # noqa: E402
from benchmarks.shapes import SHAPES, dummy_model, shape_fields  # noqa: E402

POPULARITIES = ("zipf", "uniform")


# ----------------------------------------------------------------------------------------
# Adapters on disk
# ----------------------------------------------------------------------------------------
def weight_files(work: Path, shape: dict, ranks: list[int], per_rank: int) -> dict[int, list[Path]]:
    """Rank -> ``per_rank`` PEFT directories of random weights at that rank (written once, kept)."""
    out = {}
    for rank in ranks:
        dirs = []
        for k in range(per_rank):
            d = work / "weights" / f"r{rank}-{k}"
            if not (d / "adapter_config.json").exists():
                write_random_adapter(d, shape, rank, seed=1000 * rank + k)
            dirs.append(d)
        out[rank] = dirs
    return out


def adapter_names(num: int, popularity: str) -> list[str]:
    """The row's own adapter names (plain names, as ``--lora-dir`` takes them)."""
    return [f"{popularity}{num}-{i:04d}" for i in range(num)]


def adapter_ranks(num: int, ranks: list[int], seed: int) -> list[int]:
    """Each adapter's rank, drawn from ``ranks`` (seeded: adapter i has the same rank in every row)."""
    rng = random.Random(seed)
    return [rng.choice(ranks) for _ in range(num)]


def link_adapters(lora_dir: Path, names: list[str], ranks: list[int], files: dict[int, list[Path]]) -> None:
    """``lora_dir/NAME`` for each name: its config and weights hard links to one of its rank's files."""
    for i, (name, rank) in enumerate(zip(names, ranks)):
        src = files[rank][i % len(files[rank])]
        d = lora_dir / name
        d.mkdir(parents=True, exist_ok=True)
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            if not (d / f).exists():
                os.link(src / f, d / f)


def request_adapters(num_requests: int, num_adapters: int, popularity: str, alpha: float, seed: int) -> list[int]:
    """Each request's adapter index: uniform over ``num_adapters``, or Zipf (index k weighs 1 / (k + 1) ** alpha)."""
    rng = random.Random(seed)
    if popularity == "uniform":
        return [rng.randrange(num_adapters) for _ in range(num_requests)]
    weights = [1.0 / (k + 1) ** alpha for k in range(num_adapters)]
    return rng.choices(range(num_adapters), weights=weights, k=num_requests)


# ----------------------------------------------------------------------------------------
# One run: requests arriving over time through AsyncLLM
# ----------------------------------------------------------------------------------------
def engine_kwargs(args, enable_lora: bool) -> dict:
    kw = dict(model=args.model, load_format="dummy", dtype=args.dtype, seed=0, enable_prefix_caching=False,
              max_model_len=args.input_len + args.output_len + 16, max_num_seqs=args.max_num_seqs)
    if torch.cuda.is_available():
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
    if enable_lora:
        kw.update(enable_lora=True, max_loras=args.max_loras, max_cpu_loras=args.max_cpu_loras,
                  max_lora_rank=max(args.ranks), max_lora_pool_bytes=args.max_lora_pool_bytes)
    return kw


async def _one(llm, models, prompt: list[int], params, rid: str, name: Optional[str], t0: float) -> dict:
    """One request from its arrival: resolve its adapter by name (``--lora-dir``), stream it, time it."""
    arrival = time.perf_counter()
    cold = name is not None and name not in models.lora_requests
    lora = await models.resolve_lora_by_name(name) if name is not None else None
    resolved, first, n_out = time.perf_counter(), None, 0
    async for out in llm.generate({"prompt_token_ids": prompt}, params, rid, lora_request=lora):
        n = sum(len(c.token_ids) for c in out.outputs)
        if n and first is None:
            first = time.perf_counter()
        n_out += n
    return dict(arrival_s=arrival - t0, ttft_s=first - arrival, resolve_s=resolved - arrival,
                end_s=time.perf_counter() - t0, output_tokens=n_out, cold=cold)


async def _drive(llm, models, prompts, names: list[Optional[str]], rate: float, args, tag: str) -> list[dict]:
    from engine import SamplingParams
    from engine.sampling_params import RequestOutputKind

    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    t0 = time.perf_counter()
    tasks = []
    async for i in arrival_times(len(prompts), rate, 1.0, random.Random(args.seed)):
        tasks.append(asyncio.create_task(_one(llm, models, prompts[i], params, f"{tag}-{i}", names[i], t0)))
    return list(await asyncio.gather(*tasks))


async def run(llm, models, prompts, names: list[Optional[str]], rate: float, args, tag: str) -> dict:
    """The requests at ``rate`` (inf: all at once); throughput, TTFT percentiles and the engine's counter deltas."""
    s0 = llm.get_stats()
    reqs = await _drive(llm, models, prompts, names, rate, args, tag)
    s1 = llm.get_stats()
    n_out = sum(r["output_tokens"] for r in reqs)
    assert n_out == len(prompts) * args.output_len, n_out
    seconds = max(r["end_s"] for r in reqs)
    cold = [r for r in reqs if r["cold"]]
    return dict(requests=len(reqs), seconds=seconds, output_tokens=n_out, output_tok_s=n_out / seconds,
                req_s=len(reqs) / seconds, ttft_ms=_stats([r["ttft_s"] for r in reqs], [50, 99]),
                cold_requests=len(cold), cold_start_ms=_stats([r["ttft_s"] for r in cold], [50, 99]) if cold else None,
                cold_resolve_ms=_stats([r["resolve_s"] for r in cold], [50, 99]) if cold else None,
                distinct_adapters=len({n for n in names if n is not None}),
                host_loads=s1.num_lora_host_loads - s0.num_lora_host_loads,
                slot_loads=s1.num_lora_slot_loads - s0.num_lora_slot_loads,
                lora_reloads_while_running=(s1.num_lora_reloads_while_running
                                            - s0.num_lora_reloads_while_running),
                **_read_figures(s0, s1))


def _read_figures(s0, s1) -> dict:
    """The engine's adapter reads over the row (its loader threads: count, bytes, seconds per read on a thread
    and queued for one) and the adapter bytes its steps had to read (``num_lora_step_rank_rows``)."""
    reads = s1.num_lora_disk_reads - s0.num_lora_disk_reads
    nbytes = s1.lora_disk_read_bytes - s0.lora_disk_read_bytes
    read_s = s1.lora_disk_read_s - s0.lora_disk_read_s
    queued_s = s1.lora_disk_read_queued_s - s0.lora_disk_read_queued_s
    return dict(disk_reads=reads, disk_read_gb=nbytes / 1e9,
                disk_read_ms_mean=1e3 * read_s / reads if reads else None,
                disk_read_queued_ms_mean=1e3 * queued_s / reads if reads else None,
                disk_read_gb_s_per_thread=nbytes / 1e9 / read_s if read_s else None,
                step_adapter_gb=((s1.num_lora_step_rank_rows - s0.num_lora_step_rank_rows)
                                 * s1.lora_rank_row_bytes / 1e9))


def open_engine(args, enable_lora: bool):
    """``AsyncLLM`` (engine core in its own process on CUDA, as ``chorus serve``) and the server's model registry
    resolving adapter names in ``--lora-dir``."""
    from engine.async_llm import AsyncLLM
    from engine.server.lora_resolver import filesystem_resolvers
    from engine.server.serving_models import OpenAIServingModels

    llm = AsyncLLM.from_engine_args(log_requests=False, engine_process=args.engine_process,
                                    **engine_kwargs(args, enable_lora))
    resolvers = filesystem_resolvers([str(args.lora_dir)]) if enable_lora else []
    return llm, OpenAIServingModels(llm, ["base"], args.model, lora_resolvers=resolvers)


# ----------------------------------------------------------------------------------------
async def base_rows(args, prompts, report) -> float:
    """The base engine: warm-up, the closed-loop run (its request rate is the saturation rate, unless
    ``--rate``), then the Poisson run at that rate. Returns the rate."""
    t0 = time.perf_counter()
    llm, models = open_engine(args, enable_lora=False)
    warm = [p[::-1] for p in prompts[:args.warmup_prompts]]
    await run(llm, models, warm, [None] * len(warm), math.inf, args, "warm-base")
    print(f"base engine started and warmed up in {time.perf_counter() - t0:.1f} s", flush=True)
    if args.rate is None:
        closed = await run(llm, models, prompts, [None] * len(prompts), math.inf, args, "closed")
        report["base_closed_loop"] = closed
        args.rate = closed["req_s"]
        print(f"base saturation: {closed['req_s']:.2f} req/s, {closed['output_tok_s']:.1f} tok/s", flush=True)
    report["rate_req_s"] = args.rate
    row = dict(num_adapters=0, popularity="-",
               **await run(llm, models, prompts, [None] * len(prompts), args.rate, args, "base"))
    _add_row(report, row)
    llm.shutdown()
    return args.rate


async def lora_rows(args, prompts, files, report) -> None:
    """One LoRA engine for every (N, popularity) row, warmed up on adapters of its own first."""
    t0 = time.perf_counter()
    llm, models = open_engine(args, enable_lora=True)
    warm_n = min(len(args.ranks), args.max_loras)
    names = adapter_names(warm_n, "warm")
    link_adapters(args.lora_dir, names, args.ranks[:warm_n], files)
    warm = [p[::-1] for p in prompts[:args.warmup_prompts]]
    await run(llm, models, warm, [names[i % warm_n] for i in range(len(warm))], math.inf, args, "warm-lora")
    print(f"LoRA engine started and warmed up in {time.perf_counter() - t0:.1f} s", flush=True)
    for n in args.num_adapters:
        for pop in args.popularity:
            names = adapter_names(n, pop)
            link_adapters(args.lora_dir, names, adapter_ranks(n, args.ranks, args.seed), files)
            picks = request_adapters(len(prompts), n, pop, args.zipf_alpha, seed=args.seed + n)
            row = dict(num_adapters=n, popularity=pop,
                       **await run(llm, models, prompts, [names[k] for k in picks], args.rate, args, f"{pop}{n}"))
            _add_row(report, row)
    llm.shutdown()


async def _rows(args, prompts, files, report) -> None:
    """Both engines in one event loop (``AsyncLLM`` and the model registry bind to the loop they first run in)."""
    await base_rows(args, prompts, report)
    await lora_rows(args, prompts, files, report)


HBM_BYTES_S = 4.8e12
"""The bandwidth adapter bytes are read at in ``x_base_bytes_bound``: an H200's HBM3e datasheet peak."""


def _add_row(report: dict, row: dict) -> None:
    base = report["rows"][0] if report["rows"] else row
    row["x_base"] = row["output_tok_s"] / base["output_tok_s"]
    if row["num_adapters"] and torch.cuda.is_available():
        # The x base this row could reach were its adapters to cost only reading their bytes once a step at
        # HBM bandwidth, on top of the base row's time: the adapter-bytes floor of the whole workload.
        extra_s = row["step_adapter_gb"] * 1e9 / HBM_BYTES_S
        row["x_base_bytes_bound"] = base["seconds"] / (base["seconds"] + extra_s)
    report["rows"].append(row)
    print(f"  {_line(row)}", flush=True)
    _dump(report)


HEADER = (f"{'adapters':>8s} {'popularity':>10s} {'distinct':>8s} {'out tok/s':>10s} {'x base':>7s} "
          f"{'TTFT p50':>9s} {'TTFT p99':>9s} {'cold':>5s} {'cold p50':>9s} {'cold p99':>9s} "
          f"{'host lds':>8s} {'slot lds':>8s} {'reloads*':>8s} {'bound':>6s} {'read ms':>8s} "
          f"{'queued ms':>9s} {'GB/s/thr':>8s}")


def _line(r: dict) -> str:
    cold = r["cold_start_ms"] or {}
    ms = lambda v: f"{v:.1f}" if v is not None else "-"   # noqa: E731
    return (f"{r['num_adapters']:8d} {r['popularity']:>10s} {r['distinct_adapters']:8d} {r['output_tok_s']:10.1f} "
            f"{r['x_base']:7.3f} {r['ttft_ms']['p50']:9.1f} {r['ttft_ms']['p99']:9.1f} {r['cold_requests']:5d} "
            f"{ms(cold.get('p50')):>9s} {ms(cold.get('p99')):>9s} {r['host_loads']:8d} {r['slot_loads']:8d} "
            f"{r['lora_reloads_while_running']:8d} {_f(r.get('x_base_bytes_bound'), 3):>6s} "
            f"{_f(r.get('disk_read_ms_mean'), 0):>8s} {_f(r.get('disk_read_queued_ms_mean'), 0):>9s} "
            f"{_f(r.get('disk_read_gb_s_per_thread'), 2):>8s}")


def _f(v: Optional[float], digits: int) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def print_table(args, report: dict) -> None:
    print(f"\nworkload: {args.num_prompts} requests, input {args.input_len}, output {args.output_len}, Poisson "
          f"{report['rate_req_s']:.2f} req/s; {args.shape}{' tiny' if args.tiny else ''}-shaped {args.dtype}; "
          f"adapters on all 7 projections, ranks {'/'.join(map(str, args.ranks))} mixed; {args.max_loras} GPU "
          f"slots, {args.max_cpu_loras or 'default'} host; device {report['device']}")
    print("TTFT and cold start (TTFT of requests whose adapter was not loaded when they arrived) in ms; "
          "reloads*: lora_reloads_while_running; bound: the x base if adapters cost only their bytes read "
          f"once a step at {HBM_BYTES_S / 1e12:.1f} TB/s; read / queued ms: the engine's mean read on "
          "a loader thread and its wait for one; GB/s/thr: bytes read per second on a thread")
    print(HEADER)
    for r in report["rows"]:
        print(_line(r))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b",
                    help="the model shape (benchmarks/shapes.py), random weights")
    ap.add_argument("--tiny", action="store_true",
                    help="the shape's tiny variant and a small workload (CPU, well under a minute)")
    ap.add_argument("--num-adapters", default=None,
                    help="comma-separated distinct adapter counts (default 1,16,64,256,1000,2000; tiny: 1,4)")
    ap.add_argument("--popularity", default="zipf,uniform", help="comma-separated: zipf, uniform")
    ap.add_argument("--zipf-alpha", type=float, default=1.0)
    ap.add_argument("--ranks", default="8,16,64", help="the ranks each adapter's is drawn from")
    ap.add_argument("--num-prompts", type=int, default=None, help="requests per row (default 1000; tiny: 12)")
    ap.add_argument("--input-len", type=int, default=None, help="prompt tokens (default 256; tiny: 16)")
    ap.add_argument("--output-len", type=int, default=None, help="new tokens (default 128; tiny: 4)")
    ap.add_argument("--rate", type=float, default=None,
                    help="Poisson arrivals, requests/s (default: the base model's saturation rate, measured)")
    ap.add_argument("--max-loras", type=int, default=None, help="GPU adapter slots (default 64; tiny: 2)")
    ap.add_argument("--max-cpu-loras", type=int, default=None,
                    help="the host-memory LRU's adapters (default: the engine's, max(max_loras, 64); tiny: 3)")
    ap.add_argument("--max-lora-pool-bytes", type=int, default=None,
                    help="the engine's adapter slot pool in bytes (default: slots padded to the largest rank)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--unique-adapter-files", type=int, default=4,
                    help="random weight files per rank (each adapter's files are hard links to one of them)")
    ap.add_argument("--warmup-prompts", type=int, default=None, help="untimed requests first (default 64; tiny: 4)")
    ap.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                    help="the engine core in a process of its own (default: on CUDA, as chorus serve)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default="/tmp/chorus-adapter-scale", help="where the random weight files go")
    ap.add_argument("--lora-dir", default=None, help="the adapter directories (default WORKDIR/loras)")
    ap.add_argument("--out", default="benchmarks/out/adapter_scale.json")
    args = ap.parse_args()
    tiny = args.tiny
    defaults = dict(num_adapters="1,4" if tiny else "1,16,64,256,1000,2000", num_prompts=12 if tiny else 1000,
                    input_len=16 if tiny else 256, output_len=4 if tiny else 128, max_loras=2 if tiny else 64,
                    max_cpu_loras=3 if tiny else None, warmup_prompts=4 if tiny else 64)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.num_adapters = [int(x) for x in str(args.num_adapters).split(",")]
    args.popularity = args.popularity.split(",")
    if any(p not in POPULARITIES for p in args.popularity):
        raise SystemExit(f"--popularity {','.join(args.popularity)}: each must be one of {', '.join(POPULARITIES)}.")
    args.ranks = [int(x) for x in args.ranks.split(",")]
    if args.engine_process is None:
        args.engine_process = torch.cuda.is_available()
    args.dtype = args.dtype or ("bfloat16" if torch.cuda.is_available() else "float32")
    work = Path(args.workdir) / f"{args.shape}{'-tiny' if tiny else ''}"
    args.lora_dir = Path(args.lora_dir) if args.lora_dir else work / "loras"
    args.lora_dir.mkdir(parents=True, exist_ok=True)
    shape = shape_fields(args.shape, tiny)[2]
    args.model = dummy_model(args.shape, tiny, args.dtype)
    t0 = time.perf_counter()
    files = weight_files(work, shape, args.ranks, args.unique_adapter_files)
    print(f"adapter weight files ready in {time.perf_counter() - t0:.1f} s", flush=True)
    prompts = make_prompts(args.num_prompts, args.input_len, shape["vocab_size"], seed=args.seed)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu x{torch.get_num_threads()}"
    report = dict(args=vars(args), device=device, targets="all 7 projections", rows=[])
    asyncio.run(_rows(args, prompts, files, report))
    print_table(args, report)
    _dump(report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
