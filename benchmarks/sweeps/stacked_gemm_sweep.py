"""The decode GEMM with adapter A rows stacked under the base weight, by the number of slots covered.

    python benchmarks/sweeps/stacked_gemm_sweep.py [--tokens 64] [--slots 0,8,16,24,32,48,64]

At decode, ``lora.layers`` runs each adapted projection as one cuBLAS GEMM over the base rows and
the A rows of the slots below the step's bound (16 or max_loras), rank 16 here: qkv 6144 + 48 per
slot, o 4096 + 16, gate_up 28672 + 32, down 4096 + 16 (Llama-3-8B). cuBLAS picks its kernel by
shape, so covering a few more slots than needed can be faster than covering exactly the bound.
Per projection and slot count: microseconds per call, back to back in one CUDA graph over weight
copies larger than L2 (as a 32-layer step streams its weights), against the base GEMM. CUDA only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.sweeps.kernel_timing import time_graph_calls  # noqa: E402

RANK = 16
PROJECTIONS = {"qkv": (6144, 4096, 3), "o": (4096, 4096, 1), "gate_up": (28672, 4096, 2), "down": (4096, 14336, 1)}
"""name: (base rows, in features, slices per slot)."""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="64")
    ap.add_argument("--slots", default="0,8,16,20,24,32,40,48,64")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out/stacked_gemm_sweep.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA: nothing measured.")
        return 0
    slot_counts = [int(s) for s in args.slots.split(",")]
    rows = []
    for m in (int(t) for t in args.tokens.split(",")):
        for name, (base, k, slices) in PROJECTIONS.items():
            n_max = base + max(slot_counts) * slices * RANK
            copies = max(4, -(-(400 << 20) // (n_max * k * 2)))
            ws = [torch.randn(n_max, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            line = []
            for s in slot_counts:
                n = base + s * slices * RANK
                us = time_graph_calls(lambda i, n=n: F.linear(x, ws[i % copies][:n]), calls=copies, reps=10)
                rows.append({"tokens": m, "projection": name, "slots": s, "rows": n, "us": us})
                line.append(f"{s}:{us:.1f}")
            print(f"M={m:4d} {name:8s} " + "  ".join(line), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
