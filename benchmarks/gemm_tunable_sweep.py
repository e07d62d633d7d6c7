"""Decode GEMMs as torch runs them by default (cuBLAS's heuristic pick), with cuBLASLt preferred,
and after PyTorch's TunableOp (``torch.cuda.tunable``) has timed every cuBLAS / cuBLASLt solution
it knows for the shape: how much a per-shape algorithm choice would save over the heuristic.

Example (H200, Llama-3-8B projections at decode batches):
    python benchmarks/gemm_tunable_sweep.py --ms 128,256

Each case is timed from a CUDA graph of 10 calls that cycle through weight copies of more than
2x the L2 (so weights come from HBM, as in a 32-layer step), weights held [N, K] as the engine
holds them (``F.linear``). Prints us per call and TFLOPS per variant, the solution TunableOp
chose, and the max difference to the default's output; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.gemv_sweep import SHAPES, parse_shapes, weight_copies  # noqa: E402
from benchmarks.kernel_timing import time_graph_calls  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qkv,o,gate_up,down,lm_head", help=f"of {','.join(SHAPES)}")
    ap.add_argument("--ms", default="128,256", help="token rows")
    ap.add_argument("--tuning-ms", type=int, default=200, help="TunableOp's time budget per shape")
    ap.add_argument("--out", default="benchmarks/out/gemm_tunable_sweep.json")
    args = ap.parse_args()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    ms = [int(v) for v in args.ms.split(",")]
    cases = []                    # (name, m, x [M, K], weights [N, K] each, default output)
    for name in parse_shapes(ap, args.shapes):
        n, k = SHAPES[name]
        ws = weight_copies(n, k, l2)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cases.append(dict(name=name, n=n, k=k, m=m, x=x, ws=ws, ref=F.linear(x, ws[0])))

    def timed(key: str) -> None:
        for c in cases:
            x, ws = c["x"], c["ws"]
            c[key] = time_graph_calls(lambda i: F.linear(x, ws[i % len(ws)]))
            c[key + "_diff"] = (F.linear(x, ws[0]).float() - c["ref"].float()).abs().max().item()

    timed("default_us")
    torch.backends.cuda.preferred_blas_library("cublaslt")
    timed("cublaslt_us")
    torch.backends.cuda.preferred_blas_library("cublas")
    tunable = torch.cuda.tunable
    tunable.enable(True)
    tunable.tuning_enable(True)
    tunable.set_max_tuning_duration(args.tuning_ms)
    tunable.set_filename(str(Path(args.out).with_suffix(".tunableop.csv")))
    for c in cases:            # tune eagerly (never inside a graph capture)
        F.linear(c["x"], c["ws"][0])
    torch.cuda.synchronize()
    tunable.tuning_enable(False)
    timed("tuned_us")
    results = tunable.get_results()     # ((op signature, params signature, solution, ms), ...)
    tunable.enable(False)

    print(f"{'shape':8s} {'M':>5s} {'default':>8s} {'cublasLt':>8s} {'tuned':>8s}  {'TFLOPS d/lt/t':>15s} "
          f"{'diff':>7s}  solution")
    rows = []
    for c in cases:
        flop = 2 * c["m"] * c["n"] * c["k"]
        sig = f"tn_{c['n']}_{c['m']}_{c['k']}_"     # TunableOp's params: op_N_M_K_ld... (F.linear: C^T = W x^T)
        sol = next((r[2] for r in results if str(r[1]).startswith(sig)), "?")
        tf = [flop / c[key] / 1e6 for key in ("default_us", "cublaslt_us", "tuned_us")]
        print(f"{c['name']:8s} {c['m']:5d} {c['default_us']:8.1f} {c['cublaslt_us']:8.1f} {c['tuned_us']:8.1f}  "
              f"{tf[0]:4.0f}/{tf[1]:4.0f}/{tf[2]:4.0f} {c['tuned_us_diff']:7.4f}  {sol}", flush=True)
        rows.append({key: c[key] for key in ("name", "n", "k", "m", "default_us", "cublaslt_us", "tuned_us",
                                               "cublaslt_us_diff", "tuned_us_diff")} | dict(solution=str(sol)))
    for m in ms:
        tot = {key: sum(r[key] for r in rows if r["m"] == m and r["name"] != "lm_head") for key in
               ("default_us", "cublaslt_us", "tuned_us")}
        print(f"M={m}: one decoder layer's four projections: default {tot['default_us']:.1f} us, "
              f"cublasLt {tot['cublaslt_us']:.1f}, tuned {tot['tuned_us']:.1f} "
              f"(x32 layers: {32 * (tot['default_us'] - tot['tuned_us']):.0f} us saved)")
    print("tunable results:", *results, sep="\n  ")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows,
                                              tunable_results=[list(map(str, r)) for r in results]), indent=1))


if __name__ == "__main__":
    main()
