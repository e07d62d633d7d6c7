"""MoE decode sweep: ``kernels.fused_moe_decode`` (each pair reads its expert, no sort) against the sorted
grouped GEMMs of ``kernels.fused_moe`` and the bytes floor of the experts a step selects.

Example (H200; Qwen3-30B-A3B MoE layer: hidden 2048, 128 experts, top-8, moe_intermediate 768, bf16):
    python benchmarks/sweeps/moe_decode_sweep.py
    python benchmarks/sweeps/moe_decode_sweep.py --tokens 1,8 --no-grid --out /tmp/moe.json
    python benchmarks/sweeps/moe_decode_sweep.py --tiny        # CPU: small shapes through the Triton interpreter

Per token count T (default 1, 4, 8, 16, 64), each path is timed from a CUDA graph of --calls
back-to-back calls; call i routes by its own random logits (softmax, top-k, renormalised) and reads
weight copy i % 2, so consecutive calls select other experts of another copy and the weights come
from HBM as in a 48-layer step. Timed:

- ``sorted``: ``fused_moe_triton`` with its default config (the engine's path above
  ``KernelPolicy.moe_decode_max_pairs`` pairs).
- ``decode``: ``fused_moe_decode_triton`` with its default config, then (without --no-grid) each
  launch's candidate grid (block_n, block_k, num_warps; tl.dot and elementwise forms) with the other
  launch at its default, and the best of each launch together (``decode_best``).

The floor is the bytes of the selected experts, mean over the calls' routings: unique experts x 3 x
hidden x intermediate x 2 bytes (1 with ``--fp8 channel|block``: e4m3 experts with per-channel or 128 x 128
block scales), at --peak-tbs (H200: 4.8 TB/s). Every path's output is checked once
against ``engine.layers.moe.fused_moe_ref`` (max error relative to the reference's max, in the JSON).
Prints a table (us per call) and writes JSON (default ``benchmarks/out/moe_decode_sweep[_tiny].json``).

``--tiny`` runs small shapes and a two-candidate grid on the CPU through the Triton interpreter (wall
clock: it checks that every path runs and matches its twin, not speed) or on CUDA where there is one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benchmarks.sweeps.fp8_sweep import rel_err  # noqa: E402
from benchmarks.sweeps.kernel_timing import measure_copy_bandwidth, time_calls  # noqa: E402

QWEN3_30B_A3B = dict(hidden=2048, experts=128, top_k=8, intermediate=768)
"""One Qwen3-30B-A3B MoE layer (``Qwen3MoeForCausalLM``: 48 of them)."""
TINY = dict(hidden=80, experts=8, top_k=2, intermediate=40)
"""``--tiny``: a layer the interpreter runs in seconds (80 and 40: tails of the 64-wide tiles)."""
WEIGHT_COPIES = 2
"""Distinct copies of the layer's experts, alternated call by call (each copy > L2 on an H200)."""


def candidate_launches(tiny: bool) -> list:
    """``MoEDecodeLaunch`` grid of one launch: tl.dot (block_n >= 16, 26 tiles) and elementwise forms (4 warps,
    12 tiles whose [block_n, block_k] float32 accumulators, two in gate|up, stay <= 64 registers per thread
    each)."""
    from kernels.fused_moe_decode import MoEDecodeLaunch

    if tiny:
        return [MoEDecodeLaunch(16, 32, 4, 1, 1), MoEDecodeLaunch(8, 64, 4, 1, 0)]
    out = [MoEDecodeLaunch(bn, bk, nw, 3, 1) for bn in (16, 32, 64) for bk in (128, 256, 512) for nw in (2, 4, 8)
           if not (bn == 64 and bk == 512 and nw == 2)]
    out += [MoEDecodeLaunch(bn, bk, 4, 3, 0) for bn in (4, 8, 16, 32) for bk in (64, 128, 256)]
    return out


def routings(T: int, shape: dict, calls: int, device: torch.device) -> list:
    """``calls`` (topk_weights [T, K] float32, topk_ids [T, K]) of random logits, renormalised top-k."""
    from engine.layers.moe import select_experts

    g = torch.Generator().manual_seed(T)
    return [select_experts(torch.randn(T, shape["experts"], generator=g).to(device), shape["top_k"], True)
            for _ in range(calls)]


FP8_BLOCK = (128, 128)
"""``--fp8 block``: the scale blocks of the Qwen3-MoE FP8 releases."""


