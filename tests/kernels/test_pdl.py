"""Programmatic dependent launch (``kernels.pdl``, CHORUS_PDL): the switch, and on a Hopper GPU the
same outputs with and without it, eagerly and inside a CUDA graph (one decode layer's kernel chain)."""

from __future__ import annotations

import pytest
import torch

from kernels import pdl


@pytest.fixture
def pdl_switch():
    yield pdl.set_pdl
    pdl.set_pdl(False)


def test_off_by_default_and_never_on_cpu(pdl_switch):
    assert not pdl.use_pdl(torch.device("cpu")) and pdl.launch_kwargs(False) == {}
    pdl_switch(True)
    assert not pdl.use_pdl(torch.device("cpu"))     # the interpreter has no gdc_* instructions
    assert pdl.launch_kwargs(True) == {"launch_pdl": True}


def _decode_chain(n: int):
    """gate_up GEMM -> SiLU-and-mul -> down GEMM -> add + RMSNorm -> qkv GEMM -> rotary + KV write
    -> decode attention: every PDL kernel right after a producer it must wait for."""
    from kernels.kv_write import rotary_write_kv
    from kernels.layer_ops import add_rms_norm, silu_and_mul
    from kernels.paged_attention import paged_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    dev, dt = torch.device("cuda"), torch.bfloat16
    hid, inter, heads, kv_heads, hd, bs = 512, 1024, 8, 2, 64, 16

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=dev, dtype=dt) * 0.1

    w_gu, w_down, w_qkv, norm_w = rnd(2 * inter, hid), rnd(hid, inter), rnd((heads + 2 * kv_heads) * hd, hid), rnd(hid)
    x, res = rnd(n, hid), rnd(n, hid)
    ctx = 100
    nblk = (ctx + bs - 1) // bs
    k_cache, v_cache = rnd(n * nblk + 1, bs, kv_heads, hd), rnd(n * nblk + 1, bs, kv_heads, hd)
    bt = torch.arange(1, n * nblk + 1, device=dev, dtype=torch.int32).view(n, nblk)
    seq_lens = torch.full((n,), ctx, device=dev, dtype=torch.int32)
    qsl = torch.arange(n + 1, device=dev, dtype=torch.int32)
    positions = torch.full((n,), ctx - 1, device=dev, dtype=torch.int64)
    slots = (bt[:, -1].long() * bs + (ctx - 1) % bs)
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, device=dev).float() / hd))
    ang = torch.arange(2 * ctx, device=dev).float()[:, None] * inv[None, :]
    cos, sin = ang.cos(), ang.sin()

    def run():
        h = silu_and_mul(x @ w_gu.t()) @ w_down.t()
        r = res.clone()
        normed = add_rms_norm(h, norm_w, 1e-5, residual=r)
        qkv = normed @ w_qkv.t()
        q = qkv[:, :heads * hd].view(n, heads, hd)
        k = qkv[:, heads * hd:(heads + kv_heads) * hd].view(n, kv_heads, hd)
        v = qkv[:, (heads + kv_heads) * hd:].view(n, kv_heads, hd)
        rotary_write_kv(positions, q, k, v, cos, sin, hd, k_cache, v_cache, slots)
        return paged_attention(q, k_cache, v_cache, qsl, seq_lens, bt, 1, ctx, hd ** -0.5), r

    return run, (k_cache, v_cache)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a Hopper (or later) GPU")
@pytest.mark.parametrize("n", [8, 300])
def test_same_outputs_with_and_without_pdl(pdl_switch, n):
    run, caches = _decode_chain(n)
    before = [c.clone() for c in caches]
    ref_out, ref_res = (t.clone() for t in run())
    pdl_switch(True)
    for c, b in zip(caches, before):
        c.copy_(b)
    out, res = run()
    torch.cuda.synchronize()
    assert torch.equal(out, ref_out) and torch.equal(res, ref_res)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        g_out, g_res = run()
    for _ in range(3):
        for c, b in zip(caches, before):
            c.copy_(b)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(g_out, ref_out) and torch.equal(g_res, ref_res)
