"""The fused LoRA consumers at decode sizes, timed back to back as a model step runs them.

    python benchmarks/sweeps/lora_decode_sweep.py [--tokens 64,128] [--adapters 1,16,64]

Per decode step of T tokens spread over ``--adapters`` adapters (rank 16, bf16, Llama-3-8B
widths), the three kernels that consume a decode step's shrink: the gate/up update inside
SiLU-and-mul (``kernels.lora_expand_silu_mul``), the o/down update inside add + RMSNorm
(``kernels.lora_expand_norm``, per-row programs) and the q/k/v update inside rotary + KV write
(``kernels.lora_rotary_write_kv``), each over its launch-config candidates, against its default
config, the plain kernel and the unfused pair (expand, then the plain kernel).

Timing: one CUDA graph of N back-to-back calls, each on its own copy of the inputs (enough copies
to exceed L2, as a model step streams 32 layers' adapters), replayed; microseconds per call.
Unlike ``lora_prefill_sweep.py``'s cold single calls (an L2 flush, then one launch), this keeps
the launch latency overlapped with the previous call's tail, as inside a decode graph; the two
rank configs differently (e.g. the SiLU-and-mul fusion's per-token 512 x 4 column programs, 64
tokens over 64 adapters: cold the best, back to back 27.2 us against 21.1 for 512 x 2, and in the
engine's decode graph 26.5 against 20.2). Neither predicts everything: the add + RMSNorm fusion
with 8 warps is faster here than with 16 and slower in the engine (benchmarks/RESULTS.md), so
what changes a default is checked with ``profile_step.py`` and ``multi_lora.py``.

Writes JSON (default benchmarks/out/lora_decode_sweep.json). CUDA only.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benchmarks.sweeps.kernel_timing import time_graph_calls  # noqa: E402

HIDDEN, INTER, RANK = 4096, 14336, 16
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
L2_BYTES = 160 << 20
"""Inputs cycled through per graph replay: at least this many bytes (> 3x an H200's L2)."""


def _meta(num_tokens: int, num_adapters: int):
    """As a decode graph builds it: a fixed grid over max(16, adapters) slots."""
    from kernels.lora_meta import build_lora_kernel_meta

    slots = (torch.arange(num_tokens, device="cuda") * num_adapters // num_tokens).to(torch.int32)
    return build_lora_kernel_meta(slots, max(16, num_adapters), fixed_grid=True)


def _copies(nbytes: int) -> int:
    return max(4, min(64, -(-L2_BYTES // max(1, nbytes))))


def _timed(label: str, make, copies: int) -> float:
    """us per call of make(i) (i: the input copy), back to back in one graph."""
    try:
        return time_graph_calls(make, calls=copies, reps=10)
    except Exception as e:                                          # e.g. out of shared memory
        print(f"  {label}: {type(e).__name__}: {str(e)[:120]}")
        return float("inf")


def sweep_silu_mul(num_tokens: int, num_adapters: int) -> dict:
    from kernels.layer_ops import silu_and_mul
    from kernels.lora_expand import LoRAExpandConfig, lora_expand
    from kernels.lora_expand_silu_mul import lora_expand_silu_mul, lora_expand_silu_mul_config

    meta = _meta(num_tokens, num_adapters)
    slots = meta.max_loras
    per_copy = 2 * num_adapters * INTER * RANK * 2 + num_tokens * 3 * INTER * 2
    n = _copies(per_copy)
    bufs = [torch.randn(2, 1, num_tokens, RANK, device="cuda") for _ in range(n)]
    bs = [[torch.randn(slots, INTER, RANK, device="cuda", dtype=torch.bfloat16) * 0.1 for _ in range(2)]
          for _ in range(n)]
    ys = [torch.randn(num_tokens, 2 * INTER, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
    yps = [y.clone() for y in ys]                       # the pair's expand adds into its y
    act = torch.empty(num_tokens, INTER, device="cuda", dtype=torch.bfloat16)
    default = lora_expand_silu_mul_config(num_tokens, meta.num_active, INTER, torch.device("cuda"))
    lora_expand_silu_mul(bufs[0], bs[0], meta, ys[0], act, config=default)
    want = act.clone()
    times = {"plain": _timed("plain", lambda i: silu_and_mul(ys[i], act), n),
             "pair": _timed("pair", lambda i: (lora_expand(bufs[i], bs[i], meta, yps[i], [0, INTER]),
                                               silu_and_mul(yps[i], act)), n)}
    cands = [LoRAExpandConfig(16, bn, nt, nw, ns, per_token=1) for bn, nt, nw, ns in itertools.product(
        (128, 256, 512), (1, 2, 4), (2, 4, 8), (1, 2))]
    cands += [LoRAExpandConfig(16, bn, nt, nw, 2) for bn, nt, nw in itertools.product((64, 128, 256), (1, 2, 4), (2, 4))]
    best = None
    for cfg in [default] + cands:
        lora_expand_silu_mul(bufs[0], bs[0], meta, ys[0], act, config=cfg)
        if not torch.allclose(act.float(), want.float(), atol=5e-2, rtol=2e-2):
            print(f"  silu_mul {cfg} disagrees with the default config: skipped")
            continue
        t = _timed(str(cfg), lambda i, cfg=cfg: lora_expand_silu_mul(bufs[i], bs[i], meta, ys[i], act, config=cfg), n)
        times[_name(cfg)] = t
        if best is None or t < best[0]:
            best = (t, cfg)
    return {"kernel": "lora_expand_silu_mul", "tokens": num_tokens, "adapters": num_adapters,
            "default": _name(default), "default_us": times[_name(default)], "best": _name(best[1]),
            "best_us": best[0], "us": times}


def _name(cfg) -> str:
    return ",".join(f"{k}={v}" for k, v in dataclasses.asdict(cfg).items())


def sweep_norm(num_tokens: int, num_adapters: int) -> dict:
    from kernels.layer_ops import add_rms_norm
    from kernels.lora_expand import lora_expand
    from kernels.lora_expand_norm import lora_expand_add_rms_norm

    meta = _meta(num_tokens, num_adapters)
    per_copy = num_adapters * HIDDEN * RANK * 2 + num_tokens * HIDDEN * 2 * 3
    n = _copies(per_copy)
    bufs = [torch.randn(1, 1, num_tokens, RANK, device="cuda") for _ in range(n)]
    bs = [torch.randn(meta.max_loras, HIDDEN, RANK, device="cuda", dtype=torch.bfloat16) * 0.1 for _ in range(n)]
    xs = [torch.randn(num_tokens, HIDDEN, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
    rs = [torch.randn(num_tokens, HIDDEN, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
    w = torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)
    times = {"plain": _timed("plain", lambda i: add_rms_norm(xs[i], w, 1e-5, residual=rs[i]), n),
             "pair": _timed("pair", lambda i: (lora_expand(bufs[i], [bs[i]], meta, xs[i], [0]),
                                               add_rms_norm(xs[i], w, 1e-5, residual=rs[i])), n),
             "default": _timed("default", lambda i: lora_expand_add_rms_norm(
                 bufs[i], bs[i], meta, xs[i], w, 1e-5, residual=rs[i], tiles=False), n)}
    for chunk, warps in itertools.product((1024, 2048, 4096), (4, 8, 16)):
        times[f"chunk={chunk},num_warps={warps}"] = _timed(f"norm {chunk} {warps}", lambda i, c=chunk, nw=warps: (
            lora_expand_add_rms_norm(bufs[i], bs[i], meta, xs[i], w, 1e-5, residual=rs[i], tiles=False, chunk=c,
                                     num_warps=nw)), n)
    return _result("lora_expand_add_rms_norm", num_tokens, num_adapters, times)


def sweep_rotary(num_tokens: int, num_adapters: int) -> dict:
    from kernels.kv_write import rotary_write_kv
    from kernels.lora_expand import lora_expand
    from kernels.lora_rotary_write_kv import lora_rotary_write_kv

    meta = _meta(num_tokens, num_adapters)
    widths = [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM]
    per_copy = num_adapters * sum(widths) * RANK * 2 + num_tokens * sum(widths) * 2 * 2
    n = _copies(per_copy)
    dev, bf16 = "cuda", torch.bfloat16
    qkvs = [torch.randn(num_tokens, sum(widths), device=dev, dtype=bf16) for _ in range(n)]
    views = [[t.view(num_tokens, -1, HEAD_DIM) for t in qkv.split(widths, -1)] for qkv in qkvs]
    kc = torch.zeros(num_tokens // BLOCK + 1, BLOCK, KV_HEADS, HEAD_DIM, device=dev, dtype=bf16)
    vc = torch.zeros_like(kc)
    slot_mapping = torch.arange(num_tokens, device=dev)
    pos = torch.arange(num_tokens, device=dev) + 512
    inv = 1.0 / (500000.0 ** (torch.arange(0, HEAD_DIM, 2, device=dev).float() / HEAD_DIM))
    ang = torch.arange(4096, device=dev).float()[:, None] * inv[None, :]
    cos, sin = ang.cos(), ang.sin()
    bufs = [torch.randn(3, 1, num_tokens, RANK, device=dev) for _ in range(n)]
    bss = [[torch.randn(meta.max_loras, wd, RANK, device=dev, dtype=bf16) * 0.1 for wd in widths] for _ in range(n)]

    def fused(i, warps=2):
        q, k, v = views[i]
        lora_rotary_write_kv(pos, q, k, v, cos, sin, HEAD_DIM, kc, vc, slot_mapping, bufs[i], bss[i],
                             meta.token_lora_slots, num_warps=warps)

    def plain(i):
        q, k, v = views[i]
        rotary_write_kv(pos, q, k, v, cos, sin, HEAD_DIM, kc, vc, slot_mapping)

    times = {"plain": _timed("plain", plain, n),
             "pair": _timed("pair", lambda i: (lora_expand(bufs[i], bss[i], meta, qkvs[i],
                                                           [0, widths[0], widths[0] + widths[1]]), plain(i)), n),
             "default": _timed("default", fused, n)}
    for warps in (1, 2, 4, 8):
        times[f"num_warps={warps}"] = _timed(f"rotary {warps}", lambda i, nw=warps: fused(i, nw), n)
    return _result("lora_rotary_write_kv", num_tokens, num_adapters, times)


def _result(kernel: str, num_tokens: int, num_adapters: int, times: dict) -> dict:
    cands = {k: v for k, v in times.items() if k not in ("plain", "pair")}
    best = min(cands, key=cands.get)
    return {"kernel": kernel, "tokens": num_tokens, "adapters": num_adapters, "default": "default",
            "default_us": times["default"], "best": best, "best_us": times[best], "us": times}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="64,128")
    ap.add_argument("--adapters", default="1,16,64")
    ap.add_argument("--kernels", default="silu_mul,norm,rotary")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out/lora_decode_sweep.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA: nothing measured.")
        return 0
    sweeps = {"silu_mul": sweep_silu_mul, "norm": sweep_norm, "rotary": sweep_rotary}
    results = []
    print(f"{'kernel':26s} {'T':>4s} {'ad':>3s} {'plain':>6s} {'pair':>6s} {'default':>8s} {'best':>6s}  best config; "
          "runner-up configs")
    for t, a, k in itertools.product([int(v) for v in args.tokens.split(",")],
                                     [int(v) for v in args.adapters.split(",")], args.kernels.split(",")):
        r = sweeps[k](t, a)
        results.append(r)
        us = r["us"]
        runners = sorted((v, name) for name, v in us.items() if name not in ("plain", "pair", r["best"]))[:3]
        print(f"{r['kernel']:26s} {t:4d} {a:3d} {us['plain']:6.1f} {us['pair']:6.1f} {r['default_us']:8.1f} "
              f"{r['best_us']:6.1f}  {r['best']}; " + "; ".join(f"{name} {v:.1f}" for v, name in runners), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
