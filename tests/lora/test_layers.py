"""LoRA slot buffers and the batched update against a hand-written x @ A.T @ B.T * scale."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.kernel_policy import KernelPolicy
from engine.layers.adapter import Feeds
from engine.layers.linear import Linear
from kernels.reference import lora_expand_ref, lora_shrink_ref
from lora.batch import LoRABatchState, build_lora_batch
from lora.layers import LinearLoRASlots
from lora.peft_adapter import LoRASliceWeights

IN, OUTS, MAX_LORAS, MAX_RANK = 24, [16, 8, 8], 3, 8


def _layer(backend: str, dtype=torch.float32, outs=OUTS, policy=None, feeds=Feeds.ANY):
    """A Linear (consumer ``feeds``) with LoRA slots attached as its adapter, built with ``policy``
    (None: the device's default policy)."""
    torch.manual_seed(0)
    base = Linear(IN, outs, feeds=feeds)
    base.weight.data.normal_()
    state = LoRABatchState()
    slots = LinearLoRASlots(IN, outs, MAX_LORAS, MAX_RANK, dtype, torch.device("cpu"), state, backend, policy)
    base.adapter = slots
    return base, slots, state


def _adapters(outs=OUTS):
    """Slot 0: rank 4 on slices 0 and 2; slot 2: rank 8 on every slice; slot 1 empty."""
    g = torch.Generator().manual_seed(1)
    ad = {}
    for slot, rank, slices in ((0, 4, (0, 2)), (2, 8, (0, 1, 2))):
        scale = 2.0 / rank
        ad[slot] = {s: (torch.randn(rank, IN, generator=g), torch.randn(outs[s], rank, generator=g), scale)
                    for s in slices}
    return ad


def _load(slots, adapters):
    for slot, per_slice in adapters.items():
        for s in range(slots.num_slices):
            w = per_slice.get(s)
            slots.set_slice(slot, s, None if w is None else LoRASliceWeights(w[0], w[1] * w[2]))


def _manual(x, base_y, token_slots, adapters, outs=OUTS):
    y = base_y.clone()
    offs = [sum(outs[:s]) for s in range(len(outs))]
    for t, slot in enumerate(token_slots):
        for s, (a, b, scale) in adapters.get(slot, {}).items():
            y[t, offs[s]:offs[s] + outs[s]] += (x[t] @ a.t() @ b.t()) * scale
    return y


def _backends():
    out = ["torch"]
    try:
        import kernels.lora_expand  # noqa: F401
        import kernels.lora_shrink  # noqa: F401
        out.append("triton")   # on CPU: TRITON_INTERPRET=1 (set by conftest)
    except Exception:
        pass
    return out


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("token_slots", [
    [0, 2, -1, 2, 0, 0, -1, 2, 1],     # mixed, base rows, a slot with zeros
    [2, 2, 2, 2],                       # one slot owns every token
    [0],                                # one decode row
])
def test_matches_manual(backend, token_slots):
    base, slots, state = _layer(backend)
    adapters = _adapters()
    _load(slots, adapters)
    x = torch.randn(len(token_slots), IN)
    base_y = torch.nn.functional.linear(x, base.weight)
    state.batch = build_lora_batch(torch.tensor(token_slots, dtype=torch.int32), MAX_LORAS,
                                   with_segments=backend == "torch")
    y = base(x)
    torch.testing.assert_close(y, _manual(x, base_y, token_slots, adapters), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("fixed_grid", [False, True], ids=["exact", "fixed_grid"])
def test_meta_buffers_refilled_in_place(backend, fixed_grid):
    """The engine's path: static meta tensors refilled per step (same storage), any adapter mix."""
    from lora.batch import LoRAMetaBuffers

    base, slots, state = _layer(backend)
    adapters = _adapters()
    _load(slots, adapters)
    bufs = LoRAMetaBuffers(16, MAX_LORAS, torch.device("cpu"))
    ptr = bufs.sorted_token_ids.data_ptr()
    for token_slots in ([0, 1, -1, 1, 2, 0], [-1, -1, -1], [2, 2, 2, 2, 0]):
        state.batch = bufs.fill(torch.tensor(token_slots, dtype=torch.int32).numpy(), fixed_grid,
                                with_segments=backend == "torch")
        assert state.batch.meta.sorted_token_ids.data_ptr() == ptr
        assert state.batch.meta.no_lora == (not fixed_grid and set(token_slots) == {-1})
        x = torch.randn(len(token_slots), IN)
        y = base(x)
        expected = _manual(x, y.clone(), token_slots, adapters)
        slots(x, y)
        torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-4)


def test_torch_path_matches_kernel_twins():
    base, slots, state = _layer("torch")
    _load(slots, _adapters())
    token_slots = torch.tensor([2, 0, -1, 0, 2, 1, 2], dtype=torch.int32)
    x = torch.randn(7, IN)
    base_y = torch.nn.functional.linear(x, base.weight)
    buf = lora_shrink_ref(x, slots.lora_a, token_slots)
    want = lora_expand_ref(buf, slots.lora_b, token_slots, base_y, slots.slice_offsets)
    state.batch = build_lora_batch(token_slots, MAX_LORAS, with_segments=True)
    torch.testing.assert_close(base(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", _backends())
def test_a_reloaded_or_cleared_slot_runs_its_new_weights(backend):
    """A slot set again after it ran (another adapter, another rank, fewer slices) or cleared computes
    what it now holds: nothing derived from its old weights survives (the torch path's per-slot GEMM
    operands are rebuilt)."""
    base, slots, state = _layer(backend)
    first = _adapters()
    _load(slots, first)
    token_slots = [2, 0, -1, 2]
    state.batch = build_lora_batch(torch.tensor(token_slots, dtype=torch.int32), MAX_LORAS,
                                   with_segments=backend == "torch")
    x = torch.randn(len(token_slots), IN)
    base_y = torch.nn.functional.linear(x, base.weight)
    torch.testing.assert_close(base(x), _manual(x, base_y, token_slots, first), rtol=1e-4, atol=1e-4)
    g = torch.Generator().manual_seed(7)
    second = {2: {1: (torch.randn(3, IN, generator=g), torch.randn(OUTS[1], 3, generator=g), 1.5)}}
    _load(slots, second)                       # slot 2: rank 3 on slice 1 only
    slots.clear_slot(0)
    torch.testing.assert_close(base(x), _manual(x, base_y, token_slots, second), rtol=1e-4, atol=1e-4)


def test_no_batch_or_base_only_leaves_output_alone():
    base, slots, state = _layer("torch")
    _load(slots, _adapters())
    x = torch.randn(3, IN)
    want = torch.nn.functional.linear(x, base.weight)
    torch.testing.assert_close(base(x), want)                  # no batch yet
    state.batch = build_lora_batch(torch.full((3,), -1, dtype=torch.int32), MAX_LORAS, with_segments=True)
    assert state.batch.no_lora
    torch.testing.assert_close(base(x), want)


def test_slots_are_zero_padded_and_untargeted_slices_zero():
    _, slots, _ = _layer("torch")
    adapters = _adapters()
    _load(slots, {2: adapters[2]})            # rank 8 everywhere in slot 2
    _load(slots, {2: adapters[0]})            # then rank 4 on slices 0 and 2 into the same slot
    a, b = slots.lora_a, slots.lora_b
    assert a.shape == (3, MAX_LORAS, MAX_RANK, IN)
    assert [t.shape for t in b] == [(MAX_LORAS, o, MAX_RANK) for o in OUTS]
    torch.testing.assert_close(a[0, 2, :4], adapters[0][0][0])
    assert a[0, 2, 4:].abs().sum() == 0 and b[0][2][:, 4:].abs().sum() == 0   # padding
    assert a[1, 2].abs().sum() == 0 and b[1][2].abs().sum() == 0              # k slice untargeted
    torch.testing.assert_close(b[2][2][:, :4], adapters[0][2][1] * adapters[0][2][2])
    assert a[:, 0].abs().sum() == 0 and a[:, 1].abs().sum() == 0              # other slots untouched
    slots.clear_slot(2)
    assert a.abs().sum() == 0 and all(t.abs().sum() == 0 for t in b)


def test_unpacked_layer_and_bfloat16():
    outs = [16]
    base, slots, state = _layer("torch", dtype=torch.bfloat16, outs=outs)
    base.weight.data = base.weight.data.bfloat16()
    g = torch.Generator().manual_seed(3)
    adapters = {1: {0: (torch.randn(8, IN, generator=g), torch.randn(16, 8, generator=g), 0.5)}}
    for s, (a, b_, sc) in adapters[1].items():
        slots.set_slice(1, s, LoRASliceWeights(a.bfloat16(), (b_ * sc).bfloat16()))
    x = torch.randn(5, IN).bfloat16()
    token_slots = [1, -1, 1, 1, -1]
    slots_t = torch.tensor(token_slots, dtype=torch.int32)
    state.batch = build_lora_batch(slots_t, MAX_LORAS, with_segments=True)
    y = base(x)
    a_bf, b_bf = adapters[1][0][0].bfloat16().float(), (adapters[1][0][1] * 0.5).bfloat16().float()
    want = _manual(x.float(), torch.nn.functional.linear(x, base.weight).float(), token_slots,
                   {1: {0: (a_bf, b_bf, 1.0)}}, outs)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), want, rtol=2e-2, atol=5e-2)


def test_reserved_shrink_buffer_is_never_reallocated():
    """CUDA graphs keep the partials buffer's address: after reserve, every split_k a config may
    pick for up to the reserved tokens is a view of the same storage, and a bigger one raises."""
    from kernels.lora_meta import max_split_k

    state = LoRABatchState()
    state.shrink_buffer(1, 1, 4, 8, torch.device("cpu"))             # grown freely before reserve
    state.reserve(3, 64, 16, torch.device("cpu"))
    ptr = state.shrink_buffer(3, 1, 1, 16, torch.device("cpu")).data_ptr()
    for num_tokens in range(1, 65):
        for split_k in (1, 2, 4, 8, 16):
            if split_k <= max_split_k(num_tokens):
                view = state.shrink_buffer(3, split_k, num_tokens, 16, torch.device("cpu"))
                assert view.shape == (3, split_k, num_tokens, 16) and view.data_ptr() == ptr
    with pytest.raises(RuntimeError, match="does not fit the reserved"):
        state.shrink_buffer(3, 16, 65, 16, torch.device("cpu"))


@pytest.mark.skipif("triton" not in _backends(), reason="needs triton")
def test_kernel_config_overrides_from_policy():
    """The policy's ``lora_shrink`` / ``lora_expand`` overrides are taken when a layer is built and
    drive its launches."""
    policy = KernelPolicy().with_overrides("lora_shrink.block_k=16,lora_shrink.split_k=4,"
                                           "lora_expand.block_n=16,lora_expand.n_tiles=2")
    base, slots, state = _layer("triton", policy=policy)
    assert slots.shrink_overrides == (("block_k", 16), ("split_k", 4))
    assert slots.expand_overrides == (("block_n", 16), ("n_tiles", 2))
    adapters = _adapters()
    _load(slots, adapters)
    token_slots = [0, 2, -1, 2, 1]
    x = torch.randn(len(token_slots), IN)
    base_y = torch.nn.functional.linear(x, base.weight)
    state.batch = build_lora_batch(torch.tensor(token_slots, dtype=torch.int32), MAX_LORAS,
                                   with_segments=False)
    y = base(x)
    torch.testing.assert_close(y, _manual(x, base_y, token_slots, adapters), rtol=1e-4, atol=1e-4)
    assert state._shrink_buffer.numel() >= 3 * 4 * len(token_slots) * MAX_RANK     # 4 partials per row


@pytest.mark.parametrize("backend", _backends())
def test_fixed_grid_over_few_adapters(backend):
    """A decode graph captured for few adapters launches over that many segments (not max_loras):
    the same y for any step within the bound (slots below it), and a step past it is refused."""
    from lora.batch import LoRAMetaBuffers

    base, slots, state = _layer(backend)
    adapters = _adapters()
    _load(slots, adapters)
    bufs = LoRAMetaBuffers(16, MAX_LORAS, torch.device("cpu"))
    for token_slots in ([0, 1, -1, 1, 0], [1, 1, -1], [-1, -1]):
        state.batch = bufs.fill(np.array(token_slots, dtype=np.int32), True, backend == "torch", max_active=2)
        assert state.batch.meta.num_active == 2 and state.batch.meta.fixed_grid and state.batch.slot_bound == 2
        x = torch.randn(len(token_slots), IN)
        y = base(x)
        torch.testing.assert_close(y, _manual(x, torch.nn.functional.linear(x, base.weight), token_slots,
                                              adapters), atol=1e-4, rtol=1e-4)
    for token_slots in ([0, 1, 2], [2, -1]):                     # three adapters; one adapter in slot 2
        with pytest.raises(RuntimeError, match="graph choice and the batch disagree"):
            bufs.fill(np.array(token_slots, dtype=np.int32), True, False, max_active=2)
    assert bufs.fill(np.array([2, -1, 0], dtype=np.int32), False, False).slot_bound == 3
    assert bufs.fill(np.array([-1], dtype=np.int32), False, False).slot_bound == 0


def test_stacked_gemm_matches_manual():
    """The stacked weight (``stack_onto``): base rows then every slot's A rows in one tensor, the
    Linear's weight / bias and the slots' A all views of it; a decode-sized step takes one GEMM
    over the base and the slots below the step's slot bound, and the expand reads each token's own
    slot's h from it. Same y as the hand-written update (+ bias) for exact and fixed-grid steps;
    a step past the policy's ``lora_stacked_max_tokens``, or a weight replaced after stacking, takes
    the shrink kernel instead, with the same result."""
    from lora.batch import LoRAMetaBuffers

    torch.manual_seed(0)
    base = Linear(IN, OUTS, bias=True)
    base.weight.data.normal_()
    base.bias.data.normal_()
    state = LoRABatchState()
    slots = LinearLoRASlots(IN, OUTS, MAX_LORAS, MAX_RANK, torch.float32, torch.device("cpu"), state,
                            "triton", KernelPolicy(lora_stacked_max_tokens=6))
    base.adapter = slots
    adapters = _adapters()
    _load(slots, {0: adapters[0]})                      # loaded before stacking: carried over
    weight, bias = base.weight.clone(), base.bias.clone()
    slots.stack_onto(base)
    _load(slots, {2: adapters[2]})                      # loaded after: written into the stacked rows
    out, S, R = sum(OUTS), len(OUTS), MAX_RANK
    stacked = slots.stacked_weight
    assert stacked.shape == (out + MAX_LORAS * S * R, IN) and slots.stacked_bias.shape == (stacked.shape[0],)
    assert base.weight.data_ptr() == stacked.data_ptr() and torch.equal(base.weight, weight)
    assert torch.equal(base.bias, bias) and torch.all(slots.stacked_bias[out:] == 0)
    a0, _, _ = adapters[2][1]
    row = out + (2 * S + 1) * R                         # slot 2, slice 1, rank 0
    assert torch.equal(stacked[row:row + a0.shape[0]], a0) and slots.lora_a.untyped_storage().data_ptr() == stacked.data_ptr()

    bufs = LoRAMetaBuffers(16, MAX_LORAS, torch.device("cpu"))
    steps = [([0, 2, -1, 2, 0], False, None, 3), ([0, -1], False, None, 1), ([1, 0, -1], True, None, 3),
             ([0, 0, 0, 0, 0, 2, 2, -1], False, None, None)]   # the last is past the stacked bound: 8 > 6
    for token_slots, fixed, max_active, bound in steps:
        state.batch = bufs.fill(np.array(token_slots, dtype=np.int32), fixed, False, max_active=max_active)
        x = torch.randn(len(token_slots), IN)
        want = _manual(x, torch.nn.functional.linear(x, weight, bias), token_slots, adapters)
        y = base(x)
        torch.testing.assert_close(y, want, atol=1e-4, rtol=1e-4)
        assert y.stride(0) == (out if bound is None else out + bound * S * R)   # the GEMM's h columns
    # A wider cover (``stacked_cover``, tuned at start-up): the GEMM takes more slots' rows than the
    # step's bound, the update is unchanged.
    slots.stacked_cover[(2, 1)] = 3
    state.batch = bufs.fill(np.array([0, -1], dtype=np.int32), False, False)
    assert state.batch.slot_bound == 1
    x = torch.randn(2, IN)
    y = base(x)
    assert y.stride(0) == out + 3 * S * R
    torch.testing.assert_close(y, _manual(x, torch.nn.functional.linear(x, weight, bias), [0, -1], adapters),
                               atol=1e-4, rtol=1e-4)
    slots.stacked_cover.clear()
    base.weight.data = weight.clone()                   # no longer the stacked rows: the plain path
    state.batch = bufs.fill(np.array([0, 2], dtype=np.int32), False, False)
    x = torch.randn(2, IN)
    y = base(x)
    assert y.stride(0) == out
    torch.testing.assert_close(y, _manual(x, torch.nn.functional.linear(x, weight, bias), [0, 2], adapters),
                               atol=1e-4, rtol=1e-4)


def test_which_updates_are_deferred_by_step_size():
    """``defers``: gate/up (SiLU-and-mul fusion) at every size, q/k/v (rotary fusion) up to 128 tokens,
    o/down (add + RMSNorm fusion) up to 128 and from 4097 tokens on (``lora_expand_norm.fuses``),
    each only for the consumer it fuses into; the torch backend never defers."""
    state = LoRABatchState()

    def layer(outs, backend="triton"):
        return LinearLoRASlots(IN, outs, MAX_LORAS, MAX_RANK, torch.float32, torch.device("cpu"), state,
                               backend, KernelPolicy())

    sizes = (1, 128, 129, 4096, 4097)
    gate_up, qkv, o = layer([24, 24]), layer([16, 8, 8]), layer([IN])
    assert [gate_up.defers(t, Feeds.SILU_MUL) for t in sizes] == [True] * 5
    assert [qkv.defers(t, Feeds.ROTARY_KV_WRITE) for t in sizes] == [True, True, False, False, False]
    assert [o.defers(t, Feeds.ADD_RMS_NORM) for t in sizes] == [True, True, False, False, True]
    assert not any(lay.defers(t, feeds) for lay in (gate_up, qkv, o) for t in sizes for feeds in Feeds
                   if (lay, feeds) not in ((gate_up, Feeds.SILU_MUL), (qkv, Feeds.ROTARY_KV_WRITE),
                                           (o, Feeds.ADD_RMS_NORM)))
    assert not any(layer(outs, "torch").defers(t, feeds) for outs in ([24, 24], [16, 8, 8], [IN])
                   for t in sizes for feeds in Feeds)
