"""Kernel micro-benchmarks against their memory-traffic bounds (CUDA only).

Measures a device-to-device copy bandwidth first (bytes read + written per second), then for
each kernel and size: checks the result against its torch twin, then reports
  - gpu us: median device time, replayed from a CUDA graph after an L2 flush (what a step
    captured in a graph pays);
  - wall us: ``triton.testing.do_bench`` median of eager calls (adds host gaps between the
    launches of one call, e.g. split-KV's merge kernel);
  - host us: Python + launch time per eager call;
  - bound us: the kernel's compulsory memory traffic at the copy bandwidth, and bound/gpu.

Cases (Llama-3-8B shapes, bf16):
  - paged attention decode: 32 heads, 8 KV heads, head 128, block 16, 512 context,
    batch 1/32/128/256 (and the engine's torch backend for comparison);
  - KV write: 8 KV heads x 128, 1/256/4096 tokens;
  - LoRA shrink + expand, rank 16: o_proj-like 4096 -> 4096 and qkv 4096 -> 4096+1024+1024,
    1/4/16/64 distinct adapters at batch 64/256 (one token per request, round robin).

Usage:
    python benchmarks/kernels.py [--out benchmarks/out/kernels.json] [--quick]

Without CUDA it prints "needs CUDA" and exits with status 0 (nothing to measure is not an
error, so a CPU CI job may call it).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parent.parent
# NOTE: this file is named kernels.py: drop its own folder from the path so that ``import
# kernels.lora_shrink`` finds the repository's package, not this script.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(REPO))

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, CTX_LEN = 32, 8, 128, 16, 512
HIDDEN, KV_DIM, RANK, MAX_LORAS = 4096, 1024, 16, 64
DTYPE = torch.bfloat16


@dataclass
class Row:
    """One timed case."""

    kernel: str
    case: str
    gpu_us: float           # median device time of one call, replayed from a CUDA graph, cold L2
    wall_us: float          # median eager time (do_bench): adds host gaps between a call's launches
    host_us: float          # host (Python + launch) time per eager call
    bound_us: float         # compulsory bytes / measured copy bandwidth
    bytes_moved: int        # compulsory bytes read + written
    note: str = ""

    @property
    def fraction_of_bound(self) -> float:
        """bound / gpu time: 1.0 would be at the copy bandwidth."""
        return self.bound_us / self.gpu_us if self.gpu_us > 0 else 0.0


@dataclass
class Timing:
    gpu_us: float
    wall_us: float
    host_us: float


def time_graph(fn: Callable[[], object], reps: int = 50) -> float:
    """Median device time of fn: captured once into a CUDA graph, replayed after an L2 flush.

    NOTE: the flush keeps the GPU busy while the host enqueues the replay, so launch gaps
    and Python time are excluded.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")   # [256 MiB] > L2 (60 MB)
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return float(torch.tensor([s.elapsed_time(e) for s, e in times]).median()) * 1e3


def time_host(fn: Callable[[], object], calls: int = 50) -> float:
    """Host microseconds per eager call (the GPU queue absorbs the launches)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def bench(fn: Callable[[], object]) -> Timing:
    import triton.testing

    wall = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
    try:
        gpu = time_graph(fn)
    except RuntimeError as e:                  # not capturable: report eager time
        print(f"  (CUDA graph capture failed: {e}; using eager time)")
        gpu = wall
    return Timing(gpu_us=gpu, wall_us=wall, host_us=time_host(fn))


def measure_copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy, counting read + write."""
    import triton.testing

    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t_us = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median") * 1e3
    del src, dst
    return 2 * n / (t_us * 1e-6)


def row(kernel: str, case: str, t: Timing, nbytes: int, bw: float, note: str = "") -> Row:
    return Row(kernel, case, t.gpu_us, t.wall_us, t.host_us, nbytes / bw * 1e6, nbytes, note)


