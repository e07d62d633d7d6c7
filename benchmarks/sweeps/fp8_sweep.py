"""FP8 linear sweep: ``kernels.fp8_linear`` paths against torch._scaled_mm and bf16 F.linear.

Example (H200; Llama-3-8B projections):
    python benchmarks/sweeps/fp8_sweep.py
    python benchmarks/sweeps/fp8_sweep.py --shapes qkv,down --ms 1,16,2048 --no-grid --out /tmp/fp8.json

Per projection shape (qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336) and token
count M (default 1, 4, 16, 64, 256, 2048), each case is timed from a CUDA graph of --calls
back-to-back calls that cycle through distinct weight copies totalling > 2x the L2 (weights from
HBM, as in a 32-layer step). Timed, each as a whole call (activation quantization included):

- ``bf16``: F.linear on the bf16 weight (cuBLAS).
- ``pc_triton`` / ``pc_scaled_mm``: per-channel fp8 weight, per-token fp8 activations (compressed-
  tensors FP8_DYNAMIC, ``--quantization fp8``), Triton GEMM / torch._scaled_mm (rowwise scales).
- ``blk_triton``: 128x128 block weight scales, per-token-group activations (HF ``fp8``).
- ``quant_tok`` / ``quant_grp``: the activation quantization alone (per token / per 128-wide group).

Triton paths run their default config, then (without --no-grid) a candidate grid; the table shows
default and best. Every path's output is checked once against its torch twin (max error relative
to the twin's max, in the JSON). Prints a table (us per call) and writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.sweeps.kernel_timing import measure_copy_bandwidth, time_graph_calls  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
"""Llama-3-8B projections: name -> (N, K) of the [N, K] weight."""
BLOCK = (128, 128)
"""(BN, BK) of the block-scaled weights (HF ``fp8`` checkpoints)."""


def gemm_candidates(m: int) -> list:
    """Fp8GemmConfig grid for M rows (block_k 128 divides the 128-wide scale groups); pruned to
    (block_m + block_n) * block_k * num_stages <= 192 KB of shared memory."""
    from kernels.fp8_linear import Fp8GemmConfig

    if m <= 16:
        tiles = [(16, 32, 4), (16, 64, 4), (16, 128, 4), (32, 64, 4), (16, 64, 8)]
    elif m <= 64:
        tiles = [(32, 64, 4), (64, 64, 4), (64, 128, 4), (32, 128, 4), (64, 128, 8)]
    elif m <= 256:
        tiles = [(64, 64, 4), (64, 128, 4), (128, 128, 8), (64, 256, 8), (128, 64, 4)]
    else:
        tiles = [(64, 128, 4), (128, 128, 4), (128, 128, 8), (128, 256, 8), (256, 128, 8), (64, 256, 8)]
    out = []
    for bm, bn, warps in tiles:
        for stages in (3, 4):
            if (bm + bn) * 128 * stages <= 192 << 10:
                out.append(Fp8GemmConfig(bm, bn, 128, 8 if m > 16 else 1, warps, stages))
    return out


def weight_copies(n: int, k: int, bytes_per_elem: int, l2: int) -> int:
    """How many distinct weight copies make > 2x the L2 (at least 2)."""
    return max(2, math.ceil(2 * l2 / (n * k * bytes_per_elem)) + 1)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-30)).item()


def time_path(run, ref: torch.Tensor, configs: list, args) -> dict:
    """Default (config None) and, per candidate, {config, us, err}; configs that fail to compile
    or run are reported and skipped. ``run(config, i)`` calls the path on weight copy i."""
    out = dict(default=dict(us=time_graph_calls(lambda i: run(None, i), args.calls, args.reps),
                            err=rel_err(run(None, 0), ref)))
    results = []
    for cfg in configs:
        try:
            err = rel_err(run(cfg, 0), ref)
            us = time_graph_calls(lambda i: run(cfg, i), args.calls, args.reps)
        except Exception as e:                                      # shared memory, registers
            print(f"    {cfg}: {type(e).__name__}: {str(e)[:100]}", flush=True)
            continue
        results.append(dict(config=dataclasses.asdict(cfg), us=us, err=err))
    results.sort(key=lambda r: r["us"])
    out["configs"] = results
    if results:
        out["best"] = results[0]
    return out


def sweep_case(name: str, n: int, k: int, m: int, weights: dict, args) -> dict:
    """Every path at one (shape, M)."""
    from kernels import fp8_linear as fp8

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)                            # [M, K]
    wb, wpc, spc, wblk, sblk = (weights[key] for key in ("bf16", "pc", "pc_scale", "blk", "blk_scale"))
    row = dict(shape=name, N=n, K=k, M=m, paths={})
    ref_bf16 = F.linear(x, wb[0]).float()
    row["paths"]["bf16"] = dict(default=dict(us=time_graph_calls(lambda i: F.linear(x, wb[i % len(wb)]),
                                                                 args.calls, args.reps), err=0.0))
    pc = dict(activation_scheme=fp8.PER_TOKEN)
    blk = dict(activation_scheme=fp8.PER_TOKEN_GROUP, block_size=BLOCK)
    ref_pc = fp8.fp8_linear_ref(x, wpc[0], spc[0], **pc)
    ref_blk = fp8.fp8_linear_ref(x, wblk[0], sblk[0], **blk)
    row["fp8_vs_bf16_err"] = rel_err(ref_pc, ref_bf16)
    grid = not args.no_grid
    row["paths"]["pc_triton"] = time_path(
        lambda c, i: fp8.fp8_linear(x, wpc[i % len(wpc)], spc[i % len(spc)], backend="triton", config=c, **pc),
        ref_pc, gemm_candidates(m) if grid else [], args)
    if fp8.scaled_mm_works(x.device):
        row["paths"]["pc_scaled_mm"] = time_path(
            lambda c, i: fp8.fp8_linear(x, wpc[i % len(wpc)], spc[i % len(spc)], backend="scaled_mm", **pc),
            ref_pc, [], args)
    row["paths"]["blk_triton"] = time_path(
        lambda c, i: fp8.fp8_linear(x, wblk[i % len(wblk)], sblk[i % len(sblk)], config=c, **blk),
        ref_blk, gemm_candidates(m) if grid else [], args)
    for label, scheme in (("quant_tok", fp8.PER_TOKEN), ("quant_grp", fp8.PER_TOKEN_GROUP)):
        row["paths"][label] = dict(default=dict(
            us=time_graph_calls(lambda i: fp8.quantize_activations_fp8(x, scheme), args.calls, args.reps), err=0.0))
    return row


def make_weights(n: int, k: int, l2: int) -> dict:
    """bf16 copies, and fp8 copies with per-channel / 128x128 block scales (each list > 2x L2)."""
    from kernels import fp8_linear as fp8

    out = dict(bf16=[], pc=[], pc_scale=[], blk=[], blk_scale=[])
    for _ in range(weight_copies(n, k, 2, l2)):
        out["bf16"].append(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5)   # [N, K]
    for i in range(weight_copies(n, k, 1, l2)):
        w, s = fp8.quantize_weight_fp8_per_channel(out["bf16"][i % len(out["bf16"])])
        out["pc"].append(w)
        out["pc_scale"].append(s)
        out["blk"].append(w)                               # same bytes; block scales of the right shape
        out["blk_scale"].append(torch.full((math.ceil(n / BLOCK[0]), math.ceil(k / BLOCK[1])), 1e-3,
                                           device="cuda") * (1 + torch.rand(1, device="cuda")))
    return out


def us(row: dict, path: str, which: str) -> str:
    entry = row["paths"].get(path, {}).get(which)
    return f"{entry['us']:8.1f}" if entry else f"{'-':>8s}"


def print_table(rows: list[dict]) -> None:
    cols = [("bf16", "default"), ("pc_scaled_mm", "default"), ("pc_triton", "default"), ("pc_triton", "best"),
            ("blk_triton", "default"), ("blk_triton", "best"), ("quant_tok", "default"), ("quant_grp", "default")]
    head = ["bf16", "scl_mm", "pc_tri", "pc_tri*", "blk_tri", "blk_tri*", "q_tok", "q_grp"]
    print(f"\nus per call (* = best config of the grid)\n{'shape':8s} {'M':>5s} " + " ".join(f"{h:>8s}" for h in head))
    for r in rows:
        print(f"{r['shape']:8s} {r['M']:5d} " + " ".join(us(r, p, w) for p, w in cols))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--ms", default="1,4,16,64,256,2048", help="token counts M")
    ap.add_argument("--calls", type=int, default=10, help="calls per CUDA graph")
    ap.add_argument("--reps", type=int, default=3, help="timed graph replays")
    ap.add_argument("--no-grid", action="store_true", help="default configs only (no candidate grid)")
    ap.add_argument("--out", default="benchmarks/out/fp8_sweep.json")
    args = ap.parse_args()
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    for s in shapes:
        if s not in SHAPES:
            ap.error(f"unknown shape {s!r}; choose from {', '.join(SHAPES)}")
    ms = [int(v) for v in args.ms.split(",")]
    if not torch.cuda.is_available():
        sys.exit("fp8_sweep.py times CUDA kernels; no CUDA device here.")

    from kernels.fp8_linear import scaled_mm_works

    t0 = time.time()
    bw = measure_copy_bandwidth()
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    has_scaled_mm = scaled_mm_works(torch.device("cuda", torch.cuda.current_device()))
    print(f"{props.name}: copy bandwidth {bw / 1e12:.2f} TB/s, L2 {l2 / 1e6:.0f} MB; torch {torch.__version__}, "
          f"rowwise _scaled_mm {'works' if has_scaled_mm else 'unavailable'}", flush=True)
    rows = []
    for name in shapes:
        n, k = SHAPES[name]
        weights = make_weights(n, k, l2)
        for m in ms:
            row = sweep_case(name, n, k, m, weights, args)
            rows.append(row)
            print(f"{name} M={m}: " + ", ".join(f"{p} {v['default']['us']:.1f}"
                                                 + (f" (best {v['best']['us']:.1f})" if "best" in v else "")
                                                 for p, v in row["paths"].items()), flush=True)
        del weights
        torch.cuda.empty_cache()
    print_table(rows)
    print(f"\nsweep took {time.time() - t0:.0f} s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(device=props.name, torch=torch.__version__, copy_bandwidth_bytes_s=bw,
                                              l2_bytes=l2, calls_per_graph=args.calls, scaled_mm=has_scaled_mm,
                                              rows=rows), indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
