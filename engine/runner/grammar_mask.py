"""The grammar bitmask of a step's constrained rows: asked for once the forward is launched, so that its
host fill (the matchers, ``engine.structured_output.manager``) overlaps the device's work, then copied to
the device for the sampler (``engine.sampler.TokenBitmask``).

A step with constrained requests (``SchedulerOutput.structured_output_req_ids``) runs with a
``GrammarSource``: ``ModelRunner.execute_async`` calls it with the step's sampling requests, in logits-row
order, between the forward and the sampler. On rank 0 it is the engine core's (which first settles the step
in flight, so every matcher has its request's previous tokens, then fills the bitmask); on the other
tensor-parallel ranks it receives rank 0's bitmask (every rank samples every row, so every rank applies the
same mask).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import torch

from engine.sampler import TokenBitmask

if TYPE_CHECKING:
    from engine.structured_output.manager import GrammarBitmask

GrammarSource = Callable[[list[str]], Optional["GrammarBitmask"]]
"""The step's sampling request ids (logits-row order) -> the host bitmask of its constrained rows (None:
none of them is constrained)."""


def to_device(grammar: "GrammarBitmask", device: torch.device) -> TokenBitmask:
    """``grammar`` on ``device`` (non-blocking copies from pinned memory on CUDA: the forward is not waited
    for)."""
    if device.type == "cpu":
        return TokenBitmask(grammar.bitmask, list(grammar.row_indices))
    host = grammar.bitmask if grammar.bitmask.is_pinned() else grammar.bitmask.pin_memory()  # [rows, words]
    rows = torch.tensor(grammar.row_indices, dtype=torch.int64).pin_memory()  # [K]
    return TokenBitmask(host.to(device, non_blocking=True), rows.to(device, non_blocking=True))
