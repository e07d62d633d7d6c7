"""W4A16 sweep: ``kernels.w4a16`` launch configs against bf16 cuBLAS and the torch twin, by token rows.

Example (H200; Llama-3-8B projections, bf16 activations, int4 weights):
    python benchmarks/sweeps/w4a16_sweep.py
    python benchmarks/sweeps/w4a16_sweep.py --shapes qkv,down --ms 1,16 --group-sizes 128 --out /tmp/w4.json

Per projection shape (qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336 as N x K),
group size (--group-sizes; 0 = per-channel) and token count M (--ms, default 1, 4, 16, 64, 256,
2048), timed: ``F.linear`` on the bf16 weight (cuBLAS), the torch twin ``w4a16_matmul_ref``
(float32 dequantize + matmul), ``w4a16_matmul`` with the default ``w4a16_config`` and with every
candidate ``W4A16Config`` (a decode grid for M <= 16: block_n / block_k / warps / stages /
split_k; a GEMM grid above: tiles, warps, stages, scale_in_weight). Each case is timed from a
CUDA graph of --calls back-to-back calls that cycle through distinct weight copies totalling
> 2x the L2 (int4 and bf16 alike), so weights come from HBM as in a 32-layer step; the twin,
whose own float32 intermediates dominate, runs on one copy with --twin-calls calls. Every
config's output is checked once against the twin (max abs error in the JSON). Reported: us per
call, the int4 weight bytes per second as a fraction of the copy bandwidth measured first, and
the speedup over cuBLAS bf16. Prints a table and the best config per case; writes JSON.
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

from benchmarks.latency import measure_copy_bandwidth  # noqa: E402
from benchmarks.sweeps.kernel_timing import time_graph_calls  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
"""Llama-3-8B projections: name -> (N, K) of out = x [M, K] @ W [K, N]."""

DECODE_TILES = [(16, 128, 4, 6), (16, 256, 4, 4), (16, 512, 4, 3), (16, 512, 4, 4), (16, 512, 2, 4),
                (32, 128, 4, 6), (32, 256, 4, 4), (32, 512, 4, 3), (32, 512, 4, 4), (32, 256, 2, 5),
                (64, 256, 4, 4), (64, 512, 4, 3)]
"""(block_n, block_k, num_warps, num_stages) tried at M <= 16 (block_m 16, scale per group in float32),
each with split_k 1, 2 and 4 where K has >= 4 block_k steps per slice."""

GEMM_TILES = [(32, 64, 128, 4, 4, 1), (64, 64, 128, 4, 4, 1), (64, 128, 64, 4, 4, 1),
              (64, 128, 64, 4, 4, 0), (64, 128, 128, 4, 3, 1), (64, 256, 64, 8, 3, 1),
              (128, 64, 64, 4, 4, 1), (128, 128, 64, 8, 3, 1), (128, 128, 64, 8, 4, 1),
              (128, 128, 64, 8, 3, 0), (128, 128, 128, 8, 3, 1), (128, 256, 64, 8, 3, 1)]
"""(block_m, block_n, block_k, num_warps, num_stages, scale_in_weight) tried at M > 16; block_m above
next_power_of_2(M) is skipped."""


def candidate_configs(m: int, k: int) -> list:
    """The sweep grid for M rows and K inputs (``W4A16Config`` objects)."""
    from kernels.w4a16 import W4A16Config

    out = []
    if m <= 16:
        for bn, bk, nw, ns in DECODE_TILES:
            for split in (1, 2, 4):
                if split == 1 or k // bk >= 4 * split:
                    out.append(W4A16Config(block_m=16, block_n=bn, block_k=bk, split_k=split, num_warps=nw,
                                           num_stages=ns))
        return out
    block_m_cap = max(16, 1 << (m - 1).bit_length())
    for bm, bn, bk, nw, ns, siw in GEMM_TILES:
        if bm <= block_m_cap:
            out.append(W4A16Config(block_m=bm, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns,
                                   scale_in_weight=siw))
    return out


def cfg_str(cfg) -> str:
    return (f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w={cfg.num_warps} s={cfg.num_stages} "
            f"split={cfg.split_k} siw={cfg.scale_in_weight}")


@dataclasses.dataclass
class QuantWeight:
    """One int4 weight copy in the kernel's layout."""

    qweight: torch.Tensor       # int32 [K // 8, N]
    scales: torch.Tensor        # bf16 [K // G, N]
    zeros: torch.Tensor         # bf16 [K // G, N]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zeros))


