"""engine/envs.py: the user-facing variables, and the one kernel-policy override string."""

from engine import envs
from engine.kernel_policy import KernelPolicy


def test_kernel_policy_string(monkeypatch):
    monkeypatch.delenv("CHORUS_KERNEL_POLICY", raising=False)
    assert envs.kernel_policy() is None
    assert KernelPolicy.for_device("cpu") == KernelPolicy()
    monkeypatch.setenv("CHORUS_KERNEL_POLICY", "gemm_split_k=0, attn_decode.tile_n=64 ,lora_shrink.split_k=8")
    policy = KernelPolicy.for_device("cpu")
    assert policy.gemm_split_k is False and policy.attn_decode_tiles == {"tile_n": 64}
    assert policy.lora_shrink == (("split_k", 8),) and policy.lora_overlap is True


def test_user_variables(monkeypatch):
    monkeypatch.setenv("CHORUS_CACHE", "~/somewhere")
    assert str(envs.cache_dir()).endswith("somewhere") and "~" not in str(envs.cache_dir())
    monkeypatch.setenv("CHORUS_NUM_THREADS", "3")
    assert envs.num_threads() == 3
    monkeypatch.delenv("CHORUS_NUM_THREADS")
    assert envs.num_threads() is None
    monkeypatch.setenv("CHORUS_ALLOW_RUNTIME_LORA_UPDATING", "true")
    assert envs.allow_runtime_lora_updating() is True
    monkeypatch.setenv("CHORUS_ALLOW_RUNTIME_LORA_UPDATING", "0")
    assert envs.allow_runtime_lora_updating() is False


def test_only_user_variables_and_one_override_string_are_read():
    """engine/envs.py reads the user-facing variables and CHORUS_KERNEL_POLICY, nothing else."""
    import re
    from pathlib import Path

    names = set(re.findall(r'"(CHORUS_[A-Z_]+)"', Path(envs.__file__).read_text()))
    assert names == {"CHORUS_CACHE", "CHORUS_API_KEY", "CHORUS_ALLOW_RUNTIME_LORA_UPDATING", "CHORUS_NUM_THREADS",
                     "CHORUS_KERNEL_POLICY"}