def make_weights(shape: dict, device: torch.device, fp8: str = "none") -> list:
    """``WEIGHT_COPIES`` (w13 [E, 2I, H], w2 [E, H, I], FP8 scales keywords) in bfloat16, scaled as a trained
    layer's; ``fp8`` "channel" / "block": e4m3 weights with per-channel / 128 x 128 block scales
    (``engine.layers.fp8_experts.Fp8Experts``) and the kernels' scale keywords (else {})."""
    from engine.layers.fp8_experts import Fp8Experts

    E, H, I = shape["experts"], shape["hidden"], shape["intermediate"]
    out = []
    for _ in range(WEIGHT_COPIES):
        w13 = torch.randn(E, 2 * I, H, device=device, dtype=torch.bfloat16).mul_(H ** -0.5)
        w2 = torch.randn(E, H, I, device=device, dtype=torch.bfloat16).mul_(I ** -0.5)
        if fp8 == "none":
            out.append((w13, w2, {}))
            continue
        experts = Fp8Experts.from_float(w13, w2, FP8_BLOCK if fp8 == "block" else None)
        out.append((experts.w13, experts.w2, experts.kernel_scales()))
    return out


def reference_weights(weights: tuple) -> tuple:
    """(w13, w2) in bfloat16 of one ``make_weights`` copy (FP8: dequantized), for ``fused_moe_ref``."""
    from engine.layers.fp8_experts import Fp8Experts

    w13, w2, scales = weights
    if not scales:
        return w13, w2
    return Fp8Experts(w13, w2, scales["w13_scale"], scales["w2_scale"], scales["scale_block"]).dequantize(
        torch.bfloat16)


def sweep_tokens(T: int, shape: dict, weights: list, args) -> dict:
    """One token count: the floor, the sorted path, the decode path's default and grid."""
    from engine.layers.moe import fused_moe_ref
    from kernels.fused_moe import fused_moe_triton
    from kernels.fused_moe_decode import MoEDecodeConfig, fused_moe_decode_triton, moe_decode_config

    H, I, K = shape["hidden"], shape["intermediate"], shape["top_k"]
    x = torch.randn(T, H, device=args.device, dtype=torch.bfloat16)                    # [T, H]
    routes = routings(T, shape, args.calls, args.device)
    unique = sum(int(ids.unique().numel()) for _, ids in routes) / len(routes)
    weight_bytes = 1 if args.fp8 != "none" else 2
    floor_us = unique * 3 * H * I * weight_bytes / (args.peak_tbs * 1e12) * 1e6
    ref = fused_moe_ref(x, *reference_weights(weights[0]), *routes[0])

    def sorted_call(i):
        w13, w2, scales = weights[i % WEIGHT_COPIES]
        return fused_moe_triton(x, w13, w2, *routes[i % len(routes)], **scales)

    def decode_call(config):
        def call(i):
            w13, w2, scales = weights[i % WEIGHT_COPIES]
            return fused_moe_decode_triton(x, w13, w2, *routes[i % len(routes)], config=config, **scales)
        return call

    default = moe_decode_config(T, H, I, K, args.device, fp8=args.fp8 != "none")
    row = dict(tokens=T, pairs=T * K, unique_experts=unique, floor_us=floor_us,
               sorted=dict(us=time_calls(sorted_call, args.calls, args.reps), err=rel_err(sorted_call(0), ref)),
               decode=dict(config=dataclasses.asdict(default), us=time_calls(decode_call(default), args.calls, args.reps),
                           err=rel_err(decode_call(default)(0), ref)))
    if args.no_grid:
        return row
    best = {}                                                   # stage -> its fastest MoEDecodeLaunch
    for stage in ("gate_up", "down"):
        results, launches = [], []
        for launch in candidate_launches(args.tiny):
            cfg = dataclasses.replace(default, **{stage: launch})
            try:
                err = rel_err(decode_call(cfg)(0), ref)
                us = time_calls(decode_call(cfg), args.calls, args.reps)
            except Exception as e:                                          # shared memory, registers
                print(f"    T={T} {stage} {launch}: {type(e).__name__}: {str(e)[:100]}", flush=True)
                continue
            results.append(dict(launch=dataclasses.asdict(launch), us=us, err=err))
            launches.append(launch)
        order = sorted(range(len(results)), key=lambda j: results[j]["us"])
        row[f"{stage}_grid"] = [results[j] for j in order]
        best[stage] = launches[order[0]] if order else getattr(default, stage)
    cfg = MoEDecodeConfig(**best)
    row["decode_best"] = dict(config=dataclasses.asdict(cfg), us=time_calls(decode_call(cfg), args.calls, args.reps),
                              err=rel_err(decode_call(cfg)(0), ref))
    return row


