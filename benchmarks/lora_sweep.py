"""LoRA per decoder layer (the 4 LoRA layers through the engine's path), per LoRA layer (the split
shrink + expand pair vs the fused one-launch kernel, ``kernels.lora_fused``) and the launch-config
sweep of the shrink/expand kernels; ``benchmarks/kernels.py --lora-only / --lora-sweep`` run them.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import asdict, dataclass

import torch

from benchmarks.kernel_timing import DTYPE, Row, bench, row, time_device

HIDDEN, KV_DIM, INTERMEDIATE, RANK, MAX_LORAS = 4096, 1024, 14336, 16, 64
"""Llama-3-8B's projection sizes; rank-16 adapters in 64 slots."""


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
            "gate_up": (HIDDEN, (INTERMEDIATE, INTERMEDIATE)), "down": (INTERMEDIATE, (HIDDEN,))},
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


def lora_fused_call(case: LoRALayerCase, cfg, y: torch.Tensor):
    """The fused shrink + expand of one LoRA layer (``kernels.lora_fused``) with an explicit config."""
    from kernels.lora_fused import lora_shrink_expand

    def run() -> None:
        lora_shrink_expand(case.x, case.lora_a, case.lora_b, case.meta, y, case.offsets, config=cfg)
    return run


def default_configs(case: LoRALayerCase, device: torch.device) -> tuple:
    """(shrink, expand, fused) default launch configs of one LoRA layer case (no env overrides)."""
    from kernels.lora_expand import lora_expand_config
    from kernels.lora_fused import lora_fused_config
    from kernels.lora_shrink import lora_shrink_config

    T, in_dim = case.x.shape
    out_dims = tuple(b.shape[1] for b in case.lora_b)
    num_active = case.meta.num_active
    return (lora_shrink_config(T, num_active, case.lora_a.shape[0], in_dim, device),
            lora_expand_config(T, num_active, out_dims, device),
            lora_fused_config(T, num_active, in_dim, out_dims, device))


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


def excess_error(y: torch.Tensor, y_ref: torch.Tensor) -> float:
    """Largest |y - y_ref| beyond bf16 tolerance (atol 6e-2 + rtol 1.6e-2: one bf16 ulp of a
    value in [8, 16) is 0.0625); <= 0 passes."""
    diff = (y.float() - y_ref.float()).abs() - (6e-2 + 1.6e-2 * y_ref.float().abs())
    return diff.max().item()


def _cfg_str(cfg) -> str:
    return ",".join(f"{k}={v}" for k, v in asdict(cfg).items())


def sweep_lora_case(case: LoRALayerCase, device: torch.device, smoke: bool) -> dict:
    """Time shrink+expand pairs: every shrink candidate with the default expand, then every
    expand candidate with the best shrink. Each candidate is checked against the twins first."""
    from kernels.lora_meta import MAX_SPLIT_K

    T, in_dim = case.x.shape
    S, R = case.lora_a.shape[0], case.lora_a.shape[2]
    out_dims = tuple(b.shape[1] for b in case.lora_b)
    partials = torch.empty(S * MAX_SPLIT_K * T * R, dtype=torch.float32, device=device)  # [capacity]
    d_shrink, d_expand, _ = default_configs(case, device)

    def measure(s_cfg, e_cfg) -> float:
        y = case.y.clone()
        lora_pair(case, s_cfg, e_cfg, partials, y)()
        err = excess_error(y, case.y_ref)
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


