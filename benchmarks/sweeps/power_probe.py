"""Board power and SM clock per decode-step workload: which part of a batch-256 step spends the energy.

Example (H200; Llama-3-8B shapes, bf16, batch 256, 534-token contexts):
    python benchmarks/sweeps/power_probe.py --seconds 3

Why: a batch-256 decode step runs at the board's power cap (benchmarks/RESULTS.md), so its
time is its energy over the cap. This script replays each workload from a CUDA graph for a few
seconds while ``nvidia-smi`` samples board power and SM clock every 50 ms, and reports time per
call, mean power and energy per call (power x time) for: one layer's decode attention (the default
tiles and the candidates in ``--attn-configs``), one layer's GEMMs at M = batch (weights of
``--gemm-layers`` layers cycled so L2 cannot hold them), a device-to-device copy, and the idle board.
Prints a table; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benchmarks.sweeps.kernel_timing import capture_calls  # noqa: E402

QUERY = "power.draw.instant,clocks.sm"


def _sampler() -> subprocess.Popen:
    return subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "50"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def _samples(proc: subprocess.Popen) -> list[tuple[float, float]]:
    proc.terminate()
    out, _ = proc.communicate(timeout=10)
    rows = []
    for line in out.splitlines():
        try:
            watts, mhz = (float(x) for x in line.split(","))
        except ValueError:
            continue
        rows.append((watts, mhz))
    return rows


def _median(xs: list[float]) -> float:
    return float(torch.tensor(xs).median()) if xs else float("nan")


def probe(name: str, fn: Callable[[int], object], calls: int, seconds: float) -> dict:
    """Replay a graph of ``calls`` calls of fn(i) for ``seconds``; power / clock from the middle 80%."""
    graph = capture_calls(fn, calls)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    proc = _sampler()
    time.sleep(0.3)
    t0 = time.perf_counter()
    start.record()
    replays = 0
    while time.perf_counter() - t0 < seconds:
        for _ in range(8):
            graph.replay()
        replays += 8
        torch.cuda.synchronize()
    stop.record()
    torch.cuda.synchronize()
    samples = _samples(proc)
    cut = len(samples) // 10
    steady = samples[cut + 6:len(samples) - cut] or samples      # skip the 0.3 s lead-in
    us = start.elapsed_time(stop) * 1e3 / (replays * calls)
    watts = sum(w for w, _ in steady) / max(len(steady), 1)
    row = dict(workload=name, us_per_call=us, watts=watts, sm_mhz=_median([m for _, m in steady]),
               mj_per_call=watts * us * 1e-3, samples=len(steady))
    print(f"{name:44s} {us:9.1f} us  {watts:6.0f} W  {row['sm_mhz']:6.0f} MHz  {row['mj_per_call']:7.3f} mJ/call")
    del graph
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context-len", type=int, default=534)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--gemm-layers", type=int, default=4)
    ap.add_argument("--attn-configs", default="32/1/3,64/2/3,64/4/2,128/4/2",
                    help="tile_n/num_warps/num_stages candidates besides the default")
    ap.add_argument("--out", default="benchmarks/out/power_probe.json")
    args = ap.parse_args()
    from kernels.paged_attention import paged_attention

    dev, dtype = torch.device("cuda"), torch.bfloat16
    b, ctx, bs, heads, kv_heads, hd = args.batch, args.context_len, 16, 32, 8, 128
    rows = []
    print(f"{'workload':44s} {'time':>12s}  {'power':>7s}  {'clock':>10s}  {'energy':>15s}")
    time.sleep(2.0)
    proc = _sampler()
    time.sleep(args.seconds)
    idle = _samples(proc)
    rows.append(dict(workload="idle", watts=sum(w for w, _ in idle) / max(len(idle), 1),
                     sm_mhz=_median([m for _, m in idle])))
    print(f"{'idle':44s} {'':12s}  {rows[-1]['watts']:6.0f} W  {rows[-1]['sm_mhz']:6.0f} MHz")

    n = 1 << 30
    src = torch.empty(n // 2, dtype=dtype, device=dev).normal_()
    dst = torch.empty_like(src)
    rows.append(probe("copy 1 GiB (HBM only)", lambda i: dst.copy_(src), 4, args.seconds))
    del src, dst

    nblk = (ctx + bs - 1) // bs
    num_blocks = b * nblk + 1
    k_cache = torch.randn(num_blocks, bs, kv_heads, hd, device=dev, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(b, heads, hd, device=dev, dtype=dtype)
    qsl = torch.arange(b + 1, dtype=torch.int32, device=dev)
    seq_lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    bt = torch.randperm(num_blocks - 1, device=dev)[:b * nblk].view(b, nblk).to(torch.int32) + 1
    out = torch.empty_like(q)
    attn = [("default", None)] + [(c, dict(zip(("tile_n", "num_warps", "num_stages"), map(int, c.split("/"))),
                                           heads_per_prog=1)) for c in args.attn_configs.split(",") if c]
    for label, tiles in attn:
        rows.append(probe(f"attention b{b} ctx{ctx} {label}",
                          lambda i, t=tiles: paged_attention(q, k_cache, v_cache, qsl, seq_lens, bt, 1, ctx, 0.088,
                                                             out, decode_tiles=t), 10, args.seconds))
    del k_cache, v_cache

    shapes = dict(qkv=(6144, 4096), o=(4096, 4096), gate_up=(28672, 4096), down=(4096, 14336))
    weights = [{k: torch.randn(nk, device=dev, dtype=dtype) * 0.02 for k, nk in shapes.items()}
               for _ in range(args.gemm_layers)]
    x = {k: torch.randn(b, nk[1], device=dev, dtype=dtype) for k, nk in shapes.items()}
    for name in list(shapes) + ["layer"]:
        names = list(shapes) if name == "layer" else [name]

        def run(i: int, names=names) -> None:
            w = weights[i % len(weights)]
            for k in names:
                torch.nn.functional.linear(x[k], w[k])
        rows.append(probe(f"gemm {name} M={b}", run, 2 * args.gemm_layers, args.seconds))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(batch=b, context_len=ctx, rows=rows), indent=1))


if __name__ == "__main__":
    main()
