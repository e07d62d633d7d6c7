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

``--lora-only``: the LoRA kernels alone, fixed grid (the CUDA-graph launch, max_loras 64), batch
64/256 x 1/16/64 adapters: shrink and expand per kernel, then ``lora_decoder_layer`` rows: the 4
LoRA layers of one Llama-3-8B decoder layer (qkv, o, gate_up, down: shrink + expand each, through
``LinearLoRASlots`` with its default or env-overridden configs) in one CUDA graph; gpu us is
"us per decoder layer" and the note gives "ms per step" (x32 layers).

``--lora-sweep``: per LoRA layer (qkv 4096->[4096,1024,1024], o 4096->4096, gate_up
4096->[14336,14336], down 14336->4096), batch 64/256 x 1/16/64 adapters (max_loras 64, rank 16,
bf16, fixed grid), times the shrink+expand pair for candidate launch configs (every shrink
candidate with the default expand, then every expand candidate with the best shrink; each
checked against the torch twins first) and prints the best config per case next to the default
config's time, then the per-decoder-layer and per-step sums; writes all candidate times as JSON
(default benchmarks/out/lora_sweep.json). About 1100 graph timings: a minute or two on an H200.

``--smoke`` (with --lora-only or --lora-sweep): tiny shapes on CPU under TRITON_INTERPRET=1
(wall-clock times, meaningless except as an end-to-end check of the script).

Usage:
    python benchmarks/kernels.py [--out benchmarks/out/kernels.json] [--quick]
    python benchmarks/kernels.py --lora-only | --lora-sweep [--smoke] [--out FILE]

Without CUDA (and without --smoke) it prints "needs CUDA" and exits with status 0 (nothing to
measure is not an error, so a CPU CI job may call it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
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
    if not torch.cuda.is_available():                  # --smoke on CPU: wall clock only
        t = time_device(fn)
        return Timing(gpu_us=t, wall_us=t, host_us=t)
    import triton.testing

    wall = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
    try:
        gpu = time_graph(fn)
    except RuntimeError as e:                  # not capturable: report eager time
        print(f"  (CUDA graph capture failed: {e}; using eager time)")
        gpu = wall
    return Timing(gpu_us=gpu, wall_us=wall, host_us=time_host(fn))


def measure_copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy, counting read + write (CPU: 64 MiB)."""
    if not torch.cuda.is_available():
        src = torch.empty(64 << 20, dtype=torch.uint8)
        dst = torch.empty_like(src)
        return 2 * src.numel() / (time_device(lambda: dst.copy_(src)) * 1e-6)
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
    from kernels.lora_shrink import lora_shrink, lora_shrink_config
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
    split_k = lora_shrink_config(batch, meta.num_active, num_slices, HIDDEN, x.device).split_k
    buf = torch.empty(num_slices, split_k, batch, RANK, device="cuda")              # [S, split, T, rank] fp32

    lora_shrink(x, lora_a, meta, buf)
    buf_ref = lora_shrink_ref(x, lora_a, slots, split_k=split_k)
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
            + (" fixed" if fixed_grid else "") + f" split={split_k}")

    def both():
        lora_shrink(x, lora_a, meta, buf)
        lora_expand(buf, lora_b, meta, y, offsets)

    t_shrink = bench(lambda: lora_shrink(x, lora_a, meta, buf))
    t_expand = bench(lambda: lora_expand(buf, lora_b, meta, y, offsets))
    return [row("lora_shrink", case, t_shrink, shrink_bytes, bw),
            row("lora_expand", case, t_expand, expand_bytes, bw),
            row("lora_shrink+expand", case, bench(both), shrink_bytes + expand_bytes, bw,
                f"maxerr={max(err_s, err_e):.2g}")]


# ----------------------------------------------------------------------------------------
# LoRA per decoder layer (4 LoRA layers) and the launch-config sweep
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoRABenchShapes:
    """The decode steps the per-layer LoRA benchmark and the sweep run."""

    layers: dict[str, tuple[int, tuple[int, ...]]]
    """LoRA layer of one decoder layer -> (in_dim, out_dim of each slice)."""
    batches: tuple[int, ...]          # decode tokens per step (one per request)
    adapters: tuple[int, ...]         # distinct adapters, round robin over the tokens
    max_loras: int                    # GPU slots (the fixed grid covers all of them)
    rank: int
    num_layers: int                   # decoder layers per step (the "x32" of ms per step)


LLAMA3_8B = LoRABenchShapes(
    layers={"qkv": (HIDDEN, (HIDDEN, KV_DIM, KV_DIM)), "o": (HIDDEN, (HIDDEN,)),
            "gate_up": (HIDDEN, (14336, 14336)), "down": (14336, (HIDDEN,))},
    batches=(64, 256), adapters=(1, 16, 64), max_loras=MAX_LORAS, rank=RANK, num_layers=32)
SMOKE = LoRABenchShapes(
    layers={"qkv": (64, (64, 16, 16)), "o": (64, (64,)), "gate_up": (64, (96, 96)), "down": (96, (64,))},
    batches=(4, 9), adapters=(1, 4), max_loras=4, rank=16, num_layers=2)
"""Tiny shapes for ``--smoke`` (CPU, TRITON_INTERPRET=1): checks the script end to end."""


@dataclass
class LoRALayerCase:
    """One LoRA layer's tensors for one decode step, fixed grid (the CUDA-graph launch)."""

    name: str
    x: torch.Tensor                   # [T, in_dim]
    lora_a: torch.Tensor              # [num_slices, max_loras, rank, in_dim]
    lora_b: list[torch.Tensor]        # per slice [max_loras, out_s, rank]
    y: torch.Tensor                   # [T, sum(out_s)]
    offsets: list[int]                # first column of each slice in y
    slots: torch.Tensor               # [T] int32 slot per token
    meta: object                      # LoRAKernelMeta, fixed grid
    y_ref: torch.Tensor               # y after the pair, from the torch twins
    compulsory_bytes: int             # x + active A + active B + y read and written (no partials)


def make_lora_case(name: str, shapes: LoRABenchShapes, batch: int, num_adapters: int,
                   device: torch.device) -> LoRALayerCase:
    from kernels.lora_meta import build_lora_kernel_meta
    from kernels.reference import lora_expand_ref, lora_shrink_ref

    in_dim, out_dims = shapes.layers[name]
    g = torch.Generator(device=device).manual_seed(batch * 1000 + num_adapters)
    slots = (torch.arange(batch, device=device) % num_adapters).to(torch.int32)   # [T] round robin
    meta = build_lora_kernel_meta(slots, shapes.max_loras, fixed_grid=True)
    L, R, S = shapes.max_loras, shapes.rank, len(out_dims)
    x = torch.randn(batch, in_dim, device=device, dtype=DTYPE, generator=g)
    lora_a = torch.randn(S, L, R, in_dim, device=device, dtype=DTYPE, generator=g) / in_dim ** 0.5
    lora_b = [torch.randn(L, n, R, device=device, dtype=DTYPE, generator=g) / R ** 0.5 for n in out_dims]
    offsets = [sum(out_dims[:s]) for s in range(S)]
    y = torch.randn(batch, sum(out_dims), device=device, dtype=DTYPE, generator=g)
    y_ref = lora_expand_ref(lora_shrink_ref(x, lora_a, slots), lora_b, slots, y, offsets)
    el = x.element_size()
    nbytes = (x.numel() + num_adapters * R * (S * in_dim + sum(out_dims)) + 2 * y.numel()) * el
    return LoRALayerCase(name, x, lora_a, lora_b, y, offsets, slots, meta, y_ref, nbytes)


def time_device(fn: Callable[[], object], reps: int = 20) -> float:
    """Device microseconds of fn (CUDA graph replay, cold L2); wall clock on CPU (smoke)."""
    if torch.cuda.is_available():
        return time_graph(fn, reps=reps)
    t0 = time.perf_counter()                # the interpreter is slow and steady: one call
    fn()
    return (time.perf_counter() - t0) * 1e6


def lora_pair(case: LoRALayerCase, shrink_cfg, expand_cfg, partials: torch.Tensor, y: torch.Tensor):
    """The shrink + expand of one LoRA layer with explicit configs (partials: a flat fp32 buffer)."""
    from kernels.lora_expand import lora_expand
    from kernels.lora_shrink import lora_shrink

    S, T, R = case.lora_a.shape[0], case.x.shape[0], case.lora_a.shape[2]
    buf = partials[:S * shrink_cfg.split_k * T * R].view(S, shrink_cfg.split_k, T, R)   # [S, split, T, R]

    def run() -> None:
        lora_shrink(case.x, case.lora_a, case.meta, buf, config=shrink_cfg)
        lora_expand(buf, case.lora_b, case.meta, y, case.offsets, config=expand_cfg)
    return run


def shrink_candidates(default, in_dim: int, smoke: bool) -> list:
    """block_k x split_k x num_warps, pruned: no split shorter than one block, 8 warps only for
    wide blocks. The default config is always included."""
    from kernels.lora_shrink import split_chunk

    if smoke:
        grid = [(16, 1, 4), (32, 2, 4)]
    else:
        grid = [(bk, sk, w) for bk in (128, 256, 512) for sk in (1, 2, 4, 8) for w in (4, 8)
                if (sk == 1 or split_chunk(in_dim, sk) >= bk) and (w == 4 or bk >= 256)]
    out = [default] + [dataclasses.replace(default, block_k=bk, split_k=sk, num_warps=w)
                       for bk, sk, w in grid]
    return list(dict.fromkeys(out))


def expand_candidates(default, out_dims: tuple[int, ...], smoke: bool) -> list:
    """block_n x n_tiles x num_warps, pruned: 256..4096 columns per program (capped by the
    widest slice), 8 warps only for block_n >= 128. The default config is always included."""
    if smoke:
        grid = [(16, 1, 4), (32, 2, 4)]
    else:
        widest = max(out_dims)
        grid = [(bn, nt, w) for bn in (64, 128, 256) for nt in (1, 2, 4, 8, 16, 32) for w in (4, 8)
                if 256 <= bn * nt <= 4096 and bn * nt < 2 * widest and (w == 4 or bn >= 128)]
    out = [default] + [dataclasses.replace(default, block_n=bn, n_tiles=nt, num_warps=w)
                       for bn, nt, w in grid]
    return list(dict.fromkeys(out))


def _excess_error(y: torch.Tensor, y_ref: torch.Tensor) -> float:
    """Largest |y - y_ref| beyond bf16 tolerance (atol 6e-2 + rtol 1.6e-2: one bf16 ulp of a
    value in [8, 16) is 0.0625); <= 0 passes."""
    diff = (y.float() - y_ref.float()).abs() - (6e-2 + 1.6e-2 * y_ref.float().abs())
    return diff.max().item()


def _cfg_str(cfg) -> str:
    return ",".join(f"{k}={v}" for k, v in asdict(cfg).items())


def sweep_lora_case(case: LoRALayerCase, device: torch.device, smoke: bool) -> dict:
    """Time shrink+expand pairs: every shrink candidate with the default expand, then every
    expand candidate with the best shrink. Each candidate is checked against the twins first."""
    from kernels.lora_expand import lora_expand_config
    from kernels.lora_meta import MAX_SPLIT_K
    from kernels.lora_shrink import lora_shrink_config

    T, in_dim = case.x.shape
    S, R = case.lora_a.shape[0], case.lora_a.shape[2]
    out_dims = tuple(b.shape[1] for b in case.lora_b)
    partials = torch.empty(S * MAX_SPLIT_K * T * R, dtype=torch.float32, device=device)  # [capacity]
    d_shrink = lora_shrink_config(T, case.meta.num_active, S, in_dim, device)
    d_expand = lora_expand_config(T, case.meta.num_active, out_dims, device)

    def measure(s_cfg, e_cfg) -> float:
        y = case.y.clone()
        lora_pair(case, s_cfg, e_cfg, partials, y)()
        err = _excess_error(y, case.y_ref)
        if not err <= 0:
            raise AssertionError(f"{case.name}: {_cfg_str(s_cfg)} / {_cfg_str(e_cfg)}: error beyond tolerance {err:.3g}")
        return time_device(lora_pair(case, s_cfg, e_cfg, partials, y))

    default_us = measure(d_shrink, d_expand)
    shrink_times = [(measure(c, d_expand), c) for c in shrink_candidates(d_shrink, in_dim, smoke)]
    best_shrink = min(shrink_times, key=lambda t: t[0])[1]
    expand_times = [(measure(best_shrink, c), c) for c in expand_candidates(d_expand, out_dims, smoke)]
    best_us, best_expand = min(expand_times, key=lambda t: t[0])
    return {"default_us": default_us, "best_us": best_us,
            "default_shrink": asdict(d_shrink), "default_expand": asdict(d_expand),
            "best_shrink": asdict(best_shrink), "best_expand": asdict(best_expand),
            "shrink_candidates": [{"us": t, **asdict(c)} for t, c in shrink_times],
            "expand_candidates": [{"us": t, **asdict(c)} for t, c in expand_times]}


def run_lora_sweep(shapes: LoRABenchShapes, device: torch.device, bw: float, smoke: bool) -> list[dict]:
    results = []
    for batch in shapes.batches:
        for num_adapters in shapes.adapters:
            for name in shapes.layers:
                case = make_lora_case(name, shapes, batch, num_adapters, device)
                t0 = time.perf_counter()
                r = sweep_lora_case(case, device, smoke)
                r.update(layer=name, batch=batch, adapters=num_adapters,
                         bound_us=case.compulsory_bytes / bw * 1e6, sweep_s=time.perf_counter() - t0)
                print(f"  {name:<8} batch={batch:<4} adapters={num_adapters:<3} "
                      f"default {r['default_us']:8.1f} us  "
                      f"best {r['best_us']:8.1f} us  ({r['sweep_s']:.1f} s)", flush=True)
                results.append(r)
                del case
    return results


def print_sweep(results: list[dict], shapes: LoRABenchShapes) -> None:
    def short(cfg: dict, keys: tuple[str, ...]) -> str:
        return " ".join(f"{k}={cfg[k]}" for k in keys)

    s_keys = ("block_m", "block_k", "split_k", "num_warps")
    e_keys = ("block_m", "block_n", "n_tiles", "num_warps")
    print(f"\n{'layer':<8} {'batch':>5} {'adapt':>5} {'default us':>10} {'best us':>8} {'speedup':>7} "
          f"{'bound us':>8}  best shrink / best expand   (default shrink / default expand)")
    for r in results:
        print(f"{r['layer']:<8} {r['batch']:>5} {r['adapters']:>5} {r['default_us']:>10.1f} "
              f"{r['best_us']:>8.1f} "
              f"{r['default_us'] / r['best_us']:>7.2f} {r['bound_us']:>8.1f}  "
              f"{short(r['best_shrink'], s_keys)} / {short(r['best_expand'], e_keys)}   "
              f"({short(r['default_shrink'], s_keys)} / {short(r['default_expand'], e_keys)})")
    print(f"\nper decoder layer ({len(shapes.layers)} LoRA layers: sum of their pairs) and per step "
          f"(x{shapes.num_layers} layers)")
    print(f"{'batch':>5} {'adapt':>5} {'default us':>10} {'best us':>8} {'bound us':>8} "
          f"{'default ms/step':>15} "
          f"{'best ms/step':>12}")
    for batch in shapes.batches:
        for num_adapters in shapes.adapters:
            rs = [r for r in results if r["batch"] == batch and r["adapters"] == num_adapters]
            d, b, bound = (sum(r[k] for r in rs) for k in ("default_us", "best_us", "bound_us"))
            print(f"{batch:>5} {num_adapters:>5} {d:>10.1f} {b:>8.1f} {bound:>8.1f} "
                  f"{d * shapes.num_layers / 1e3:>15.3f} {b * shapes.num_layers / 1e3:>12.3f}")


def bench_lora_decoder_layer(shapes: LoRABenchShapes, batch: int, num_adapters: int, device: torch.device,
                             bw: float) -> Row:
    """The 4 LoRA layers of one decoder layer through ``LinearLoRASlots`` (the engine's path:
    default or env-overridden configs, the shared reserved partials buffer), one CUDA graph."""
    from lora.batch import LoRABatch, LoRABatchState
    from lora.layers import LinearLoRASlots

    state = LoRABatchState()
    state.reserve(max(len(o) for _, o in shapes.layers.values()), batch, shapes.rank, device)
    layers, nbytes = [], 0
    for name, (in_dim, out_dims) in shapes.layers.items():
        case = make_lora_case(name, shapes, batch, num_adapters, device)
        layer = LinearLoRASlots(in_dim, list(out_dims), shapes.max_loras, shapes.rank, DTYPE, device, state,
                                "triton")
        layer.lora_a.copy_(case.lora_a)
        for dst, src in zip(layer.lora_b, case.lora_b):
            dst.copy_(src)
        state.batch = LoRABatch(meta=case.meta, segments=[])        # the same grouping for every layer
        y = case.y.clone()
        layer(case.x, y)
        err = _excess_error(y, case.y_ref)
        if not err <= 0:
            raise AssertionError(f"decoder layer {name} batch={batch} adapters={num_adapters}: "
                                 f"error beyond tolerance {err:.3g}")
        layers.append((layer, case.x, y))
        nbytes += case.compulsory_bytes

    def step() -> None:
        for layer, x, y in layers:
            layer(x, y)

    t = bench(step)
    case = f"{'+'.join(shapes.layers)} adapters={num_adapters} batch={batch}"
    per_step_ms = t.gpu_us * shapes.num_layers / 1e3
    return row("lora_decoder_layer", case, t, nbytes, bw,
               f"x{shapes.num_layers} layers = {per_step_ms:.3f} ms/step")


def print_table(rows: list[Row]) -> None:
    print(f"{'kernel':<22} {'case':<46} {'gpu us':>8} {'wall us':>8} {'host us':>8} {'bound us':>8} "
          f"{'bound/gpu':>9}  note")
    for r in rows:
        print(f"{r.kernel:<22} {r.case:<46} {r.gpu_us:>8.1f} {r.wall_us:>8.1f} {r.host_us:>8.1f} "
              f"{r.bound_us:>8.1f} {r.fraction_of_bound:>9.2f}  {r.note}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON report (default benchmarks/out/kernels.json; lora_sweep.json with "
                             "--lora-sweep)")
    parser.add_argument("--quick", action="store_true", help="one size per kernel")
    parser.add_argument("--lora-only", action="store_true",
                        help="only LoRA: shrink/expand per kernel, fixed grid (the CUDA-graph launch), batch "
                             "64/256, 1/16/64 adapters, and the 4 LoRA layers of a decoder layer in one "
                             "graph")
    parser.add_argument("--lora-sweep", action="store_true",
                        help="time candidate shrink/expand launch configs per LoRA layer (decode, fixed "
                             "grid); "
                             "print the best per case and the default's time")
    parser.add_argument("--smoke", action="store_true",
                        help="with --lora-only/--lora-sweep: tiny shapes, runs on CPU (TRITON_INTERPRET=1)")
    args = parser.parse_args(argv)
    if args.smoke and not (args.lora_only or args.lora_sweep):
        parser.error("--smoke needs --lora-only or --lora-sweep")
    if args.out is None:
        args.out = REPO / "benchmarks" / "out" / ("lora_sweep.json" if args.lora_sweep else "kernels.json")
    if not torch.cuda.is_available():
        if not args.smoke:
            print("needs CUDA: no GPU visible, nothing measured.")
            return 0
        # NOTE: before the first kernels import: triton reads it when the kernels are decorated.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = SMOKE if args.smoke else LLAMA3_8B

    bw = measure_copy_bandwidth()
    print(f"device: {_device_name()}  copy bandwidth (read+write): {bw / 1e12:.3f} TB/s")
    if args.lora_sweep:
        t0 = time.perf_counter()
        results = run_lora_sweep(shapes, device, bw, args.smoke)
        print_sweep(results, shapes)
        print(f"sweep took {time.perf_counter() - t0:.0f} s")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": _device_name(), "copy_bandwidth_bytes_per_s": bw,
                                        "torch": torch.__version__, "shapes": asdict(shapes),
                                        "cases": results}, indent=2))
        print(f"wrote {args.out}")
        return 0
    rows: list[Row] = []
    if torch.cuda.is_available():
        tiny = torch.zeros(1, device="cuda")
        rows.append(row("launch_floor", "one 4-byte memset kernel", bench(tiny.zero_), 4, bw,
                        "latency floor of any one-kernel call"))
    if args.lora_only:
        if not args.smoke:
            for out_dims in [(HIDDEN,), (HIDDEN, KV_DIM, KV_DIM)]:
                for batch in (64, 256):
                    for num_adapters in (1, 16, 64):
                        rows += bench_lora(out_dims, num_adapters, batch, bw, fixed_grid=True)[:2]
        for batch in shapes.batches:
            for num_adapters in shapes.adapters:
                rows.append(bench_lora_decoder_layer(shapes, batch, num_adapters, device, bw))
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


def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (TRITON_INTERPRET=1)"


def _report(args, rows: list[Row], bw: float) -> int:
    print_table(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"device": _device_name(), "copy_bandwidth_bytes_per_s": bw,
              "torch": torch.__version__,
              "rows": [dict(asdict(r), fraction_of_bound=r.fraction_of_bound) for r in rows]}
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
