"""The o/down LoRA expand fused into add + RMSNorm (``kernels.lora_expand_norm``) against its twin
(expand, then add + RMSNorm), on CPU through the interpreter; real sizes on CUDA."""

from __future__ import annotations

import pytest
import torch

from kernels.lora_expand import slotwise_buf
from kernels.lora_expand_norm import lora_expand_add_rms_norm
from kernels.reference import lora_expand_add_rms_norm_ref
from tests.kernels.test_kernel_lora import DEVICE

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=2e-2),
       torch.float16: dict(atol=4e-3, rtol=4e-3)}


def run_case(dtype, hidden, with_residual, slotwise, num_tokens=7, rank=8, max_loras=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden + 5, generator=g).to(dtype).to(DEVICE)[:, :hidden]   # strided rows
    residual = torch.randn(num_tokens, hidden, generator=g).to(dtype).to(DEVICE) if with_residual else None
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).to(DEVICE)
    lslots = torch.tensor([(i % (max_loras + 1)) - 1 for i in range(num_tokens)], dtype=torch.int32,
                          device=DEVICE)                                          # -1 (base), 0, 1, 2, ...
    lora_b = (torch.randn(max_loras, hidden, rank, generator=g) / rank).to(dtype).to(DEVICE)
    h_all = torch.randn(num_tokens, max_loras, 1, rank, generator=g).to(DEVICE)
    own = torch.zeros(1, 1, num_tokens, rank, device=DEVICE)
    for t, s in enumerate(lslots.tolist()):
        if s >= 0:
            own[:, 0, t] = h_all[t, s]
    want_out, want_s = lora_expand_add_rms_norm_ref(own, lora_b, lslots, x, weight, 1e-5, residual)
    buf, slot_stride = slotwise_buf(h_all) if slotwise else (torch.cat([own * 0.5, own * 0.5], dim=1), 0)
    x0 = x.clone()
    out = lora_expand_add_rms_norm(buf, lora_b, lslots, x, weight, 1e-5, residual=residual,
                                   slot_stride=slot_stride)
    stored = residual if with_residual else x
    return out, stored, want_out, want_s, x, x0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [64, 100, 3000, 8192])
@pytest.mark.parametrize("with_residual,slotwise", [(True, True), (False, False), (True, False)],
                         ids=["residual-slotwise", "no-residual-partials", "residual-partials"])
def test_matches_ref(dtype, hidden, with_residual, slotwise):
    """Rows updated, summed (stored into residual, or x without one) and normalized; base-model rows
    (slot -1) get the plain add + RMSNorm; odd widths and rows wider than one piece (8192)."""
    out, stored, want_out, want_s, x, x0 = run_case(dtype, hidden, with_residual, slotwise)
    torch.testing.assert_close(stored.float(), want_s.float(), **TOL[dtype])
    torch.testing.assert_close(out.float(), want_out.float(), **TOL[dtype])
    if with_residual:
        assert torch.equal(x, x0)                                   # x only read when there is a residual


def test_update_is_added():
    """Base rows equal plain add_rms_norm; a LoRA row is x + h . B before the norm (h . B = 4 here)."""
    from kernels.layer_ops import add_rms_norm

    x = torch.randn(2, 16, device=DEVICE)
    residual = torch.randn(2, 16, device=DEVICE)
    w = torch.ones(16, device=DEVICE)
    b = torch.ones(1, 16, 4, device=DEVICE)
    slots = torch.tensor([-1, 0], dtype=torch.int32, device=DEVICE)
    want_r = residual.clone()
    want = add_rms_norm(x + torch.tensor([[0.0], [4.0]], device=DEVICE), w, 1e-5, residual=want_r)
    r = residual.clone()
    out = lora_expand_add_rms_norm(torch.ones(1, 1, 2, 4, device=DEVICE), b, slots, x, w, 1e-5, residual=r)
    torch.testing.assert_close(r, want_r)
    torch.testing.assert_close(out, want)


def test_rejects_bad_inputs():
    x = torch.randn(2, 16, device=DEVICE)
    w = torch.ones(16, device=DEVICE)
    b = torch.ones(1, 16, 4, device=DEVICE)
    slots = torch.tensor([-1, 0], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="buf"):
        lora_expand_add_rms_norm(torch.ones(2, 1, 2, 4, device=DEVICE), b, slots, x, w, 1e-5)
    with pytest.raises(ValueError, match="lora_b"):
        lora_expand_add_rms_norm(torch.ones(1, 1, 2, 4, device=DEVICE), b[:, :8], slots, x, w, 1e-5)
    with pytest.raises(ValueError, match="token_lora_slots"):
        lora_expand_add_rms_norm(torch.ones(1, 1, 2, 4, device=DEVICE), b, slots.long(), x, w, 1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("slotwise", [True, False])
def test_gpu_llama3_sizes(slotwise):
    """Llama-3-8B hidden (4096), 64 decode rows over 3 adapters and the base model, rank 16, bf16."""
    out, stored, want_out, want_s, _, _ = run_case(torch.bfloat16, 4096, True, slotwise, num_tokens=64, rank=16)
    torch.testing.assert_close(stored.float(), want_s.float(), **TOL[torch.bfloat16])
    torch.testing.assert_close(out.float(), want_out.float(), **TOL[torch.bfloat16])
