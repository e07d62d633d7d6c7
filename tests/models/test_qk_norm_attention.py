"""The q/k norms of Qwen3, Qwen3-MoE and Gemma 3 applied by the attention layer (``PagedAttention.qk_norm``).

The models declare their norms on the layer. On the fused paths (on CUDA; forced on for CPU tensors here, the
Triton backend running through the interpreter) the norms run inside the rotary + KV write kernels, with no launch of the
norm modules, and the layer's output and cache equal the torch path's (norm modules -> rotary -> KV write ->
attention, what the CPU engine runs).
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Gemma3TextConfig, Qwen3Config, Qwen3MoeConfig

import kernels.kv_write as kv_write
import kernels.paged_attention as paged_attention
from engine.attention import AttentionBackend, AttentionMetadata
from engine.distributed.group import TensorParallelGroup
from engine.forward_context import forward_context
from engine.kernel_policy import KernelPolicy
from engine.layers.attention import PagedAttention
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.models.gemma3 import Gemma3Attention
from engine.models.qwen3 import Qwen3Attention
from engine.models.qwen3_moe import Qwen3MoeForCausalLM

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HIDDEN, BLOCK_SIZE = 4, 2, 64, 48, 16
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _qwen3_attention(seed: int) -> Qwen3Attention:
    """A Qwen3 attention layer (GQA, head_dim 64 != hidden / heads) with random weights, norms around 1."""
    config = Qwen3Config(hidden_size=HIDDEN, num_attention_heads=NUM_HEADS, num_key_value_heads=NUM_KV_HEADS,
                         head_dim=HEAD_DIM, rms_norm_eps=1e-6, vocab_size=64, num_hidden_layers=1)
    attn = Qwen3Attention(config, RotaryEmbedding(config, HEAD_DIM, 256), TensorParallelGroup.single())
    g = torch.Generator().manual_seed(seed)
    for name, p in attn.named_parameters():
        p.data.copy_((1.0 if "norm" in name else 0.0) + 0.3 * torch.randn(p.shape, generator=g))
    return attn.to(DEVICE)


def _step(query_lens: list[int], seq_lens: list[int], seed: int):
    """Requests whose last query_lens[i] tokens of seq_lens[i] are this step's (decodes first), over shuffled
    blocks -> (metadata, positions [T], qkv [T, q + 2 kv], k_cache, v_cache with noise in the cached slots)."""
    g = torch.Generator().manual_seed(seed)
    blocks = [math.ceil(s / BLOCK_SIZE) for s in seq_lens]
    perm = torch.randperm(sum(blocks) + 1, generator=g).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    slots, positions, used = [], [], 0
    for i, (n, s, q) in enumerate(zip(blocks, seq_lens, query_lens)):
        tables[i, :n] = perm[used:used + n]
        used += n
        for p in range(s - q, s):
            positions.append(p)
            slots.append(int(tables[i, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE)
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    ints = dict(dtype=torch.int32, device=DEVICE)
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots, device=DEVICE),
                             query_start_loc=torch.tensor(qsl, **ints), seq_lens=torch.tensor(seq_lens, **ints),
                             block_tables=tables.to(DEVICE), max_query_len=max(query_lens),
                             max_seq_len=max(seq_lens), num_decode_reqs=sum(q == 1 for q in query_lens))
    num_tokens = len(slots)
    qkv = torch.randn(num_tokens, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, generator=g)
    cache_shape = (len(perm), BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.randn(cache_shape, generator=g), torch.randn(cache_shape, generator=g)
    return (meta, torch.tensor(positions, device=DEVICE), qkv.to(DEVICE), k_cache.to(DEVICE),
            v_cache.to(DEVICE))


def _run(attn: Qwen3Attention, backend: str, policy: KernelPolicy, step):
    """The layer's output and caches for one step on ``backend``."""
    meta, positions, qkv, k_cache, v_cache = step
    paged = attn.attn
    paged.k_cache, paged.v_cache = k_cache.clone(), v_cache.clone()
    paged.backend = AttentionBackend(backend, policy)
    with forward_context(meta, policy):
        out = attn(positions, qkv.clone())
    return out, paged.k_cache, paged.v_cache