def bench_lora_layer_kernels(shapes: LoRABenchShapes, batch: int, num_adapters: int, device: torch.device,
                             bw: float) -> list[Row]:
    """Per LoRA layer of a decoder layer: the split pair ("lora_shrink+expand", two launches) and the
    fused kernel ("lora_fused", one launch), default configs, each checked against the twins, timed
    alike; the bound of both is the layer's compulsory bytes (no partials)."""
    from kernels.lora_meta import MAX_SPLIT_K

    rows = []
    for name in shapes.layers:
        case = make_lora_case(name, shapes, batch, num_adapters, device)
        S, T, R = case.lora_a.shape[0], case.x.shape[0], case.lora_a.shape[2]
        partials = torch.empty(S * MAX_SPLIT_K * T * R, dtype=torch.float32, device=device)  # [capacity]
        d_shrink, d_expand, d_fused = default_configs(case, device)
        runs = {"lora_shrink+expand": lambda y: lora_pair(case, d_shrink, d_expand, partials, y),
                "lora_fused": lambda y: lora_fused_call(case, d_fused, y)}
        times = {}
        for kernel, make_run in runs.items():
            y = case.y.clone()
            make_run(y)()
            err = excess_error(y, case.y_ref)
            if not err <= 0:
                raise AssertionError(f"{kernel} {name} batch={batch} adapters={num_adapters}: "
                                     f"error beyond tolerance {err:.3g}")
            times[kernel] = bench(make_run(y))
        label = (f"{name} {case.x.shape[1]}->{'+'.join(str(b.shape[1]) for b in case.lora_b)} "
                 f"adapters={num_adapters} batch={batch}")
        split, fused = times["lora_shrink+expand"], times["lora_fused"]
        rows.append(row("lora_shrink+expand", label, split, case.compulsory_bytes, bw,
                        f"split_k={d_shrink.split_k} n_tiles={d_expand.n_tiles}"))
        rows.append(row("lora_fused", label, fused, case.compulsory_bytes, bw,
                        f"{split.gpu_us / fused.gpu_us:.2f}x split; {_cfg_str(d_fused)}"))
    return rows


def _decoder_lora_layers(shapes: LoRABenchShapes, batch: int, num_adapters: int, device: torch.device,
                         kernel: str = "split"):
    """(state, [(LinearLoRASlots, x, y)], compulsory bytes): one decoder layer's LoRA layers built
    the engine's way (a reserved shared partials buffer, one grouping for every layer), each checked
    once against its reference. ``kernel``: the layers' kernel choice ("split" or "fused")."""
    from lora.batch import LoRABatch, LoRABatchState
    from lora.layers import LinearLoRASlots

    state = LoRABatchState()
    state.reserve(max(len(o) for _, o in shapes.layers.values()), batch, shapes.rank, device)
    layers, nbytes = [], 0
    for name, (in_dim, out_dims) in shapes.layers.items():
        case = make_lora_case(name, shapes, batch, num_adapters, device)
        layer = LinearLoRASlots(in_dim, list(out_dims), shapes.max_loras, shapes.rank, DTYPE, device, state,
                                "triton")
        layer.overrides = dataclasses.replace(layer.overrides, kernel=kernel)
        layer.lora_a.copy_(case.lora_a)
        for dst, src in zip(layer.lora_b, case.lora_b):
            dst.copy_(src)
        state.batch = LoRABatch(meta=case.meta, segments=[], slot_bound=case.meta.active_slots.numel())        # the same grouping for every layer
        y = case.y.clone()
        layer(case.x, y)
        err = excess_error(y, case.y_ref)
        if not err <= 0:
            raise AssertionError(f"decoder layer {name} ({kernel}) batch={batch} adapters={num_adapters}: "
                                 f"error beyond tolerance {err:.3g}")
        layers.append((layer, case.x, y))
        nbytes += case.compulsory_bytes
    return state, layers, nbytes


def bench_lora_decoder_layer(shapes: LoRABenchShapes, batch: int, num_adapters: int, device: torch.device,
                             bw: float, kernel: str = "split") -> Row:
    """The 4 LoRA layers of one decoder layer through ``LinearLoRASlots`` (the engine's path:
    default or env-overridden configs, the shared reserved partials buffer), one CUDA graph.

    ``kernel``: the layers' kernel choice ("split" or "fused", as CHORUS_LORA_KERNEL; set here
    whatever the environment says, so that one run times both).
    """
    _, layers, nbytes = _decoder_lora_layers(shapes, batch, num_adapters, device, kernel)

    def step() -> None:
        for layer, x, y in layers:
            layer(x, y)

    t = bench(step)
    case = f"{'+'.join(shapes.layers)} adapters={num_adapters} batch={batch}"
    per_step_ms = t.gpu_us * shapes.num_layers / 1e3
    return row("lora_decoder_layer" if kernel == "split" else f"lora_decoder_{kernel}", case, t, nbytes, bw,
               f"x{shapes.num_layers} layers = {per_step_ms:.3f} ms/step")


