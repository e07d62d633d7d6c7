"""``StepTimer``: CUDA events around each step's device work, for the GPU-busy fraction of wall time.

Set it as the runner's step observer (``engine.runner.step_observer.StepObserver``)::

    timer = engine.runner.step_observer = StepTimer()
    ...                                   # run steps
    engine.runner.step_observer = None
    timer.summary()
"""

from __future__ import annotations

from typing import Optional

import torch


class StepTimer:
    """Step i's interval runs from the event recorded before its input copies to the one after its
    sampled-id copy; intervals never overlap (one stream). busy = sum(intervals) / span, where
    span runs from the first start to the last end. NOTE: launch gaps inside an eager step count
    as busy; CUDA-graph steps have none. Each step also carries its kind ("decode graph",
    "mixed graph", "eager") and token counts, so ``summary`` can say where the device time went.
    """

    def __init__(self) -> None:
        self.intervals: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.kinds: list[tuple[str, int, int]] = []   # (kind, num_tokens, num_tokens run incl. padding)
        self._start: Optional[torch.cuda.Event] = None

    def begin(self, kind: str = "step", num_tokens: int = 0, num_tokens_run: int = 0) -> None:
        self._start = torch.cuda.Event(enable_timing=True)
        self._start.record()
        self.kinds.append((kind, num_tokens, num_tokens_run or num_tokens))

    def end(self) -> None:
        stop = torch.cuda.Event(enable_timing=True)
        stop.record()
        self.intervals.append((self._start, stop))

    def summary(self) -> dict:
        torch.cuda.synchronize()
        if not self.intervals:
            return dict(steps=0, gpu_busy_ms=0.0, span_ms=0.0, busy_fraction=0.0, by_kind={})
        times = [a.elapsed_time(b) for a, b in self.intervals]
        busy = sum(times)
        span = self.intervals[0][0].elapsed_time(self.intervals[-1][1])
        by_kind: dict[str, dict] = {}
        for (kind, n, n_run), ms in zip(self.kinds, times):
            k = by_kind.setdefault(kind, dict(steps=0, gpu_ms=0.0, tokens=0, tokens_run=0))
            k["steps"] += 1
            k["gpu_ms"] += ms
            k["tokens"] += n
            k["tokens_run"] += n_run
        return dict(steps=len(self.intervals), gpu_busy_ms=busy, span_ms=span,
                    busy_fraction=busy / span if span > 0 else 0.0, by_kind=by_kind)
