"""W4A16 sweep: ``kernels.w4a16`` launch configs against the int4 bytes floor and bf16 cuBLAS, per shape.

Examples:
    python benchmarks/sweeps/w4a16_sweep.py                  # H200: Llama-3-8B projections, M 1, 4, 16, 64, G 128
    python benchmarks/sweeps/w4a16_sweep.py --shapes qkv,down --ms 1,16 --group-sizes 128,0 --out /tmp/w4.json
    python benchmarks/sweeps/w4a16_sweep.py --ms 256,2048    # the GEMM tiles
    python benchmarks/sweeps/w4a16_sweep.py --tiny           # CPU smoke: every launch path through the interpreter

Per projection shape (Llama-3-8B: qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336 as
N x K), group size (--group-sizes; 0 = per-channel) and token count M (--ms), timed: ``F.linear`` on
the bf16 weight (cuBLAS), ``w4a16_matmul`` with its default config and with every candidate
``W4A16Config`` (``candidate_configs``): the GEMV tiles (``FMA_TILES`` up to ``FMA_MAX_ROWS`` rows;
``DOT_TILES`` up to 64 rows from ``DOT_MIN_ROWS``, one of them below) and from 5 rows the tiled kernel
(``GEMM_TILES``: block_m 16 up to 16 rows, larger tiles above). Each tile runs at split_k 1, 2, 4, 8 (while
every K slice keeps >= 2 steps and the programs stay <= 8 per SM), every split with both reductions
(a second launch, or ``reduce_in_kernel``). Each case is timed from a CUDA graph of --calls
back-to-back calls that cycle through distinct weight copies totalling > 2x the L2, so weights come
from HBM as in a 32-layer step. Every config's output is checked against the torch twin
``w4a16_matmul_ref`` before and after its timing; a config off by more than ``ERR_LIMIT`` (x the
output's magnitude) is reported and never picked. The bytes floor of a case is its int4 bytes (packed
weights, bf16 scales and zeros) at --peak-tbs.

One run on an H200 stays under 4 minutes: the candidates compile first in --compile-workers processes
(Triton's on-disk cache, which the timing process then reads), the M values run in the order given
(M = 1 first), and past --budget-s seconds the remaining cases time their default config only.

Prints, per case, the default and the fastest configs (us, floor / us, x cuBLAS); a summary table (per
shape and M: floor, cuBLAS, default, best, the floor fraction, the best config); for each M the decode
tile with the least total over the shapes (the ``DECODE_DEFAULTS`` row for shapes not in the table);
and ``kernels.w4a16.SHAPE_DEFAULTS`` ready to paste (the fastest config per shape and M, group size
128 or the first given). Writes JSON (default ``benchmarks/out/w4a16_sweep[_tiny].json``).

``--tiny`` runs two small shapes (column tails, K of 2-4 groups of 128) at group size 32 and one config
per launch path (each GEMV form, the tiled kernel, split-K with each reduction) on the CPU through the
Triton interpreter in seconds: wall-clock times mean nothing there; it checks that the sweep runs end to end and every path
matches the twin.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.sweeps.kernel_timing import measure_copy_bandwidth, time_calls  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
"""Llama-3-8B projections: name -> (N, K) of out = x [M, K] @ W [K, N]."""

TINY_SHAPES = {"qkv": (96, 256), "o": (40, 256), "gate_up": (112, 256), "down": (40, 512)}
"""``--tiny``: the same projections at a size the interpreter runs in seconds (N tails of 64-wide tiles)."""

TINY_DEFAULT_SHAPES = ("o", "down")
"""``--tiny``'s shapes unless --shapes names others (a column tail; 2 and 4 groups of 128 per column)."""

FMA_MAX_ROWS = 4
"""Most rows the grid tries the FMA form at (its cost grows with every row)."""

DOT_MIN_ROWS = 4
"""Fewest rows the grid tries every tl.dot tile at (below it, the first one only, as a control)."""

