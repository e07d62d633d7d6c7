"""engine.loader on GGUF files: tiny GGUFs written here, and the real SmolLM2-135M-Instruct Q4_1.

Reference: transformers' own GGUF loading (``from_pretrained(dir, gguf_file=...)``). The real model
is converted once per session into a temporary CHORUS_CACHE, and transformers loads it once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.loader import (
    ResolvedModel, checkpoint_dir, checkpoint_dtype, iter_weights, load_config, load_tokenizer, resolve_model,
)
from engine.loader import gguf_loader
from tests.models.gguf_writer import llama_cpp_permute, write_gguf

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
TEXTS = ["Hello world! How are you today?", "def add(a, b):\n    return a + b\n",
         "  leading spaces, émojis 🎉", "<|im_start|>user\nhi<|im_end|>"]

def _config_dict(cfg) -> dict:
    d = cfg.to_dict()
    # quantization_config: set by from_pretrained(gguf_file=...) on the model it loads, not by the config.
    for volatile in ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "quantization_config"):
        d.pop(volatile, None)
    return d


# ----------------------------------------------------------------------------------------- tiny GGUF files

def write_tiny_gguf(out: Path, model, tokenizer_dir: Path, quant: str = "F32") -> None:
    """Write ``model`` (a tiny HF Llama/Qwen2) and the tokenizer in ``tokenizer_dir`` as a GGUF file."""
    import shutil

    hf_dir = out.parent / f"{out.stem}-hf"
    model.save_pretrained(hf_dir)
    for path in tokenizer_dir.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(path, hf_dir / path.name)
    write_gguf(out, hf_dir, quant)
    shutil.rmtree(hf_dir)


TINY_CASES = {
    # name: (arch, tie, heads, kv_heads, quant)
    "llama-untied-4h2kv-f32": ("llama", False, 4, 2, "F32"),
    "llama-tied-4h1kv-q8_0": ("llama", True, 4, 1, "Q8_0"),
    "llama-untied-8h8kv-f16": ("llama", False, 8, 8, "F16"),
    "qwen2-tied-4h2kv-f32": ("qwen2", True, 4, 2, "F32"),
}


@pytest.mark.parametrize("case", list(TINY_CASES))
def test_tiny_gguf_matches_transformers(case, tiny_llama_dir, tmp_path, monkeypatch):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    arch, tie, heads, kv_heads, quant = TINY_CASES[case]
    monkeypatch.setenv("CHORUS_CACHE", str(tmp_path / "cache"))
    cfg = AutoConfig.for_model(arch, vocab_size=384, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads,
                               initializer_range=0.2, max_position_embeddings=256, tie_word_embeddings=tie)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    gdir = tmp_path / "gguf"
    gdir.mkdir()
    write_tiny_gguf(gdir / "tiny.gguf", model, tiny_llama_dir, quant)

    resolved = resolve_model(str(gdir))
    assert resolved.kind == "gguf" and resolved.path == (gdir / "tiny.gguf").resolve()
    assert checkpoint_dtype(resolved) == torch.float32
    got = dict(iter_weights(resolved, torch.float32))
    ref_model = AutoModelForCausalLM.from_pretrained(str(gdir), gguf_file="tiny.gguf")
    want = dict(ref_model.state_dict())
    if tie:
        want.pop("lm_head.weight")
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
        if quant == "F32":
            assert torch.equal(got[name], model.state_dict()[name]), name  # exact round trip
    # NOTE: a wrong un-permutation would still match a wrongly-permuting reference; check it against
    # the source model too (exact for F32, within the quantization error otherwise).
    q = "model.layers.1.self_attn.k_proj.weight"
    assert torch.allclose(got[q], model.state_dict()[q], atol=0.02), q

    ours = load_config(resolved)
    assert _config_dict(ours) == _config_dict(AutoConfig.from_pretrained(str(gdir), gguf_file="tiny.gguf"))
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "tie_word_embeddings",
                "vocab_size", "intermediate_size", "num_hidden_layers", "max_position_embeddings"):
        assert getattr(ours, key) == getattr(cfg, key), key

    tok = load_tokenizer(resolved)
    ref_tok = AutoTokenizer.from_pretrained(str(gdir), gguf_file="tiny.gguf")
    for text in TEXTS:
        assert tok(text).input_ids == ref_tok(text).input_ids, text


def test_unsupported_gguf_architecture(tmp_path, monkeypatch):
    import gguf

    monkeypatch.setenv("CHORUS_CACHE", str(tmp_path / "cache"))
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "bert")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="architecture 'bert' is not supported"):
        load_config(resolve_model(str(tmp_path / "m.gguf")))
    converted = tmp_path / "cache" / "converted"
    assert not converted.exists() or not list(converted.iterdir())  # no half cache left behind


def test_unpermute_inverts_llama_cpp_permute():
    rng = np.random.default_rng(0)
    for n_head, head_dim in [(9, 64), (3, 64), (1, 8), (4, 16)]:
        w = rng.standard_normal((n_head * head_dim, 12)).astype(np.float32)
        assert np.array_equal(gguf_loader._unpermute_rope_rows(llama_cpp_permute(w, n_head), n_head), w)
        b = w[:, 0].copy()
        assert np.array_equal(gguf_loader._unpermute_rope_rows(llama_cpp_permute(b, n_head), n_head), b)


# ------------------------------------------------------------------------------------- real SmolLM2 GGUF

@dataclass
class SmolCache:
    """The session's converted SmolLM2 cache."""

    root: Path            # the CHORUS_CACHE directory it lives in
    resolved: ResolvedModel
    cold_s: float         # seconds the first (converting) checkpoint_dir call took


