"""``StepObserver``: what a profiler implements to see each step's device work
(``benchmarks/step_timer.py``)."""

from __future__ import annotations

from typing import Protocol


class StepObserver(Protocol):
    """Called around each launched step, on the host, in launch order."""

    def begin(self, kind: str, num_tokens: int, num_tokens_run: int) -> None:
        """Before the step's input copies: its kind ("decode graph", "mixed graph", "eager"), its tokens and
        the tokens it runs (with a graph's padding)."""

    def end(self) -> None:
        """After the step's sampled-id copy was launched."""
