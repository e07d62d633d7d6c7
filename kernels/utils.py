"""Shared helpers for the kernel wrappers: argument checks and launch-size arithmetic.

Every wrapper checks its inputs with these before launch and raises ``ValueError`` naming
the argument, what was expected and what it got. No triton import here.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def is_interpreted(device: torch.device) -> bool:
    """True when triton runs on CPU tensors, i.e. under TRITON_INTERPRET=1.

    NOTE: triton can only launch on CPU tensors through its interpreter, so the device tells
    us the mode without reading the environment. Wrappers pick tiny tiles in this mode.
    """
    return device.type == "cpu"


def check_tensor(name: str, t: object, *, ndim: Optional[int] = None,
                 dtypes: Optional[Iterable[torch.dtype]] = None,
                 shape: Optional[Sequence[Optional[int]]] = None,
                 device: Optional[torch.device] = None, contiguous: bool = False,
                 last_dim_contiguous: bool = False) -> torch.Tensor:
    """Validate one tensor argument; ``None`` in ``shape`` means any size on that dim."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}.")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(t.shape)}.")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            raise ValueError(f"{name}: dtype {t.dtype} not supported; expected one of {dtypes}.")
    if shape is not None:
        if len(shape) != t.dim() or any(s is not None and s != ts for s, ts in zip(shape, t.shape)):
            want = tuple("*" if s is None else s for s in shape)
            raise ValueError(f"{name}: expected shape {want}, got {tuple(t.shape)}.")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: on {t.device}, expected {device} (all inputs on one device).")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous (strides {t.stride()} for shape {tuple(t.shape)}).")
    if last_dim_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: last dim must have stride 1, got strides {t.stride()}.")
    return t


def check_pow2_field(owner: str, name: str, value: object, min_value: int, max_value: int) -> None:
    """ValueError naming ``owner.name`` unless value is a power of two in [min_value, max_value] (a config
    field's check)."""
    if (isinstance(value, bool) or not isinstance(value, int) or not min_value <= value <= max_value
            or value & (value - 1)):
        raise ValueError(f"{owner}.{name}: {value!r} must be a power of two in [{min_value}, {max_value}].")


def check_int(name: str, v: object, *, min_value: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{name}: expected a host int, got {type(v).__name__}.")
    if v < min_value:
        raise ValueError(f"{name}: expected >= {min_value}, got {v}.")
    return v


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a small stand-in under the interpreter)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count
