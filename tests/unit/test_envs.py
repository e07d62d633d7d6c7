"""Kernel-tuning environment variables: parsed in engine/envs.py, errors name the variable."""

from __future__ import annotations

import pytest

from engine import envs


def test_attn_decode_config(monkeypatch):
    monkeypatch.delenv("CHORUS_ATTN_DECODE_CONFIG", raising=False)
    assert envs.attn_decode_config() == {}
    monkeypatch.setenv("CHORUS_ATTN_DECODE_CONFIG", "tile_n=32, num_warps=2,num_stages=4")
    assert envs.attn_decode_config() == {"tile_n": 32, "num_warps": 2, "num_stages": 4}
    monkeypatch.setenv("CHORUS_ATTN_DECODE_CONFIG", "heads_first=0,heads_per_prog=0")
    assert envs.attn_decode_config() == {"heads_first": 0, "heads_per_prog": 0}
    for bad in ("tile_n=0", "block_m=16", "tile_n=big", "tile_n", "heads_first=2", "heads_per_prog=3"):
        monkeypatch.setenv("CHORUS_ATTN_DECODE_CONFIG", bad)
        with pytest.raises(ValueError, match="CHORUS_ATTN_DECODE_CONFIG"):
            envs.attn_decode_config()


def test_gemm_split_k_and_decode_fuse_rotary(monkeypatch):
    monkeypatch.delenv("CHORUS_GEMM_SPLIT_K", raising=False)
    monkeypatch.delenv("CHORUS_DECODE_FUSE_ROTARY", raising=False)
    assert envs.gemm_split_k() is True and envs.decode_fuse_rotary() == "auto"
    monkeypatch.setenv("CHORUS_GEMM_SPLIT_K", "0")
    monkeypatch.setenv("CHORUS_DECODE_FUSE_ROTARY", " 1")
    assert envs.gemm_split_k() is False and envs.decode_fuse_rotary() == "1"
    monkeypatch.setenv("CHORUS_GEMM_SPLIT_K", "on")
    with pytest.raises(ValueError, match="CHORUS_GEMM_SPLIT_K"):
        envs.gemm_split_k()
    monkeypatch.setenv("CHORUS_DECODE_FUSE_ROTARY", "always")
    with pytest.raises(ValueError, match="CHORUS_DECODE_FUSE_ROTARY"):
        envs.decode_fuse_rotary()


def test_lora_kernel_configs(monkeypatch):
    from kernels.lora_expand import LoRAExpandConfig
    from kernels.lora_shrink import LoRAShrinkConfig, parse_config_override

    monkeypatch.setenv("CHORUS_LORA_SHRINK_CONFIG", "block_k=128,split_k=8")
    monkeypatch.delenv("CHORUS_LORA_EXPAND_CONFIG", raising=False)
    assert parse_config_override(envs.lora_shrink_config(), LoRAShrinkConfig) == (("block_k", 128), ("split_k", 8))
    assert envs.lora_expand_config() is None
    assert parse_config_override(envs.lora_expand_config(), LoRAExpandConfig) == ()


def test_decode_gemv_max_tokens(monkeypatch):
    monkeypatch.delenv("CHORUS_DECODE_GEMV_MAX_TOKENS", raising=False)
    assert envs.decode_gemv_max_tokens() == 2
    monkeypatch.setenv("CHORUS_DECODE_GEMV_MAX_TOKENS", "0")
    assert envs.decode_gemv_max_tokens() == 0
    for bad in ("17", "-1", "two"):
        monkeypatch.setenv("CHORUS_DECODE_GEMV_MAX_TOKENS", bad)
        with pytest.raises(ValueError, match="CHORUS_DECODE_GEMV_MAX_TOKENS"):
            envs.decode_gemv_max_tokens()


def test_gemv_config(monkeypatch):
    monkeypatch.setenv("CHORUS_GEMV_CONFIG", "block_n=64,use_dot=1")
    assert envs.gemv_config() == {"block_n": 64, "use_dot": 1}
    monkeypatch.setenv("CHORUS_GEMV_CONFIG", "block_m=16")
    with pytest.raises(ValueError, match="CHORUS_GEMV_CONFIG"):
        envs.gemv_config()


def test_lora_stacked_max_tokens(monkeypatch):
    name = "CHORUS_LORA_STACKED_MAX_TOKENS"
    monkeypatch.delenv(name, raising=False)
    assert envs.lora_stacked_max_tokens() == 128                       # decode steps by default
    monkeypatch.setenv(name, " 64 ")
    assert envs.lora_stacked_max_tokens() == 64
    for bad in ("-1", "many", "1025"):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=f"{name}=.*from 0 to 1024"):
            envs.lora_stacked_max_tokens()


@pytest.mark.parametrize("name,read", [("CHORUS_LORA_OVERLAP", envs.lora_overlap),
                                       ("CHORUS_LORA_FUSE_SILU_MUL", envs.lora_fuse_silu_mul),
                                       ("CHORUS_LORA_FUSE_ROTARY", envs.lora_fuse_rotary),
                                       ("CHORUS_LORA_FUSE_NORM", envs.lora_fuse_norm),
                                       ("CHORUS_LORA_STACKED_TUNE", envs.lora_stacked_tune)])
def test_on_off_switches(name, read, monkeypatch):
    monkeypatch.delenv(name, raising=False)
    assert read() is True
    for value, want in (("0", False), ("1", True), (" 0 ", False), ("", True)):
        monkeypatch.setenv(name, value)
        assert read() is want, value
    for bad in ("yes", "2", "off", "true"):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=f"{name}='{bad}': use 1 .* or 0 .*unset it for 1"):
            read()
