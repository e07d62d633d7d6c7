"""KV cache figures: the FP8 cache's capacity and decode step against the model's dtype, and a sliding-window
model's KV held by one long prompt against the same shape without windows.

Examples:
    # H200, Llama-3-8B shape (random bf16 weights): blocks at start-up and decode at batch 256, bf16 vs FP8 cache
    python benchmarks/kv_cache.py fp8 --shape llama3-8b --batch-sizes 256
    # H200, Gemma 3 12B shape: a 32k-token prompt's blocks, windows on and off; decode at batch 64, 2048 tokens
    python benchmarks/kv_cache.py window --shape gemma3-12b --prompt-len 32768 --batch-sizes 64 --context-len 2048
    # CPU smoke runs (no FP8 cache on CPU: bfloat16 against the tiny model's float32)
    python benchmarks/kv_cache.py fp8 --shape llama3-8b --tiny --kv-cache-dtypes auto,bfloat16 --batch-sizes 4 \\
        --context-len 32 --steps 4 --kv-cache-space 0.01
    python benchmarks/kv_cache.py window --shape gemma3-12b --tiny --prompt-len 256 --batch-sizes 4 \\
        --context-len 64 --steps 4

``fp8``: one engine per ``--kv-cache-dtypes`` entry (default auto,fp8) under the same memory budget
(``--gpu-memory-utilization``; CPU: ``--kv-cache-space`` GiB), each with room for ``--capacity-seqs`` sequences of
``--capacity-model-len`` tokens so the budget, not that bound, sets the blocks ("capped" says when the bound did):
the KV blocks and tokens the engine allocates at start-up, their ratio to the first entry's, and
benchmarks/latency.py's decode rows (step ms vs its bytes floor, the KV at the cache's bytes per element) at
``--batch-sizes`` on that engine.

``window``: the shape as configured (its sliding windows) and with every layer global (``layer_types`` all full
attention); on each, one ``--prompt-len``-token prompt is prefilled (chunked) and the block pool's counters give
the blocks it holds at its first decode step and at most during its prefill, with their bytes (with windows the
layers are KV cache groups, ``engine.kv_cache_groups``: a block holds one group's layers, and a sliding group
returns the blocks before its window, so compare bytes, not blocks); "window need" is the KV its layers read at
the least (a sliding layer its window, a global one every token). Then latency.py's decode rows at
``--batch-sizes``, ``--context-len`` tokens (past the window, so the sliding layers read only theirs).
Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.latency import chorus_llm, decode_rows, device_and_bandwidth, write_report  # noqa: E402
from benchmarks.shapes import add_shape_args, dummy_model, resolve_shape_args, shape_fields  # noqa: E402


def _release() -> None:
    """Return a closed engine's device memory: call it after the function that held the engine returned (its
    locals, which reach the runner's tensors, are gone only then)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def free_gib() -> float | None:
    """The device's free memory in GiB before an engine starts (CUDA; None on CPU): an engine left alive would
    take the next one's KV budget, so each row records it and ``check_free`` compares them."""
    return torch.cuda.mem_get_info()[0] / (1 << 30) if torch.cuda.is_available() else None


def check_free(rows: list[dict]) -> None:
    """Warns when an engine started with over 1 GiB less free memory than the first (its KV budget smaller)."""
    first = rows[0]["free_gib_before"]
    for r in rows[1:]:
        if first is not None and r["free_gib_before"] < first - 1.0:
            print(f"WARNING: an engine started with {r['free_gib_before']:.1f} GiB free, the first with {first:.1f}: "
                  "its KV budget is the smaller for it", flush=True)


def cache_capacity(llm) -> dict:
    """The KV cache the engine allocated at start-up (its log's blocks and tokens of every layer, the reserved
    null block included; a block holds one KV cache group's layers), the blocks requests can hold, bytes."""
    engine = llm.llm_engine
    kv = engine.runner.kv_cache
    pool = engine.scheduler.kv_cache_manager.block_pool
    return dict(kv_dtype=str(kv.dtype).removeprefix("torch."), blocks=kv.num_blocks,
                usable_blocks=pool.num_usable_blocks, block_size=kv.block_size,
                tokens=kv.num_blocks * kv.block_size // kv.groups.num_groups,
                bytes_per_block=kv.bytes_per_block(), kv_gib=kv.num_blocks * kv.bytes_per_block() / (1 << 30))


