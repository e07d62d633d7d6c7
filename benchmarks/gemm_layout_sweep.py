"""Decode GEMMs with the weight stored as [N, K] (``F.linear``, as the engine holds it) or
transposed to [K, N] (``torch.mm(x, w_t)``): cuBLAS picks its kernel by layout as well as shape,
so the same product can get a different kernel (split-K or not, tile shape) from each.

Example (H200, Llama-3-8B projections at decode batches):
    python benchmarks/gemm_layout_sweep.py --ms 128,256

Each case is timed from a CUDA graph of 10 calls that cycle through weight copies of more than
2x the L2 (so weights come from HBM, as in a 32-layer step); outputs are checked against each
other. Prints us per call and TFLOPS per layout; writes JSON.
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
    ap.add_argument("--out", default="benchmarks/out/gemm_layout_sweep.json")
    args = ap.parse_args()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    print(f"{'shape':8s} {'M':>5s} {'[N,K] us':>9s} {'[K,N] us':>9s} {'TFLOPS':>13s} {'max diff':>9s}")
    for name in parse_shapes(ap, args.shapes):
        n, k = SHAPES[name]
        ws = weight_copies(n, k, l2)                                   # each [N, K]
        wts = [w.t().contiguous() for w in ws]                         # each [K, N]
        for m in [int(v) for v in args.ms.split(",")]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)  # [M, K]
            diff = (F.linear(x, ws[0]).float() - torch.mm(x, wts[0]).float()).abs().max().item()
            nk = time_graph_calls(lambda i: F.linear(x, ws[i % len(ws)]))
            kn = time_graph_calls(lambda i: torch.mm(x, wts[i % len(wts)]))
            flop = 2 * m * n * k
            print(f"{name:8s} {m:5d} {nk:9.1f} {kn:9.1f} {flop / nk / 1e6:6.0f} {flop / kn / 1e6:6.0f} {diff:9.4f}",
                  flush=True)
            rows.append(dict(shape=name, n=n, k=k, m=m, nk_us=nk, kn_us=kn, max_diff=diff))
        del ws, wts
        torch.cuda.empty_cache()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows), indent=1))


if __name__ == "__main__":
    main()
