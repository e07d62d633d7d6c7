"""GGUF files of Qwen3, Qwen3-MoE, Qwen2-MoE, Gemma 3 and Mixtral (llama.cpp's ``qwen3``, ``qwen3moe``,
``qwen2moe``, ``gemma3`` and ``llama`` with experts) against transformers on the tiny HF checkpoints they were written from (CPU, float32).

Each tiny checkpoint comes from the family's own test config (test_qwen3, test_gemma3, test_moe), made
representable in llama.cpp's format where it fixes things in code (Gemma 3: every 6th layer global, local rope
base 1e4, attention scale 1/sqrt(head_dim), no soft-capping); ``tests.models.gguf_writer`` writes it as
llama.cpp's converter would. Chorus serves the file; the reference is transformers on the weights the file
holds (dequantized): served as float weights (F32, F16, Q8_0 with --quantization none), every greedy token
equal and logprobs within 1e-3; Q8_0 kept int8 on CPU (MoE experts included), vLLM's rule
(tokens equal or, where they part, each in the other's top-5), with or without an adapter beside the int8 experts.
Where transformers reads the arch from GGUF
itself (``from_pretrained(..., gguf_file=...)``: qwen3, qwen3moe, qwen2moe, gemma3) its weights equal our converted
checkpoint's.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from engine import LLM, SamplingParams
from engine.loader import checkpoint_dir, gguf_loader, load_config, resolve_model
from tests.conftest import TINY_PROMPTS, build_tiny_checkpoint
from tests.models import test_gemma3, test_moe, test_qwen3
from tests.models.gguf_writer import write_gguf
from tests.models.utils import RefOutput, check_logprobs_close, hf_float32, hf_greedy, ours_as_ref

MAX_TOKENS = 8
INT8_FIRST_STEP_ATOL = 0.6
"""An MoE Q8_0 file's per-row int8 weights against its float weights: one first-step logprob (measured up to
0.49 where an expert choice flips; the same with the int8 kernels replaced by float32 matmuls)."""
INT8_FIRST_STEP_MEAN = 0.2
"""The same, each request's largest deviation averaged over the requests (measured 0.06-0.11)."""
HF_READS_GGUF = ("qwen3", "qwen3moe", "qwen2moe", "gemma3")
"""The GGUF architectures transformers loads itself (the writer's cross-check)."""


def _qwen3(d: Path) -> Path:
    return test_qwen3._build(d, seed=5)


def _qwen3_tied_bias(d: Path) -> Path:
    return test_qwen3._build(d, seed=6, tie_word_embeddings=True, attention_bias=True)


def _gemma3(d: Path) -> Path:
    return test_gemma3._build(d, seed=11, num_hidden_layers=6, num_key_value_heads=2,
                              tie_word_embeddings=False, query_pre_attn_scalar=test_gemma3.SHAPE["head_dim"],
                              final_logit_softcapping=None)


def _moe(variant: str):
    arch, overrides = test_moe.VARIANTS[variant]
    return lambda d: build_tiny_checkpoint(d, arch, seed=3, **overrides)


CASES = {   # name: (checkpoint builder, GGUF arch, tensor type of the 2-D weights, our class)
    "qwen3-f32": (_qwen3, "qwen3", "F32", "Qwen3ForCausalLM"),
    "qwen3-tied-bias-q8_0": (_qwen3_tied_bias, "qwen3", "Q8_0", "Qwen3ForCausalLM"),
    "gemma3-f32": (_gemma3, "gemma3", "F32", "Gemma3ForCausalLM"),
    "gemma3-f16": (_gemma3, "gemma3", "F16", "Gemma3ForCausalLM"),
    "gemma3-q8_0": (_gemma3, "gemma3", "Q8_0", "Gemma3ForCausalLM"),
    "qwen3moe-f32": (_moe("qwen3moe-8x2-norm"), "qwen3moe", "F32", "Qwen3MoeForCausalLM"),
    "qwen3moe-q8_0": (_moe("qwen3moe-8x2-norm"), "qwen3moe", "Q8_0", "Qwen3MoeForCausalLM"),
    "qwen3moe-dense1-f32": (_moe("qwen3moe-64x8-norm-dense1"), "qwen3moe", "F32", "Qwen3MoeForCausalLM"),
    "qwen2moe-f32": (_moe("qwen2moe-8x2-shared"), "qwen2moe", "F32", "Qwen2MoeForCausalLM"),
    "qwen2moe-q8_0": (_moe("qwen2moe-8x2-shared"), "qwen2moe", "Q8_0", "Qwen2MoeForCausalLM"),
    "mixtral-f32": (_moe("mixtral-8x2"), "llama", "F32", "MixtralForCausalLM"),
    "mixtral-q8_0": (_moe("mixtral-8x2"), "llama", "Q8_0", "MixtralForCausalLM"),
}


