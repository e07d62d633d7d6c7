"""``engine.kernel_policy.KernelPolicy``: defaults, the override string, shape rules."""

import pytest

from engine.kernel_policy import KernelPolicy


def test_defaults_are_the_measured_ones():
    p = KernelPolicy()
    assert (p.decode_gemv_max_tokens, p.gemm_split_k, p.decode_fuse_rotary) == (2, True, "auto")
    assert (p.lora_overlap, p.lora_fuse_silu_mul, p.lora_fuse_rotary, p.lora_fuse_norm) == (True,) * 4
    assert (p.lora_stacked_max_tokens, p.lora_stacked_tune) == (128, True)
    assert p.attn_decode == p.gemv == p.lora_shrink == p.lora_expand == ()


def test_overrides_parse_every_kind_of_field():
    p = KernelPolicy().with_overrides("decode_gemv_max_tokens=0,gemm_split_k=0,decode_fuse_rotary=1,"
                                      "lora_overlap=0,lora_stacked_max_tokens=64,attn_decode.heads_per_prog=0,"
                                      "gemv.block_n=64,gemv.use_dot=1,lora_expand.block_n=16")
    assert (p.decode_gemv_max_tokens, p.gemm_split_k, p.decode_fuse_rotary, p.lora_overlap) == (0, False, "1", False)
    assert p.lora_stacked_max_tokens == 64 and p.attn_decode_tiles == {"heads_per_prog": 0}
    assert p.gemv == (("block_n", 64), ("use_dot", 1)) and p.lora_expand == (("block_n", 16),)
    # a later override of the same group merges with the earlier one
    assert p.with_overrides("gemv.block_k=128").gemv == (("block_k", 128), ("block_n", 64), ("use_dot", 1))
    assert KernelPolicy().with_overrides("") == KernelPolicy().with_overrides(None) == KernelPolicy()


@pytest.mark.parametrize("text, message", [
    ("nope=1", "unknown field"),
    ("num_sms=4", "unknown field"),
    ("gemm_split_k=yes", "use 0 or 1"),
    ("decode_fuse_rotary=2", "auto, 0 or 1"),
    ("decode_gemv_max_tokens=17", "0-16"),
    ("lora_stacked_max_tokens=-1", "non-negative integer"),
    ("attn_decode.heads_first=2", "heads_first 0 or 1"),
    ("attn_decode.tile_n=0", "tile_n"),
    ("gemv.block_n=3", "power of two"),
    ("lora_shrink.nope=1", "no field 'nope'"),
    ("mystery.x=1", "groups are"),
    ("gemm_split_k", "field=value"),
])
def test_bad_overrides_say_how_to_fix_them(text, message):
    with pytest.raises(ValueError, match=message):
        KernelPolicy().with_overrides(text)


def test_split_k_rule():
    p = KernelPolicy(num_sms=132)
    # Llama-3-8B o_proj / down_proj (N = 4096): 2 x tiles <= 132 SMs from 3 to 256 tokens
    for k in (4096, 14336):
        assert [p.split_k_parts(t, k, 4096) for t in (1, 2, 3, 64, 256, 257, 1024)] == [1, 1, 2, 2, 2, 1, 1]
    assert p.split_k_parts(64, 1024, 4096) == 1            # K below SPLIT_K_MIN_K
    assert p.split_k_parts(64, 4104, 4096) == 1            # halves not 16-byte aligned
    assert p.split_k_parts(64, 4096, 16384) == 1           # 128 tiles: the GPU is full
    assert KernelPolicy(num_sms=132, gemm_split_k=False).split_k_parts(64, 4096, 4096) == 1
    assert KernelPolicy().split_k_parts(64, 4096, 4096) == 1   # no SMs (CPU)


def test_fused_decode_rotary_switch():
    import torch
    cpu = torch.device("cpu")
    assert KernelPolicy(decode_fuse_rotary="1").fuses_decode_rotary(256, 8, cpu)
    assert not KernelPolicy(decode_fuse_rotary="0").fuses_decode_rotary(1, 8, cpu)