# ----------------------------------------------------------------------------------------
# Paged attention + KV write
# ----------------------------------------------------------------------------------------
def bench_attention(batch: int, bw: float) -> list[Row]:
    from engine.attention import AttentionMetadata, paged_attention_torch
    from kernels.paged_attention import _choose_config, paged_attention
    from kernels.reference import paged_attention_ref

    g = torch.Generator(device="cuda").manual_seed(batch)
    blocks_per_req = math.ceil(CTX_LEN / BLOCK_SIZE)
    num_blocks = batch * blocks_per_req
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE,
                          generator=g)
    v_cache = torch.randn_like(k_cache)
    block_tables = torch.randperm(num_blocks, device="cuda", generator=g).to(torch.int32).view(batch, -1)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE, generator=g)
    qsl = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    seq_lens = torch.full((batch,), CTX_LEN, device="cuda", dtype=torch.int32)
    scale = HEAD_DIM ** -0.5
    args = (q, k_cache, v_cache, qsl, seq_lens, block_tables)

    out = paged_attention(*args, 1, CTX_LEN, scale)
    ref = paged_attention_ref(*args, scale)
    err = (out.float() - ref.float()).abs().max().item()
    if err > 3e-2:
        raise AssertionError(f"paged_attention batch {batch}: max error {err:.3g} vs the twin")
    splits = _choose_config(q.device, NUM_HEADS // NUM_KV_HEADS, HEAD_DIM, batch, NUM_KV_HEADS, 1, CTX_LEN,
                            None).num_splits
    kv_bytes = 2 * batch * CTX_LEN * NUM_KV_HEADS * HEAD_DIM * k_cache.element_size()
    nbytes = kv_bytes + 2 * q.numel() * q.element_size() + block_tables.numel() * 4
    case = f"decode batch={batch} ctx={CTX_LEN}"
    rows = [row("paged_attention", case, bench(lambda: paged_attention(*args, 1, CTX_LEN, scale, out=out)),
                nbytes, bw, f"splits={splits} maxerr={err:.2g}")]
    meta = AttentionMetadata(slot_mapping=torch.zeros(batch, dtype=torch.int64, device="cuda"),
                             query_start_loc=qsl, seq_lens=seq_lens, block_tables=block_tables,
                             max_query_len=1, max_seq_len=CTX_LEN, num_decode_reqs=batch,
                             query_start_loc_cpu=list(range(batch + 1)), seq_lens_cpu=[CTX_LEN] * batch)
    t_torch = bench(lambda: paged_attention_torch(q, k_cache, v_cache, meta, scale))
    rows.append(row("paged_attention_torch", case, t_torch, nbytes, bw))
    return rows


def bench_kv_write(num_tokens: int, bw: float) -> list[Row]:
    from kernels.kv_write import write_kv
    from kernels.reference import write_kv_ref

    num_blocks = max(64, 2 * math.ceil(num_tokens / BLOCK_SIZE))
    k_cache = torch.zeros(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    v = torch.randn_like(k)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device="cuda")[:num_tokens]
    k_ref, v_ref = write_kv_ref(k, v, k_cache, v_cache, slots) if num_tokens <= 256 else (None, None)
    write_kv(k, v, k_cache, v_cache, slots)
    if k_ref is not None and not (torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)):
        raise AssertionError(f"write_kv {num_tokens} tokens: differs from the twin")
    nbytes = 2 * 2 * k.numel() * k.element_size() + slots.numel() * 8
    return [row("write_kv", f"tokens={num_tokens}", bench(lambda: write_kv(k, v, k_cache, v_cache, slots)),
                nbytes, bw)]


