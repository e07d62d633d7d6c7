"""FP8 linear sweep: ``kernels.fp8_linear`` paths against torch._scaled_mm and bf16 F.linear, and the
FP8 decode GEMV (``kernels.gemv`` on e4m3 weights) against the W8A8 GEMM and the bytes floor.

Example (H200; Llama-3-8B projections):
    python benchmarks/sweeps/fp8_sweep.py
    python benchmarks/sweeps/fp8_sweep.py --shapes qkv,down --ms 1,16,2048 --no-grid --out /tmp/fp8.json
    python benchmarks/sweeps/fp8_sweep.py --ms 1,4,16 --out benchmarks/out/fp8_gemv_sweep.json   # decode
    python benchmarks/sweeps/fp8_sweep.py --tiny        # CPU: small shapes through the Triton interpreter

Per projection shape (qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336) and token
count M (default 1, 4, 16, 64, 256, 2048), each case is timed from a CUDA graph of --calls
back-to-back calls that cycle through distinct weight copies totalling > 2x the L2 (weights from
HBM, as in a 32-layer step). Timed, each as a whole call (activation quantization included):

- ``bf16``: F.linear on the bf16 weight (cuBLAS).
- ``pc_triton`` / ``pc_scaled_mm``: per-channel fp8 weight, per-token fp8 activations (compressed-
  tensors FP8_DYNAMIC, ``--quantization fp8``), Triton GEMM / torch._scaled_mm (rowwise scales).
- ``blk_triton``: 128x128 block weight scales, per-token-group activations (HF ``fp8``).
- ``quant_tok`` / ``quant_grp``: the activation quantization alone (per token / per 128-wide group).

At M <= 16 also the decode GEMV (W8A16: the e4m3 weight converted in registers, activations
unquantized), each against the bytes floor (N * K weight bytes + the scales at --peak-tbs):

- ``pc_gemv`` / ``blk_gemv``: ``kernels.gemv.gemv`` on the per-channel / block-scaled weight.
- ``pc_fused`` / ``pc_unfused``: the projection's prologue (qkv, gate_up: add + RMSNorm; down:
  SiLU-and-mul) fused into the GEMV (``add_rms_norm_gemv`` / ``silu_mul_gemv``) against the
  ``kernels.layer_ops`` kernel followed by the W8A8 Triton GEMM, as FP8 decode steps ran before.

``--maths`` compares the FP8 GEMV's ways of meeting the e4m3 weight (``GemvConfig.fp8_math``) on the
Llama-3-8B and -70B decode projections at M 1, 2, 4 (unless --shapes / --ms say otherwise): the W8A8
GEMM with its activation quantization (``pc_triton``, tile grid), then per math (``widen``: e4m3 widened
to bf16, the engine's default; ``e4m3``: rows rounded to e4m3 in the kernel, FP8 MMA; ``f16``: e4m3
widened to float16, rows pre-scaled by a power of two) the plain GEMV on per-channel and 128x128 block
scales with its own tile grid (e4m3 / f16: also ``swap_ab`` tiles, the weight rows as the MMA's M, which
compile to wgmma; widen: its tl.dot tiles), and the fused prologue (default tiles and the plain GEMV's
best). Only those paths run; a table prints the best of each per shape and M, its time over the bytes
floor, and the fastest path (after each shape, and all at the end; the JSON is written after each shape):
    python benchmarks/sweeps/fp8_sweep.py --maths --out benchmarks/out/fp8_gemv_maths.json
    python benchmarks/sweeps/fp8_sweep.py --maths --tiny          # CPU smoke run of every path

``--tiny`` runs small shapes with weight dims of 1-4 scale blocks, default configs, on the CPU through
the Triton interpreter (wall-clock times, meaningless as speed: it checks that every path runs and
matches its twin) or on CUDA when there is one.

Triton paths run their default config, then (without --no-grid) a candidate grid; the table shows
default and best. Every path's output is checked once against its torch twin (max error relative
to the twin's max, in the JSON). Prints a table (us per call) and writes JSON.
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
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.sweeps.kernel_timing import measure_copy_bandwidth, time_calls  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "qkv_70b": (10240, 8192), "o_70b": (8192, 8192), "gate_up_70b": (57344, 8192), "down_70b": (8192, 28672)}
"""Llama-3-8B and -70B projections: name -> (N, K) of the [N, K] weight."""
SHAPES_8B = ("qkv", "o", "gate_up", "down")
"""The default --shapes (``--maths``: all of SHAPES)."""
TINY_SHAPES = {"qkv": (384, 256), "o": (256, 256), "gate_up": (512, 256), "down": (256, 448)}
"""``--tiny``: the 8B projections at a size the interpreter runs in seconds (down's K a ragged block)."""
MATHS = {"widen": 0, "e4m3": 1, "f16": 2}
"""``--maths``: label -> ``kernels.gemv.GemvConfig.fp8_math`` (WIDEN, E4M3_DOT, F16_WIDEN)."""
BLOCK = (128, 128)
"""(BN, BK) of the block-scaled weights (HF ``fp8`` checkpoints)."""
PROLOGUE = {"qkv": "add_rmsnorm", "gate_up": "add_rmsnorm", "down": "silu_mul"}
"""The elementwise op in front of each projection in a decode step (o_proj has none), by the shape's
name without its model suffix."""
EPS = 1e-5
GEMV_MAX_ROWS = 16
"""Rows up to which the decode GEMV paths are timed (``kernels.gemv.MAX_ROWS``)."""


def gemv_candidates(m: int, block_scales: bool, fp8_math: int = 0) -> list:
    """GemvConfig grid for the FP8 GEMV at M rows: tl.dot tiles and elementwise reduce-once tiles
    (block_n, block_k, num_warps, num_stages), the latter pruned to <= 128 float32 partial sums
    per thread. An e4m3 tile is half a bf16 tile's bytes, so block_k wider than the bf16 defaults
    are in; block scales cap block_k at the 128-wide block. fp8_math E4M3_DOT / F16_WIDEN: tl.dot
    tiles only (their one form), unswapped and swapped (``GemvConfig.swap_ab``)."""
    from kernels.gemv import GemvConfig

    if fp8_math:
        # (block_n, block_k, num_warps, num_stages, swap_ab): swap_ab 1 with block_n >= 64 on 4 warps is
        # Hopper's wgmma (block_n rows per program: fewer programs), 0 mma.sync.
        if block_scales:
            dot = [(32, 128, 4, 4, 0), (64, 128, 4, 4, 0), (128, 128, 8, 4, 0), (16, 128, 4, 4, 0),
                   (64, 128, 4, 4, 1), (64, 128, 4, 6, 1), (128, 128, 4, 4, 1)]
        else:
            dot = [(32, 512, 4, 3, 0), (64, 256, 4, 3, 0), (32, 1024, 4, 3, 0), (128, 256, 8, 3, 0),
                   (16, 1024, 4, 4, 0), (64, 256, 4, 3, 1), (64, 512, 4, 3, 1), (64, 128, 4, 6, 1),
                   (128, 256, 4, 3, 1), (128, 128, 4, 4, 1)]
        return [GemvConfig(bn, bk, nw, ns, use_dot=1, fp8_math=fp8_math, swap_ab=sw) for bn, bk, nw, ns, sw in dot]
    if block_scales:
        dot = [(32, 128, 4, 4), (64, 128, 4, 4), (128, 128, 4, 3), (128, 128, 8, 4)]
        once = [(32, 128, 4, 3), (64, 128, 4, 3), (128, 128, 4, 3), (128, 128, 8, 3), (16, 128, 2, 3)]
    else:
        dot = [(32, 512, 4, 3), (64, 256, 4, 3), (32, 1024, 4, 3), (16, 1024, 4, 4), (128, 256, 8, 3)]
        once = [(32, 256, 4, 3), (64, 256, 4, 3), (32, 512, 4, 3), (64, 128, 4, 3), (128, 128, 4, 3),
                (32, 256, 8, 3), (64, 256, 8, 3), (16, 512, 4, 3), (16, 256, 2, 3)]
    block_m = 1 << max(0, m - 1).bit_length()
    out = [GemvConfig(bn, bk, nw, ns, use_dot=1) for bn, bk, nw, ns in dot]
    out += [GemvConfig(bn, bk, nw, ns, use_dot=0, reduce_once=1) for bn, bk, nw, ns in once
            if block_m * bn * bk <= 128 * 32 * nw]
    return out


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
    out = dict(default=dict(us=time_calls(lambda i: run(None, i), args.calls, args.reps),
                            err=rel_err(run(None, 0), ref)))
    results = []
    for cfg in configs:
        try:
            err = rel_err(run(cfg, 0), ref)
            us = time_calls(lambda i: run(cfg, i), args.calls, args.reps)
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

    x = torch.randn(m, k, device=args.device, dtype=torch.bfloat16)                     # [M, K]
    wb, wpc, spc, wblk, sblk = (weights[key] for key in ("bf16", "pc", "pc_scale", "blk", "blk_scale"))
    row = dict(shape=name, N=n, K=k, M=m, paths={},
               floor_us=dict(pc=floor_us(n, k, spc[0], args), blk=floor_us(n, k, sblk[0], args)))
    if args.maths:
        sweep_maths(name, x, weights, row, args)
        return row
    ref_bf16 = F.linear(x, wb[0]).float()
    row["paths"]["bf16"] = dict(default=dict(us=time_calls(lambda i: F.linear(x, wb[i % len(wb)]), args.calls,
                                                           args.reps),
                                             err=0.0))
    pc = dict(activation_scheme=fp8.PER_TOKEN)
    blk = dict(activation_scheme=fp8.PER_TOKEN_GROUP, block_size=BLOCK)
    ref_pc = fp8.fp8_linear_ref(x, wpc[0], spc[0], **pc)
    ref_blk = fp8.fp8_linear_ref(x, wblk[0], sblk[0], **blk)
    row["fp8_vs_bf16_err"] = rel_err(ref_pc, ref_bf16)
    grid = not args.no_grid
    row["paths"]["pc_triton"] = time_path(
        lambda c, i: fp8.fp8_linear(x, wpc[i % len(wpc)], spc[i % len(spc)], backend="triton", config=c, **pc),
        ref_pc, gemm_candidates(m) if grid else [], args)
    if x.is_cuda and fp8.scaled_mm_works(x.device):
        row["paths"]["pc_scaled_mm"] = time_path(
            lambda c, i: fp8.fp8_linear(x, wpc[i % len(wpc)], spc[i % len(spc)], backend="scaled_mm", **pc),
            ref_pc, [], args)
    row["paths"]["blk_triton"] = time_path(
        lambda c, i: fp8.fp8_linear(x, wblk[i % len(wblk)], sblk[i % len(sblk)], config=c, **blk),
        ref_blk, gemm_candidates(m) if grid else [], args)
    for label, scheme in (("quant_tok", fp8.PER_TOKEN), ("quant_grp", fp8.PER_TOKEN_GROUP)):
        row["paths"][label] = dict(default=dict(
            us=time_calls(lambda i: fp8.quantize_activations_fp8(x, scheme), args.calls, args.reps), err=0.0))
    if m <= GEMV_MAX_ROWS:
        sweep_gemv(name, x, weights, row, args)
    return row


def floor_us(n: int, k: int, scale: torch.Tensor, args) -> float:
    """Microseconds to read the e4m3 weight [n, k] and its float32 scales at --peak-tbs."""
    return (n * k + scale.numel() * 4) / (args.peak_tbs * 1e12) * 1e6


def sweep_gemv(name: str, x: torch.Tensor, weights: dict, row: dict, args) -> None:
    """The decode GEMV paths of one (shape, M) into ``row["paths"]`` (module docstring)."""
    from kernels import fp8_linear as fp8
    from kernels import gemv as gv
    from kernels.layer_ops import add_rms_norm, silu_and_mul

    wpc, spc, wblk, sblk = (weights[key] for key in ("pc", "pc_scale", "blk", "blk_scale"))
    grid = not args.no_grid
    row["paths"]["pc_gemv"] = time_path(
        lambda c, i: gv.gemv(x, wpc[i % len(wpc)], weight_scale=spc[i % len(spc)], config=c),
        gv.gemv_ref(x, wpc[0], weight_scale=spc[0]), gemv_candidates(x.shape[0], False) if grid else [], args)
    row["paths"]["blk_gemv"] = time_path(
        lambda c, i: gv.gemv(x, wblk[i % len(wblk)], weight_scale=sblk[i % len(sblk)], scale_block=BLOCK, config=c),
        gv.gemv_ref(x, wblk[0], weight_scale=sblk[0], scale_block=BLOCK),
        gemv_candidates(x.shape[0], True) if grid else [], args)
    prologue = PROLOGUE.get(name.removesuffix("_70b"))
    if prologue is None:
        return
    m, k = x.shape
    pc = dict(activation_scheme=fp8.PER_TOKEN, backend="triton")
    if prologue == "add_rmsnorm":
        res = torch.randn_like(x)                                                     # [M, K]
        nw = torch.ones(k, device=x.device, dtype=x.dtype)                            # [K]
        buf = torch.empty_like(x)                                                     # [M, K]

        def unfused(i):
            add_rms_norm(x, nw, EPS, residual=res, out=buf)                           # residual updated in place
            return fp8.fp8_linear(buf, wpc[i % len(wpc)], spc[i % len(spc)], **pc)

        def fused(c, i):
            return gv.add_rms_norm_gemv(x, res, nw, EPS, wpc[i % len(wpc)], weight_scale=spc[i % len(spc)],
                                        config=c)[0]
        ref = gv.add_rms_norm_gemv_ref(x, res, nw, EPS, wpc[0], weight_scale=spc[0])[0]
    else:
        gate_up = torch.randn(m, 2 * k, device=x.device, dtype=x.dtype)              # [M, 2K]

        def unfused(i):
            return fp8.fp8_linear(silu_and_mul(gate_up), wpc[i % len(wpc)], spc[i % len(spc)], **pc)

        def fused(c, i):
            return gv.silu_mul_gemv(gate_up, wpc[i % len(wpc)], weight_scale=spc[i % len(spc)], config=c)
        ref = gv.silu_mul_gemv_ref(gate_up, wpc[0], weight_scale=spc[0])
    row["paths"]["pc_fused"] = time_path(fused, ref, [], args)
    row["paths"]["pc_fused"]["prologue"] = prologue
    row["paths"]["pc_unfused"] = dict(default=dict(us=time_calls(unfused, args.calls, args.reps), err=0.0),
                                      prologue=prologue)


def dot_only(configs: list) -> list:
    """``--maths`` keeps the tl.dot tiles of the widening's grid (its elementwise forms were 8-60% slower
    on the H200 at one row, ``kernels.gemv.gemv_config``'s note), to fit one run in minutes."""
    return [c for c in configs if c.use_dot or c.fp8_math]


def fused_path(name: str, x: torch.Tensor, wq: list, scales: list, fp8_math: int):
    """(run(config, i), twin output) of the projection's prologue fused into the GEMV on the per-channel
    weight, rows built from x; None for a projection without prologue (o_proj)."""
    from kernels import gemv as gv

    prologue = PROLOGUE.get(name.removesuffix("_70b"))
    if prologue is None:
        return None
    m, k = x.shape
    if prologue == "add_rmsnorm":
        res = torch.randn_like(x)                                                     # [M, K]
        nw = torch.ones(k, device=x.device, dtype=x.dtype)                            # [K]
        def run(c, i):
            return gv.add_rms_norm_gemv(x, res, nw, EPS, wq[i % len(wq)], weight_scale=scales[i % len(scales)],
                                        config=c)[0]
        return run, gv.add_rms_norm_gemv_ref(x, res, nw, EPS, wq[0], weight_scale=scales[0], fp8_math=fp8_math)[0]
    gate_up = torch.randn(m, 2 * k, device=x.device, dtype=x.dtype)                  # [M, 2K]

    def run_silu(c, i):
        return gv.silu_mul_gemv(gate_up, wq[i % len(wq)], weight_scale=scales[i % len(scales)], config=c)
    return run_silu, gv.silu_mul_gemv_ref(gate_up, wq[0], weight_scale=scales[0], fp8_math=fp8_math)


def sweep_maths(name: str, x: torch.Tensor, weights: dict, row: dict, args) -> None:
    """``--maths``: the W8A8 GEMM + quantization and, per ``MATHS`` entry, the plain GEMV (per-channel and
    block scales, each with its grid) and the fused prologue (default config and the plain GEMV's best)."""
    from kernels import fp8_linear as fp8
    from kernels import gemv as gv

    wpc, spc, wblk, sblk = (weights[key] for key in ("pc", "pc_scale", "blk", "blk_scale"))
    m = x.shape[0]
    grid = not args.no_grid
    pc = dict(activation_scheme=fp8.PER_TOKEN)
    row["paths"]["pc_triton"] = time_path(
        lambda c, i: fp8.fp8_linear(x, wpc[i % len(wpc)], spc[i % len(spc)], backend="triton", config=c, **pc),
        fp8.fp8_linear_ref(x, wpc[0], spc[0], **pc), gemm_candidates(m) if grid else [], args)
    row["paths"]["quant_tok"] = dict(default=dict(
        us=time_calls(lambda i: fp8.quantize_activations_fp8(x, fp8.PER_TOKEN), args.calls, args.reps), err=0.0))
    for label, fp8_math in MATHS.items():
        math = (("fp8_math", fp8_math),)

        def with_math(c):
            return c if c is not None else gv.gemv_config(m, *wpc[0].shape, x.device, override=math, weight_fp8=True)
        row["paths"][f"pc_{label}"] = time_path(
            lambda c, i: gv.gemv(x, wpc[i % len(wpc)], weight_scale=spc[i % len(spc)], config=with_math(c)),
            gv.gemv_ref(x, wpc[0], weight_scale=spc[0], fp8_math=fp8_math),
            dot_only(gemv_candidates(m, False, fp8_math)) if grid else [], args)

        def with_math_blk(c):
            return c if c is not None else gv.gemv_config(m, *wblk[0].shape, x.device, override=math,
                                                          scale_block_k=BLOCK[1], weight_fp8=True)
        row["paths"][f"blk_{label}"] = time_path(
            lambda c, i: gv.gemv(x, wblk[i % len(wblk)], weight_scale=sblk[i % len(sblk)], scale_block=BLOCK,
                                 config=with_math_blk(c)),
            gv.gemv_ref(x, wblk[0], weight_scale=sblk[0], scale_block=BLOCK, fp8_math=fp8_math),
            dot_only(gemv_candidates(m, True, fp8_math)) if grid else [], args)
        fused = fused_path(name, x, wpc, spc, fp8_math)
        if fused is not None:
            run, ref = fused
            best = row["paths"][f"pc_{label}"].get("best")
            candidates = [gv.GemvConfig(**best["config"])] if best else []
            prologue = gv.SILU_MUL if PROLOGUE[name.removesuffix("_70b")] == "silu_mul" else gv.ADD_RMSNORM
            default = gv.gemv_config(m, *wpc[0].shape, x.device, prologue, override=math, weight_fp8=True)
            row["paths"][f"fused_{label}"] = time_path(lambda c, i: run(c if c is not None else default, i), ref,
                                                       candidates, args)


def make_weights(n: int, k: int, l2: int, device: torch.device) -> dict:
    """bf16 copies, and fp8 copies with per-channel / 128x128 block scales (each list > 2x L2)."""
    from kernels import fp8_linear as fp8

    out = dict(bf16=[], pc=[], pc_scale=[], blk=[], blk_scale=[])
    for _ in range(weight_copies(n, k, 2, l2)):
        out["bf16"].append(torch.randn(n, k, device=device, dtype=torch.bfloat16) * k ** -0.5)   # [N, K]
    for i in range(weight_copies(n, k, 1, l2)):
        w, s = fp8.quantize_weight_fp8_per_channel(out["bf16"][i % len(out["bf16"])])
        out["pc"].append(w)
        out["pc_scale"].append(s)
        out["blk"].append(w)                               # same bytes; block scales of the right shape
        out["blk_scale"].append(torch.full((math.ceil(n / BLOCK[0]), math.ceil(k / BLOCK[1])), 1e-3,
                                           device=device) * (1 + torch.rand(1, device=device)))
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


def print_gemv_table(rows: list[dict]) -> None:
    """The decode rows: W8A8 Triton GEMM, the FP8 GEMV and the bytes floor (x floor = time / floor)."""
    rows = [r for r in rows if "pc_gemv" in r["paths"]]
    if not rows:
        return
    cols = [("pc_triton", "default"), ("pc_triton", "best"), ("pc_gemv", "default"), ("pc_gemv", "best"),
            ("blk_triton", "default"), ("blk_gemv", "default"), ("blk_gemv", "best"), ("pc_unfused", "default"),
            ("pc_fused", "default")]
    head = ["pc_tri", "pc_tri*", "pc_gemv", "pc_gemv*", "blk_tri", "blk_gemv", "blk_gmv*", "unfused", "fused"]
    print(f"\nFP8 decode GEMV, us per call (* = best config of the grid; unfused = norm / SiLU kernel + pc_tri, "
          f"fused = the GEMV with it)\n{'shape':8s} {'M':>5s} {'floor':>8s} " + " ".join(f"{h:>8s}" for h in head)
          + f" {'pc x fl':>8s} {'blk x fl':>8s}")
    for r in rows:
        def ratio(path: str, floor: float) -> str:
            p = r["paths"][path]
            return f"{p.get('best', p['default'])['us'] / floor:8.3g}"
        print(f"{r['shape']:8s} {r['M']:5d} {r['floor_us']['pc']:8.2f} " + " ".join(us(r, p, w) for p, w in cols)
              + f" {ratio('pc_gemv', r['floor_us']['pc'])} {ratio('blk_gemv', r['floor_us']['blk'])}")


def best_us(row: dict, path: str) -> Optional[float]:
    """The path's best time (its default's without a grid); None if it did not run."""
    entry = row["paths"].get(path)
    return None if entry is None else entry.get("best", entry["default"])["us"]


def print_maths_table(rows: list[dict]) -> None:
    """``--maths``: per shape and M the best time of the W8A8 GEMM + quantization and of each GEMV math
    (per-channel, block scales, fused prologue), x floor = per-channel time / bytes floor, and the fastest
    per-channel path."""
    labels = list(MATHS)
    head = (["w8a8"] + [f"pc_{k}" for k in labels] + [f"{k} xfl" for k in ["w8a8"] + labels]
            + [f"blk_{k}" for k in labels] + [f"fus_{k}" for k in labels])
    print(f"\nFP8 decode GEMV maths, best us per call over each tile grid (w8a8 = quantization + W8A8 Triton GEMM; "
          f"xfl = time / bytes floor; fus = the prologue fused in, per channel)\n{'shape':12s} {'M':>3s} {'floor':>7s} "
          + " ".join(f"{h:>10s}" for h in head) + "  fastest")
    for r in rows:
        pcs = {"w8a8": best_us(r, "pc_triton")} | {k: best_us(r, f"pc_{k}") for k in labels}
        cells = [pcs["w8a8"]] + [pcs[k] for k in labels]
        cells += [None if v is None else v / r["floor_us"]["pc"] for v in cells]
        cells += [best_us(r, f"blk_{k}") for k in labels] + [best_us(r, f"fused_{k}") for k in labels]
        ran = {k: v for k, v in pcs.items() if v is not None}
        fastest = min(ran, key=ran.get) if ran else "-"
        print(f"{r['shape']:12s} {r['M']:3d} {r['floor_us']['pc']:7.2f} "
              + " ".join(f"{v:10.2f}" if v is not None else f"{'-':>10s}" for v in cells) + f"  {fastest}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=None,
                    help=f"comma list of {', '.join(SHAPES)} (default: {', '.join(SHAPES_8B)}; --maths: all)")
    ap.add_argument("--ms", default=None, help="token counts M (default 1,4,16,64,256,2048; --maths 1,2,4)")
    ap.add_argument("--maths", action="store_true",
                    help="only the FP8 decode GEMV maths against the W8A8 GEMM (module docstring)")
    ap.add_argument("--calls", type=int, default=10, help="calls per CUDA graph")
    ap.add_argument("--reps", type=int, default=3, help="timed graph replays")
    ap.add_argument("--no-grid", action="store_true", help="default configs only (no candidate grid)")
    ap.add_argument("--peak-tbs", type=float, default=4.8, help="HBM TB/s of the bytes floor (H200: 4.8)")
    ap.add_argument("--tiny", action="store_true",
                    help="small shapes, M 1,4,16, default configs; runs on CPU through the Triton interpreter")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/out/fp8_sweep[_tiny].json)")
    args = ap.parse_args()
    shape_table = TINY_SHAPES if args.tiny else SHAPES
    if args.shapes is None:
        args.shapes = ",".join(shape_table if args.tiny or args.maths else SHAPES_8B)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    for s in shapes:
        if s not in shape_table:
            ap.error(f"unknown shape {s!r}; choose from {', '.join(shape_table)}")
    if args.ms is None:
        args.ms = "1,2,4" if args.maths else "1,4,16" if args.tiny else "1,4,16,64,256,2048"
    if args.tiny:
        args.no_grid, args.calls, args.reps = True, min(args.calls, 2), 1
    ms = [int(v) for v in args.ms.split(",")]
    if args.maths and max(ms) > GEMV_MAX_ROWS:
        ap.error(f"--maths times the decode GEMV: M <= {GEMV_MAX_ROWS}")
    out_path = args.out or (f"benchmarks/out/fp8_{'gemv_maths' if args.maths else 'sweep'}"
                            f"{'_tiny' if args.tiny else ''}.json")
    if not torch.cuda.is_available():
        if not args.tiny:
            sys.exit("fp8_sweep.py times CUDA kernels; no CUDA device here (--tiny runs on CPU).")
        os.environ["TRITON_INTERPRET"] = "1"           # before anything imports triton
    args.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    from kernels.fp8_linear import scaled_mm_works

    t0 = time.time()
    bw = measure_copy_bandwidth()
    if args.device.type == "cuda":
        props = torch.cuda.get_device_properties(0)
        device_name, l2 = props.name, getattr(props, "L2_cache_size", 50 << 20)
        has_scaled_mm = scaled_mm_works(torch.device("cuda", torch.cuda.current_device()))
    else:
        device_name, l2, has_scaled_mm = "cpu (Triton interpreter)", 0, False
    print(f"{device_name}: copy bandwidth {bw / 1e12:.2f} TB/s, L2 {l2 / 1e6:.0f} MB; torch {torch.__version__}, "
          f"rowwise _scaled_mm {'works' if has_scaled_mm else 'unavailable'}; bytes floor at {args.peak_tbs} TB/s",
          flush=True)
    rows = []

    def write_json() -> None:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        Path(out_path).write_text(json.dumps(dict(device=device_name, torch=torch.__version__, copy_bandwidth_bytes_s=bw,
                                                  l2_bytes=l2, calls_per_graph=args.calls, scaled_mm=has_scaled_mm,
                                                  peak_tbs=args.peak_tbs, tiny=args.tiny, maths=args.maths,
                                                  rows=rows), indent=1))
    for name in shapes:
        n, k = shape_table[name]
        weights = make_weights(n, k, l2, args.device)
        for m in ms:
            row = sweep_case(name, n, k, m, weights, args)
            rows.append(row)
            print(f"{name} M={m} ({time.time() - t0:.0f} s): "
                  + ", ".join(f"{p} {v['default']['us']:.1f}" + (f" (best {v['best']['us']:.1f})" if "best" in v else "")
                              for p, v in row["paths"].items()), flush=True)
        del weights
        if args.device.type == "cuda":
            torch.cuda.empty_cache()
        if args.maths:
            print_maths_table(rows[-len(ms):])
        write_json()                       # after every shape: a run cut short keeps what it timed
    if args.maths:
        print_maths_table(rows)
    else:
        print_table(rows)
        print_gemv_table(rows)
    print(f"\nsweep took {time.time() - t0:.0f} s")
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
