"""Decode GEMV sweep: ``kernels.gemv`` against cuBLAS, and the fused prologues against their unfused sequences.

Example (H200; Llama-3-8B decode projections, bf16):
    python benchmarks/sweeps/gemv_sweep.py
    python benchmarks/sweeps/gemv_sweep.py --shapes qkv,down --ms 1,4 --out /tmp/gemv.json

Per projection shape (qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336, lm_head
128256x4096) and token count M (1, 2, 4, 8, 16), each case is timed from a CUDA graph of --calls
back-to-back calls that cycle through distinct weight copies totalling > 2x the L2, so weights
come from HBM as in a real 32-layer step. Timed: torch.matmul (cuBLAS), ``gemv`` for every
candidate ``GemvConfig`` (a pruned grid of block_n / block_k / num_warps / num_stages / use_dot)
and for the default ``gemv_config``, then the fused variant with the best and the default config
against its unfused sequence (qkv, gate_up, lm_head: ``layer_ops.add_rms_norm`` + matmul; down:
``layer_ops.silu_and_mul`` + matmul). Reported: us per call, weight GB/s and its fraction of
the copy bandwidth measured first (device-to-device copy of 2 GiB, bytes read + written, as
``benchmarks/latency.py``). Prints a table and the best config per (shape, M); writes JSON.
Every config's output is checked once against cuBLAS (max abs error in the JSON).
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

from benchmarks.sweeps.kernel_timing import time_graph_calls  # noqa: E402
from benchmarks.latency import measure_copy_bandwidth  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
"""Llama-3-8B projections: name -> (N, K) of the [N, K] weight."""
FUSED = {"qkv": "add_rmsnorm", "gate_up": "add_rmsnorm", "lm_head": "add_rmsnorm", "down": "silu_mul"}
"""The prologue each projection's input goes through first (o_proj has none)."""
EPS = 1e-5


def candidate_configs(m: int):
    """The sweep grid for M rows: (block_n, block_k, num_warps, num_stages, use_dot) candidates.

    Pruned: the elementwise form holds a [BLOCK_M, block_n, block_k] product, so it keeps at most
    128 elements per thread; tl.dot keeps its pipelined tiles under ~160 KB of shared memory.
    """
    from kernels.gemv import GemvConfig

    elementwise = [(16, 256, 4, 3), (16, 512, 4, 3), (32, 128, 4, 3), (32, 256, 4, 3), (64, 128, 4, 3),
                   (32, 512, 8, 3)]
    dot = [(16, 256, 4, 3), (16, 512, 4, 4), (32, 256, 4, 3), (32, 512, 4, 3), (32, 128, 4, 4),
           (64, 256, 4, 3), (64, 128, 4, 4), (64, 512, 8, 3), (128, 128, 8, 3), (128, 256, 8, 2),
           (32, 256, 2, 3), (16, 128, 2, 4)]
    out = []
    block_m = 1 << max(0, m - 1).bit_length()
    for bn, bk, nw, ns in elementwise:
        if block_m * bn * bk <= 128 * 32 * nw:
            out.append(GemvConfig(bn, bk, nw, ns, 0))
    for bn, bk, nw, ns in dot:
        if ns * (bn + 16) * bk * 2 <= 160 << 10:
            out.append(GemvConfig(bn, bk, nw, ns, 1))
    return out


def cfg_dict(cfg) -> dict:
    return dict(block_n=cfg.block_n, block_k=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                use_dot=cfg.use_dot)


def cfg_str(cfg) -> str:
    return (f"bn={cfg.block_n:3d} bk={cfg.block_k:3d} w={cfg.num_warps} s={cfg.num_stages} "
            f"{'dot' if cfg.use_dot else 'ew '}")


FUSED_EXTRA = [(16, 512, 4, 3), (32, 256, 4, 3), (32, 512, 4, 3), (64, 256, 4, 3), (64, 512, 4, 3),
               (128, 128, 4, 3), (128, 128, 8, 3)]
"""tl.dot configs tried for the fused prologues besides the plain case's top 3 and the default
(every program rebuilds the input rows for its whole K loop: wider block_n means less of that
work, narrower means more programs to spread the weight reads over the SMs)."""


