"""W4A16 sweep: ``kernels.w4a16`` launch configs against the int4 bytes floor, bf16 cuBLAS and the torch twin.

Examples:
    python benchmarks/sweeps/w4a16_sweep.py                  # H200: decode rows M 1, 4, 16, group 128
    python benchmarks/sweeps/w4a16_sweep.py --shapes qkv,down --ms 1,16 --group-sizes 128,0 --out /tmp/w4.json
    python benchmarks/sweeps/w4a16_sweep.py --ms 64,256,2048 # the GEMM tiles
    python benchmarks/sweeps/w4a16_sweep.py --tiny           # CPU: small shapes through the Triton interpreter

Per projection shape (Llama-3-8B: qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336 as
N x K), group size (--group-sizes; 0 = per-channel) and token count M (--ms), timed: ``F.linear`` on
the bf16 weight (cuBLAS), the torch twin ``w4a16_matmul_ref``, ``w4a16_matmul`` with the default
``w4a16_config`` and with every candidate ``W4A16Config``: for M <= 16 the decode GEMV grid
(``DECODE_TILES``: FMA form up to ``FMA_MAX_ROWS`` rows, tl.dot form, each with split_k 1..16 where
every K slice keeps >= 2 steps), above it the GEMM grid (``GEMM_TILES``). Each case is timed from a
CUDA graph of --calls back-to-back calls that cycle through distinct weight copies totalling > 2x
the L2, so weights come from HBM as in a 32-layer step; the twin, whose float32 intermediates
dominate, runs on one copy with --twin-calls calls. Every config's output is checked once against
the twin (max abs error in the JSON). The bytes floor of a case is its int4 bytes (packed weights,
bf16 scales and zeros) at --peak-tbs.

Prints, per case, the default and the fastest configs (us, x floor, x cuBLAS); a summary table; and
for each M the decode tile (form, block_n, block_k, warps, stages) with the least total time over
the shapes, each shape at its best split_k: the candidate row of ``kernels.w4a16.DECODE_DEFAULTS``.
Writes JSON (default ``benchmarks/out/w4a16_sweep[_tiny].json``).

``--tiny`` runs small shapes (column tails, K of 2-4 groups) and a few configs per form on the CPU
through the Triton interpreter: wall-clock times mean nothing there; it checks that the sweep and
every form run and match the twin.
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

FMA_MAX_ROWS = 4
"""Most rows the grid tries the FMA form at (its cost grows with every row)."""

DECODE_TILES = [(1, 16, 256, 4, 1), (1, 32, 128, 4, 1), (1, 32, 512, 8, 1), (1, 32, 1024, 8, 1),
                (1, 64, 64, 4, 1), (1, 64, 128, 4, 1), (1, 64, 128, 4, 2), (1, 64, 256, 4, 1),
                (1, 64, 512, 8, 1), (1, 32, 256, 2, 1), (1, 128, 128, 4, 1), (1, 128, 32, 1, 1), (1, 128, 64, 1, 1),
                (2, 16, 128, 4, 1), (2, 32, 128, 4, 1), (2, 64, 128, 4, 1), (2, 64, 128, 4, 2), (2, 64, 128, 8, 1),
                (2, 128, 128, 4, 1), (2, 128, 128, 8, 1), (2, 64, 256, 4, 1)]
"""(form, block_n, block_k, num_warps, num_stages) tried at M <= 16 (form 1: FMA, M <= FMA_MAX_ROWS;
2: tl.dot, whose block_k is clipped to the group), each with split_k 1, 2, 4, 8, 16 while K keeps >= 2
block_k steps per slice and the programs stay <= 8 per SM. The narrow and wide-K FMA tiles (16-32
columns, 512-1024 inputs a step over several groups) keep more weight bytes in flight per program
without split-K's second launch; the one-warp 128-column tiles give each thread every packed row of
the step (the fewest instructions a weight in sm_90 SASS: ~4.7 at one row, against ~5.2 for 64 x 128
with 4 warps), at the price of more split-K."""

TINY_DECODE_TILES = [(1, 16, 64, 4, 1), (1, 32, 128, 4, 1), (2, 32, 128, 4, 1)]
"""``--tiny``'s decode grid (split_k 1 and 2)."""

GEMM_TILES = [(32, 64, 128, 4, 4, 1), (64, 64, 128, 4, 4, 1), (64, 128, 64, 4, 4, 1),
              (64, 128, 64, 4, 4, 0), (64, 128, 128, 4, 3, 1), (64, 256, 64, 8, 3, 1),
              (128, 64, 64, 4, 4, 1), (128, 128, 64, 8, 3, 1), (128, 128, 64, 8, 4, 1),
              (128, 128, 64, 8, 3, 0), (128, 128, 128, 8, 3, 1), (128, 256, 64, 8, 3, 1)]
"""(block_m, block_n, block_k, num_warps, num_stages, scale_in_weight) tried at M > 16; block_m above
next_power_of_2(M) is skipped."""