def _fp8_row(args, kv_dtype: str, bandwidth: float) -> dict:
    """One engine with the ``kv_dtype`` cache: its blocks at start-up and its decode rows (closed on return)."""
    args.kv_cache_dtype = kv_dtype
    t0, free = time.perf_counter(), free_gib()
    llm = chorus_llm(args, args.model, max(args.capacity_seqs, max(args.batch_sizes)), args.capacity_model_len,
                     kv_cache_space=args.kv_cache_space)
    cap = cache_capacity(llm)
    needed = max(args.capacity_seqs, max(args.batch_sizes)) * math.ceil(args.capacity_model_len
                                                                       / cap["block_size"])
    cap.update(kv_cache_dtype=kv_dtype, capped=cap["blocks"] >= needed, load_s=time.perf_counter() - t0,
               free_gib_before=free)
    print(f"{kv_dtype}: {cap['blocks']} blocks x {cap['block_size']} = {cap['tokens']} tokens, {cap['kv_dtype']}, "
          f"{cap['kv_gib']:.2f} GiB{' (capped by the sequences bound)' if cap['capped'] else ''}", flush=True)
    cap["decode"] = decode_rows(llm, args, args.batch_sizes, bandwidth)
    llm.llm_engine.close()
    return cap


def fp8_rows(args, bandwidth: float) -> list[dict]:
    rows = []
    for kv_dtype in args.kv_cache_dtypes:
        rows.append(_fp8_row(args, kv_dtype, bandwidth))
        _release()
    check_free(rows)
    for r in rows:
        r["capacity_x_first"] = r["blocks"] / rows[0]["blocks"]
        for d, first in zip(r["decode"], rows[0]["decode"]):
            d["step_x_first"] = d["step_ms"] / first["step_ms"]
    print(f"\n{'kv cache':>10s} {'blocks':>9s} {'tokens':>10s} {'GiB':>7s} {'x cap':>6s} {'batch':>5s} {'step ms':>8s} "
          f"{'floor ms':>8s} {'x floor':>7s} {'x step':>6s}")
    for r in rows:
        for d in r["decode"]:
            print(f"{r['kv_cache_dtype']:>10s} {r['blocks']:9d} {r['tokens']:10d} {r['kv_gib']:7.2f} "
                  f"{r['capacity_x_first']:6.3f} {d['batch']:5d} {d['step_ms']:8.2f} {d['floor_ms']:8.2f} "
                  f"{d['step_over_floor']:7.2f} {d['step_x_first']:6.3f}")
    return rows


def prompt_blocks(llm, prompt_len: int) -> dict:
    """Blocks one ``prompt_len``-token prompt holds: at its first decode step and at most during its prefill."""
    from engine import SamplingParams
    engine = llm.llm_engine
    pool = engine.scheduler.kv_cache_manager.block_pool
    vocab = engine.runner.model.config.vocab_size
    rng = random.Random(0)
    prompt = [rng.randrange(100, vocab - 100) for _ in range(prompt_len)]
    engine.add_request("long", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=4, ignore_eos=True))
    peak = steps = 0
    while True:
        engine.step()
        steps += 1
        held = pool.num_usable_blocks - pool.num_free_blocks
        peak = max(peak, held)
        if engine.scheduler.last_num_scheduled_tokens == 1:         # its first decode step
            break
    engine.abort_request(["long"])
    while engine.has_unfinished_requests():
        engine.step()
    return dict(blocks_held=held, blocks_peak=peak, prefill_steps=steps - 1)