FMA_TILES = [(64, 128, 4, 1), (64, 256, 8, 1), (64, 256, 4, 1), (32, 256, 4, 1), (32, 512, 8, 1),
             (16, 512, 4, 1)]
"""(block_n, block_k, num_warps, num_stages) of the FMA form at one row. sm_90 SASS of the K loop, at one
row: 5.0 instructions a weight for 64 x 128 with 4 warps, 5.1 for each of the others (the narrow
wide-K tiles give more programs without split-K); 128 x 128 with 4 warps takes 7.8 (left out)."""

FMA_TILES_MULTI_ROW = [(64, 128, 4, 1), (64, 256, 8, 1)]
"""The FMA tiles tried at 2..FMA_MAX_ROWS rows: at four rows 9.7 and 9.3 instructions a weight (32 x 256
and 32 x 512: 13.2)."""

DOT_TILES = [(64, 128, 4, 1), (64, 128, 4, 2), (128, 128, 8, 1), (64, 128, 8, 1)]
"""(block_n, block_k, num_warps, num_stages) of the tl.dot form (block_k clipped to the group): 6.0, 6.0,
5.7 and 7.0 instructions a weight at any row count (128 x 128 with 4 warps: 7.9, 32 x 128: 8.2, left out)."""

GEMM_TILES = [(16, 64, 128, 4, 4, 1), (16, 128, 128, 4, 3, 1), (32, 64, 128, 4, 4, 1), (64, 64, 128, 4, 4, 1),
              (64, 128, 64, 4, 4, 1), (64, 128, 128, 4, 3, 1), (64, 64, 64, 4, 3, 0), (128, 128, 64, 8, 3, 1)]
"""(block_m, block_n, block_k, num_warps, num_stages, scale_in_weight) of the tiled kernel: at 5..16 rows
those with block_m 16, above 16 rows those with block_m <= next_power_of_2(M) (the two largest that
fit, and every smaller one)."""

SPLITS = (1, 2, 4, 8)
"""split_k values tried (each > 1 with both reductions)."""

MAX_PROGRAMS_PER_SM = 8
"""Splits stop where the programs exceed this many per SM."""

ERR_LIMIT = 0.05
"""Largest max abs error, as a fraction of max(1, max |twin output|), of a config that may be picked
(bf16 rounding of the output and, with scale_in_weight, of the weights stays below ~0.02)."""

TINY_CONFIGS = {1: [dict(form=1, block_n=32, block_k=128), dict(form=1, block_n=16, block_k=64, split_k=2),
                    dict(form=1, block_n=16, block_k=64, split_k=2, reduce_in_kernel=1)],
                4: [dict(form=2, block_n=16, block_k=128, split_k=2, reduce_in_kernel=1)],
                16: [dict(block_m=16, block_n=32, block_k=64)],
                64: [dict(block_m=64, block_n=32, block_k=64, split_k=2, reduce_in_kernel=1)]}
"""``--tiny``: per M bucket (the smallest key >= M), one config per launch path (num_stages 1)."""


