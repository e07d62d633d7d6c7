"""Decode-batch GEMM sweep: cuBLAS, cuBLASLt and ``kernels.gemm`` configs at M = 64..1024 rows.

Example (H200; Llama-3-8B projections, bf16):
    python benchmarks/gemm_sweep.py
    python benchmarks/gemm_sweep.py --shapes o,down --ms 256 --out /tmp/gemm.json

Why: at decode batch 256 the projections are near the H200's ridge point, and the profile of a
batch-256 step shows cuBLAS at ~680 TFLOPS over the step's 4.1 TFLOP of weight GEMMs. Per
projection shape (qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336, lm_head
128256x4096) and token count M, each case is timed from a CUDA graph of --calls back-to-back
calls that cycle through weight copies totalling > 2x the L2 (weights come from HBM, as in a
32-layer step): ``F.linear`` with torch's default BLAS (cuBLAS), the same with
``torch.backends.cuda.preferred_blas_library("cublaslt")``, and ``kernels.gemm`` for every
candidate ``GemmConfig`` (pointer loads and TMA loads). Reported per case: us, TFLOPS, and the
case's bound max(weight + activation bytes / copy bandwidth, FLOP / --peak-tflops). The summary
gives, per M, the sum over one decoder layer's four projections (and the lm_head) of cuBLAS vs
the best of all, i.e. what a per-shape choice would save per step (x32 layers). Writes JSON.
Every Triton config's output is checked once against cuBLAS (max abs error in the JSON).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.gemv_sweep import SHAPES, parse_shapes, time_configs, weight_copies, write_json  # noqa: E402
from benchmarks.kernel_timing import measure_copy_bandwidth, time_graph_calls  # noqa: E402

LAYER = ("qkv", "o", "gate_up", "down")
"""The projections of one decoder layer (x32 per step); lm_head runs once per step."""


def candidate_configs(m: int, max_smem: int) -> list:
    """(block_m, block_n, block_k, num_warps, num_stages, use_tma) candidates for M rows, pruned to
    tiles whose pipelined loads fit ``max_smem`` bytes of shared memory and to block_m <= 2 * M
    (for M <= 64: one M tile of M rounded up to a power of two, block_n 32-128)."""
    from kernels.gemm import GemmConfig

    out = []
    if m <= 64:
        # Decode-sized M: one M tile, narrow column tiles so that the N / block_n programs fill the
        # SMs (qkv at block_n 32: 192 programs), no split-K (``kernels.gemm`` has none).
        bm = max(16, 1 << (m - 1).bit_length())
        for tma in (0, 1):
            for bn in (32, 64, 128):
                for bk in (64, 128, 256):
                    for nw, ns in ((4, 3), (4, 4), (4, 6)):
                        if ns * (bm + bn) * bk * 2 <= max_smem:
                            out.append(GemmConfig(bm, bn, bk, nw, ns, tma))
        return out
    for tma in (0, 1):
        for bm in (64, 128):
            if bm > max(64, 2 * m):
                continue
            for bn in (64, 128, 256):
                for bk in (64, 128):
                    for nw, ns in ((4, 3), (4, 4), (8, 3), (8, 4), (8, 5)):
                        smem = ns * (bm + bn) * bk * 2
                        if smem > max_smem or (bm * bn > 128 * 128 and nw == 4):
                            continue
                        out.append(GemmConfig(bm, bn, bk, nw, ns, tma))
    return out


def cfg_str(c) -> str:
    return (f"bm={c.block_m:3d} bn={c.block_n:3d} bk={c.block_k:3d} w={c.num_warps} s={c.num_stages} "
            f"{'tma' if c.use_tma else 'ptr'}")


def sweep_shape(name: str, n: int, k: int, ms: list[int], args, bw: float, l2: int, max_smem: int) -> list[dict]:
    from kernels.gemm import gemm, gemm_config

    dev, dtype = torch.device("cuda"), torch.bfloat16
    wbytes = n * k * 2
    ws = weight_copies(n, k, l2)
    copies = len(ws)
    rows = []
    for m in ms:
        x = torch.randn(m, k, device=dev, dtype=dtype)
        y = torch.empty(m, n, device=dev, dtype=dtype)
        ref = F.linear(x, ws[0]).float()
        flops = 2 * m * n * k
        nbytes = wbytes + (m * k + m * n) * 2
        bound_us = max(nbytes / bw, flops / (args.peak_tflops * 1e12)) * 1e6
        cublas_us = time_graph_calls(lambda i: F.linear(x, ws[i % copies]), args.calls, args.reps)
        torch.backends.cuda.preferred_blas_library("cublaslt")
        try:
            lt_us = time_graph_calls(lambda i: F.linear(x, ws[i % copies]), args.calls, args.reps)
        finally:
            torch.backends.cuda.preferred_blas_library("cublas")
        results = time_configs(f"{name} M={m}", [gemm_config(m, n, k, dev)] + candidate_configs(m, max_smem),
                               cfg_str, lambda cfg, i: gemm(x, ws[i % copies], config=cfg, out=y), ref, args)

        def tf(us):
            return flops / (us * 1e-6) / 1e12

        print(f"\n{name} N={n} K={k} M={m}: bound {bound_us:.1f} us; cuBLAS {cublas_us:.1f} us "
              f"({tf(cublas_us):.0f} TFLOPS, {bound_us / cublas_us:.2f} of bound); cuBLASLt {lt_us:.1f} us "
              f"({tf(lt_us):.0f})", flush=True)
        for r in results[:args.top]:
            print(f"  {cfg_str(r['cfg'])}: {r['us']:7.1f} us {tf(r['us']):5.0f} TFLOPS "
                  f"({bound_us / r['us']:.2f} of bound) err {r['max_err']:.3g}")
        row = dict(shape=name, N=n, K=k, M=m, flops=flops, bytes=nbytes, bound_us=bound_us, cublas_us=cublas_us,
                   cublaslt_us=lt_us, configs=[{kk: v for kk, v in r.items() if kk != "cfg"} for r in results])
        if results:
            row["best"] = row["configs"][0]
        rows.append(row)
    ws.clear()
    torch.cuda.empty_cache()
    return rows


def summary(rows: list[dict], ms: list[int]) -> list[dict]:
    """Per M: one decoder layer's projections and the lm_head, cuBLAS vs the best of all three."""
    out = []
    print(f"\n{'M':>5s} {'shape':8s} {'bound':>7s} {'cuBLAS':>7s} {'Lt':>7s} {'triton':>7s} {'best':>7s}  best triton config")
    for m in ms:
        tot = dict(M=m, bound=0.0, cublas=0.0, best=0.0, head_cublas=0.0, head_best=0.0)
        for r in (r for r in rows if r["M"] == m):
            tri = r["best"]["us"] if "best" in r else math.inf
            best = min(r["cublas_us"], r["cublaslt_us"], tri)
            cfg = r["best"]["config"] if "best" in r else {}
            print(f"{m:5d} {r['shape']:8s} {r['bound_us']:7.1f} {r['cublas_us']:7.1f} {r['cublaslt_us']:7.1f} "
                  f"{tri:7.1f} {best:7.1f}  {cfg}")
            if r["shape"] in LAYER:
                tot["bound"] += r["bound_us"]
                tot["cublas"] += r["cublas_us"]
                tot["best"] += best
            else:
                tot["head_cublas"], tot["head_best"] = r["cublas_us"], best
        step_cublas = 32 * tot["cublas"] + tot["head_cublas"]
        step_best = 32 * tot["best"] + tot["head_best"]
        print(f"{m:5d} layer    {tot['bound']:7.1f} {tot['cublas']:7.1f} {'':7s} {'':7s} {tot['best']:7.1f}  "
              f"per step (x32 + lm_head): cuBLAS {step_cublas / 1e3:.2f} ms, best {step_best / 1e3:.2f} ms")
        tot.update(step_cublas_ms=step_cublas / 1e3, step_best_ms=step_best / 1e3)
        out.append(tot)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--ms", default="64,128,256,512", help="token counts M")
    ap.add_argument("--calls", type=int, default=10, help="calls per CUDA graph")
    ap.add_argument("--reps", type=int, default=5, help="timed graph replays")
    ap.add_argument("--top", type=int, default=3, help="Triton configs printed per case")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak for the bound (H200: 989)")
    ap.add_argument("--out", default="benchmarks/out/gemm_sweep.json")
    args = ap.parse_args()
    shapes = parse_shapes(ap, args.shapes)
    ms = [int(v) for v in args.ms.split(",")]
    if not torch.cuda.is_available():
        sys.exit("gemm_sweep.py times CUDA kernels; no CUDA device here.")

    t0 = time.time()
    bw = measure_copy_bandwidth()
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    max_smem = getattr(props, "shared_memory_per_block_optin", 227 << 10)
    print(f"{props.name}: copy bandwidth {bw / 1e12:.2f} TB/s (read + write), L2 {l2 / 1e6:.0f} MB, "
          f"{props.multi_processor_count} SMs, {max_smem >> 10} KB shared memory per block", flush=True)
    rows = []
    for s in shapes:
        n, k = SHAPES[s]
        rows += sweep_shape(s, n, k, ms, args, bw, l2, max_smem)
    totals = summary(rows, ms)
    print(f"\nsweep took {time.time() - t0:.0f} s")
    write_json(args.out, props, bw, l2, args.calls, rows, totals=totals)


if __name__ == "__main__":
    main()
