"""kernels/moe_router.py: the one-launch routing (softmax, top-k, renormalisation) against its torch twin over
expert counts (powers of two and not), top-k, renormalisation, logit dtypes and strided rows; CPU tensors run
through the interpreter. Also: ties go to the lower expert id, a NaN row stays in range, and
``engine.layers.moe.select_experts`` routes CUDA tensors through the kernel only while the policy says so."""

from __future__ import annotations

import pytest
import torch

from engine.forward_context import forward_context
from engine.kernel_policy import KernelPolicy
from engine.layers import moe
from kernels.moe_router import MAX_EXPERTS, MAX_TOP_K, fits_router_kernel, topk_softmax, topk_softmax_ref

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens,num_experts,top_k", [
    (1, 8, 2), (5, 8, 2), (7, 60, 4), (3, 128, 8), (2, 64, 6), (4, 256, 8), (1, 3, 3),
])
@pytest.mark.parametrize("renormalize", [True, False])
def test_topk_softmax_equals_its_twin(dtype, num_tokens, num_experts, top_k, renormalize):
    g = torch.Generator().manual_seed(num_experts * 31 + top_k)
    # distinct logits in every dtype (multiples of 1/16 below 8 in magnitude), so no two experts tie
    ranks = torch.stack([torch.randperm(num_experts, generator=g) for _ in range(num_tokens)])
    logits = ((ranks - num_experts // 2) / (16 if num_experts > 64 else 4)).to(dtype).to(DEVICE)
    weights, ids = topk_softmax(logits, top_k, renormalize)
    ref_weights, ref_ids = topk_softmax_ref(logits, top_k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert weights.shape == ids.shape == (num_tokens, top_k)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-6)
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(num_tokens, device=DEVICE))


def test_topk_softmax_reads_strided_rows():
    """Router logits as a column slice of a wider tensor (a fused projection's output): row stride free."""
    wide = torch.randn(6, 40, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    logits = wide[:, 8:24]                                                     # [6, 16], row stride 40
    weights, ids = topk_softmax(logits, 4, True)
    ref_weights, ref_ids = topk_softmax_ref(logits, 4, True)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-6)


def test_ties_go_to_the_lower_expert_and_nan_rows_stay_in_range():
    logits = torch.tensor([[0.0, 1.0, 1.0, 0.5, 1.0],
                           [float("nan")] * 5], device=DEVICE)
    weights, ids = topk_softmax(logits, 3, False)
    assert ids[0].tolist() == [1, 2, 4]
    torch.testing.assert_close(weights[0], torch.full((3,), weights[0, 0].item(), device=DEVICE))
    assert ((ids[1] >= 0) & (ids[1] < 5)).all()                                # an expert the layer holds


def test_topk_softmax_checks_its_arguments():
    assert fits_router_kernel(MAX_EXPERTS, MAX_TOP_K) and not fits_router_kernel(MAX_EXPERTS + 1, 2)
    assert not fits_router_kernel(4, 5) and not fits_router_kernel(64, MAX_TOP_K + 1)
    with pytest.raises(ValueError, match="top_k=5"):
        topk_softmax(torch.randn(2, 4, device=DEVICE), 5, True)
    with pytest.raises(ValueError, match="experts"):
        topk_softmax(torch.randn(2, MAX_EXPERTS + 1, device=DEVICE), 2, True)
    with pytest.raises(ValueError, match="dims"):
        topk_softmax(torch.randn(8, device=DEVICE), 2, True)
    with pytest.raises(ValueError, match="dtype"):
        topk_softmax(torch.zeros(2, 8, dtype=torch.int32, device=DEVICE), 2, True)
    w, i = topk_softmax(torch.empty(0, 8, device=DEVICE), 2, True)
    assert w.shape == i.shape == (0, 2)


@pytest.mark.parametrize("enabled", [True, False])
def test_select_experts_takes_the_kernel_on_cuda_only_by_policy(enabled, monkeypatch):
    """The dispatch rule, seen on CPU: a CUDA-looking call goes to the kernel iff the policy allows it and the
    shape fits; CPU calls always take the twin."""
    calls = []
    monkeypatch.setattr(moe, "topk_softmax", lambda *a: calls.append("kernel") or topk_softmax_ref(*a))
    logits = torch.randn(3, 16)
    with forward_context(None, KernelPolicy(moe_router_kernel=enabled)):
        moe.select_experts(logits, 2, True)
        assert calls == []                                                     # a CPU tensor: the twin
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
        moe.select_experts(logits, 2, True)
        moe.select_experts(torch.randn(3, MAX_EXPERTS + 1), 2, True)           # too wide: the twin
    assert calls == (["kernel"] if enabled else [])