@pytest.fixture(scope="session")
def smol_cache(tmp_path_factory) -> SmolCache:
    root = tmp_path_factory.mktemp("chorus-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CHORUS_CACHE", str(root))
        resolved = resolve_model(None)
        start = time.perf_counter()
        checkpoint_dir(resolved)
        return SmolCache(root, resolved, time.perf_counter() - start)


@pytest.fixture
def smol(smol_cache, monkeypatch) -> ResolvedModel:
    monkeypatch.setenv("CHORUS_CACHE", str(smol_cache.root))
    return smol_cache.resolved


@pytest.fixture(scope="session")
def smol_hf_reference(smol_cache):
    """transformers' own load of the GGUF (~15-22 s, once per session)."""
    from transformers import AutoModelForCausalLM

    path = smol_cache.resolved.path
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name)


def test_smollm2_weights_equal_transformers(smol, smol_hf_reference):
    want = smol_hf_reference.state_dict()
    seen = set()
    for name, tensor in iter_weights(smol, torch.float32):
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, want[name]), name
        seen.add(name)
    assert seen == set(want) - {"lm_head.weight"}  # tied: lm_head is the embedding
    assert len(seen) == 272


def test_smollm2_config_equals_transformers(smol, smol_hf_reference):
    cfg = load_config(smol)
    assert _config_dict(cfg) == _config_dict(smol_hf_reference.config)
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size) == ("llama", 30, 576)
    assert cfg.num_attention_heads == 9
    assert (cfg.num_key_value_heads, cfg.tie_word_embeddings, cfg.vocab_size) == (3, True, 49152)
    assert cfg.rope_parameters["rope_theta"] == 100000.0
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.max_position_embeddings) == (1, 2, 8192)


def test_smollm2_tokenizer_equals_transformers(smol):
    from transformers import AutoTokenizer

    path = smol.path
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok = load_tokenizer(smol)
    prompt = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert prompt == ref.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    ids = tok(prompt, add_special_tokens=False).input_ids
    assert ids == ref(prompt, add_special_tokens=False).input_ids
    assert len(ids) == 37  # ChatML with SmolLM2's default system prompt
    assert tok.chat_template == ref.chat_template
    assert (tok.bos_token, tok.eos_token, tok.eos_token_id) == ("<|im_start|>", "<|im_end|>", 2)
    for text in TEXTS:
        assert tok(text).input_ids == ref(text).input_ids, text
        assert tok.decode(tok(text).input_ids) == ref.decode(ref(text).input_ids)


def test_smollm2_second_load_is_cached_and_fast(smol, smol_cache, monkeypatch):
    import gguf

    def forbidden(*args, **kwargs):
        raise AssertionError("the GGUF file was parsed again instead of using the cache")

    monkeypatch.setattr(gguf, "GGUFReader", forbidden)
    monkeypatch.setattr(gguf_loader, "_convert_into", forbidden)
    start = time.perf_counter()
    resolved = resolve_model(None)
    cfg = load_config(resolved)
    num_tensors = sum(1 for _ in iter_weights(resolved, torch.float32))
    tok = load_tokenizer(resolved)
    warm_s = time.perf_counter() - start
    print(f"SmolLM2 GGUF: cold conversion {smol_cache.cold_s:.1f} s, warm load {warm_s:.2f} s")
    assert (cfg.num_hidden_layers, num_tensors, len(tok)) == (30, 272, 49152)
    assert warm_s < 5.0
    # The cache is one complete directory; no temporary directories are left behind.
    converted = list((smol_cache.root / "converted").iterdir())
    assert converted == [checkpoint_dir(resolved)]
    assert gguf_loader.is_converted(converted[0])
