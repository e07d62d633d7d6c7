"""What every layer of one forward pass may read: the step's attention metadata, the engine's
kernel policy, and the one adapter update in flight between a projection and its consumer.

The runner (and the CUDA-graph capture) enters ``forward_context(meta, policy)`` around each
forward; layers read it with ``get_forward_context()``. Forward passes do not nest.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Optional

import torch

from engine.kernel_policy import KernelPolicy

if TYPE_CHECKING:
    from engine.attention import AttentionMetadata
    from engine.pending_update import PendingUpdate
    from kernels.cpu_layer_ops import CpuLayerOps


@dataclass
class ForwardContext:
    """The state of one forward pass, shared by all its layers."""

    attn_metadata: Optional["AttentionMetadata"]
    """The step's attention inputs (None for a forward without attention, e.g. a layer test)."""
    policy: KernelPolicy
    """The engine's fast-path choices (``engine.kernel_policy``)."""
    pending_update: Optional["PendingUpdate"] = None
    """An adapter update a Linear left to its consumer (``engine.layers.adapter``); None between ops."""
    cross_attn_metadata: Optional["AttentionMetadata"] = None
    """Encoder-decoder models: the step's requests over their cross blocks, every position visible to
    every query token (``AttentionBackend.attend_cross``); None for decoder-only models."""
    cpu_ops: Optional["CpuLayerOps"] = None
    """On CPU, the C layer ops (add + RMSNorm, SiLU-and-mul, rotary + KV write) the runner loaded per
    ``KernelPolicy.cpu_layer_ops``; None: torch's."""


class _Local(threading.local):
    current: Optional[ForwardContext] = None


_LOCAL = _Local()
"""The forward pass of this thread (two engines may run in one process, each loop in its own thread)."""


@contextlib.contextmanager
def forward_context(meta: Optional["AttentionMetadata"], policy: Optional[KernelPolicy] = None,
                    cross_meta: Optional["AttentionMetadata"] = None,
                    cpu_ops: Optional["CpuLayerOps"] = None) -> Iterator[ForwardContext]:
    """Make ``meta``, ``policy`` (None: ``default_policy()``), ``cross_meta`` (encoder-decoder
    models) and ``cpu_ops`` visible to every layer for one forward pass. Refuses nesting; on exit an
    update still pending is an error (its consumer never ran)."""
    local = _LOCAL
    if local.current is not None:
        raise RuntimeError("forward_context is already active; forward passes do not nest.")
    ctx = ForwardContext(meta, policy or default_policy(), cross_attn_metadata=cross_meta, cpu_ops=cpu_ops)
    local.current = ctx
    try:
        yield ctx
    finally:
        local.current = None
    if ctx.pending_update is not None:
        raise RuntimeError("a forward pass ended with an adapter update still pending: the Linear's Feeds "
                           "names a consumer the model never ran.")


def current_forward_context() -> Optional[ForwardContext]:
    """The active context, or None outside a forward pass."""
    return _LOCAL.current


def get_forward_context() -> ForwardContext:
    current = _LOCAL.current
    if current is None:
        raise RuntimeError("a layer that needs the step's state ran outside forward_context(); the runner sets it.")
    return current


def current_policy() -> KernelPolicy:
    """The active forward's kernel policy; outside one (layer tests, tools) ``default_policy()``."""
    current = _LOCAL.current
    return current.policy if current is not None else default_policy()


def current_cpu_ops() -> Optional["CpuLayerOps"]:
    """The active forward's CPU layer ops (None outside a forward pass, off the CPU, or without a compiler)."""
    current = _LOCAL.current
    return current.cpu_ops if current is not None else None


def default_policy() -> KernelPolicy:
    """The policy of an engine on this machine's default device (CUDA device 0 where there is one),
    with ``CHORUS_KERNEL_POLICY`` applied (read on each call: for tests and tools, not the engine)."""
    return KernelPolicy.for_device(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