@pytest.fixture
def spies(monkeypatch):
    """Fused rotary + KV write on for the Triton backend on CPU; counts the norm modules' calls and the
    fused kernels' calls with a q/k norm."""
    calls = {"norm_module": 0, "rotary_write_kv": 0, "paged_decode_rotary": 0}
    monkeypatch.setattr(PagedAttention, "fuses_rotary_write", lambda self, x: self.backend.name == "triton")
    norm_forward = RMSNorm.forward

    def counted_norm(self, *a, **kw):
        calls["norm_module"] += 1
        return norm_forward(self, *a, **kw)
    monkeypatch.setattr(RMSNorm, "forward", counted_norm)
    for module, name in ((kv_write, "rotary_write_kv"), (paged_attention, "paged_decode_rotary")):
        fn = getattr(module, name)

        def counted(*a, _fn=fn, _name=name, **kw):
            calls[_name] += kw.get("qk_norm") is not None
            return _fn(*a, **kw)
        monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.parametrize("kind,fuse,kernel", [
    ("decode", "1", "paged_decode_rotary"),       # rotary + KV write + norms inside the decode attention
    ("decode", "0", "rotary_write_kv"),           # norms inside the rotary + KV write, then the attention
    ("mixed", "1", "rotary_write_kv"),            # a prefill chunk beside a decode
])
def test_fused_norms_equal_the_torch_path(spies, kind, fuse, kernel):
    attn = _qwen3_attention(seed=1)
    step = (_step([1, 1, 1], [5, 17, 40], seed=2) if kind == "decode"
            else _step([1, 6], [9, 22], seed=3))
    ref_out, ref_k, ref_v = _run(attn, "torch", KernelPolicy(), step)
    assert spies["norm_module"] == 2 and spies[kernel] == 0               # q_norm, k_norm
    out, k_cache, v_cache = _run(attn, "triton", KernelPolicy(decode_fuse_rotary=fuse), step)
    assert spies["norm_module"] == 2 and spies[kernel] == 1               # no norm launch of their own
    torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(k_cache, ref_k, atol=1e-5, rtol=1e-5)
    assert torch.equal(v_cache, ref_v)


def test_without_the_declaration_the_fused_path_would_rotate_raw_q_and_k(spies):
    """The norms change the result (the test above would see a kernel that skipped them)."""
    attn = _qwen3_attention(seed=1)
    step = _step([1, 1], [5, 17], seed=4)
    ref_out, _, _ = _run(attn, "torch", KernelPolicy(), step)
    attn.attn.qk_norm = None
    out, _, _ = _run(attn, "triton", KernelPolicy(decode_fuse_rotary="1"), step)
    assert not torch.allclose(out, ref_out, atol=1e-2)


def test_qwen3_moe_and_gemma3_declare_their_norms():
    """Each model's attention layer carries its own q_norm / k_norm modules as ``attn.qk_norm`` (Gemma's
    weights hold 1 + w after loading, so no offset is asked of the kernels)."""
    tp = TensorParallelGroup.single()
    gemma_config = Gemma3TextConfig(hidden_size=HIDDEN, num_attention_heads=NUM_HEADS, head_dim=HEAD_DIM,
                                    num_key_value_heads=NUM_KV_HEADS, vocab_size=64, num_hidden_layers=1)
    moe_config = Qwen3MoeConfig(hidden_size=HIDDEN, num_attention_heads=NUM_HEADS, head_dim=HEAD_DIM,
                                num_key_value_heads=NUM_KV_HEADS, vocab_size=64, num_hidden_layers=1)
    layers = [Gemma3Attention(gemma_config, RotaryEmbedding(gemma_config, HEAD_DIM, 64), tp),
              Qwen3MoeForCausalLM.build_attention(type("M", (), {"tp": tp})(), moe_config,
                                                  RotaryEmbedding(moe_config, HEAD_DIM, 64))]
    for layer in layers:
        norm = layer.attn.qk_norm
        assert norm.q_norm is layer.q_norm and norm.k_norm is layer.k_norm
        weights = norm.weights()
        assert weights.q_weight is layer.q_norm.weight and not weights.plus_one
        # Registered once: the checkpoint names stay self_attn.q_norm / k_norm.
        assert sorted(n for n, _ in layer.named_parameters() if "norm" in n) == ["k_norm.weight", "q_norm.weight"]
