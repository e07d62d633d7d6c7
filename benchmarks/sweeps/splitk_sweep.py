"""A decode projection as one batched GEMM over S slices of K (``torch.bmm`` on strided views of
the activation and the [N, K] weight, no copies) whose S partial products a later kernel sums,
against cuBLAS's own pick (``F.linear``; for down_proj at 128-256 rows a split-K GEMM followed by
a separate reduce kernel). The partials come out in bfloat16 or, with ``out_dtype``, float32.

Example (H200, Llama-3-8B down_proj):
    python benchmarks/sweeps/splitk_sweep.py --shapes down --ms 64,128,256 --splits 2,3,4

Each case is timed from a CUDA graph of 10 calls cycling through weight copies of more than 2x
the L2 (weights from HBM, as in a 32-layer step). The summed partials are checked against
``F.linear``. Prints us per call; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.sweeps.gemv_sweep import SHAPES, parse_shapes, weight_copies  # noqa: E402
from benchmarks.sweeps.kernel_timing import time_graph_calls  # noqa: E402


def sliced(x: torch.Tensor, w: torch.Tensor, splits: int, out_dtype) -> torch.Tensor:
    """[S, M, N] partial products of x [M, K] and w [N, K] over S equal slices of K."""
    m, k = x.shape
    n = w.shape[0]
    xs = x.view(m, splits, k // splits).transpose(0, 1)          # [S, M, K/S]
    ws = w.view(n, splits, k // splits).permute(1, 2, 0)         # [S, K/S, N]
    return torch.bmm(xs, ws) if out_dtype is None else torch.bmm(xs, ws, out_dtype=out_dtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="down", help=f"of {','.join(SHAPES)}")
    ap.add_argument("--ms", default="64,128,256", help="token rows")
    ap.add_argument("--splits", default="2,3,4", help="slices of K (each must divide K)")
    ap.add_argument("--out", default="benchmarks/out/splitk_sweep.json")
    args = ap.parse_args()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    print(f"{'shape':8s} {'M':>5s} {'S':>3s} {'cuBLAS us':>9s} {'bmm bf16':>9s} {'+sum':>7s} {'bmm fp32':>9s} "
          f"{'+sum':>7s} {'err bf16':>9s} {'err fp32':>9s}")
    for name in parse_shapes(ap, args.shapes):
        n, k = SHAPES[name]
        wts = weight_copies(n, k, l2)                                   # each [N, K]
        for m in [int(v) for v in args.ms.split(",")]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)  # [M, K]
            ref = F.linear(x, wts[0]).float()
            base = time_graph_calls(lambda i: F.linear(x, wts[i % len(wts)]))
            for s in [int(v) for v in args.splits.split(",")]:
                if k % s:
                    continue
                row = dict(shape=name, n=n, k=k, m=m, splits=s, cublas_us=base)
                for tag, dt in (("bf16", None), ("fp32", torch.float32)):
                    err = (sliced(x, wts[0], s, dt).float().sum(0) - ref).abs().max().item()
                    us = time_graph_calls(lambda i: sliced(x, wts[i % len(wts)], s, dt))
                    us_sum = time_graph_calls(lambda i: sliced(x, wts[i % len(wts)], s, dt).sum(0))
                    row |= {f"bmm_{tag}_us": us, f"bmm_{tag}_sum_us": us_sum, f"err_{tag}": err}
                print(f"{name:8s} {m:5d} {s:3d} {base:9.1f} {row['bmm_bf16_us']:9.1f} {row['bmm_bf16_sum_us']:7.1f} "
                      f"{row['bmm_fp32_us']:9.1f} {row['bmm_fp32_sum_us']:7.1f} {row['err_bf16']:9.4f} "
                      f"{row['err_fp32']:9.4f}", flush=True)
                rows.append(row)
        del wts
        torch.cuda.empty_cache()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows), indent=1))


if __name__ == "__main__":
    main()