def launch_str(launch: dict) -> str:
    return (f"bn={launch['block_n']} bk={launch['block_k']} w={launch['num_warps']} "
            f"{'dot' if launch['use_dot'] else 'ew'}")


def print_table(rows: list) -> None:
    print(f"{'T':>4} {'pairs':>5} {'experts':>7} {'floor us':>8} {'sorted us':>9} {'decode us':>9} "
          f"{'best us':>8} {'floor/best':>10} {'max err':>8}  best gate_up | best down")
    for r in rows:
        best = r.get("decode_best", r["decode"])
        err = max(r["sorted"]["err"], r["decode"]["err"], best["err"])
        cfg = best["config"]
        print(f"{r['tokens']:>4} {r['pairs']:>5} {r['unique_experts']:>7.1f} {r['floor_us']:>8.2f} "
              f"{r['sorted']['us']:>9.1f} {r['decode']['us']:>9.1f} {best['us']:>8.1f} "
              f"{r['floor_us'] / best['us']:>10.2f} {err:>8.1e}  "
              f"{launch_str(cfg['gate_up'])} | {launch_str(cfg['down'])}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,4,8,16,64", help="token counts T of the decode step")
    ap.add_argument("--calls", type=int, default=10, help="calls per CUDA graph (each its own routing)")
    ap.add_argument("--reps", type=int, default=5, help="timed graph replays")
    ap.add_argument("--no-grid", action="store_true", help="default configs only (no candidate grid)")
    ap.add_argument("--peak-tbs", type=float, default=4.8, help="HBM TB/s of the bytes floor (H200: 4.8)")
    ap.add_argument("--tiny", action="store_true",
                    help="small shapes, T 1,4,8, a two-candidate grid; runs on CPU through the Triton interpreter")
    ap.add_argument("--fp8", choices=("none", "channel", "block"), default="none",
                    help="FP8 experts: per-channel or 128 x 128 block scales (floor at 1 byte per weight)")
    ap.add_argument("--out", default=None,
                    help="JSON path (default benchmarks/out/moe_decode_sweep[_fp8_FP8][_tiny].json)")
    args = ap.parse_args()
    shape = TINY if args.tiny else QWEN3_30B_A3B
    if args.tiny:
        if args.tokens == ap.get_default("tokens"):
            args.tokens = "1,4,8"
        args.calls, args.reps = 1, 1
    tokens = [int(v) for v in args.tokens.split(",")]
    if not tokens or min(tokens) < 1:
        ap.error("--tokens: comma list of token counts >= 1")
    fp8_tag = "" if args.fp8 == "none" else f"_fp8_{args.fp8}"
    out_path = args.out or f"benchmarks/out/moe_decode_sweep{fp8_tag}{'_tiny' if args.tiny else ''}.json"
    if not torch.cuda.is_available():
        if not args.tiny:
            sys.exit("moe_decode_sweep.py times CUDA kernels; no CUDA device here (--tiny runs on CPU).")
        os.environ["TRITON_INTERPRET"] = "1"           # before anything imports triton
    args.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    t0 = time.time()
    bw = measure_copy_bandwidth()
    device_name = torch.cuda.get_device_name(0) if args.device.type == "cuda" else "cpu (Triton interpreter)"
    print(f"{device_name}: copy bandwidth {bw / 1e12:.2f} TB/s; layer {shape}, fp8 {args.fp8}; bytes floor at "
          f"{args.peak_tbs} TB/s; "
          f"torch {torch.__version__}", flush=True)
    weights = make_weights(shape, args.device, args.fp8)
    rows = []
    for T in tokens:
        rows.append(sweep_tokens(T, shape, weights, args))
        print(f"  T={T} done ({time.time() - t0:.0f} s)", flush=True)
    print_table(rows)
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    Path(out_path).write_text(json.dumps(dict(device=device_name, copy_bandwidth_bytes_per_s=bw, shape=shape, fp8=args.fp8,
                                              peak_tbs=args.peak_tbs, calls=args.calls, reps=args.reps,
                                              rows=rows), indent=1))
    print(f"wrote {out_path} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
