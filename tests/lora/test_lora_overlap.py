"""``LinearLoRASlots.begin`` / ``finish`` (``KernelPolicy.lora_overlap``): the split path's shrink
issued before the base GEMM, on a side stream on CUDA, and the expand after the join.

CPU (Triton interpreter): the two phases give exactly ``forward``'s y on both backends, the shrink
runs in ``begin`` only on the Triton split path with overlap on, and the choice is the policy the
layer was built with. GPU: overlap on and off give identical outputs eagerly and through a CUDA graph, and a
side stream held back by a sleep shows that ``finish`` waits for the shrink.
"""

from __future__ import annotations

from unittest.mock import Mock

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.forward_context import forward_context
from engine.kernel_policy import KernelPolicy
from engine.layers.adapter import Feeds
from lora.batch import LoRAMetaBuffers, build_lora_batch
from lora.layers import side_stream
from tests.lora.test_layers import IN, MAX_LORAS, MAX_RANK, _adapters, _backends, _layer, _load, _manual

STEPS = [[0, 2, -1, 2, 0, 0, -1, 2, 1], [2, 2, 2, 2], [0]]
"""Mixed with base rows and a slot without weights; one slot owns every token; one decode row."""


def _input(num_tokens: int, strided: bool, seed: int = 0) -> torch.Tensor:
    """[num_tokens, IN], contiguous or a transposed (non-contiguous) view."""
    g = torch.Generator().manual_seed(seed)
    if strided:
        return torch.randn(IN, num_tokens, generator=g).t()
    return torch.randn(num_tokens, IN, generator=g)


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("overlap", ["1", "0"])
@pytest.mark.parametrize("token_slots", STEPS, ids=["mixed", "one-slot", "decode-row"])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_begin_finish_equals_forward(backend, overlap, token_slots, strided, monkeypatch):
    import kernels.lora_shrink as lora_shrink

    base, slots, state = _layer(backend, policy=KernelPolicy(lora_overlap=overlap == "1"))
    adapters = _adapters()
    _load(slots, adapters)
    shrink_spy = Mock(wraps=lora_shrink.lora_shrink)       # ``lora.layers`` imports it at call time
    monkeypatch.setattr(lora_shrink, "lora_shrink", shrink_spy)
    x = _input(len(token_slots), strided)
    base_y = F.linear(x, base.weight)                                   # [T, sum(OUTS)]
    state.batch = build_lora_batch(torch.tensor(token_slots, dtype=torch.int32), MAX_LORAS,
                                   with_segments=backend == "torch")
    y_forward = slots(x, base_y.clone())

    early_shrink = backend == "triton" and overlap == "1"
    before = shrink_spy.call_count
    pending = slots.begin(x)
    assert (pending.plan is not None) == early_shrink
    assert pending.side is None                                         # CPU: no side stream
    assert shrink_spy.call_count == before + early_shrink                # the shrink ran in begin
    y_two_phase = base_y.clone()
    assert slots.finish(pending, y_two_phase) is y_two_phase
    if backend == "triton":
        assert shrink_spy.call_count == before + 1

    assert torch.equal(y_two_phase, y_forward)
    torch.testing.assert_close(y_forward, _manual(x, base_y, token_slots, adapters), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(base(x), y_forward, rtol=0, atol=0)     # Linear.forward: begin, GEMM, finish


def test_begin_finish_add_nothing_without_adapters():
    base, slots, state = _layer("triton")
    _load(slots, _adapters())
    x = _input(3, False)
    y = F.linear(x, base.weight)
    want = y.clone()
    for batch in (None, build_lora_batch(torch.tensor([-1, -1, -1], dtype=torch.int32), MAX_LORAS,
                                         with_segments=False)):
        state.batch = batch
        pending = slots.begin(x)
        assert pending.plan is None
        assert torch.equal(slots.finish(pending, y), want)


def test_overlap_is_the_policys(monkeypatch):
    """A layer takes the overlap of the policy it is built with; without one, the device's default
    policy with CHORUS_KERNEL_POLICY applied."""
    monkeypatch.delenv("CHORUS_KERNEL_POLICY", raising=False)
    assert _layer("triton")[1].overlap is True                          # default on
    assert _layer("torch")[1].overlap is False                          # the torch path never overlaps
    base, slots, state = _layer("triton", policy=KernelPolicy(lora_overlap=False))
    assert slots.overlap is False
    _load(slots, _adapters())
    state.batch = build_lora_batch(torch.tensor([0, 2], dtype=torch.int32), MAX_LORAS, with_segments=False)
    assert slots.begin(_input(2, False)).plan is None                   # no early shrink
    monkeypatch.setenv("CHORUS_KERNEL_POLICY", "lora_overlap=0")
    assert _layer("triton")[1].overlap is False                         # no policy given: the override string
    assert _layer("triton", policy=KernelPolicy())[1].overlap is True   # a policy given: not read


# ----------------------------------------------------------------------------------------
# GPU: the side stream, eagerly and inside a CUDA graph
# ----------------------------------------------------------------------------------------
SLEEP_CYCLES = 200_000_000
"""~0.1 s of ``torch.cuda._sleep`` on the side stream: without the join, the expand would read
the NaN-filled scratch buffer long before the shrink overwrites it."""


def _cuda_layer(overlap: str, num_tokens: int):
    """A Triton-backend layer on CUDA with the reserved scratch and static meta of the graph path."""
    dev = torch.device("cuda")
    base, slots, state = _layer("triton", policy=KernelPolicy.for_device(dev, f"lora_overlap={overlap}"))
    _load(slots, _adapters())
    base.to(dev)
    state.reserve(slots.num_slices, num_tokens, MAX_RANK, dev)
    return base, slots, state, LoRAMetaBuffers(num_tokens, MAX_LORAS, dev)


def _poison_scratch(state) -> None:
    """NaN into the whole shrink scratch (on the current stream), so a read before the shrink shows."""
    state._shrink_buffer.fill_(float("nan"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_overlap_eager_and_graph_match():
    eager_slots = np.array(STEPS[0], dtype=np.int32)
    graph_slots = np.array([1, 0, 2, 2, -1, 0, 2, 0, 0], dtype=np.int32)      # another mix, same size
    num_tokens = len(eager_slots)
    x_eager, x_graph = _input(num_tokens, False, seed=1), _input(num_tokens, False, seed=2)
    results = {}
    for overlap in ("0", "1"):
        base, slots, state, meta_bufs = _cuda_layer(overlap, num_tokens)
        assert slots.overlap is (overlap == "1")
        x = x_eager.cuda()                                              # [T, IN], the graph's static input
        state.batch = meta_bufs.fill(eager_slots, fixed_grid=True, with_segments=False)
        _poison_scratch(state)
        if slots.overlap:
            side = side_stream(x.device.index)
            with torch.cuda.stream(side):
                torch.cuda._sleep(SLEEP_CYCLES)                         # holds the shrink back
        eager = base(x)                         # also the warm-up: Triton compiles, the side stream exists
        torch.cuda.synchronize()

        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = base(x)
        x.copy_(x_graph)
        state.batch = meta_bufs.fill(graph_slots, fixed_grid=True, with_segments=False)
        _poison_scratch(state)
        graph.replay()
        torch.cuda.synchronize()
        results[overlap] = (eager.cpu(), static_y.cpu(), base.weight.cpu())

    (eager_off, graph_off, weight), (eager_on, graph_on, _) = results["0"], results["1"]
    assert torch.equal(eager_on, eager_off)
    assert torch.equal(graph_on, graph_off)
    adapters = _adapters()
    for x, token_slots, y in ((x_eager, eager_slots, eager_on), (x_graph, graph_slots, graph_on)):
        want = _manual(x, F.linear(x, weight), token_slots.tolist(), adapters)
        torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------------------
# The gate/up update fused into SiLU-and-mul (``KernelPolicy.lora_fuse_silu_mul``)
# ----------------------------------------------------------------------------------------
GATE_UP = [12, 12]


def _gate_up_adapters():
    """Slot 0: rank 4 on gate only; slot 2: rank 8 on gate and up; slot 1 empty."""
    g = torch.Generator().manual_seed(5)
    return {slot: {s: (torch.randn(rank, IN, generator=g), torch.randn(GATE_UP[s], rank, generator=g), 2.0 / rank)
                   for s in slices}
            for slot, rank, slices in ((0, 4, (0,)), (2, 8, (0, 1)))}


@pytest.mark.parametrize("fuse", ["1", "0"])
@pytest.mark.parametrize("token_slots", STEPS, ids=["mixed", "one-slot", "decode-row"])
def test_deferred_update_then_silu_mul_equals_unfused(fuse, token_slots, monkeypatch):
    """A gate/up-shaped Linear feeding SiLU-and-mul leaves its update pending in the forward context
    (fused) or adds it (unfused); either way SiLU-and-mul of the result is silu_and_mul(forward(x))."""
    from engine.layers.activation import silu_and_mul, silu_and_mul_torch
    from kernels import lora_expand, lora_expand_silu_mul

    policy = KernelPolicy(lora_fuse_silu_mul=fuse == "1")
    base, slots, state = _layer("triton", outs=GATE_UP, policy=policy, feeds=Feeds.SILU_MUL)
    assert slots.fuse_silu_mul is (fuse == "1")
    adapters = _gate_up_adapters()
    _load(slots, adapters)
    x = _input(len(token_slots), False)
    state.batch = build_lora_batch(torch.tensor(token_slots, dtype=torch.int32), MAX_LORAS, with_segments=False)
    want = silu_and_mul_torch(_manual(x, F.linear(x, base.weight), token_slots, adapters, GATE_UP))

    fused_spy = Mock(wraps=lora_expand_silu_mul.lora_expand_silu_mul)
    expand_spy = Mock(wraps=lora_expand.lora_expand)
    monkeypatch.setattr(lora_expand_silu_mul, "lora_expand_silu_mul", fused_spy)
    monkeypatch.setattr(lora_expand, "lora_expand", expand_spy)
    with forward_context(None, policy) as ctx:
        y = base(x)
        pending = ctx.pending_update
        if fuse == "1":
            assert pending is not None and pending.owner is slots and pending.y is y
            assert torch.equal(y, F.linear(x, base.weight))               # the update is not in y yet
        else:
            assert pending is None
        act = silu_and_mul(y)                                             # takes the pending update
        assert ctx.pending_update is None
    if fuse == "1":
        assert (fused_spy.call_count, expand_spy.call_count) == (1, 0)
    else:
        assert (fused_spy.call_count, expand_spy.call_count) == (0, 1)
        torch.testing.assert_close(act, silu_and_mul_torch(y), rtol=0, atol=0)
    torch.testing.assert_close(act, want, rtol=1e-4, atol=1e-4)


def test_silu_mul_fusion_only_on_gate_up_shapes():
    """Only two equal slices on the overlapped Triton split path fuse."""
    policy = KernelPolicy()
    assert _layer("triton", outs=GATE_UP, policy=policy)[1].fuse_silu_mul is True
    assert _layer("triton", policy=policy)[1].fuse_silu_mul is False                # q/k/v: three slices
    assert _layer("triton", outs=[12, 8], policy=policy)[1].fuse_silu_mul is False  # unequal widths
    assert _layer("torch", outs=GATE_UP, policy=policy)[1].fuse_silu_mul is False
    assert _layer("triton", outs=GATE_UP, policy=KernelPolicy(lora_overlap=False))[1].fuse_silu_mul is False
    # the torch path: y complete, nothing left pending
    base, slots, state = _layer("torch", outs=GATE_UP, policy=policy, feeds=Feeds.SILU_MUL)
    _load(slots, _gate_up_adapters())
    state.batch = build_lora_batch(torch.tensor([0, 2], dtype=torch.int32), MAX_LORAS, with_segments=True)
    x = _input(2, False)
    with forward_context(None, policy) as ctx:
        y = base(x)
        assert ctx.pending_update is None
    assert torch.equal(y, base(x))
