"""The seam through which per-token adapter updates enter the layer library.

Models are plain: a model file builds ``Linear`` layers, says what reads each one's output
(``Feeds``), and calls them. Something that adds a per-token update ``y += delta(x)`` to a Linear
(``lora.layers.LinearLoRASlots`` implements it) is attached as the Linear's ``adapter``
(``LinearAdapter``); nothing in ``engine/`` knows what the update is.

Fusing an update into the op after the projection (gate/up into SiLU-and-mul, q/k/v into the
rotary + KV write, o/down into the residual add + RMSNorm) saves a launch and a round trip of
the output. The Linear then returns its base output and leaves a ``PendingUpdate``
(``engine.pending_update``) in the forward context (``defer_update``); the consumer op, a layer of
this library, takes it by its input (``take_update``) and completes it. Only a Linear whose
``feeds`` names such a consumer defers, and the consumer is the next op to read that output, so a
model never sees an incomplete tensor and never passes an update along by hand.
"""

from __future__ import annotations

import enum
from typing import Optional, Protocol

import torch

from engine.forward_context import current_forward_context, get_forward_context
from engine.pending_update import PendingUpdate


class Feeds(enum.Enum):
    """What reads a ``Linear``'s output, declared by the model when it builds the layer."""

    ANY = "any"
    """Anything: the output is complete when ``forward`` returns."""
    ROTARY_KV_WRITE = "rotary_kv_write"
    """Packed q | k | v, read by the attention layer's rotary + KV write (``PagedAttention``)."""
    SILU_MUL = "silu_mul"
    """Packed gate | up, read by SiLU-and-mul (``engine.layers.activation.silu_and_mul``)."""
    ADD_RMS_NORM = "add_rms_norm"
    """Read by the next residual add + RMSNorm only (``engine.layers.norm.RMSNorm``); the output may
    also be split-K partials [num_parts, num_tokens, out] that the norm sums."""


class AdaptedWeights(Protocol):
    """What an adapter reads of the layer it is attached to (an ``engine.layers.linear.Linear``)."""

    weight: torch.Tensor
    """[out, in] the base projection's weight."""
    bias: Optional[torch.Tensor]
    """[out] the base projection's bias, or None."""


class LinearAdapter(Protocol):
    """A per-token update attached to one ``Linear`` (``Linear.adapter``)."""

    def adds_nothing(self) -> bool:
        """True when this step adds nothing here: the Linear runs its plain (and fused) base paths."""

    def defers(self, num_tokens: int, feeds: Feeds) -> bool:
        """Whether a step of num_tokens tokens leaves the update to a consumer of kind ``feeds``."""

    def run(self, linear: AdaptedWeights, x: torch.Tensor, defer: bool
            ) -> tuple[torch.Tensor, Optional[PendingUpdate]]:
        """(y, pending): the base projection of x [num_tokens, in] with the update added, or, with
        ``defer``, possibly still to add (pending; None when y is complete)."""


# ----------------------------------------------------------------------------------------
# The one update in flight between a producer Linear and its consumer
# ----------------------------------------------------------------------------------------
def defer_update(pending: PendingUpdate) -> None:
    """Leave ``pending`` for the consumer of ``pending.y`` (inside the forward context)."""
    ctx = get_forward_context()
    if ctx.pending_update is not None:
        raise RuntimeError("an adapter update is already pending: its consumer never ran (a model read a "
                           "Linear's output with an op that its Feeds does not name).")
    ctx.pending_update = pending


def take_update(x: torch.Tensor) -> Optional[PendingUpdate]:
    """The update pending on the tensor x starts (x is the producer's output or a view at its
    start, e.g. q of a packed q | k | v), removed from the context; None when there is none.

    NOTE: called by every consumer op on every forward, so it costs one attribute read when no
    forward context or no update is active.
    """
    ctx = current_forward_context()
    if ctx is None or ctx.pending_update is None:
        return None
    pending = ctx.pending_update
    if pending.y.data_ptr() != x.data_ptr():
        return None
    ctx.pending_update = None
    return pending


def has_pending_update() -> bool:
    """An update is in flight (a fused input-side path must not read its producer's output raw)."""
    ctx = current_forward_context()
    return ctx is not None and ctx.pending_update is not None