def _window_row(args, windows: bool, bandwidth: float) -> dict:
    """One engine of the shape with its windows (or every layer global): the long prompt's blocks and the decode
    rows (closed on return)."""
    from engine.models.sliding_window import layer_windows
    model_dir = dummy_model(args.shape, args.tiny, windows=windows)
    max_len = max(args.prompt_len, args.context_len + 2 * args.steps) + 64
    free = free_gib()
    llm = chorus_llm(args, model_dir, max(args.batch_sizes), max_len, kv_cache_space=args.kv_cache_space)
    cfg = llm.llm_engine.runner.model.config
    kv = llm.llm_engine.runner.kv_cache
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_token_layer = 2 * cfg.num_key_value_heads * head_dim * (torch.finfo(kv.dtype).bits // 8)
    need_tokens = sum(min(args.prompt_len, w) if w else args.prompt_len for w in layer_windows(cfg))
    row = dict(windows=windows, sliding_layers=sum(w is not None for w in layer_windows(cfg)),
               layers=cfg.num_hidden_layers, kv_groups=kv.groups.num_groups, group_layers=kv.groups.group_size,
               prompt_len=args.prompt_len, **prompt_blocks(llm, args.prompt_len),
               bytes_per_block=kv.bytes_per_block(), window_need_bytes=need_tokens * per_token_layer,
               free_gib_before=free)
    row["held_bytes"] = row["blocks_held"] * row["bytes_per_block"]
    row["peak_bytes"] = row["blocks_peak"] * row["bytes_per_block"]
    row["decode"] = decode_rows(llm, args, args.batch_sizes, bandwidth)
    llm.llm_engine.close()
    print(f"windows {'on' if windows else 'off'}: {row['kv_groups']} KV cache groups of {row['group_layers']} "
          f"layers; {row['blocks_held']} blocks held ({row['held_bytes'] / 2**20:.1f} MiB), peak "
          f"{row['blocks_peak']} ({row['peak_bytes'] / 2**20:.1f} MiB); window need "
          f"{row['window_need_bytes'] / 2**20:.1f} MiB", flush=True)
    return row


def window_rows(args, bandwidth: float) -> list[dict]:
    rows = []
    for windows in (True, False):
        rows.append(_window_row(args, windows, bandwidth))
        _release()
    check_free(rows)
    off = rows[1]
    print(f"\n{'windows':>7s} {'sliding':>7s} {'groups':>6s} {'blocks':>7s} {'peak':>6s} {'held MiB':>9s} "
          f"{'peak MiB':>9s} {'need MiB':>9s} {'x off':>6s} {'batch':>5s} {'step ms':>8s} {'floor ms':>8s} "
          f"{'x floor':>7s} {'x off':>6s}")
    for r in rows:
        r["held_x_off"] = r["held_bytes"] / off["held_bytes"]
        for d, d_off in zip(r["decode"], off["decode"]):
            d["step_x_off"] = d["step_ms"] / d_off["step_ms"]
            print(f"{'on' if r['windows'] else 'off':>7s} {r['sliding_layers']:7d} {r['kv_groups']:6d} "
                  f"{r['blocks_held']:7d} {r['blocks_peak']:6d} {r['held_bytes'] / 2**20:9.1f} "
                  f"{r['peak_bytes'] / 2**20:9.1f} {r['window_need_bytes'] / 2**20:9.1f} "
                  f"{r['held_x_off']:6.3f} {d['batch']:5d} {d['step_ms']:8.2f} {d['floor_ms']:8.2f} "
                  f"{d['step_over_floor']:7.2f} {d['step_x_off']:6.3f}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["fp8", "window"])
    add_shape_args(ap)
    ap.add_argument("--kv-cache-dtypes", default="auto,fp8", help="fp8: the caches compared, the first the reference")
    ap.add_argument("--capacity-seqs", type=int, default=512, help="fp8: max_num_seqs of each engine")
    ap.add_argument("--capacity-model-len", type=int, default=None,
                    help="fp8: max_model_len of each engine (default: the shape's positions, at most 8192)")
    ap.add_argument("--prompt-len", type=int, default=32768, help="window: the long prompt's tokens")
    ap.add_argument("--batch-sizes", default="256")
    ap.add_argument("--context-len", type=int, default=512, help="decode rows: tokens per sequence")
    ap.add_argument("--steps", type=int, default=32, help="decode rows: timed steps per batch size")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--kv-cache-space", type=float, default=4.0, help="CPU: the KV cache budget in GiB")
    ap.add_argument("--out", default=None, help="default benchmarks/out/kv_cache_MODE.json")
    args = ap.parse_args()
    resolve_shape_args(args)
    if args.shape is None:
        ap.error("--shape is required")
    args.batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    args.kv_cache_dtypes = args.kv_cache_dtypes.split(",")
    if args.capacity_model_len is None:
        args.capacity_model_len = min(8192, shape_fields(args.shape, args.tiny)[2]["max_position_embeddings"])
    args.out = args.out or f"benchmarks/out/kv_cache_{args.mode}.json"
    device, bandwidth = device_and_bandwidth()
    rows = fp8_rows(args, bandwidth) if args.mode == "fp8" else window_rows(args, bandwidth)
    write_report(args, device, bandwidth, rows)


if __name__ == "__main__":
    main()