def _reference_dir(hf_dir: Path, stored: dict[str, torch.Tensor], out: Path) -> Path:
    """``hf_dir`` with the weights the GGUF holds (dequantized), for transformers."""
    shutil.copytree(hf_dir, out)
    save_file({k: v.contiguous() for k, v in stored.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Case name -> (HF checkpoint dir, GGUF file, the weights the file holds), built on first use."""
    cache, hf_dirs = {}, {}

    def get(case: str):
        if case not in cache:
            build, _, quant, _ = CASES[case]
            if build not in hf_dirs:
                hf_dirs[build] = build(tmp_path_factory.mktemp(case + "-hf"))
            gdir = tmp_path_factory.mktemp(case + "-gguf")
            stored = write_gguf(gdir / "tiny.gguf", hf_dirs[build], quant)
            cache[case] = (hf_dirs[build], gdir / "tiny.gguf", stored)
        return cache[case]
    return get


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("CHORUS_CACHE", str(tmp_path_factory.getbasetemp() / "chorus-cache"))


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_matches_transformers(case, built, tmp_path):
    hf_dir, gguf_path, stored = built(case)
    _, gguf_arch, quant, cls = CASES[case]
    import gguf
    from transformers import AutoTokenizer
    reader = gguf.GGUFReader(str(gguf_path))
    assert reader.fields["general.architecture"].contents() == gguf_arch
    types = {t.tensor_type.name for t in reader.tensors if len(t.shape) >= 2}
    assert types == {quant}, types
    if "moe" in case or "mixtral" in case:
        assert any(t.name.endswith("ffn_gate_exps.weight") and len(t.shape) == 3 for t in reader.tensors)

    hf_cfg = hf_float32(hf_dir).config
    cfg = load_config(resolve_model(str(gguf_path)))
    keys = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
            "tie_word_embeddings", "rms_norm_eps", "head_dim", "intermediate_size"]
    keys += {"qwen3": ["attention_bias"], "gemma3": ["layer_types", "sliding_window", "query_pre_attn_scalar",
                                                     "rope_parameters", "final_logit_softcapping"],
             "qwen3moe": ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                          "mlp_only_layers"],
             "qwen2moe": ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                          "shared_expert_intermediate_size", "qkv_bias", "mlp_only_layers"],
             "llama": ["num_local_experts", "num_experts_per_tok", "sliding_window"]}[gguf_arch]
    for key in keys:
        want, got = getattr(hf_cfg, key, None), getattr(cfg, key, None)
        if key == "head_dim":   # Mixtral's and Qwen2-MoE's configs leave it to hidden_size / heads
            want, got = (v or hf_cfg.hidden_size // hf_cfg.num_attention_heads for v in (want, got))
        assert got == (pytest.approx(want, rel=1e-6) if isinstance(want, float) else want), key
    if quant == "F32":
        from safetensors.torch import load_file
        want = load_file(str(hf_dir / "model.safetensors"))
        assert set(stored) == set(want) - ({"lm_head.weight"} if hf_cfg.tie_word_embeddings else set())
        for name, tensor in stored.items():
            torch.testing.assert_close(tensor, want[name].float(), atol=1e-6, rtol=0, msg=name)

    hf = hf_float32(_reference_dir(hf_dir, stored, tmp_path / "reference"))
    # The tokenizer is transformers' reading of the file's metadata (``_run`` checks ours against it).
    hf_tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    refs = [hf_greedy(hf, hf_tok.encode(p), MAX_TOKENS) for p in TINY_PROMPTS]
    assert len({tuple(r.token_ids) for r in refs}) > 1
    # Float weights (a quantized file dequantized): every token equal, logprobs within 1e-3.
    assert _run(case, gguf_path, hf_tok, refs, quantization=None if quant == "F32" else "none",
                atol=1e-3) == "float"
    if quant == "Q8_0":
        # On CPU the file's Q8_0 tensors stay int8 (re-quantized per row), an MoE's routed experts too (its
        # routers float): vLLM's top-5 rule. The int8 kernels' bfloat16 activations move these tiny models'
        # logprobs by up to ~0.6 per step, so an MoE's paths part where no token is in the other's top-5; its
        # first step is held to the rule and its experts to the file's values (``_run``).
        moe = "moe" in case or "mixtral" in case
        refs = [RefOutput(r.token_ids[:1], r.logprobs[:1]) for r in refs] if moe else refs
        assert _run(case, gguf_path, hf_tok, refs, quantization=None, atol=float("inf")) == "int8"


def _run(case: str, gguf_path: Path, hf_tok, refs: list, quantization, atol: float) -> str:
    """Serve ``gguf_path`` with ``quantization`` and check it against ``refs`` (transformers' greedy
    outputs for TINY_PROMPTS: all tokens equal where ``atol`` is finite, else vLLM's rule) and its
    tokenizer against ``hf_tok``; returns "int8" where projections stayed int8, else "float"."""
    from engine.layers.moe import FusedMoE, SparseMoeBlock
    from engine.layers.quantized import Int8Weight, packed_weights

    _, _, _, cls = CASES[case]
    llm = LLM(str(gguf_path), seed=0, max_model_len=256, quantization=quantization)
    model = llm.llm_engine.core.runner.model
    assert type(model).__name__ == cls
    tok = llm.get_tokenizer()
    for p in TINY_PROMPTS:   # the tokenizer is transformers' reading of the file's metadata
        assert tok.encode(p) == hf_tok.encode(p), p
    params = SamplingParams(temperature=0.0, max_tokens=len(refs[0].token_ids), ignore_eos=True, logprobs=5)
    outputs = llm.generate(TINY_PROMPTS, params, use_tqdm=False)
    matched = [check_logprobs_close(r, ours_as_ref(o.outputs[0]), f"{case} prompt {i}", atol=atol)
               for i, (r, o) in enumerate(zip(refs, outputs))]
    if atol != float("inf"):
        assert matched == [len(r.token_ids) for r in refs]
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    if packed_weights(model) and experts:       # int8 experts holding the file's weights re-quantized per row
        assert all(m.gate.weight_q is None for m in model.modules() if isinstance(m, SparseMoeBlock))
        float_llm = LLM(str(gguf_path), seed=0, max_model_len=256, quantization="none")
        float_model = float_llm.llm_engine.core.runner.model
        float_experts = [m for m in float_model.modules() if isinstance(m, FusedMoE)]
        for moe, float_moe in zip(experts, float_experts):
            for ws, stacked in zip(moe.cpu_quantized, (float_moe.w13, float_moe.w2)):
                for w, f in zip(ws, stacked):
                    assert isinstance(w, Int8Weight) and torch.equal(w.q, Int8Weight(f).q)
    return "int8" if packed_weights(model) else "float"


@pytest.mark.parametrize("case", ["qwen3moe-q8_0", "qwen2moe-q8_0", "mixtral-q8_0"])
def test_adapters_run_beside_a_moe_files_int8_experts(case, built, tmp_path):
    """With LoRA the file's Q8_0 tensors stay int8 as without it (every routed expert too) and a per-expert
    adapter (attention, router, experts) runs beside them, mixed with base requests, against the same adapter on
    the float weights (``-q none``; exact against PEFT in ``test_moe_lora``): at each request's first step the
    tokens both top-5s hold (at least 2) agree within ``INT8_FIRST_STEP_ATOL``, their largest deviation within
    ``INT8_FIRST_STEP_MEAN`` on average (the adapter moves them by ~1 and changes most tokens). The per-row int8
    weights differ from the file's Q8_0 blocks and can flip an expert choice, and these tiny random models' first
    steps are near-flat, so tokens are not compared."""
    from engine.layers.moe import FusedMoE
    from engine.layers.quantized import Int8Weight
    from lora import LoRARequest
    from tests.models.test_moe_lora import per_expert_adapter

    hf_dir, gguf_path, _ = built(case)
    lora = LoRARequest("a", 1, str(per_expert_adapter(hf_dir, tmp_path / "a", r=8, alpha=16, seed=1)))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    outs = {}
    for quantization in ("none", None):
        llm = LLM(str(gguf_path), seed=0, max_model_len=256, quantization=quantization, enable_lora=True,
                  max_loras=1, max_lora_rank=8)
        experts = [m for m in llm.llm_engine.core.runner.model.modules() if isinstance(m, FusedMoE)]
        assert experts and all((m.cpu_quantized is None) == (quantization == "none") for m in experts)
        if quantization is None:
            assert all(isinstance(w, Int8Weight) for m in experts for ws in m.cpu_quantized for w in ws)
        requests = [lora] * len(TINY_PROMPTS) + [None] * len(TINY_PROMPTS)
        outs[quantization] = [ours_as_ref(o.outputs[0]) for o in llm.generate(
            TINY_PROMPTS * 2, params, lora_request=requests, use_tqdm=False)]
    floats, int8s = outs["none"], outs[None]
    assert [o.token_ids for o in floats[:len(TINY_PROMPTS)]] != [o.token_ids for o in floats[len(TINY_PROMPTS):]]
    largest = []
    for i, (ref, ours) in enumerate(zip(floats, int8s)):
        shared = set(ref.logprobs[0]) & set(ours.logprobs[0])
        assert len(shared) >= 2, f"{case} request {i}: top-5s {sorted(ref.logprobs[0])} / {sorted(ours.logprobs[0])}"
        largest.append(max(abs(ref.logprobs[0][t] - ours.logprobs[0][t]) for t in shared))
        assert largest[-1] <= INT8_FIRST_STEP_ATOL, f"{case} request {i}: {largest[-1]:.3f}"
    assert sum(largest) / len(largest) <= INT8_FIRST_STEP_MEAN, largest


@pytest.mark.parametrize("case", ["qwen3-f32", "gemma3-f32", "qwen3moe-f32", "qwen2moe-f32"])
def test_transformers_reads_our_gguf_as_we_do(case, built):
    """transformers' own GGUF tensor loading holds the same weights as our converted checkpoint (read back by
    transformers: so that directory serves transformers and PEFT too). transformers is given the checkpoint's
    config: its GGUF config mapping skips ``attention.key_length`` for qwen3 and
    ``expert_feed_forward_length`` for qwen3moe, so it would build a tiny file at the defaults' sizes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_dir, gguf_path, _ = built(case)
    assert CASES[case][1] in HF_READS_GGUF
    theirs = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                  config=AutoConfig.from_pretrained(str(hf_dir)),
                                                  dtype=torch.float32).state_dict()
    ours = hf_float32(checkpoint_dir(resolve_model(str(gguf_path)))).state_dict()
    assert sorted(theirs) == sorted(ours)
    for name, tensor in ours.items():
        torch.testing.assert_close(theirs[name], tensor, atol=1e-6, rtol=0, msg=name)


def _rewrite(src: Path, dst: Path, drop: frozenset[str] = frozenset(), per_expert: bool = False,
             extra: dict | None = None, arch: str | None = None) -> None:
    """A copy of GGUF ``src`` without the tensors named in ``drop``; ``per_expert``: stacked ``ffn_*_exps``
    tensors as older llama.cpp wrote Mixtral, one ``ffn_*.E`` per expert; ``extra``: metadata to add
    (key -> (value, GGUFValueType, array item type or None)); ``arch``: another ``general.architecture``."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), arch or reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        w.add_key_value(key, field.contents(), vtype,
                        sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    for key, (value, vtype, sub) in (extra or {}).items():
        w.add_key_value(key, value, vtype, sub_type=sub)
    for t in reader.tensors:
        stem = t.name.removesuffix(".weight")
        if t.name in drop:
            continue
        if per_expert and stem.endswith("_exps"):
            for e, part in enumerate(np.array(t.data)):
                w.add_tensor(f"{stem.removesuffix('_exps')}.{e}.weight", part, raw_dtype=t.tensor_type)
        else:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_older_per_expert_mixtral_files_read_as_stacked_ones(built, tmp_path):
    """Older llama.cpp wrote Mixtral's experts one tensor each (``blk.N.ffn_gate.E.weight``)."""
    from engine.loader import iter_weights

    _, gguf_path, _ = built("mixtral-f32")
    legacy = tmp_path / "legacy.gguf"
    _rewrite(gguf_path, legacy, per_expert=True)
    import gguf
    names = {t.name for t in gguf.GGUFReader(str(legacy)).tensors}
    assert "blk.1.ffn_down.7.weight" in names and not any(n.endswith("_exps.weight") for n in names)
    want = dict(iter_weights(resolve_model(str(gguf_path)), torch.float32))
    got = dict(iter_weights(resolve_model(str(legacy)), torch.float32))
    assert sorted(got) == sorted(want) and "model.layers.1.block_sparse_moe.experts.7.w2.weight" in got
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def test_gemma3_sliding_window_pattern_key_sets_the_layer_types(built, tmp_path):
    """Without ``gemma3.attention.sliding_window_pattern`` every 6th layer is global (llama.cpp's gemma3);
    with it, the key says which layers slide."""
    import gguf

    _, gguf_path, _ = built("gemma3-f32")
    default = load_config(resolve_model(str(gguf_path))).layer_types
    assert default == ["sliding_attention"] * 5 + ["full_attention"]
    pattern = [True, False, True, True, False, True]
    keyed = tmp_path / "keyed.gguf"
    _rewrite(gguf_path, keyed, extra={"gemma3.attention.sliding_window_pattern":
                                      (pattern, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.BOOL)})
    cfg = load_config(resolve_model(str(keyed)))
    assert cfg.layer_types == ["sliding_attention" if s else "full_attention" for s in pattern]


def test_shared_expert_and_router_names():
    """Qwen2-MoE-style shared-expert tensors of a qwen3moe file take HF's names (the gate as [1, hidden])."""
    from engine.loader.gguf_arch import ARCHS, hf_tensors

    arch = ARCHS["qwen3moe"]
    gate = hf_tensors(arch, "blk.2.ffn_gate_inp_shexp.weight", np.ones(64, np.float32))
    assert [(n, t.shape) for n, t in gate] == [("model.layers.2.mlp.shared_expert_gate.weight", (1, 64))]
    assert hf_tensors(arch, "blk.2.ffn_up_shexp.weight", np.ones((32, 64), np.float32))[0][0] == \
        "model.layers.2.mlp.shared_expert.up_proj.weight"
    stacked = np.arange(3 * 4 * 2, dtype=np.float32).reshape(3, 4, 2)   # [n_expert, out, in]
    experts = hf_tensors(arch, "blk.0.ffn_down_exps.weight", stacked)
    assert [n for n, _ in experts] == [f"model.layers.0.mlp.experts.{e}.down_proj.weight" for e in range(3)]
    assert all(np.array_equal(t, stacked[e]) for e, (_, t) in enumerate(experts))
    with pytest.raises(ValueError, match="no Hugging Face equivalent"):
        hf_tensors(arch, "blk.0.attn_qkv.weight", np.ones((4, 4), np.float32))


@pytest.mark.parametrize("case, drop, named", [
    ("gemma3-f32", {"blk.2.post_ffw_norm.weight"}, "blk.2.post_ffw_norm.weight"),
    ("qwen3moe-f32", {"blk.1.ffn_up_exps.weight", "blk.0.attn_k_norm.weight"},
     "blk.0.attn_k_norm.weight, blk.1.ffn_up_exps.weight"),
    ("mixtral-f32", {"blk.0.ffn_gate_inp.weight"}, "blk.0.ffn_gate_inp.weight"),
])
def test_missing_tensors_stop_start_up_naming_them(case, drop, named, built, tmp_path):
    _, gguf_path, _ = built(case)
    broken = tmp_path / "broken.gguf"
    _rewrite(gguf_path, broken, frozenset(drop))
    with pytest.raises(ValueError, match="lacks tensors") as err:
        LLM(str(broken), max_model_len=64)
    message = str(err.value)
    assert "\n" not in message and named in message, message
    assert not gguf_loader.converted_dir_for(broken).exists()   # refused before anything is written


@pytest.mark.parametrize("broken, words, in_process", [
    ("missing", ["lacks tensors", "qwen3moe", "blk.1.ffn_down_exps.weight"], False),
    ("unsupported", ["architecture 'phi3' is not supported", "qwen3moe", "Hugging Face checkpoint"], True),
], ids=["missing-subprocess", "unsupported-in-process"])
def test_serve_stops_with_one_line_naming_what_is_missing(broken, words, in_process, built, tmp_path, capfd,
                                                          monkeypatch):
    """``chorus serve`` on a file without a tensor its model needs, or of an architecture Chorus does not
    read: the one-line start-up error, nothing else. The first as a real ``chorus serve`` process (stderr as a
    user sees it); the second through ``engine.cli.main`` in this process (the same parser and start-up,
    without another process's Python and torch imports)."""
    import os
    import subprocess

    from engine.cli import main
    from engine.server.app import EXIT_CONFIG_ERROR
    from tests.server.conftest import free_port
    from tests.server.test_cli import REPO, chorus_cmd

    _, gguf_path, _ = built("qwen3moe-f32")
    path = tmp_path / "broken.gguf"
    if broken == "missing":
        _rewrite(gguf_path, path, frozenset({"blk.1.ffn_down_exps.weight"}))
    else:
        _rewrite(gguf_path, path, arch="phi3")
    argv = ["serve", str(path), "--host", "127.0.0.1", "--port", str(free_port()), "--max-model-len", "64"]
    if in_process:
        monkeypatch.setenv("CHORUS_CACHE", str(tmp_path / "cache"))
        capfd.readouterr()
        returncode, stderr = main(argv), capfd.readouterr().err
    else:
        env = {**os.environ, "PYTHONPATH": str(REPO), "CHORUS_CACHE": str(tmp_path / "cache")}
        run = subprocess.run([*chorus_cmd(), *argv], capture_output=True, text=True, cwd=REPO, env=env,
                             timeout=240)
        returncode, stderr = run.returncode, run.stderr
    lines = stderr.strip().splitlines()
    assert returncode == EXIT_CONFIG_ERROR, stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("chorus serve: error: "), stderr[-2000:]
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert not (tmp_path / "cache" / "converted").exists()   # refused before anything is written


def test_large_conversions_are_written_in_files_of_shard_bytes(built, tmp_path, monkeypatch):
    """Past ``SHARD_BYTES`` the converted weights are several files and an index (the conversion never holds
    the whole model); they read back equal to one file's."""
    import json

    from engine.loader import iter_weights

    _, gguf_path, _ = built("mixtral-f32")
    whole = dict(iter_weights(resolve_model(str(gguf_path)), torch.float32))
    monkeypatch.setenv("CHORUS_CACHE", str(tmp_path / "sharded-cache"))
    monkeypatch.setattr(gguf_loader, "SHARD_BYTES", 256 << 10)
    resolved = resolve_model(str(gguf_path))
    out = checkpoint_dir(resolved)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3 and not (out / "model.safetensors").exists()
    assert all((out / f).stat().st_size <= (256 << 10) + (64 << 10) for f in files)   # + the file's header
    sharded = dict(iter_weights(resolved, torch.float32))
    assert sorted(sharded) == sorted(whole)
    for name, tensor in whole.items():
        assert torch.equal(sharded[name], tensor), name
