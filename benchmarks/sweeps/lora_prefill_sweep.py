"""LoRA kernels at prefill sizes: launch-config candidates for the shrink and for the expand fused
into SiLU-and-mul, against their default configs, plain SiLU-and-mul and the copy bandwidth.

    python benchmarks/sweeps/lora_prefill_sweep.py [--tokens 2048,16384] [--adapters 1,16]
    python benchmarks/sweeps/lora_prefill_sweep.py --tokens 64 --adapters 16,64     # decode sizes
    python benchmarks/sweeps/lora_prefill_sweep.py --fused-consumers --tokens 256,16384 --adapters 16,64

At most 256 tokens count as a decode step: the meta is built as the engine's decode graphs build
it (fixed grid over ``max(16, adapters)`` slots), the fused kernel reads ``split_k`` shrink
partials as the decode shrink stores them, and the candidates are decode-sized tiles. (Each call
here is timed cold and alone; at decode sizes ``lora_decode_sweep.py`` times calls back to back, as
a decode graph runs them, and that ranks configs closer to the engine.)

Per token count T (one step's rows, grouped into ``--adapters`` equal segments), rank 16, bf16,
Llama-3-8B widths: the shrink of each projection (qkv: 4096 -> 3 x 16, o: 4096 -> 16, gate_up:
4096 -> 2 x 16, down: 14336 -> 16) over block_m x block_k x split_k x num_warps, and the fused
gate/up expand + SiLU-and-mul (d = 14336) over block_m x block_n x n_tiles x num_warps. Every
candidate is first checked against the default config's output. Prints the default's time, the
best candidate and its time, and each kernel's compulsory-bytes bound; writes JSON
(default benchmarks/out/lora_prefill_sweep.json). CUDA only.
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

from benchmarks.sweeps.kernel_timing import measure_copy_bandwidth, time_graph  # noqa: E402

HIDDEN, INTER, RANK, MAX_LORAS = 4096, 14336, 16, 64
SHRINKS = {"qkv": (HIDDEN, 3), "o": (HIDDEN, 1), "gate_up": (HIDDEN, 2), "down": (INTER, 1)}


DECODE_MAX_TOKENS = 256
"""Steps of at most this many tokens are swept as decode steps (see the module docstring)."""


def _meta(num_tokens: int, num_adapters: int):
    from kernels.lora_meta import build_lora_kernel_meta

    slots = (torch.arange(num_tokens, device="cuda") * num_adapters // num_tokens).to(torch.int32)
    if num_tokens <= DECODE_MAX_TOKENS:   # as a decode graph launches: a fixed grid over the slots
        return build_lora_kernel_meta(slots, max(16, num_adapters), fixed_grid=True)
    return build_lora_kernel_meta(slots, MAX_LORAS)


def _slots(meta) -> int:
    return meta.max_loras


def _time(fn) -> float:
    return time_graph(fn, reps=20)


def sweep_shrink(num_tokens: int, num_adapters: int, bw: float) -> list[dict]:
    from kernels.lora_shrink import LoRAShrinkConfig, lora_shrink, lora_shrink_config
    from kernels.lora_meta import max_split_k

    meta = _meta(num_tokens, num_adapters)
    out = []
    for name, (in_dim, slices) in SHRINKS.items():
        x = torch.randn(num_tokens, in_dim, device="cuda", dtype=torch.bfloat16)
        a = torch.randn(slices, _slots(meta), RANK, in_dim, device="cuda", dtype=torch.bfloat16) / in_dim ** 0.5
        default = lora_shrink_config(num_tokens, meta.num_active, slices, in_dim, x.device)

        def run(cfg):
            buf = torch.empty(slices, cfg.split_k, num_tokens, RANK, device="cuda")
            return buf, (lambda: lora_shrink(x, a, meta, buf, config=cfg))

        buf, fn = run(default)
        fn()
        want = buf.sum(1)
        t_default = _time(fn)
        best = (t_default, default)
        decode = num_tokens <= DECODE_MAX_TOKENS
        grid = (((16,), (64, 128, 256), (2, 4, 8, 16), (2, 4)) if decode
                else ((64, 128), (64, 128), (1, 2, 4), (4, 8)))
        for bm, bk, sk, nw in itertools.product(*grid):
            if sk > max_split_k(num_tokens):
                continue
            cfg = LoRAShrinkConfig(bm, bk, sk, nw, 3)
            buf, fn = run(cfg)
            try:
                fn()
            except Exception as e:                                      # e.g. out of shared memory
                print(f"  shrink {name} {cfg}: {type(e).__name__}")
                continue
            if not torch.allclose(buf.sum(1), want, atol=1e-2, rtol=1e-2):
                raise AssertionError(f"shrink {name} {cfg} disagrees with the default config")
            t = _time(fn)
            if t < best[0]:
                best = (t, cfg)
        nbytes = num_tokens * in_dim * 2 + slices * num_adapters * RANK * in_dim * 2
        out.append({"kernel": "shrink", "layer": name, "tokens": num_tokens, "adapters": num_adapters,
                    "default_us": t_default, "default": dataclasses.asdict(default), "best_us": best[0],
                    "best": dataclasses.asdict(best[1]), "bound_us": nbytes / bw * 1e6})
    return out


def sweep_silu_mul(num_tokens: int, num_adapters: int, bw: float) -> list[dict]:
    from kernels.layer_ops import silu_and_mul
    from kernels.lora_expand import LoRAExpandConfig
    from kernels.lora_expand_silu_mul import lora_expand_silu_mul, lora_expand_silu_mul_config
    from kernels.lora_shrink import lora_shrink_config

    meta = _meta(num_tokens, num_adapters)
    decode = num_tokens <= DECODE_MAX_TOKENS
    split_k = lora_shrink_config(num_tokens, meta.num_active, 2, HIDDEN, torch.device("cuda")).split_k if decode else 1
    buf = torch.randn(2, split_k, num_tokens, RANK, device="cuda") / split_k
    b = [torch.randn(_slots(meta), INTER, RANK, device="cuda", dtype=torch.bfloat16) * 0.1 for _ in range(2)]
    y = torch.randn(num_tokens, 2 * INTER, device="cuda", dtype=torch.bfloat16)
    act = torch.empty(num_tokens, INTER, device="cuda", dtype=torch.bfloat16)
    default = lora_expand_silu_mul_config(num_tokens, meta.num_active, INTER, y.device)
    fn = lambda cfg: (lambda: lora_expand_silu_mul(buf, b, meta, y, act, config=cfg))  # noqa: E731
    fn(default)()
    want = act.clone()
    t_default = _time(fn(default))
    t_plain = _time(lambda: silu_and_mul(y, act))
    best = (t_default, default)
    cands = [LoRAExpandConfig(bm, bn, nt, nw, 2) for bm, bn, nt, nw in itertools.product(
        *(((16,), (64, 128), (2, 4), (4,)) if decode
          else ((16, 32, 64), (64, 128, 256), (1, 2, 4), (4, 8))))]
    if decode:
        cands += _token_candidates(wide=True)
    best, best_token = _best_configs("silu_mul", cands, fn, lambda: act, want, best)
    nbytes = num_tokens * 3 * INTER * 2 + 2 * num_adapters * INTER * RANK * 2
    return [{"kernel": "expand_silu_mul", "layer": "gate_up", "tokens": num_tokens, "adapters": num_adapters,
             "default_us": t_default, "default": dataclasses.asdict(default), "best_us": best[0],
             "best": dataclasses.asdict(best[1]), "plain_silu_mul_us": t_plain, "bound_us": nbytes / bw * 1e6,
             **_token_fields(best_token)}]


def _best_configs(label: str, cands: list, fn, result, want: torch.Tensor, best: tuple, reset=None):
    """(best, best per-token) as (us, config) over ``cands``: each config runs once (after
    ``reset``), its ``result()`` must match ``want`` (the default config's), then it is timed.
    ``best`` starts as the default's (time, config)."""
    best_token = (float("inf"), None)
    for cfg in cands:
        if reset is not None:
            reset()
        try:
            fn(cfg)()
        except Exception as e:                                          # e.g. out of shared memory
            print(f"  {label} {cfg}: {type(e).__name__}")
            continue
        if not torch.allclose(result().float(), want.float(), atol=5e-2, rtol=2e-2):
            raise AssertionError(f"{label} {cfg} disagrees with the default config")
        t = _time(fn(cfg))
        if t < best[0]:
            best = (t, cfg)
        if cfg.per_token and t < best_token[0]:
            best_token = (t, cfg)
    return best, best_token


def _token_candidates(wide: bool = False) -> list:
    """Per-token configs; ``wide`` adds longer programs (the fused SiLU-and-mul's 14336 columns)."""
    from kernels.lora_expand import LoRAExpandConfig

    grid = ((128, 256, 512, 1024), (1, 2, 4, 8), (2, 4, 8)) if wide else ((128, 256, 512), (1, 2, 4), (2, 4))
    return [LoRAExpandConfig(16, bn, nt, nw, 2, per_token=1) for bn, nt, nw in itertools.product(*grid)]


def _token_fields(best_token) -> dict:
    if best_token[1] is None:
        return {}
    return {"best_per_token_us": best_token[0], "best_per_token": dataclasses.asdict(best_token[1])}


EXPANDS = {"qkv": (HIDDEN, 1024, 1024), "o": (HIDDEN,), "down": (HIDDEN,)}


def sweep_expand(num_tokens: int, num_adapters: int, bw: float) -> list[dict]:
    """Decode only: the expand of q/k/v, o and down, segment configs vs per-token configs."""
    from kernels.lora_expand import lora_expand, lora_expand_config
    from kernels.lora_shrink import lora_shrink_config

    meta = _meta(num_tokens, num_adapters)
    out = []
    for name, dims in EXPANDS.items():
        in_dim = INTER if name == "down" else HIDDEN
        split_k = lora_shrink_config(num_tokens, meta.num_active, len(dims), in_dim, torch.device("cuda")).split_k
        buf = torch.randn(len(dims), split_k, num_tokens, RANK, device="cuda") / split_k
        b = [torch.randn(_slots(meta), n, RANK, device="cuda", dtype=torch.bfloat16) * 0.1 for n in dims]
        offs = [sum(dims[:i]) for i in range(len(dims))]
        y0 = torch.randn(num_tokens, sum(dims), device="cuda", dtype=torch.bfloat16)
        y = y0.clone()
        default = lora_expand_config(num_tokens, meta.num_active, dims, y.device)
        fn = lambda cfg: (lambda: lora_expand(buf, b, meta, y, offs, config=cfg))  # noqa: E731
        fn(default)()
        want = y - y0
        t_default = _time(fn(default))
        cands = [dataclasses.replace(default, per_token=0)] + _token_candidates()
        best, best_token = _best_configs(f"expand {name}", cands, fn, lambda: y - y0, want, (t_default, default),
                                         reset=lambda: y.copy_(y0))
        nbytes = 2 * num_tokens * sum(dims) * 2 + num_adapters * sum(dims) * RANK * 2
        out.append({"kernel": "expand", "layer": name, "tokens": num_tokens, "adapters": num_adapters,
                    "default_us": t_default, "default": dataclasses.asdict(default), "best_us": best[0],
                    "best": dataclasses.asdict(best[1]), "bound_us": nbytes / bw * 1e6,
                    **_token_fields(best_token)})
    return out


def sweep_fused_consumers(num_tokens: int, num_adapters: int, bw: float) -> list[dict]:
    """The o/down update inside add + RMSNorm per launch shape (per-row programs up to 4096 tokens,
    segment tiles of 16-64 rows) and the q/k/v update inside rotary + KV write (per-token programs,
    up to 4096 tokens), against the unfused pair (expand, then the plain kernel) and the plain
    kernel alone."""
    from kernels.kv_write import rotary_write_kv
    from kernels.layer_ops import add_rms_norm
    from kernels.lora_expand import lora_expand
    from kernels.lora_expand_norm import lora_expand_add_rms_norm
    from kernels.lora_rotary_write_kv import lora_rotary_write_kv

    meta = _meta(num_tokens, num_adapters)
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    shapes = ([(False, None)] if num_tokens <= 4096 else []) + [(True, bm) for bm in (16, 32, 64) if num_tokens > 128]
    out = []
    # add + RMSNorm after o_proj (hidden 4096)
    buf = torch.randn(1, 1, num_tokens, RANK, device=dev)
    b = torch.randn(_slots(meta), HIDDEN, RANK, device=dev, dtype=bf16) * 0.1
    x = torch.randn(num_tokens, HIDDEN, device=dev, dtype=bf16)
    res = torch.randn(num_tokens, HIDDEN, device=dev, dtype=bf16)
    w = torch.ones(HIDDEN, device=dev, dtype=bf16)
    t_plain = _time(lambda: add_rms_norm(x, w, 1e-5, residual=res))
    t_unfused = _time(lambda: (lora_expand(buf, [b], meta, x, [0]), add_rms_norm(x, w, 1e-5, residual=res)))
    times = {}
    for tiles, bm in shapes:
        key = "per_row" if not tiles else f"tiles_{bm}"
        times[key] = _time(lambda: lora_expand_add_rms_norm(buf, b, meta, x, w, 1e-5, residual=res, tiles=tiles,
                                                            block_m=bm))
    if num_tokens <= 128:   # per-row pieces and warps (default: the whole row, 16 warps)
        for chunk, warps in itertools.product((2048, 4096), (8, 16)):
            times[f"per_row_{chunk}x{warps}w"] = _time(
                lambda: lora_expand_add_rms_norm(buf, b, meta, x, w, 1e-5, residual=res, tiles=False, chunk=chunk,
                                                 num_warps=warps))
    nbytes = num_tokens * HIDDEN * 2 * 5
    out.append({"kernel": "lora_add_rms_norm", "layer": "o", "tokens": num_tokens, "adapters": num_adapters,
                "plain_us": t_plain, "unfused_us": t_unfused, "fused_us": times, "bound_us": nbytes / bw * 1e6})
    # rotary + KV write after qkv_proj (32 / 8 heads x 128)
    heads, kv_heads, dim, block = 32, 8, 128, 16
    widths = [heads * dim, kv_heads * dim, kv_heads * dim]
    qkv = torch.randn(num_tokens, sum(widths), device=dev, dtype=bf16)
    q, k, v = (t.view(num_tokens, -1, dim) for t in qkv.split(widths, -1))
    num_blocks = num_tokens // block + 1
    kc = torch.zeros(num_blocks, block, kv_heads, dim, device=dev, dtype=bf16)
    vc = torch.zeros_like(kc)
    slots = torch.arange(num_tokens, device=dev)
    pos = torch.arange(num_tokens, device=dev) % 4096
    inv = 1.0 / (500000.0 ** (torch.arange(0, dim, 2, device=dev).float() / dim))
    ang = torch.arange(4096, device=dev).float()[:, None] * inv[None, :]
    cos, sin = ang.cos(), ang.sin()
    buf3 = torch.randn(3, 1, num_tokens, RANK, device=dev)
    bs = [torch.randn(_slots(meta), n, RANK, device=dev, dtype=bf16) * 0.1 for n in widths]
    t_plain = _time(lambda: rotary_write_kv(pos, q, k, v, cos, sin, dim, kc, vc, slots))
    t_unfused = _time(lambda: (lora_expand(buf3, bs, meta, qkv, [0, widths[0], widths[0] + widths[1]]),
                               rotary_write_kv(pos, q, k, v, cos, sin, dim, kc, vc, slots)))
    times = {}
    if num_tokens <= 4096:
        times["per_token"] = _time(lambda: lora_rotary_write_kv(pos, q, k, v, cos, sin, dim, kc, vc, slots, buf3, bs,
                                                                meta.token_lora_slots))
    if num_tokens <= 128:
        for warps in (1, 4, 8):
            times[f"per_token_{warps}w"] = _time(lambda: lora_rotary_write_kv(
                pos, q, k, v, cos, sin, dim, kc, vc, slots, buf3, bs, meta.token_lora_slots, num_warps=warps))
    nbytes = num_tokens * sum(widths) * 2 * 2 + num_tokens * 2 * kv_heads * dim * 2
    out.append({"kernel": "lora_rotary_write_kv", "layer": "qkv", "tokens": num_tokens, "adapters": num_adapters,
                "plain_us": t_plain, "unfused_us": t_unfused, "fused_us": times, "bound_us": nbytes / bw * 1e6})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="2048,16384")
    ap.add_argument("--adapters", default="1,16")
    ap.add_argument("--skip-shrink", action="store_true", help="only the expand kernels")
    ap.add_argument("--fused-consumers", action="store_true",
                    help="only the q/k/v update in rotary + KV write and the o/down update in add + RMSNorm")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out/lora_prefill_sweep.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA: nothing measured.")
        return 0
    bw = measure_copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s")
    results = []
    for t, n in itertools.product([int(v) for v in args.tokens.split(",")], [int(v) for v in args.adapters.split(",")]):
        if args.fused_consumers:
            for r in sweep_fused_consumers(t, n, bw):
                results.append(r)
                fused = "  ".join(f"{k} {v:.1f}" for k, v in r["fused_us"].items())
                print(f"{r['kernel']:22s} T={t:6d} adapters={n:3d}  plain {r['plain_us']:7.1f} us  unfused "
                      f"{r['unfused_us']:7.1f} us  fused: {fused}  bound {r['bound_us']:.1f}", flush=True)
            continue
        expands = sweep_expand(t, n, bw) if t <= DECODE_MAX_TOKENS else []
        shrinks = [] if args.skip_shrink else sweep_shrink(t, n, bw)
        for r in shrinks + sweep_silu_mul(t, n, bw) + expands:
            results.append(r)
            extra = f"  plain silu_mul {r['plain_silu_mul_us']:.1f}" if "plain_silu_mul_us" in r else ""
            if "best_per_token_us" in r:
                extra += f"  per-token best {r['best_per_token_us']:.1f} {r['best_per_token']}"
            print(f"{r['kernel']:16s} {r['layer']:8s} T={t:6d} adapters={n:3d}  default {r['default_us']:8.1f} us  "
                  f"best {r['best_us']:8.1f} us {r['best']}  bound {r['bound_us']:7.1f}{extra}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
