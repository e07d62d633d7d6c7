"""One adapted projection at a decode step: cuBLAS alone, the split LoRA path, and ``kernels.gemm_lora`` configs.

Example (H200; Llama-3-8B projections, bf16, 64 tokens, rank 16, 64 slots):
    python benchmarks/gemm_lora_sweep.py --out /tmp/gemm_lora.json

Per projection (qkv, o, down) and adapter count (16: a fixed grid over 16 segments, as the
engine's few-adapter decode graphs; 64: over all 64 slots), each case is timed from a CUDA graph of
calls cycling through base-weight copies larger than the L2 (``benchmarks.kernel_timing``), through
``engine.layers.linear.Linear`` with its ``lora.layers.LinearLoRASlots`` hook as the engine runs it:

- ``cublas``: the base GEMM alone (the LoRA-off engine);
- ``split``: the split path (shrink on the side stream beside cuBLAS, then the expand);
- ``gemm <config>``: ``gemm_lora`` with each candidate config, and ``gemm base rows`` (the
  default config on a step whose rows all run the base model: the GEMM and the handshake only).

Prints a table (us per call) and the config with the least summed time at 16 adapters, and
writes JSON (with that config as a CHORUS_LORA_GEMM_CONFIG string).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.gemv_sweep import weight_copies, write_json  # noqa: E402
from benchmarks.kernel_timing import time_graph_calls  # noqa: E402

SHAPES = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "down": (14336, (4096,))}
"""name -> (input dim, output slices) of Llama-3-8B's adapted projections that take gemm_lora."""

CANDIDATES = [
    {},
    {"num_warps": 8},
    {"lora_chunk": 8},
    {"block_n": 32},
    {"shrink_k": 256},
    {"shrink_programs": 64},
    {"block_k": 64, "num_stages": 6},
    {"num_warps": 8, "block_n": 32},
]
"""``GemmLoRAConfig`` overrides tried on top of the default."""


def cfg_str(over: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in over.items()) or "default"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default="benchmarks/out/gemm_lora_sweep.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gemm_lora_sweep.py times CUDA kernels; no CUDA device here.")
    from engine.layers.linear import Linear
    from kernels.lora_meta import build_lora_kernel_meta
    from lora.batch import LoRABatch, LoRABatchState
    from lora.layers import LinearLoRASlots

    dev, dtype, max_loras, rank, t = torch.device("cuda"), torch.bfloat16, 64, 16, args.tokens
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    for name, (in_dim, outs) in SHAPES.items():
        ws = weight_copies(sum(outs), in_dim, l2)
        state = LoRABatchState()
        layer = LinearLoRASlots(in_dim, list(outs), max_loras, rank, dtype, dev, state, "triton")
        layer.lora_a.normal_(0, in_dim ** -0.5)
        for b in layer.lora_b:
            b.normal_(0, rank ** -0.5)
        lin = Linear(in_dim, list(outs)).to(dev, dtype)
        lin.lora = layer
        x = torch.randn(t, in_dim, device=dev, dtype=dtype)
        base_overrides = layer.overrides

        def run(i: int) -> torch.Tensor:
            lin.weight.data = ws[i % len(ws)]
            return lin(x)

        def timed(gemm_max: int, over: dict) -> float:
            layer.gemm_max_tokens = gemm_max
            layer.overrides = dataclasses.replace(base_overrides, gemm=tuple(sorted(over.items())))
            return time_graph_calls(run, args.calls, args.reps)

        for adapters in (16, 64):
            slots = torch.arange(t, device=dev, dtype=torch.int32) % adapters
            meta = build_lora_kernel_meta(slots, max_loras, fixed_grid=True)
            if adapters <= 16:
                meta = dataclasses.replace(meta, num_active=16)
            state.batch = LoRABatch(meta=meta, segments=[], slot_bound=meta.active_slots.numel())
            res = {"split": timed(0, {})}
            for over in CANDIDATES:
                try:
                    res[f"gemm {cfg_str(over)}"] = timed(t, over)
                except Exception as e:   # a config the compiler rejects (shared memory, registers)
                    print(f"{name} {adapters} adapters {cfg_str(over)}: {type(e).__name__}: {e}"[:200])
            base_meta = build_lora_kernel_meta(torch.full_like(slots, -1), max_loras, fixed_grid=True)
            state.batch = LoRABatch(meta=dataclasses.replace(base_meta, num_active=16), segments=[], slot_bound=16)
            res["gemm base rows"] = timed(t, {})
            state.batch = None
            res["cublas"] = time_graph_calls(lambda i: torch.nn.functional.linear(x, ws[i % len(ws)]),
                                             args.calls, args.reps)
            print(f"\n{name} (K={in_dim}, N={sum(outs)}), {t} tokens, {adapters} adapters: us per call")
            for k, v in sorted(res.items(), key=lambda kv: kv[1]):
                print(f"  {k:40s} {v:7.1f}")
            rows.append(dict(shape=name, adapters=adapters, tokens=t, us=res))
        ws.clear()
        torch.cuda.empty_cache()
    totals = {}
    for r in (r for r in rows if r["adapters"] == 16):
        for k, v in r["us"].items():
            totals[k] = totals.get(k, 0.0) + v
    print("\nsum over qkv + o + down at 16 adapters (x32 layers = per step):")
    for k, v in sorted(totals.items(), key=lambda kv: kv[1]):
        print(f"  {k:40s} {v:7.1f} us  ({32 * v / 1e3:.2f} ms/step)")
    gemms = {k: v for k, v in totals.items() if k.startswith("gemm ") and k != "gemm base rows"}
    best = min(gemms, key=gemms.get).removeprefix("gemm ") if gemms else "default"
    print(f"best gemm_lora config: {best}")
    write_json(args.out, torch.cuda.get_device_properties(0), 0.0, l2, args.calls, rows, totals=totals,
               best=("" if best == "default" else best))


if __name__ == "__main__":
    main()
