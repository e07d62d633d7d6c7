"""Decode attention tile sweep: one layer of paged attention per batch size, every candidate config.

Example (H200; Llama-3-8B attention: 32 heads, 8 KV heads, head_dim 128, bf16, block 16):
    python benchmarks/sweeps/attention_sweep.py --batch-sizes 1,256 --context-len 534

Each case times ``paged_attention`` on a decode batch (one query token per request) replayed from
a CUDA graph of 10 calls, for every (tile_n, num_warps, num_stages[, num_splits]) candidate (the wrapper's
``decode_tiles``; the engine takes the same overrides from ``CHORUS_KERNEL_POLICY=attn_decode.tile_n=..``),
and reports it against the KV bytes it must read over the measured copy bandwidth. Prints the best configs per batch and the default's time; writes JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benchmarks.sweeps.kernel_timing import time_graph_calls  # noqa: E402
from benchmarks.latency import measure_copy_bandwidth  # noqa: E402


def _time_us(fn, reps: int = 10) -> float:
    return time_graph_calls(lambda i: fn(), calls=10, reps=reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="1,256")
    ap.add_argument("--context-len", type=int, default=534)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--tiles", default="32,64,128", help="tile_n candidates")
    ap.add_argument("--warps", default="2,4,8", help="num_warps candidates at batch >= 64")
    ap.add_argument("--stages", default="2,3,4", help="num_stages candidates at batch >= 64")
    ap.add_argument("--layout", choices=["nhd", "hnd"], default="nhd",
                    help="cache memory order: nhd = [block, slot, head, dim] (the engine's), hnd = [block, head, slot, dim]")
    ap.add_argument("--large-batch-splits", default="none",
                    help="split-KV settings tried at batch >= 64 (comma list of none or a power of two)")
    ap.add_argument("--heads-per-prog", default="2",
                    help="KV heads per program of kernels.paged_decode (pure decode without split-KV; 0: the general kernel)")
    ap.add_argument("--orders", default="1", help="grid orders to try: 1 = KV heads first, 0 = q-blocks first")
    ap.add_argument("--out", default="benchmarks/out/attention_sweep.json")
    args = ap.parse_args()
    from kernels.paged_attention import paged_attention

    bw = measure_copy_bandwidth()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    ctx, bs = args.context_len, args.block_size
    nblk = (ctx + bs - 1) // bs
    tiles, warps, stages = ([int(v) for v in x.split(",")] for x in (args.tiles, args.warps, args.stages))
    report = dict(bandwidth_tb_s=bw / 1e12, context_len=ctx, layout=args.layout, cases=[])
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        num_blocks = b * nblk + 1
        if args.layout == "hnd":   # each (block, KV head) contiguous: block_size x head_dim
            k_cache = torch.randn(num_blocks, args.kv_heads, bs, args.head_dim, device=dev, dtype=dtype)
            v_cache = torch.randn_like(k_cache)
            k_cache, v_cache = k_cache.permute(0, 2, 1, 3), v_cache.permute(0, 2, 1, 3)
        else:                      # the engine's [block, slot, KV head, dim]
            k_cache = torch.randn(num_blocks, bs, args.kv_heads, args.head_dim, device=dev, dtype=dtype)
            v_cache = torch.randn_like(k_cache)
        q = torch.randn(b, args.heads, args.head_dim, device=dev, dtype=dtype)
        qsl = torch.arange(b + 1, dtype=torch.int32, device=dev)
        seq_lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
        bt = torch.randperm(num_blocks - 1, device=dev)[:b * nblk].view(b, nblk).to(torch.int32) + 1
        out = torch.empty_like(q)
        kv_bytes = 2 * b * ctx * args.kv_heads * args.head_dim * 2
        bound_us = kv_bytes / bw * 1e6
        orders = [int(x) for x in args.orders.split(",")]
        hpps = [int(x) for x in args.heads_per_prog.split(",")]
        if b >= 64:
            splits = [None if x == "none" else int(x) for x in args.large_batch_splits.split(",")]
            grid = itertools.product(tiles, warps, stages, splits, orders, hpps)
        else:   # split-KV matters here; fewer warp/stage choices keep the compile count down
            grid = itertools.product(tiles, [2, 4], [2, 3], [None, 4, 8, 16], orders, hpps)
        rows = []
        for tile_n, nw, ns, sp, hf, hpp in grid:
            tiles_cfg = dict(tile_n=tile_n, num_warps=nw, num_stages=ns, heads_first=hf, heads_per_prog=hpp)
            try:
                us = _time_us(lambda: paged_attention(q, k_cache, v_cache, qsl, seq_lens, bt, 1, ctx,
                                                      0.088, out, num_splits=sp, decode_tiles=tiles_cfg))
            except Exception as e:   # a config the compiler rejects (shared memory)
                print(f"  b={b} tile_n={tile_n} warps={nw} stages={ns} splits={sp}: {type(e).__name__}")
                continue
            rows.append(dict(tile_n=tile_n, num_warps=nw, num_stages=ns, num_splits=sp, heads_first=hf,
                             heads_per_prog=hpp, us=us))
        default_us = _time_us(lambda: paged_attention(q, k_cache, v_cache, qsl, seq_lens, bt, 1, ctx, 0.088, out))
        rows.sort(key=lambda r: r["us"])
        print(f"\nbatch {b}, ctx {ctx}: KV {kv_bytes / 1e6:.1f} MB, bound {bound_us:.1f} us, "
              f"default {default_us:.1f} us ({bound_us / default_us:.2f} of bound)")
        for r in rows[:6]:
            print(f"  tile_n={r['tile_n']:3d} warps={r['num_warps']} stages={r['num_stages']} "
                  f"splits={r['num_splits']} heads_first={r['heads_first']} heads_per_prog={r['heads_per_prog']}: "
                  f"{r['us']:.1f} us ({bound_us / r['us']:.2f} of bound)")
        for hpp in hpps:
            best = next((r for r in rows if r["heads_per_prog"] == hpp), None)
            if best is not None and len(hpps) > 1:
                print(f"  best with heads_per_prog={hpp}: {best['us']:.1f} us (tile_n={best['tile_n']} "
                      f"warps={best['num_warps']} stages={best['num_stages']} splits={best['num_splits']})")
        report["cases"].append(dict(batch=b, bound_us=bound_us, default_us=default_us, top=rows[:10]))
        del k_cache, v_cache
        torch.cuda.empty_cache()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
