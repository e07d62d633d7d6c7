"""Timing helpers of the kernel benchmarks: device time from CUDA-graph replays after an L2 flush,
eager wall and host time, the copy bandwidth every bound is measured against, and the row type.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

DTYPE = torch.bfloat16
"""Every kernel benchmark runs bfloat16 (the GPU serving dtype)."""


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


def capture_calls(fn: Callable[[int], object], calls: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``fn(0) .. fn(calls - 1)`` back to back, warmed up (one eager call, one replay)."""
    fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    return graph


def time_graph_calls(fn: Callable[[int], object], calls: int = 10, reps: int = 10) -> float:
    """Device microseconds per call of ``fn(i)``: one CUDA graph of ``calls`` back-to-back calls
    (``i`` = the call's index, e.g. to cycle through weight copies larger than L2), replayed
    ``reps`` times; no flush, so consecutive calls overlap their tails as in a model step."""
    graph = capture_calls(fn, calls)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    stop.record()
    torch.cuda.synchronize()
    del graph
    return start.elapsed_time(stop) * 1e3 / (reps * calls)


def time_calls(fn: Callable[[int], object], calls: int = 10, reps: int = 10) -> float:
    """Microseconds per ``fn(i)`` call: ``time_graph_calls`` on CUDA; on CPU (a sweep's ``--tiny`` run
    through the Triton interpreter) the wall clock of ``calls`` eager calls."""
    if torch.cuda.is_available():
        return time_graph_calls(fn, calls, reps)
    t0 = time.perf_counter()
    for i in range(calls):
        fn(i)
    return (time.perf_counter() - t0) / calls * 1e6


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


def time_device(fn: Callable[[], object], reps: int = 20) -> float:
    """Device microseconds of fn (CUDA graph replay, cold L2); wall clock on CPU (smoke)."""
    if torch.cuda.is_available():
        return time_graph(fn, reps=reps)
    t0 = time.perf_counter()                # the interpreter is slow and steady: one call
    fn()
    return (time.perf_counter() - t0) * 1e6


def print_table(rows: list[Row]) -> None:
    print(f"{'kernel':<22} {'case':<46} {'gpu us':>8} {'wall us':>8} {'host us':>8} {'bound us':>8} "
          f"{'bound/gpu':>9}  note")
    for r in rows:
        print(f"{r.kernel:<22} {r.case:<46} {r.gpu_us:>8.1f} {r.wall_us:>8.1f} {r.host_us:>8.1f} "
              f"{r.bound_us:>8.1f} {r.fraction_of_bound:>9.2f}  {r.note}")
