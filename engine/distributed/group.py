"""``TensorParallelGroup``: this process's rank among the tensor-parallel ranks, and the collectives
the sharded layers and the engine use.

Passed explicitly to the model builder, the model's layers and the engine (no module-level
process-group state of our own). At size 1 every collective returns its input untouched and no
``torch.distributed`` call is made, so a one-process engine pays nothing.

Two process groups, as vLLM keeps them: ``device_group`` for tensors (NCCL on CUDA, gloo on CPU)
and ``cpu_group`` (always gloo) for Python objects, so broadcasting the step's ``SchedulerOutput``
never goes through a GPU copy.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Any, Optional

import torch

ENV_MASTER_ADDR = "MASTER_ADDR"
ENV_MASTER_PORT = "MASTER_PORT"


@dataclass
class TensorParallelGroup:
    """One rank's view of the tensor-parallel group."""

    rank: int
    """This process's rank, 0 .. size - 1 (rank 0 runs the scheduler)."""
    size: int
    """Ranks in the group (``--tensor-parallel-size``)."""
    device_group: Any = None
    """``torch.distributed`` group for tensor collectives (NCCL on CUDA, gloo on CPU); None at size 1."""
    cpu_group: Any = None
    """gloo group for object broadcasts (the step messages); None at size 1."""

    @classmethod
    def single(cls) -> "TensorParallelGroup":
        """The group of a one-process engine: every collective is a no-op."""
        return cls(rank=0, size=1)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks; returns the sum: x itself (in place), or, where x is a strided view
        (e.g. an adapter's stacked GEMM output, ``y = out[:, :n]``), a contiguous copy (NCCL's rule)."""
        if self.size > 1:
            x = x.contiguous()
            torch.distributed.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's x concatenated along ``dim`` in rank order: [..., d, ...] -> [..., size * d, ...]."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]       # size x [..., d, ...]
        torch.distributed.all_gather(parts, x, group=self.device_group)
        return torch.cat(parts, dim=dim)

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (pickled over the gloo group); other ranks pass nothing."""
        if self.size == 1:
            return obj
        box = [obj if self.rank == 0 else None]
        torch.distributed.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def min_int(self, value: int) -> int:
        """The smallest ``value`` over the ranks (e.g. the KV blocks every rank can hold)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())


def free_port() -> int:
    """A TCP port nobody listens on now (the rendezvous port; a tiny race with other programs remains)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_tensor_parallel(rank: int, size: int, device: torch.device, timeout_s: float,
                         master_addr: Optional[str] = None, master_port: Optional[int] = None
                         ) -> TensorParallelGroup:
    """Join the ``size``-rank group through torch.distributed's ``env://`` rendezvous (MASTER_ADDR /
    MASTER_PORT: given here, or already set, e.g. by torchrun). NCCL for tensors on CUDA, gloo on CPU;
    a gloo group for objects either way. Collectives fail after ``timeout_s`` instead of hanging."""
    import torch.distributed as dist

    if size == 1:
        return TensorParallelGroup.single()
    require_no_process_group()
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    given = {ENV_MASTER_ADDR: master_addr, ENV_MASTER_PORT: None if master_port is None else str(master_port)}
    saved = {k: os.environ.get(k) for k in given}
    os.environ.update({k: v for k, v in given.items() if v is not None})
    try:
        dist.init_process_group(backend=backend, init_method="env://", rank=rank, world_size=size, timeout=timeout)
    finally:   # a later engine in this process picks its own port (unless the environment names one)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
    return TensorParallelGroup(rank=rank, size=size, device_group=dist.group.WORLD, cpu_group=cpu_group)


def require_no_process_group() -> None:
    """RuntimeError when this process already has torch.distributed's default group (one per process:
    an engine's group must be destroyed, ``destroy_tensor_parallel``, before the next one forms)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        raise RuntimeError("torch.distributed's default process group already exists in this process: "
                           "another tensor-parallel engine is still open (close it first: LLM.close(), or "
                           "`with LLM(...) as llm:`), or the program formed a group of its own.")


def destroy_tensor_parallel(group: TensorParallelGroup) -> None:
    """Leave the group (a later engine in this process may form a new one)."""
    import torch.distributed as dist

    if group.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