# ----------------------------------------------------------------------------------------
# LoRA shrink + expand
# ----------------------------------------------------------------------------------------
def bench_lora(out_dims: tuple[int, ...], num_adapters: int, batch: int, bw: float,
               fixed_grid: bool = False) -> list[Row]:
    """``fixed_grid``: the CUDA-graph launch (grid over all MAX_LORAS slots, inactive ones exit)."""
    from kernels.lora_expand import lora_expand
    from kernels.lora_meta import build_lora_kernel_meta
    from kernels.lora_shrink import lora_shrink
    from kernels.reference import lora_expand_ref, lora_shrink_ref

    num_slices = len(out_dims)
    g = torch.Generator(device="cuda").manual_seed(num_adapters * 1000 + batch)
    slots = (torch.arange(batch, device="cuda") % num_adapters).to(torch.int32)    # [T] round robin
    meta = build_lora_kernel_meta(slots, MAX_LORAS, fixed_grid=fixed_grid)
    x = torch.randn(batch, HIDDEN, device="cuda", dtype=DTYPE, generator=g)
    lora_a = torch.randn(num_slices, MAX_LORAS, RANK, HIDDEN, device="cuda", dtype=DTYPE, generator=g) / 64
    lora_b = [torch.randn(MAX_LORAS, n, RANK, device="cuda", dtype=DTYPE, generator=g) / 4 for n in out_dims]
    offsets = [sum(out_dims[:s]) for s in range(num_slices)]
    y = torch.randn(batch, sum(out_dims), device="cuda", dtype=DTYPE, generator=g)
    buf = torch.empty(num_slices, batch, RANK, device="cuda")                       # [S, T, rank] fp32

    lora_shrink(x, lora_a, meta, buf)
    buf_ref = lora_shrink_ref(x, lora_a, slots)
    err_s = (buf - buf_ref).abs().max().item()
    y_ref = lora_expand_ref(buf_ref, lora_b, slots, y, offsets)
    y_out = y.clone()
    lora_expand(buf_ref, lora_b, meta, y_out, offsets)
    err_e = (y_out.float() - y_ref.float()).abs().max().item()
    if err_s > 1e-2 or err_e > 6e-2:
        raise AssertionError(f"lora {out_dims} adapters={num_adapters} batch={batch}: "
                             f"errors {err_s}, {err_e}")

    el = x.element_size()
    shrink_bytes = x.numel() * el + num_adapters * num_slices * RANK * HIDDEN * el + buf.numel() * 4
    expand_bytes = buf.numel() * 4 + num_adapters * sum(out_dims) * RANK * el + 2 * y.numel() * el
    case = (f"{HIDDEN}->{'+'.join(map(str, out_dims))} r={RANK} adapters={num_adapters} batch={batch}"
            + (" fixed" if fixed_grid else ""))

    def both():
        lora_shrink(x, lora_a, meta, buf)
        lora_expand(buf, lora_b, meta, y, offsets)

    t_shrink = bench(lambda: lora_shrink(x, lora_a, meta, buf))
    t_expand = bench(lambda: lora_expand(buf, lora_b, meta, y, offsets))
    return [row("lora_shrink", case, t_shrink, shrink_bytes, bw),
            row("lora_expand", case, t_expand, expand_bytes, bw),
            row("lora_shrink+expand", case, bench(both), shrink_bytes + expand_bytes, bw,
                f"maxerr={max(err_s, err_e):.2g}")]


def print_table(rows: list[Row]) -> None:
    print(f"{'kernel':<22} {'case':<46} {'gpu us':>8} {'wall us':>8} {'host us':>8} {'bound us':>8} "
          f"{'bound/gpu':>9}  note")
    for r in rows:
        print(f"{r.kernel:<22} {r.case:<46} {r.gpu_us:>8.1f} {r.wall_us:>8.1f} {r.host_us:>8.1f} "
              f"{r.bound_us:>8.1f} {r.fraction_of_bound:>9.2f}  {r.note}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out" / "kernels.json")
    parser.add_argument("--quick", action="store_true", help="one size per kernel")
    parser.add_argument("--lora-only", action="store_true",
                        help="only LoRA shrink/expand, fixed grid (the CUDA-graph launch): batch 64/256, 1/16/64 adapters")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA: no GPU visible, nothing measured.")
        return 0

    bw = measure_copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}  copy bandwidth (read+write): {bw / 1e12:.2f} TB/s")
    tiny = torch.zeros(1, device="cuda")
    rows: list[Row] = [row("launch_floor", "one 4-byte memset kernel", bench(tiny.zero_), 4, bw,
                           "latency floor of any one-kernel call")]
    if args.lora_only:
        for out_dims in [(HIDDEN,), (HIDDEN, KV_DIM, KV_DIM)]:
            for batch in (64, 256):
                for num_adapters in (1, 16, 64):
                    rows += bench_lora(out_dims, num_adapters, batch, bw, fixed_grid=True)[:2]
        return _report(args, rows, bw)
    for batch in ([32] if args.quick else [1, 32, 128, 256]):
        rows += bench_attention(batch, bw)
    for num_tokens in ([256] if args.quick else [1, 256, 4096]):
        rows += bench_kv_write(num_tokens, bw)
    for out_dims in [(HIDDEN,), (HIDDEN, KV_DIM, KV_DIM)]:
        for batch in ([64] if args.quick else [64, 256]):
            for num_adapters in ([4] if args.quick else [1, 4, 16, 64]):
                rows += bench_lora(out_dims, num_adapters, batch, bw)
    return _report(args, rows, bw)


def _report(args, rows: list[Row], bw: float) -> int:
    print_table(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"device": torch.cuda.get_device_name(), "copy_bandwidth_bytes_per_s": bw,
              "torch": torch.__version__,
              "rows": [dict(asdict(r), fraction_of_bound=r.fraction_of_bound) for r in rows]}
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