def bench_lora_with_gemms(shapes: LoRABenchShapes, batch: int, num_adapters: int, device: torch.device,
                          bw: float, timeline: bool = False) -> list[Row]:
    """One decoder layer's 4 projections as the engine runs them (``engine.layers.linear.Linear``:
    the cuBLAS GEMM plus its LoRA hook), one CUDA graph each: the base GEMMs alone (no adapter in
    the step), then with the adapters, shrink after the GEMM (overlap off) and shrink on the side
    stream beside it (overlap on, the default), and the same with the side stream at the highest
    priority ("overlap_hiprio", CUDA only). ``timeline``: also print the overlap case's kernel
    timeline (``print_timeline``). A LoRA row's note gives its cost over the base row;
    the drop from off to on is what the overlap hides. CHORUS_GEMM_SM_CARVEOUT applies when set
    (``benchmarks/kernels.py`` applies it first)."""
    from engine.layers.linear import Linear

    state, layers, nbytes = _decoder_lora_layers(shapes, batch, num_adapters, device)
    linears = []
    for (slots, x, _), (in_dim, out_dims) in zip(layers, shapes.layers.values()):
        lin = Linear(in_dim, list(out_dims)).to(device=device, dtype=DTYPE)
        lin.weight.data.normal_(std=in_dim ** -0.5)
        lin.lora = slots
        linears.append((lin, x))
    weight_bytes = sum(lin.weight.numel() * lin.weight.element_size() for lin, _ in linears)

    def step() -> None:
        for lin, x in linears:
            lin(x)

    lora_batch, state.batch = state.batch, None
    base = bench(step)
    case = f"{'+'.join(shapes.layers)} adapters={num_adapters} batch={batch}"
    rows = [row("gemms_base", f"{'+'.join(shapes.layers)} batch={batch}", base, weight_bytes, bw,
                "the 4 GEMMs, no adapter in the step")]
    state.batch = lora_batch
    variants = [("serial", False, None), ("overlap", True, None)]
    if torch.cuda.is_available():
        # The side stream at the highest priority: its CTAs go first whenever an SM frees up.
        variants.append(("overlap_hiprio", True, torch.cuda.Stream(device=device, priority=-1)))
    import lora.layers as lora_layers

    default_side = lora_layers.side_stream
    for name, overlap, stream in variants:
        for slots, _, _ in layers:
            slots.overlap = overlap
        if stream is not None:
            lora_layers.side_stream = lambda _index, s=stream: s
        try:
            t = bench(step)
            if name == "overlap" and timeline and torch.cuda.is_available():
                print_timeline(step, f"{case} overlap")
        finally:
            lora_layers.side_stream = default_side
        cost_ms = (t.gpu_us - base.gpu_us) * shapes.num_layers / 1e3
        rows.append(row(f"gemms_lora_{name}", case, t, weight_bytes + nbytes, bw,
                        f"LoRA +{t.gpu_us - base.gpu_us:.1f} us/layer = +{cost_ms:.3f} ms/step"))
    return rows


def print_timeline(fn, title: str) -> None:
    """Print the kernels of one CUDA-graph replay of fn as the profiler saw them: stream, start
    (us from the first kernel), duration, name. Shows whether side-stream kernels really run beside
    the main stream's (overlapping intervals) or only after them."""
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    graph = torch.cuda.CUDAGraph()
    fn()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name)).get("traceEvents", [])
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    print(f"timeline: {title}: {len(kernels)} kernels")
    if not kernels:
        return
    t0 = kernels[0]["ts"]
    for e in kernels:
        print(f"  stream {e.get('args', {}).get('stream', '?'):>4}  start {e['ts'] - t0:8.1f}  "
              f"dur {e['dur']:7.1f}  {e['name'][:90]}")