def candidate_configs(m: int, n: int, k: int, group_size: int, tiny: bool = False, sms: int = 132) -> list:
    """The sweep grid for M rows of an N x K weight with groups of ``group_size`` (``W4A16Config``s)."""
    from kernels.w4a16 import GEMV_DOT, GEMV_FMA, W4A16Config

    out = []
    if m <= 16:
        for form, bn, bk, nw, ns in TINY_DECODE_TILES if tiny else DECODE_TILES:
            if form == GEMV_FMA and m > FMA_MAX_ROWS:
                continue
            step = min(bk, group_size) if form == GEMV_DOT and group_size < k else bk
            if form == GEMV_DOT and step < bk:
                continue      # clipped to the group: another tile's launch, or (G < 128) the FMA form's
            for split in ((1, 2) if tiny else (1, 2, 4, 8, 16)):
                if split > 1 and (k // step < 2 * split or -(-n // bn) * split > 8 * sms):
                    continue
                out.append(W4A16Config(form=form, block_n=bn, block_k=bk, split_k=split, num_warps=nw,
                                       num_stages=ns))
        return out
    block_m_cap = max(16, 1 << (m - 1).bit_length())
    for bm, bn, bk, nw, ns, siw in GEMM_TILES:
        if bm <= block_m_cap:
            out.append(W4A16Config(block_m=bm, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns,
                                   scale_in_weight=siw))
    return out


def cfg_str(cfg: dict) -> str:
    """A config (``dataclasses.asdict`` of a ``W4A16Config``) in one short string."""
    from kernels.w4a16 import TILES
    if cfg["form"] == TILES:
        return (f"tiles {cfg['block_m']}x{cfg['block_n']}x{cfg['block_k']} w={cfg['num_warps']} "
                f"s={cfg['num_stages']} split={cfg['split_k']} siw={cfg['scale_in_weight']}")
    return (f"{'fma' if cfg['form'] == 1 else 'dot'} n={cfg['block_n']} k={cfg['block_k']} w={cfg['num_warps']} "
            f"s={cfg['num_stages']} split={cfg['split_k']}")


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
    """Each config's max abs error against ``ref`` (``run(cfg, 0)``) and us per call over ``run(cfg, i)``;
    configs the compiler rejects are printed and skipped. Fastest first."""
    results = []
    for cfg in configs:
        try:
            err = (run(cfg, 0).float() - ref).abs().max().item()
            us = time_calls(lambda i: run(cfg, i), args.calls, args.reps)
        except Exception as e:                                       # shared memory, registers
            print(f"  {label} {cfg_str(dataclasses.asdict(cfg))}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        results.append(dict(config=dataclasses.asdict(cfg), us=us, max_err=err))
    results.sort(key=lambda r: r["us"])
    return results


def sweep_case(name: str, n: int, k: int, group_size: int, ms: list[int], args, l2: int, sms: int) -> list[dict]:
    """Rows of one (shape, group size) over the token counts ``ms``."""
    from kernels.w4a16 import w4a16_config, w4a16_matmul, w4a16_matmul_ref

    g = group_size or k
    qws = quant_copies(n, k, g, l2, args.device)
    wts = bf16_copies(n, k, l2, args.device)
    rows = []
    for m in ms:
        x = torch.randn(m, k, device=args.device, dtype=torch.bfloat16)                  # [M, K]
        q0 = qws[0]
        ref = w4a16_matmul_ref(x, q0.qweight, q0.scales, q0.zeros, g).float()            # [M, N]
        cublas_us = time_calls(lambda i: F.linear(x, wts[i % len(wts)]), args.calls, args.reps)
        twin_us = (math.nan if args.no_twin else
                   time_calls(lambda i: w4a16_matmul_ref(x, q0.qweight, q0.scales, q0.zeros, g),
                              args.twin_calls, args.reps))

        def run(cfg, i):
            w = qws[i % len(qws)]
            return w4a16_matmul(x, w.qweight, w.scales, w.zeros, g, config=cfg)

        # The CUDA default, also under the interpreter (its own default tiles are for tests).
        default = w4a16_config(m, n, k, None if args.tiny else args.device)
        default_res = time_configs([default], run, ref, args, f"{name} G={g} M={m} default")
        results = [] if args.default_only else time_configs(
            candidate_configs(m, n, k, g, args.tiny, sms), run, ref, args, f"{name} G={g} M={m}")
        floor_us = q0.nbytes / (args.peak_tbs * 1e12) * 1e6
        row = dict(shape=name, N=n, K=k, group_size=g, M=m, int4_bytes=q0.nbytes, bf16_bytes=n * k * 2,
                   int4_copies=len(qws), floor_us=floor_us, cublas_bf16_us=cublas_us, twin_us=twin_us,
                   default=default_res[0] if default_res else None, configs=results)
        best = min(default_res + results, key=lambda r: r["us"], default=None)
        if best is not None:
            row["best"] = best
        print(f"\n{name} N={n} K={k} G={g} M={m}: int4 {q0.nbytes / 1e6:.1f} MB x{len(qws)}, floor {floor_us:.1f} us; "
              f"cuBLAS bf16 {cublas_us:8.1f} us; twin {twin_us:8.1f} us", flush=True)
        shown = [("default", default_res[0] if default_res else None)] + [("", r) for r in results[:args.top]]
        for label, r in shown:
            if r is not None:
                print(f"  {label:7s} {cfg_str(r['config'])}: {r['us']:8.1f} us ({r['us'] / floor_us:.2f}x floor, "
                      f"{cublas_us / r['us']:.2f}x cuBLAS) err {r['max_err']:.3g}")
        rows.append(row)
    return rows


def print_summary(rows: list[dict]) -> None:
    print(f"\n{'shape':8s} {'G':>5s} {'M':>5s} {'floor':>7s} {'cuBLAS':>8s} {'twin':>8s} {'default':>8s} {'best':>8s} "
          f"{'x floor':>7s} {'x cuBLAS':>8s}  best config")
    for r in rows:
        d, b = r.get("default"), r.get("best")
        d_us = d["us"] if d else math.nan
        b_us = b["us"] if b else math.nan
        print(f"{r['shape']:8s} {r['group_size']:5d} {r['M']:5d} {r['floor_us']:7.1f} {r['cublas_bf16_us']:8.1f} "
              f"{r['twin_us']:8.1f} {d_us:8.1f} {b_us:8.1f} {b_us / r['floor_us']:7.2f} "
              f"{r['cublas_bf16_us'] / b_us:8.2f}  {cfg_str(b['config']) if b else '-'}")


def suggest_decode_defaults(rows: list[dict]) -> dict:
    """Per (M <= 16, group size): the decode tile (all but split_k) with the least summed time over the
    shapes, each at its best split_k, among the tiles timed on every shape: the candidate
    ``DECODE_DEFAULTS`` row. Keys "M=1 G=128"."""
    out = {}
    for m, g in sorted({(r["M"], r["group_size"] if r["group_size"] < r["K"] else 0) for r in rows if r["M"] <= 16}):
        cases = [r for r in rows if r["M"] == m and (r["group_size"] if r["group_size"] < r["K"] else 0) == g]
        totals: dict[tuple, list] = {}
        for r in cases:
            best_of_tile: dict[tuple, float] = {}
            for c in r["configs"]:
                cfg = c["config"]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--ms", default="1,4,16", help="token counts M (<= 16: the decode grid; above: GEMM tiles)")
    ap.add_argument("--group-sizes", default="128", help="comma list; 0 = per-channel (G = K)")
    ap.add_argument("--calls", type=int, default=20, help="calls per CUDA graph")
    ap.add_argument("--twin-calls", type=int, default=2, help="calls per CUDA graph for the torch twin")
    ap.add_argument("--reps", type=int, default=3, help="timed graph replays")
    ap.add_argument("--top", type=int, default=4, help="configs printed per case")
    ap.add_argument("--peak-tbs", type=float, default=4.8, help="HBM TB/s of the bytes floor (H200: 4.8)")
    ap.add_argument("--default-only", action="store_true", help="time the default config only (no grid)")
    ap.add_argument("--no-twin", action="store_true", help="skip timing the torch twin")
    ap.add_argument("--tiny", action="store_true", help="small shapes and grid on CPU through the Triton interpreter")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/out/w4a16_sweep[_tiny].json)")
    args = ap.parse_args()
    shape_table = TINY_SHAPES if args.tiny else SHAPES
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    for s in shapes:
        if s not in shape_table:
            ap.error(f"unknown shape {s!r}; choose from {', '.join(shape_table)}")
    ms = [int(v) for v in args.ms.split(",")]
    group_sizes = [int(v) for v in args.group_sizes.split(",")]
    if any(m < 1 for m in ms):
        ap.error("--ms: each M must be >= 1")
    if args.tiny:
        args.calls, args.reps, args.twin_calls = min(args.calls, 2), 1, 1
        if args.group_sizes == ap.get_default("group_sizes"):
            group_sizes = [32, 0]
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
    rows = []
    for s in shapes:
        n, k = shape_table[s]
        for g in group_sizes:
            if g and (k % g or g & (g - 1) or g < 16):
                print(f"skip {s} G={g}: not a power of two >= 16 dividing K = {k}")
                continue
            rows += sweep_case(s, n, k, g, ms, args, l2, sms)
            if args.device.type == "cuda":
                torch.cuda.empty_cache()
    print_summary(rows)
    suggested = suggest_decode_defaults(rows)
    for key, t in suggested.items():
        print(f"{key}: decode tile with the least total over the cases: {cfg_str(dict(t, split_k='best'))} "
              f"{t['total_us']:.1f} us (default {t['default_total_us']:.1f} us, floor {t['total_floor_us']:.1f} us)")
    print(f"\nsweep took {time.time() - t0:.0f} s")
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    Path(out_path).write_text(json.dumps(dict(device=device_name, copy_bandwidth_bytes_s=bw, l2_bytes=l2,
                                              peak_tbs=args.peak_tbs, calls_per_graph=args.calls, tiny=args.tiny,
                                              suggested_decode_defaults=suggested, rows=rows), indent=1))
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