def quant_copies(n: int, k: int, group_size: int, l2_bytes: int, device) -> list[QuantWeight]:
    """Random int4 weights (asymmetric zeros 0..15, scales ~ 1 / (4.6 sqrt(K))) totalling > 2x the L2."""
    num_groups = k // group_size
    one = n * k // 2 + 4 * num_groups * n
    copies = max(2, math.ceil(2 * l2_bytes / one) + 1)
    out = []
    for _ in range(copies):
        qweight = torch.randint(-2 ** 31, 2 ** 31 - 1, (k // 8, n), dtype=torch.int32, device=device)
        scales = ((0.5 + torch.rand(num_groups, n, device=device)) / (4.6 * k ** 0.5)).to(torch.bfloat16)
        zeros = torch.randint(0, 16, (num_groups, n), device=device).to(torch.bfloat16)
        out.append(QuantWeight(qweight, scales, zeros))
    return out


def bf16_copies(n: int, k: int, l2_bytes: int, device) -> list[torch.Tensor]:
    """Random bf16 [N, K] weights (``F.linear`` layout) totalling > 2x the L2."""
    copies = max(2, math.ceil(2 * l2_bytes / (n * k * 2)) + 1)
    return [torch.randn(n, k, device=device, dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]


def time_configs(configs, run, ref: torch.Tensor, args, label: str) -> list[dict]:
    """Each config's max abs error against ``ref`` (``run(cfg, 0)``) and us per call over ``run(cfg, i)``;
    configs the compiler rejects are printed and skipped. Fastest first."""
    results = []
    for cfg in configs:
        try:
            err = (run(cfg, 0).float() - ref).abs().max().item()
            us = time_graph_calls(lambda i: run(cfg, i), args.calls, args.reps)
        except Exception as e:                                       # shared memory, registers
            print(f"  {label} {cfg_str(cfg)}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        results.append(dict(config=dataclasses.asdict(cfg), us=us, max_err=err, cfg=cfg))
    results.sort(key=lambda r: r["us"])
    return results


def _plain(result: dict) -> dict:
    """A ``time_configs`` entry without its config object (JSON-ready)."""
    return {k: v for k, v in result.items() if k != "cfg"}


def sweep_case(name: str, n: int, k: int, group_size: int, ms: list[int], args, bw: float, l2: int,
               device) -> list[dict]:
    """Rows of one (shape, group size) over the token counts ``ms``."""
    from kernels.w4a16 import w4a16_config, w4a16_matmul, w4a16_matmul_ref

    g = group_size or k
    qws = quant_copies(n, k, g, l2, device)
    wts = bf16_copies(n, k, l2, device)
    rows = []
    for m in ms:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)                       # [M, K]
        q0 = qws[0]
        ref = w4a16_matmul_ref(x, q0.qweight, q0.scales, q0.zeros, g).float()            # [M, N]
        cublas_us = time_graph_calls(lambda i: F.linear(x, wts[i % len(wts)]), args.calls, args.reps)
        twin_us = (math.nan if args.no_twin else
                   time_graph_calls(lambda i: w4a16_matmul_ref(x, q0.qweight, q0.scales, q0.zeros, g),
                                    args.twin_calls, args.reps))

        def run(cfg, i):
            w = qws[i % len(qws)]
            return w4a16_matmul(x, w.qweight, w.scales, w.zeros, g, config=cfg)

        default = w4a16_config(m, n, k, device)
        default_res = time_configs([default], run, ref, args, f"{name} G={g} M={m} default")
        results = [] if args.default_only else time_configs(candidate_configs(m, k), run, ref, args,
                                                            f"{name} G={g} M={m}")
        row = dict(shape=name, N=n, K=k, group_size=g, M=m, int4_bytes=q0.nbytes, bf16_bytes=n * k * 2,
                   int4_copies=len(qws), cublas_bf16_us=cublas_us, twin_us=twin_us,
                   default=_plain(default_res[0]) if default_res else None,
                   configs=[_plain(r) for r in results])
        best = min(default_res + results, key=lambda r: r["us"], default=None)
        if best is not None:
            row["best"] = _plain(best)

        def frac(us):
            return q0.nbytes / (us * 1e-6) / bw

        print(f"\n{name} N={n} K={k} G={g} M={m}: int4 {q0.nbytes / 1e6:.1f} MB x{len(qws)}; "
              f"cuBLAS bf16 {cublas_us:8.1f} us; twin {twin_us:8.1f} us", flush=True)
        for label, r in [("default", default_res[0] if default_res else None)] + [("", r) for r in
                                                                                 results[:args.top]]:
            if r is not None:
                print(f"  {label:7s} {cfg_str(r['cfg'])}: {r['us']:8.1f} us ({frac(r['us']):.2f} of copy bw, "
                      f"{cublas_us / r['us']:.2f}x cuBLAS) err {r['max_err']:.3g}")
        rows.append(row)
    qws.clear()
    wts.clear()
    torch.cuda.empty_cache()
    return rows


def print_summary(rows: list[dict], bw: float) -> None:
    print(f"\n{'shape':8s} {'G':>5s} {'M':>5s} {'cuBLAS':>8s} {'twin':>8s} {'default':>8s} {'best':>8s} "
          f"{'best/bw':>7s} {'x cuBLAS':>8s}  best config")
    for r in rows:
        d, b = r.get("default"), r.get("best")
        d_us = d["us"] if d else math.nan
        b_us = b["us"] if b else math.nan
        c = b["config"] if b else None
        bstr = (f"{c['block_m']}x{c['block_n']}x{c['block_k']} w={c['num_warps']} s={c['num_stages']} "
                f"split={c['split_k']} siw={c['scale_in_weight']}" if c else "-")
        print(f"{r['shape']:8s} {r['group_size']:5d} {r['M']:5d} {r['cublas_bf16_us']:8.1f} "
              f"{r['twin_us']:8.1f} {d_us:8.1f} {b_us:8.1f} {r['int4_bytes'] / (b_us * 1e-6) / bw:7.2f} "
              f"{r['cublas_bf16_us'] / b_us:8.2f}  {bstr}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--ms", default="1,4,16,64,256,2048", help="token counts M")
    ap.add_argument("--group-sizes", default="128,0", help="comma list; 0 = per-channel (G = K)")
    ap.add_argument("--calls", type=int, default=20, help="calls per CUDA graph")
    ap.add_argument("--twin-calls", type=int, default=2, help="calls per CUDA graph for the torch twin")
    ap.add_argument("--reps", type=int, default=3, help="timed graph replays")
    ap.add_argument("--top", type=int, default=4, help="configs printed per case")
    ap.add_argument("--default-only", action="store_true", help="time the default config only (no grid)")
    ap.add_argument("--no-twin", action="store_true", help="skip timing the torch twin")
    ap.add_argument("--out", default="benchmarks/out/w4a16_sweep.json")
    args = ap.parse_args()
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    for s in shapes:
        if s not in SHAPES:
            ap.error(f"unknown shape {s!r}; choose from {', '.join(SHAPES)}")
    ms = [int(v) for v in args.ms.split(",")]
    group_sizes = [int(v) for v in args.group_sizes.split(",")]
    if any(m < 1 for m in ms):
        ap.error("--ms: each M must be >= 1")
    if not torch.cuda.is_available():
        sys.exit("w4a16_sweep.py times CUDA kernels; no CUDA device here.")

    t0 = time.time()
    bw = measure_copy_bandwidth()
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    print(f"{props.name}: copy bandwidth {bw / 1e12:.2f} TB/s (read + write), L2 {l2 / 1e6:.0f} MB",
          flush=True)
    rows = []
    for s in shapes:
        n, k = SHAPES[s]
        for g in group_sizes:
            if g and (k % g or g & (g - 1) or g < 16):
                print(f"skip {s} G={g}: not a power of two >= 16 dividing K = {k}")
                continue
            rows += sweep_case(s, n, k, g, ms, args, bw, l2, torch.device("cuda"))
    print_summary(rows, bw)
    print(f"\nsweep took {time.time() - t0:.0f} s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(device=props.name, copy_bandwidth_bytes_s=bw, l2_bytes=l2,
                                              calls_per_graph=args.calls, rows=rows), indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