def sweep_fused(prologue: str, x: torch.Tensor, ws: list, copies: int, top_plain: list, args, wbytes: int,
                bw: float) -> dict:
    """Time the fused prologue + GEMV over a few configs against its unfused sequence."""
    from kernels.gemv import ADD_RMSNORM, SILU_MUL, GemvConfig, add_rms_norm_gemv, gemv_config, silu_mul_gemv
    from kernels.layer_ops import add_rms_norm, silu_and_mul

    m, k = x.shape
    n = ws[0].shape[0]
    dev, dtype = x.device, x.dtype
    if prologue == "add_rmsnorm":
        res = torch.randn(m, k, device=dev, dtype=dtype)
        nw = torch.ones(k, device=dev, dtype=dtype)
        buf = torch.empty(m, k, device=dev, dtype=dtype)

        def unfused(i):
            add_rms_norm(x, nw, EPS, residual=res, out=buf)       # residual updated in place
            return torch.matmul(buf, ws[i % copies].t())

        def fused_fn(cfg):
            return lambda i: add_rms_norm_gemv(x, res, nw, EPS, ws[i % copies], config=cfg)
        default = gemv_config(m, n, k, prologue=ADD_RMSNORM)
    else:
        gate_up = torch.randn(m, 2 * k, device=dev, dtype=dtype)

        def unfused(i):
            return torch.matmul(silu_and_mul(gate_up), ws[i % copies].t())

        def fused_fn(cfg):
            return lambda i: silu_mul_gemv(gate_up, ws[i % copies], config=cfg)
        default = gemv_config(m, n, k, prologue=SILU_MUL)
    out = dict(prologue=prologue, unfused_us=time_graph_calls(unfused, args.calls, args.reps),
               default=dict(config=cfg_dict(default), us=time_graph_calls(fused_fn(default), args.calls, args.reps)))
    cands = list(dict.fromkeys(top_plain + [GemvConfig(*c, 1) for c in FUSED_EXTRA]))
    results = []
    for cfg in cands:
        try:
            us = time_graph_calls(fused_fn(cfg), args.calls, args.reps)
        except Exception as e:
            print(f"  fused {prologue} {cfg_str(cfg)}: {type(e).__name__}: {str(e)[:100]}", flush=True)
            continue
        results.append(dict(config=cfg_dict(cfg), us=us, cfg=cfg))
    results.sort(key=lambda r: r["us"])
    print(f"  fused {prologue}: unfused (kernel + cuBLAS) {out['unfused_us']:7.1f} us; "
          f"fused default {cfg_str(default)}: {out['default']['us']:7.1f} us", flush=True)
    for r in results[:args.top]:
        gbs = wbytes / (r["us"] * 1e-6)
        print(f"    fused {cfg_str(r['cfg'])}: {r['us']:7.1f} us {gbs / 1e9:6.0f} GB/s ({gbs / bw:.2f})")
    out["configs"] = [{kk: v for kk, v in r.items() if kk != "cfg"} for r in results]
    if results:
        out["best"] = out["configs"][0]
    return out


def weight_copies(n: int, k: int, l2: int) -> list[torch.Tensor]:
    """Distinct random bf16 [n, k] CUDA weights totalling > 2x the L2 (at least 2), so a graph that
    cycles through them reads each from HBM, as a 32-layer step does."""
    copies = max(2, math.ceil(2 * l2 / (n * k * 2)) + 1)
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]


def time_configs(label: str, configs, describe, run, ref: torch.Tensor, args) -> list[dict]:
    """Each launch config's max error against ``ref`` (``run(cfg, 0)``) and device time over
    ``run(cfg, i)`` calls cycling the weight copies; configs the compiler rejects (shared memory,
    registers) are printed with ``label`` and ``describe(cfg)`` and skipped. Fastest first; each
    entry is {config (as a dict), us, max_err, cfg (the config object)}."""
    results = []
    for cfg in configs:
        try:
            err = (run(cfg, 0).float() - ref).abs().max().item()
            us = time_graph_calls(lambda i: run(cfg, i), args.calls, args.reps)
        except Exception as e:
            print(f"  {label} {describe(cfg)}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        results.append(dict(config=dataclasses.asdict(cfg), us=us, max_err=err, cfg=cfg))
    results.sort(key=lambda r: r["us"])
    return results


def sweep_shape(name: str, n: int, k: int, ms: list[int], args, bw: float, l2: int) -> list[dict]:
    from kernels.gemv import gemv, gemv_config

    dev, dtype = torch.device("cuda"), torch.bfloat16
    wbytes = n * k * 2
    ws = weight_copies(n, k, l2)
    copies = len(ws)
    rows = []
    for m in ms:
        x = torch.randn(m, k, device=dev, dtype=dtype)
        ref = torch.matmul(x, ws[0].t()).float()
        cublas_us = time_graph_calls(lambda i: torch.matmul(x, ws[i % copies].t()), args.calls, args.reps)
        results = time_configs(f"{name} M={m}", candidate_configs(m), cfg_str,
                               lambda cfg, i: gemv(x, ws[i % copies], config=cfg), ref, args)
        default = gemv_config(m, n, k)
        default_us = time_graph_calls(lambda i: gemv(x, ws[i % copies], config=default), args.calls, args.reps)
        best = results[0] if results else None
        row = dict(shape=name, N=n, K=k, M=m, weight_bytes=wbytes, copies=copies, cublas_us=cublas_us,
                   default=dict(config=cfg_dict(default), us=default_us),
                   configs=[{kk: v for kk, v in r.items() if kk != "cfg"} for r in results])

        def gbs(us):
            return wbytes / (us * 1e-6) / 1e9

        print(f"\n{name} N={n} K={k} M={m}: weight {wbytes / 1e6:.1f} MB x{copies} copies; "
              f"cuBLAS {cublas_us:7.1f} us {gbs(cublas_us):6.0f} GB/s ({gbs(cublas_us) * 1e9 / bw:.2f} of copy bw)")
        print(f"  default {cfg_str(default)}: {default_us:7.1f} us {gbs(default_us):6.0f} GB/s "
              f"({gbs(default_us) * 1e9 / bw:.2f})")
        for r in results[:args.top]:
            print(f"  {cfg_str(r['cfg'])}: {r['us']:7.1f} us {gbs(r['us']):6.0f} GB/s "
                  f"({gbs(r['us']) * 1e9 / bw:.2f}) err {r['max_err']:.3g}")

        prologue = FUSED.get(name) if not args.no_fused else None
        if prologue is not None:
            row["fused"] = sweep_fused(prologue, x, ws, copies, [r["cfg"] for r in results[:3]], args, wbytes, bw)
        if best is not None:
            row["best"] = {kk: v for kk, v in best.items() if kk != "cfg"}
        rows.append(row)
    ws.clear()
    torch.cuda.empty_cache()
    return rows


def parse_shapes(ap: argparse.ArgumentParser, value: str) -> list[str]:
    """--shapes: a comma list of ``SHAPES`` names (argparse error otherwise)."""
    shapes = [s.strip() for s in value.split(",") if s.strip()]
    for s in shapes:
        if s not in SHAPES:
            ap.error(f"unknown shape {s!r}; choose from {', '.join(SHAPES)}")
    return shapes


def write_json(path: str, props, bw: float, l2: int, calls: int, rows: list, **extra) -> None:
    """The sweep's JSON: device, copy bandwidth, L2 size, calls per graph, rows (+ extra keys)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(dict(device=props.name, copy_bandwidth_bytes_s=bw, l2_bytes=l2,
                                          calls_per_graph=calls, rows=rows, **extra), indent=1))
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--ms", default="1,2,4,8,16", help="token counts M (1..16)")
    ap.add_argument("--calls", type=int, default=20, help="calls per CUDA graph")
    ap.add_argument("--reps", type=int, default=3, help="timed graph replays")
    ap.add_argument("--top", type=int, default=4, help="configs printed per case")
    ap.add_argument("--no-fused", action="store_true", help="skip the fused-prologue comparisons")
    ap.add_argument("--out", default="benchmarks/out/gemv_sweep.json")
    args = ap.parse_args()
    shapes = parse_shapes(ap, args.shapes)
    ms = [int(v) for v in args.ms.split(",")]
    if any(not 1 <= m <= 16 for m in ms):
        ap.error("--ms: each M must be in 1..16")
    if not torch.cuda.is_available():
        sys.exit("gemv_sweep.py times CUDA kernels; no CUDA device here.")

    t0 = time.time()
    bw = measure_copy_bandwidth()
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    print(f"{props.name}: copy bandwidth {bw / 1e12:.2f} TB/s (read + write), L2 {l2 / 1e6:.0f} MB", flush=True)
    rows = []
    for s in shapes:
        n, k = SHAPES[s]
        rows += sweep_shape(s, n, k, ms, args, bw, l2)

    print(f"\n{'shape':8s} {'M':>2s} {'cuBLAS us':>9s} {'default':>8s} {'best':>8s} {'best/bw':>7s}  best config"
          f"{'':22s} {'unfused':>8s} {'fused':>8s} {'fused default':>13s}")
    for r in rows:
        best = r.get("best")
        f = r.get("fused", {})
        bcfg = best["config"] if best else None
        bstr = (f"bn={bcfg['block_n']} bk={bcfg['block_k']} w={bcfg['num_warps']} s={bcfg['num_stages']} "
                f"dot={bcfg['use_dot']}" if bcfg else "-")
        frac = r["weight_bytes"] / (best["us"] * 1e-6) / bw if best else float("nan")
        fused_us = f["best"]["us"] if f.get("best") else math.nan
        print(f"{r['shape']:8s} {r['M']:2d} {r['cublas_us']:9.1f} {r['default']['us']:8.1f} "
              f"{best['us'] if best else math.nan:8.1f} {frac:7.2f}  {bstr:33s} "
              f"{f.get('unfused_us', math.nan):8.1f} {fused_us:8.1f} "
              f"{f['default']['us'] if f else math.nan:13.1f}")
    print(f"\nsweep took {time.time() - t0:.0f} s")
    write_json(args.out, props, bw, l2, args.calls, rows)


if __name__ == "__main__":
    main()
