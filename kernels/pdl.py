"""Programmatic dependent launch (PDL, Hopper and later): experimental, off by default.

With PDL a kernel may be launched while the kernel before it in the stream is still running:
its programs start, run what does not depend on the predecessor (step inputs such as
``seq_lens`` or ``slot_mapping``), then block in ``gdc_wait`` until the predecessor has finished
and its writes are visible. Each PDL kernel here waits first and then lets its own successor
launch (``gdc_launch_dependents``), so every read or write of data another kernel produces or
consumes comes after the wait: the order of memory effects is that of a plain launch. What it can
save is the launch gap between two kernels and, for the decode attention kernel, its first load of
``seq_lens`` (see ``kernels.paged_decode``); a decode step has ~340 kernel boundaries.

Kernels that take it: ``layer_ops.add_rms_norm``, ``layer_ops.silu_and_mul``,
``kv_write.rotary_write_kv`` and ``paged_decode``. The engine turns it on with CHORUS_PDL=1
(``engine.envs.pdl``), off by default: measured on an H200 (Llama-3-8B shape), -0.1 ms per
batch-256 decode step but +0.02 to +0.1 ms at batch 1, 32 and 128 (only these four of the ~300
kernels of a step take it; cuBLAS's GEMMs launch plainly). The interpreter has no ``gdc_*``, so
CPU runs always launch without it.
"""

from __future__ import annotations

from functools import lru_cache

import torch

import triton
import triton.language as tl

_enabled = False


def set_pdl(enabled: bool) -> None:
    """Launch the kernels listed above with PDL on devices that support it (compute capability 9+)."""
    global _enabled
    _enabled = bool(enabled)


@lru_cache(maxsize=None)
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def use_pdl(device: torch.device) -> bool:
    """Whether a launch on ``device`` takes PDL now (never on CPU tensors, i.e. the interpreter)."""
    return _enabled and device.type == "cuda" and _supported(device.index if device.index is not None
                                                             else torch.cuda.current_device())


def launch_kwargs(pdl: bool) -> dict:
    """Extra launch options for a kernel launched with ``PDL=pdl``."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def pdl_wait_then_release(PDL: tl.constexpr):
    """With PDL: wait until the previous kernel in the stream has finished (its writes visible),
    then let the next kernel launch. Without: nothing."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
