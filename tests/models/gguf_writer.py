"""Write a GGUF file from a tiny HF checkpoint directory the way llama.cpp's ``convert_hf_to_gguf.py`` does,
independently of ``engine.loader``: tensor names from ``gguf``'s own ``TensorNameMap`` (llama.cpp's mapping),
``llama``'s q/k rope permutation, Gemma's norms stored as 1 + w, experts stacked [n_expert, out, in], the
metadata each converter writes, and the tokenizer as a byte-level BPE (``tokenizer.ggml.model`` "gpt2").

``write_gguf`` returns the HF tensors as the file holds them (dequantized), the weights a reference model
runs.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch

_GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe",
              "gemma3_text": "gemma3", "mixtral": "llama"}
"""HF model_type -> llama.cpp architecture (Mixtral is ``llama`` with experts)."""
_EXPERT = re.compile(
    r"^(?P<module>model\.layers\.\d+\.(?:block_sparse_moe|mlp)\.experts)\.(?P<e>\d+)\.(?P<proj>\w+)$")


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` of q/k rows (rope pairs interleaved per head)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def add_bpe_tokenizer(writer, tokenizer_dir: Path) -> None:
    """The HF byte-level BPE tokenizer in ``tokenizer_dir`` as GGUF tokenizer metadata (``gpt2`` model)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tj = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    added = {t["content"]: t["id"] for t in tj["added_tokens"]}
    by_id = {i: t for t, i in {**tj["model"]["vocab"], **added}.items()}
    tokens = [by_id[i] for i in range(len(by_id))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in added else 1 for t in tokens])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tj["model"]["merges"]])
    writer.add_bos_token_id(tok.bos_token_id)
    writer.add_eos_token_id(tok.eos_token_id)
    writer.add_pad_token_id(tok.pad_token_id)
    if tok.chat_template:
        writer.add_chat_template(tok.chat_template)


def _add_hparams(w, cfg, arch: str) -> None:
    """The metadata llama.cpp's converters write for ``arch`` (``TextModel`` and the arch's own)."""
    text = cfg.get_text_config()
    w.add_block_count(text.num_hidden_layers)
    w.add_context_length(text.max_position_embeddings)
    w.add_embedding_length(text.hidden_size)
    w.add_feed_forward_length(text.intermediate_size)
    w.add_head_count(text.num_attention_heads)
    w.add_head_count_kv(text.num_key_value_heads)
    w.add_layer_norm_rms_eps(text.rms_norm_eps)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    rope = text.rope_parameters
    full = rope.get("full_attention", rope) if isinstance(rope, dict) else {}
    w.add_rope_freq_base(full["rope_theta"])
    if arch != "llama" or getattr(text, "head_dim", None):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
        w.add_vocab_size(text.vocab_size)
    experts = getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(text.num_experts_per_tok)
    if arch in ("qwen3moe", "qwen2moe"):
        w.add_expert_feed_forward_length(text.moe_intermediate_size)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(text.shared_expert_intermediate_size)
    if arch == "gemma3":
        w.add_sliding_window(text.sliding_window)
        if full.get("rope_type") == "linear":
            import gguf
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])


def _stored(a: np.ndarray, quant: str) -> tuple[np.ndarray, np.ndarray, object]:
    """(what to write, its dequantized float32 values, raw_dtype or None) for ``a`` in ``quant``; vectors
    (norms, biases) and rows not a multiple of the block stay float32, as llama.cpp keeps them."""
    import gguf

    if a.ndim >= 2 and quant == "Q8_0" and a.shape[-1] % 32 == 0:
        qtype = gguf.GGMLQuantizationType.Q8_0
        q = gguf.quants.quantize(a, qtype)
        return q, gguf.quants.dequantize(q, qtype), qtype
    if a.ndim >= 2 and quant == "F16":
        h = a.astype(np.float16)
        return h, h.astype(np.float32), None
    return a, a, None


def write_gguf(out: Path, hf_dir: Path, quant: str = "F32") -> dict[str, torch.Tensor]:
    """Write the checkpoint in ``hf_dir`` (config, safetensors, tokenizer) to ``out`` as llama.cpp would
    convert it, 2-D weights in ``quant`` ("F32", "F16", "Q8_0"). Returns HF name -> the float32 tensor the
    file holds for it (what a reference model should run)."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(hf_dir))
    text = cfg.get_text_config()
    arch = _GGUF_ARCH[cfg.model_type]
    name_map = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch),
                                        text.num_hidden_layers)
    # llama.cpp's qwen3moe has no dense-MLP tensors: a Qwen3-MoE with mlp_only_layers takes llama's names.
    dense_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, text.num_hidden_layers)
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name("tiny")
    _add_hparams(w, cfg, arch)
    add_bpe_tokenizer(w, hf_dir)

    tensors = {k: v.float().numpy() for k, v in load_file(str(hf_dir / "model.safetensors")).items()}
    if text.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    stacks: dict[str, dict[int, np.ndarray]] = {}
    plain: list[tuple[str, np.ndarray]] = []
    for name, a in tensors.items():
        stem, leaf = name.rsplit(".", 1)
        m = _EXPERT.match(stem)
        if m:
            stacks.setdefault(f"{m['module']}.{m['proj']}", {})[int(m["e"])] = a
        else:
            plain.append((name, a))
    stored: dict[str, torch.Tensor] = {}
    for name, a in plain:
        stem, leaf = name.rsplit(".", 1)
        gname = f"{name_map.get_name(stem) or dense_map.get_name(stem)}.{leaf}"
        if arch == "llama" and ".attn_q." in gname:
            a = llama_cpp_permute(a, text.num_attention_heads)
        elif arch == "llama" and ".attn_k." in gname:
            a = llama_cpp_permute(a, text.num_key_value_heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            a = a + np.float32(1.0)   # Gemma3RMSNorm scales by 1 + w; llama.cpp stores 1 + w
        if gname.endswith("ffn_gate_inp_shexp.weight"):
            a = a.reshape(-1)         # llama.cpp's {n_embd} vector, kept float like the norms
        data, values, raw = _stored(np.ascontiguousarray(a), quant)
        w.add_tensor(gname, data, raw_dtype=raw)
        if arch == "gemma3" and name.endswith("norm.weight"):
            values = values - np.float32(1.0)
        values = values.reshape(tensors[name].shape)
        if arch == "llama" and (".attn_q." in gname or ".attn_k." in gname):
            # Rows quantize on their own: the permuted rows' values are the HF rows' values, permuted.
            values = tensors[name] if quant == "F32" else _stored(tensors[name], quant)[1]
        stored[name] = torch.from_numpy(np.array(values, dtype=np.float32))
    for stem, by_expert in stacks.items():
        stacked = np.stack([by_expert[e] for e in sorted(by_expert)])   # [n_expert, out, in]
        data, values, raw = _stored(stacked, quant)
        w.add_tensor(f"{name_map.get_name(stem)}.weight", data, raw_dtype=raw)
        module, proj = stem.rsplit(".", 1)
        for e in sorted(by_expert):
            stored[f"{module}.{e}.{proj}.weight"] = torch.from_numpy(np.array(values[e], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored
