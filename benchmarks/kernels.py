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
    1/4/16/64 distinct adapters at batch 64/256 (one token per request, round robin); and the
    fused one-launch kernel (``kernels.lora_fused``) on the same case ("lora_fused").

``--lora-only``: the LoRA kernels alone, fixed grid (the CUDA-graph launch, max_loras 64), batch
64/256 x 1/16/64 adapters: shrink and expand per kernel; per LoRA layer of a Llama-3-8B decoder
layer (qkv, o, gate_up, down) the split pair ("lora_shrink+expand") next to the fused kernel
("lora_fused", its note: split time / fused time), default configs; then ``lora_decoder_layer``
rows: the 4 LoRA layers of one decoder layer (shrink + expand each, through ``LinearLoRASlots``
with its default or env-overridden configs) in one CUDA graph, each followed by
``lora_decoder_fused``: the same with the layers' kernel choice set to "fused" (as
CHORUS_LORA_KERNEL=fused; CHORUS_LORA_FUSED_CONFIG applies); gpu us is "us per decoder layer" and
the note gives "ms per step" (x32 layers). Then the same decoder layer as the engine runs it, base
GEMMs included (``Linear`` + its LoRA hook): "gemms_base" (no adapter in the step), "gemms_lora_serial"
(overlap off) and "gemms_lora_overlap" (the shrink on the side stream); their notes give the LoRA
cost over the base GEMMs, which shows how much the overlap hides (run with CHORUS_GEMM_SM_CARVEOUT=N
to leave cuBLAS N fewer SMs).

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
import json
import math
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
# NOTE: this file is named kernels.py: drop its own folder from the path so that ``import
# kernels.lora_shrink`` finds the repository's package, not this script.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(REPO))

from benchmarks.kernel_timing import (DTYPE, Row, bench, measure_copy_bandwidth, print_table,  # noqa: E402
                                      row)
from benchmarks.lora_sweep import (HIDDEN, KV_DIM, LLAMA3_8B, MAX_LORAS, RANK, SMOKE,  # noqa: E402
                                   bench_lora_decoder_layer, bench_lora_layer_kernels, bench_lora_with_gemms,
                                   excess_error, print_sweep, run_lora_sweep)

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, CTX_LEN = 32, 8, 128, 16, 512


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
    from kernels.lora_fused import lora_shrink_expand
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
    if err_s > 1e-2 or excess_error(y_out, y_ref) > 0:
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

    y_fused = y.clone()
    lora_shrink_expand(x, lora_a, lora_b, meta, y_fused, offsets)
    if excess_error(y_fused, y_ref) > 0:
        raise AssertionError(f"lora_fused {out_dims} adapters={num_adapters} batch={batch}: "
                             f"error beyond tolerance {excess_error(y_fused, y_ref):.3g}")
    fused_bytes = shrink_bytes + expand_bytes - 2 * buf.numel() * 4                # no partials

    t_shrink = bench(lambda: lora_shrink(x, lora_a, meta, buf))
    t_expand = bench(lambda: lora_expand(buf, lora_b, meta, y, offsets))
    t_both = bench(both)
    t_fused = bench(lambda: lora_shrink_expand(x, lora_a, lora_b, meta, y, offsets))
    return [row("lora_shrink", case, t_shrink, shrink_bytes, bw),
            row("lora_expand", case, t_expand, expand_bytes, bw),
            row("lora_shrink+expand", case, t_both, shrink_bytes + expand_bytes, bw,
                f"maxerr={max(err_s, err_e):.2g}"),
            row("lora_fused", case, t_fused, fused_bytes, bw, f"{t_both.gpu_us / t_fused.gpu_us:.2f}x split")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON report (default benchmarks/out/kernels.json; lora_sweep.json with "
                             "--lora-sweep)")
    parser.add_argument("--quick", action="store_true", help="one size per kernel")
    parser.add_argument("--lora-only", action="store_true",
                        help="only LoRA: shrink/expand per kernel, fixed grid (the CUDA-graph launch), batch "
                             "64/256, 1/16/64 adapters, split pair vs fused kernel per LoRA layer, and the 4 "
                             "LoRA layers of a decoder layer in one graph (split, then fused)")
    parser.add_argument("--lora-sweep", action="store_true",
                        help="time candidate shrink/expand launch configs per LoRA layer (decode, fixed "
                             "grid); "
                             "print the best per case and the default's time")
    parser.add_argument("--smoke", action="store_true",
                        help="with --lora-only/--lora-sweep: tiny shapes, runs on CPU (TRITON_INTERPRET=1)")
    parser.add_argument("--timeline", action="store_true",
                        help="with --lora-only: print the kernel timeline (stream, start, duration) of one "
                             "decoder layer's GEMMs + overlapped LoRA at the first batch size")
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
        from engine.model_runner import apply_gemm_sm_carveout
        apply_gemm_sm_carveout()                  # CHORUS_GEMM_SM_CARVEOUT, as the engine does
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
                rows += bench_lora_layer_kernels(shapes, batch, num_adapters, device, bw)
                split = bench_lora_decoder_layer(shapes, batch, num_adapters, device, bw)
                fused = bench_lora_decoder_layer(shapes, batch, num_adapters, device, bw, kernel="fused")
                fused.note += f"; {split.gpu_us / fused.gpu_us:.2f}x split"
                rows += [split, fused]
                rows += bench_lora_with_gemms(shapes, batch, num_adapters, device, bw,
                                              timeline=args.timeline and batch == shapes.batches[0])
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