def _with_splits(base: dict, n: int, k: int, step: int, sms: int) -> list[dict]:
    """``base`` at each of ``SPLITS`` that keeps >= 2 K steps of ``step`` inputs per slice and at most
    MAX_PROGRAMS_PER_SM programs per SM; splits > 1 with each reduction."""
    out = []
    for split in SPLITS:
        if split > 1 and (k // step < 2 * split or -(-n // base["block_n"]) * split > MAX_PROGRAMS_PER_SM * sms):
            continue
        for reduce_in_kernel in ((0,) if split == 1 else (0, 1)):
            out.append(dict(base, split_k=split, reduce_in_kernel=reduce_in_kernel))
    return out


def candidate_configs(m: int, n: int, k: int, group_size: int, tiny: bool = False, sms: int = 132) -> list:
    """The sweep grid for M rows of an N x K weight with groups of ``group_size`` (``W4A16Config``s)."""
    from kernels.w4a16 import GEMV_DOT, GEMV_DOT_MAX_ROWS, GEMV_FMA, W4A16Config

    if tiny:
        bucket = min((b for b in TINY_CONFIGS if b >= m), default=max(TINY_CONFIGS))
        return [W4A16Config(num_stages=1, **c) for c in TINY_CONFIGS[bucket]]
    grid = []
    if m <= FMA_MAX_ROWS:
        for bn, bk, nw, ns in FMA_TILES if m == 1 else FMA_TILES_MULTI_ROW:
            base = dict(form=GEMV_FMA, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
            grid += _with_splits(base, n, k, bk, sms)
    if m <= GEMV_DOT_MAX_ROWS:
        if group_size >= 128 or group_size == k:
            for bn, bk, nw, ns in DOT_TILES if m >= DOT_MIN_ROWS else DOT_TILES[:1]:
                base = dict(form=GEMV_DOT, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
                grid += _with_splits(base, n, k, min(bk, group_size), sms)
    if m > FMA_MAX_ROWS:
        cap = 16 if m <= 16 else max(16, 1 << (m - 1).bit_length())
        for bm, bn, bk, nw, ns, siw in GEMM_TILES:
            if bm <= cap and (m > 16 or bm == 16):
                base = dict(block_m=bm, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns, scale_in_weight=siw)
                grid += _with_splits(base, n, k, bk, sms * -(-m // bm))
    return [W4A16Config(**c) for c in grid]


def cfg_str(cfg: dict) -> str:
    """A config (``dataclasses.asdict`` of a ``W4A16Config``) in one short string."""
    from kernels.w4a16 import TILES
    split = f"split={cfg['split_k']}{'k' if cfg.get('reduce_in_kernel') else ''}"
    if cfg["form"] == TILES:
        return (f"tiles {cfg['block_m']}x{cfg['block_n']}x{cfg['block_k']} w={cfg['num_warps']} "
                f"s={cfg['num_stages']} {split} siw={cfg['scale_in_weight']}")
    return (f"{'fma' if cfg['form'] == 1 else 'dot'} n={cfg['block_n']} k={cfg['block_k']} w={cfg['num_warps']} "
            f"s={cfg['num_stages']} {split}")


def config_source(cfg: dict) -> str:
    """``W4A16Config(...)`` source of a config: the fields that differ from the dataclass defaults."""
    from kernels.w4a16 import W4A16Config
    default = dataclasses.asdict(W4A16Config())
    fields = [f"{name}={value}" for name, value in cfg.items() if value != default[name]]
    return f"W4A16Config({', '.join(fields)})"


@dataclasses.dataclass
class QuantWeight:
    """One int4 weight copy in the kernel's layout."""

    qweight: torch.Tensor       # int32 [K // 8, N]
    scales: torch.Tensor        # bf16 [K // G, N]
    zeros: torch.Tensor         # bf16 [K // G, N]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zeros))


def _copies(one_bytes: int, l2_bytes: int) -> int:
    """Weight copies that total > 2x the L2 (at least 2)."""
    return max(2, math.ceil(2 * l2_bytes / one_bytes) + 1)


def quant_copies(n: int, k: int, group_size: int, l2_bytes: int, device) -> list[QuantWeight]:
    """Random int4 weights (asymmetric zeros 0..15, scales ~ 1 / (4.6 sqrt(K))) totalling > 2x the L2."""
    num_groups = k // group_size
    out = []
    for _ in range(_copies(n * k // 2 + 4 * num_groups * n, l2_bytes)):
        qweight = torch.randint(-2 ** 31, 2 ** 31 - 1, (k // 8, n), dtype=torch.int32, device=device)
        scales = ((0.5 + torch.rand(num_groups, n, device=device)) / (4.6 * k ** 0.5)).to(torch.bfloat16)
        zeros = torch.randint(0, 16, (num_groups, n), device=device).to(torch.bfloat16)
        out.append(QuantWeight(qweight, scales, zeros))
    return out


def bf16_copies(n: int, k: int, l2_bytes: int, device) -> list[torch.Tensor]:
    """Random bf16 [N, K] weights (``F.linear`` layout) totalling > 2x the L2."""
    return [torch.randn(n, k, device=device, dtype=torch.bfloat16) * k ** -0.5
            for _ in range(_copies(n * k * 2, l2_bytes))]


def time_configs(configs, run, ref: torch.Tensor, args, label: str) -> list[dict]:
    """Each config's max abs error against ``ref`` (``run(cfg, 0)``, before and after the timing) and us
    per call over ``run(cfg, i)``; configs the compiler rejects are printed and skipped. Fastest first."""
    results = []
    for cfg in configs:
        try:
            err = (run(cfg, 0).float() - ref).abs().max().item()
            us = time_calls(lambda i: run(cfg, i), args.calls, args.reps)
            err = max(err, (run(cfg, 0).float() - ref).abs().max().item())
        except Exception as e:                                       # shared memory, registers
            print(f"  {label} {cfg_str(dataclasses.asdict(cfg))}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        results.append(dict(config=dataclasses.asdict(cfg), us=us, max_err=err))
    results.sort(key=lambda r: r["us"])
    return results


@dataclasses.dataclass
class ShapeData:
    """One (shape, group size)'s weights, kept across the M values."""

    name: str
    n: int
    k: int
    group_size: int             # G (K for per-channel)
    qws: list                   # QuantWeight copies
    wts: list                   # bf16 [N, K] copies


def sweep_case(sd: ShapeData, m: int, args, sms: int, grid: bool) -> dict:
    """One row: shape ``sd`` at M rows (the default config, and the grid when ``grid``)."""
    from kernels.w4a16 import w4a16_config, w4a16_matmul, w4a16_matmul_ref

    name, n, k, g = sd.name, sd.n, sd.k, sd.group_size
    x = torch.randn(m, k, device=args.device, dtype=torch.bfloat16)                      # [M, K]
    q0 = sd.qws[0]
    ref = w4a16_matmul_ref(x, q0.qweight, q0.scales, q0.zeros, g).float()                # [M, N]
    err_limit = ERR_LIMIT * max(1.0, ref.abs().max().item())
    cublas_us = time_calls(lambda i: F.linear(x, sd.wts[i % len(sd.wts)]), args.calls, args.reps)

    def run(cfg, i):
        w = sd.qws[i % len(sd.qws)]
        return w4a16_matmul(x, w.qweight, w.scales, w.zeros, g, config=cfg)

    # The CUDA default, also under the interpreter (its own default tiles are for tests).
    default = w4a16_config(m, n, k, None if args.tiny else args.device)
    default_res = time_configs([default], run, ref, args, f"{name} G={g} M={m} default")
    results = time_configs(candidate_configs(m, n, k, g, args.tiny, sms), run, ref, args,
                           f"{name} G={g} M={m}") if grid else []
    floor_us = q0.nbytes / (args.peak_tbs * 1e12) * 1e6
    row = dict(shape=name, N=n, K=k, group_size=g, M=m, int4_bytes=q0.nbytes, bf16_bytes=n * k * 2,
               int4_copies=len(sd.qws), floor_us=floor_us, cublas_bf16_us=cublas_us, err_limit=err_limit,
               swept=grid, default=default_res[0] if default_res else None, configs=results)
    valid = [r for r in default_res + results if r["max_err"] <= err_limit]
    for r in default_res + results:
        if r["max_err"] > err_limit:
            print(f"  WRONG {cfg_str(r['config'])}: max err {r['max_err']:.3g} > {err_limit:.3g} (never picked)")
    if valid:
        row["best"] = min(valid, key=lambda r: r["us"])
    print(f"\n{name} N={n} K={k} G={g} M={m}: int4 {q0.nbytes / 1e6:.1f} MB x{len(sd.qws)}, floor {floor_us:.1f} us; "
          f"cuBLAS bf16 {cublas_us:8.1f} us; {len(results)} configs", flush=True)
    shown = [("default", default_res[0] if default_res else None)] + [("", r) for r in results[:args.top]]
    for label, r in shown:
        if r is not None:
            print(f"  {label:7s} {cfg_str(r['config'])}: {r['us']:8.1f} us ({floor_us / r['us']:.2f} of floor, "
                  f"{cublas_us / r['us']:.2f}x cuBLAS) err {r['max_err']:.3g}")
    return row


def print_summary(rows: list[dict]) -> None:
    print(f"\n{'shape':8s} {'G':>5s} {'M':>5s} {'floor':>7s} {'cuBLAS':>8s} {'default':>8s} {'best':>8s} "
          f"{'floor/best':>10s} {'cuBLAS/best':>11s}  best config")
    for r in rows:
        d, b = r.get("default"), r.get("best")
        d_us = d["us"] if d else math.nan
        b_us = b["us"] if b else math.nan
        print(f"{r['shape']:8s} {r['group_size']:5d} {r['M']:5d} {r['floor_us']:7.1f} {r['cublas_bf16_us']:8.1f} "
              f"{d_us:8.1f} {b_us:8.1f} {r['floor_us'] / b_us:10.2f} {r['cublas_bf16_us'] / b_us:11.2f}  "
              f"{cfg_str(b['config']) if b else '-'}{'' if r['swept'] else ' (default only: past --budget-s)'}")


def suggest_decode_defaults(rows: list[dict]) -> dict:
    """Per (M <= 16, group size): the decode tile (all but split_k and the reduction) with the least summed
    time over the shapes, each at its best split, among the tiles timed on every shape: the candidate
    ``DECODE_DEFAULTS`` row. Keys "M=1 G=128"."""
    out = {}
    for m, g in sorted({(r["M"], r["group_size"] if r["group_size"] < r["K"] else 0) for r in rows if r["M"] <= 16}):
        cases = [r for r in rows if r["M"] == m and (r["group_size"] if r["group_size"] < r["K"] else 0) == g]
        totals: dict[tuple, list] = {}
        for r in cases:
            best_of_tile: dict[tuple, float] = {}
            for c in r["configs"]:
                cfg = c["config"]
                if cfg["form"] == 0 or c["max_err"] > r["err_limit"]:
                    continue
                tile = (cfg["form"], cfg["block_n"], cfg["block_k"], cfg["num_warps"], cfg["num_stages"])
                best_of_tile[tile] = min(best_of_tile.get(tile, math.inf), c["us"])
            for tile, us in best_of_tile.items():
                totals.setdefault(tile, []).append(us)
        complete = {t: sum(v) for t, v in totals.items() if len(v) == len(cases)}
        if complete:
            tile = min(complete, key=complete.get)
            out[f"M={m} G={g or 'K'}"] = dict(
                form=tile[0], block_n=tile[1], block_k=tile[2], num_warps=tile[3], num_stages=tile[4],
                total_us=complete[tile], total_floor_us=sum(r["floor_us"] for r in cases),
                default_total_us=sum(r["default"]["us"] for r in cases if r.get("default")))
    return out


def shape_defaults_source(rows: list[dict], group_size: int) -> str:
    """``SHAPE_DEFAULTS`` source: per (shape, M) swept at ``group_size``, the fastest valid config."""
    lines = ["SHAPE_DEFAULTS: tuple[ShapeDefault, ...] = ("]
    for r in sorted(rows, key=lambda r: (r["N"], r["K"], r["M"])):
        if r["group_size"] != group_size or not r["swept"] or "best" not in r:
            continue
        b = r["best"]
        lines.append(f"    ShapeDefault({r['N']}, {r['K']}, {r['M']}, {config_source(b['config'])}),"
                     f"  # {r['shape']}: {b['us']:.1f} us, {r['floor_us'] / b['us']:.2f} of floor, "
                     f"cuBLAS {r['cublas_bf16_us']:.1f}")
    lines.append(")")
    return "\n".join(lines)


def _compile_worker(jobs: list, shape_table: dict, device: str) -> int:
    """Compile (one call each) the configs ``jobs`` = [(shape, G, M, config dict)] into Triton's on-disk
    cache; returns how many compiled. Runs in a spawned process."""
    from kernels.w4a16 import W4A16Config, w4a16_matmul

    done, weights = 0, {}
    for name, g, m, cfg in jobs:
        n, k = shape_table[name]
        if (name, g) not in weights:
            weights[(name, g)] = (torch.zeros(k // 8, n, dtype=torch.int32, device=device),
                                  torch.ones(k // g, n, dtype=torch.bfloat16, device=device),
                                  torch.zeros(k // g, n, dtype=torch.bfloat16, device=device))
        qw, s, z = weights[(name, g)]
        x = torch.zeros(m, k, dtype=torch.bfloat16, device=device)                       # [M, K]
        try:
            w4a16_matmul(x, qw, s, z, g, config=W4A16Config(**cfg))
            done += 1
        except Exception:                     # reported by the timing process, which compiles it again
            pass
    if device == "cuda":
        torch.cuda.synchronize()
    return done


def precompile(cases: list, shape_table: dict, args, sms: int) -> None:
    """Compile every candidate of ``cases`` = [(shape, G, M)] in ``args.compile_workers`` processes first
    (the timing process then loads the binaries from Triton's cache). Any failure here only costs time."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    from kernels.w4a16 import w4a16_config

    groups: dict[str, list] = {}          # one launch's jobs over the shapes (one compile in one worker)
    for name, g, m in cases:
        n, k = shape_table[name]
        for cfg in [w4a16_config(m, n, k, None)] + candidate_configs(m, n, k, g, args.tiny, sms):
            one_launch = dataclasses.asdict(dataclasses.replace(cfg, split_k=min(cfg.split_k, 2)))   # same binary
            groups.setdefault(json.dumps((g, m, one_launch), sort_keys=True), []).append(
                (name, g, m, dataclasses.asdict(cfg)))
    workers = max(1, min(args.compile_workers, len(groups)))
    shares: list[list] = [[] for _ in range(workers)]
    for i, group in enumerate(groups.values()):
        shares[i % workers] += group
    jobs = [j for share in shares for j in share]
    t0 = time.time()
    try:
        with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
            futures = [pool.submit(_compile_worker, share, shape_table, args.device.type) for share in shares]
            done = sum(f.result() for f in futures)
        print(f"precompiled {done}/{len(jobs)} launches in {workers} processes, {time.time() - t0:.0f} s", flush=True)
    except Exception as e:                                          # the timing process compiles instead
        print(f"precompile failed ({type(e).__name__}: {str(e)[:200]}); compiling while timing", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=None, help=f"comma list of {', '.join(SHAPES)} (default: all; --tiny: "
                    f"{', '.join(TINY_DEFAULT_SHAPES)})")
    ap.add_argument("--ms", default="1,4,16,64", help="token counts M, swept in this order (GEMV forms to 64 "
                    "rows, tiled kernel from 5)")
    ap.add_argument("--group-sizes", default=None, help="comma list; 0 = per-channel (G = K); default 128 "
                    "(--tiny: 32)")
    ap.add_argument("--calls", type=int, default=20, help="calls per CUDA graph")
    ap.add_argument("--reps", type=int, default=3, help="timed graph replays")
    ap.add_argument("--top", type=int, default=4, help="configs printed per case")
    ap.add_argument("--peak-tbs", type=float, default=4.8, help="HBM TB/s of the bytes floor (H200: 4.8)")
    ap.add_argument("--default-only", action="store_true", help="time the default config only (no grid)")
    ap.add_argument("--budget-s", type=float, default=200.0,
                    help="past this many seconds, the remaining cases time their default config only")
    ap.add_argument("--compile-workers", type=int, default=None,
                    help="processes that compile the candidates before timing (0: compile while timing; "
                    "default: min(12, CPUs) on CUDA, 1 with --tiny, where it only runs the configs once)")
    ap.add_argument("--tiny", action="store_true", help="small shapes, one config per launch path, on CPU "
                    "through the Triton interpreter (a smoke test of the sweep)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/out/w4a16_sweep[_tiny].json)")
    args = ap.parse_args()
    shape_table = TINY_SHAPES if args.tiny else SHAPES
    shapes = [s.strip() for s in (args.shapes or ",".join(TINY_DEFAULT_SHAPES if args.tiny else SHAPES)).split(",")
              if s.strip()]
    for s in shapes:
        if s not in shape_table:
            ap.error(f"unknown shape {s!r}; choose from {', '.join(shape_table)}")
    ms = [int(v) for v in args.ms.split(",")]
    group_sizes = [int(v) for v in (args.group_sizes or ("32" if args.tiny else "128")).split(",")]
    if any(m < 1 for m in ms):
        ap.error("--ms: each M must be >= 1")
    if args.compile_workers is None:
        args.compile_workers = 1 if args.tiny else min(12, os.cpu_count() or 1)
    if args.tiny:
        args.calls, args.reps = 1, 1
    out_path = args.out or f"benchmarks/out/w4a16_sweep{'_tiny' if args.tiny else ''}.json"
    if not torch.cuda.is_available():
        if not args.tiny:
            sys.exit("w4a16_sweep.py times CUDA kernels; no CUDA device here (--tiny runs on CPU).")
        os.environ["TRITON_INTERPRET"] = "1"           # before anything imports triton
    args.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    t0 = time.time()
    bw = measure_copy_bandwidth()
    if args.device.type == "cuda":
        props = torch.cuda.get_device_properties(0)
        device_name, l2, sms = props.name, getattr(props, "L2_cache_size", 50 << 20), props.multi_processor_count
    else:
        device_name, l2, sms = "cpu (Triton interpreter)", 0, 132
    print(f"{device_name}: copy bandwidth {bw / 1e12:.2f} TB/s (read + write), L2 {l2 / 1e6:.0f} MB; "
          f"bytes floor at {args.peak_tbs} TB/s", flush=True)
    data = []
    for s in shapes:
        n, k = shape_table[s]
        for g in group_sizes:
            if g and (k % g or g & (g - 1) or g < 16):
                print(f"skip {s} G={g}: not a power of two >= 16 dividing K = {k}")
                continue
            data.append(ShapeData(s, n, k, g or k, quant_copies(n, k, g or k, l2, args.device),
                                  bf16_copies(n, k, l2, args.device)))
    if args.compile_workers > 0 and not args.default_only:
        # --tiny: the first M only (the interpreter compiles nothing; this runs the path once).
        precompile([(sd.name, sd.group_size, m) for m in (ms[:1] if args.tiny else ms) for sd in data],
                   shape_table, args, sms)
    rows = []
    for m in ms:
        for sd in data:
            over = time.time() - t0 > args.budget_s
            if over and not args.default_only:
                print(f"past --budget-s {args.budget_s:.0f} s: {sd.name} G={sd.group_size} M={m} times its default only")
            rows.append(sweep_case(sd, m, args, sms, grid=not (args.default_only or over)))
    print_summary(rows)
    suggested = suggest_decode_defaults(rows)
    for key, t in suggested.items():
        print(f"{key}: decode tile with the least total over the shapes: {cfg_str(dict(t, split_k='best'))} "
              f"{t['total_us']:.1f} us (default {t['default_total_us']:.1f} us, floor {t['total_floor_us']:.1f} us)")
    table = shape_defaults_source(rows, data[0].group_size if data else 128)
    print(f"\n# kernels/w4a16.py, from this sweep on {device_name} (group size {data[0].group_size if data else '-'}):")
    print(table)
    print(f"\nsweep took {time.time() - t0:.0f} s")
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    Path(out_path).write_text(json.dumps(dict(device=device_name, copy_bandwidth_bytes_s=bw, l2_bytes=l2,
                                              peak_tbs=args.peak_tbs, calls_per_graph=args.calls, tiny=args.tiny,
                                              suggested_decode_defaults=suggested, shape_defaults_source=table,
                                              rows=rows), indent=1))
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
