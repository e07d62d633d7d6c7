"""What ``AsyncLLM`` reports to its ``StatLogger``s: per step, the tokens and the time-to-first-token /
inter-token gaps its outputs show; per finished request, its counts and latencies."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol

from engine.outputs import RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams


class StatLogger(Protocol):
    """What the client reports per step and per finished request; ``server/metrics.py`` implements it."""

    def on_step(self, num_prompt_tokens: int, num_generation_tokens: int, ttfts_s: list[float],
                itls_s: list[float]) -> None:
        """Prompt tokens of requests that got their first output, tokens generated, and the
        time-to-first-token / inter-token gaps observed in one step."""

    def on_finished(self, finish_reason: Optional[str], num_prompt_tokens: int, num_generation_tokens: int,
                    e2e_s: float, ttft_s: Optional[float], params: SamplingParams) -> None:
        ...


@dataclass
class RequestTimings:
    """One request's token counts and timestamps, as its outputs reach the client."""

    params: SamplingParams
    """As the processor resolved them (max_tokens filled in)."""
    arrival_s: float
    """time.monotonic() when the request was added."""
    num_prompt_tokens: int
    """Prompt length in tokens (counted once, at the first token)."""
    first_token_s: Optional[float] = None
    """time.monotonic() of the first output with tokens."""
    last_token_s: Optional[float] = None
    """time.monotonic() of the latest output with tokens (inter-token gaps)."""
    num_tokens_by_index: dict[int, int] = field(default_factory=dict)
    """Sample index -> generated tokens seen so far (counters; works for every output kind)."""

    @property
    def num_generation_tokens(self) -> int:
        return sum(self.num_tokens_by_index.values())

    def count_new_tokens(self, out: RequestOutput) -> int:
        """Tokens ``out`` adds to those seen so far (recorded)."""
        seen_by_index = self.num_tokens_by_index
        if self.params.output_kind == RequestOutputKind.DELTA:
            num_new = 0
            for c in out.outputs:
                n = len(c.token_ids)
                seen_by_index[c.index] = seen_by_index.get(c.index, 0) + n
                num_new += n
            return num_new
        num_new = 0
        for c in out.outputs:
            seen = seen_by_index.get(c.index, 0)
            num_new += max(0, len(c.token_ids) - seen)
            seen_by_index[c.index] = max(seen, len(c.token_ids))
        return num_new


@dataclass
class StepMetrics:
    """The tokens and latencies of one step's outputs, summed over its requests."""

    num_prompt_tokens: int = 0
    """Prompt tokens of the requests whose first tokens came in this step."""
    num_generation_tokens: int = 0
    """Tokens generated in this step."""
    ttfts_s: list[float] = field(default_factory=list)
    """Arrival to first token, of the requests whose first tokens came in this step."""
    itls_s: list[float] = field(default_factory=list)
    """Gap since the previous tokens, of the other requests with tokens in this step."""

    def observe(self, timings: RequestTimings, out: RequestOutput, now_s: float) -> None:
        """Count the tokens ``out`` brings to its request (at ``now_s``, time.monotonic())."""
        num_new = timings.count_new_tokens(out)
        if not num_new:
            return
        self.num_generation_tokens += num_new
        if timings.first_token_s is None:
            timings.first_token_s = now_s
            self.num_prompt_tokens += timings.num_prompt_tokens
            self.ttfts_s.append(now_s - timings.arrival_s)
        else:
            self.itls_s.append(now_s - timings.last_token_s)
        timings.last_token_s = now_s

    def report(self, stat_loggers: list[StatLogger]) -> None:
        """Hand the step to ``stat_loggers`` (nothing when no tokens came)."""
        if stat_loggers and (self.num_generation_tokens or self.num_prompt_tokens):
            for sl in stat_loggers:
                sl.on_step(self.num_prompt_tokens, self.num_generation_tokens, self.ttfts_s, self.itls_s)


def report_finished(stat_loggers: list[StatLogger], timings: RequestTimings, out: RequestOutput,
                    now_s: float) -> None:
    """Hand a request's finished output ``out`` (at ``now_s``, time.monotonic()) to ``stat_loggers``."""
    reason = next((c.finish_reason for c in out.outputs if c.finish_reason), None)
    ttft = None if timings.first_token_s is None else timings.first_token_s - timings.arrival_s
    for sl in stat_loggers:
        sl.on_finished(reason, timings.num_prompt_tokens, timings.num_generation_tokens,
                       now_s - timings.arrival_s, ttft, timings.params)
