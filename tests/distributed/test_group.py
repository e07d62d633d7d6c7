"""``TensorParallelGroup``'s collectives over a real 2-process gloo group (the NCCL rules that matter
hold for gloo too): an all-reduce of a strided view, as an adapter's stacked GEMM hands the
row-parallel layers on CUDA (``y = out[:, :n]``), sums into a contiguous result."""

from __future__ import annotations

import multiprocessing

import torch

from engine.distributed.group import destroy_tensor_parallel, free_port, init_tensor_parallel

TIMEOUT_S = 60.0


def _rank(rank: int, port: int, results) -> None:
    group = init_tensor_parallel(rank, 2, torch.device("cpu"), TIMEOUT_S, "127.0.0.1", port)
    try:
        wide = torch.arange(12, dtype=torch.float32).view(3, 4) * (rank + 1)   # [3, 4]
        view = wide[:, :2]                                                   # [3, 2], strides (4, 1)
        summed = group.all_reduce(view)
        results.put((rank, summed.tolist(), summed.is_contiguous(),
                     group.all_gather(torch.full((1, 2), float(rank)), dim=-1).tolist()))
    finally:
        destroy_tensor_parallel(group)


def test_all_reduce_of_a_strided_view_and_all_gather():
    ctx = multiprocessing.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict((r, rest) for r, *rest in (results.get(timeout=TIMEOUT_S) for _ in procs))
    for p in procs:
        p.join(TIMEOUT_S)
        assert p.exitcode == 0
    want = (torch.arange(12, dtype=torch.float32).view(3, 4)[:, :2] * 3).tolist()   # rank 0 x1 + rank 1 x2
    for rank in (0, 1):
        summed, contiguous, gathered = got[rank]
        assert summed == want and contiguous
        assert gathered == [[0.0, 0.0, 1.0, 1.0]]
