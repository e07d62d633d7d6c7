"""What each GGUF architecture Chorus reads means in Hugging Face terms: its tensor names, its q/k layout,
its norm convention and the config fields llama.cpp's ``convert_hf_to_gguf.py`` leaves implicit.

One ``GgufArch`` per ``general.architecture`` (``llama``, ``qwen2``, ``qwen2moe``, ``qwen3``, ``qwen3moe``,
``gemma3``);
a ``llama`` file with ``llama.expert_count`` is Mixtral. Names follow ``gguf.constants`` (``TENSOR_NAMES``):

- every arch: ``token_embd``, ``output_norm``, ``output`` (absent: tied), ``blk.N.attn_norm``, ``attn_q`` /
  ``attn_k`` / ``attn_v`` / ``attn_output``, ``ffn_norm``, ``ffn_gate`` / ``ffn_up`` / ``ffn_down``;
- ``qwen3``, ``qwen3moe``, ``gemma3``: ``attn_q_norm`` / ``attn_k_norm`` (per-head RMSNorm);
- ``gemma3``: ``post_attention_norm``, ``post_ffw_norm``; its ``ffn_norm`` is HF's
  ``pre_feedforward_layernorm``;
- MoE (``qwen2moe``, ``qwen3moe``, Mixtral): ``ffn_gate_inp`` (router), ``ffn_gate_exps`` / ``ffn_up_exps`` /
  ``ffn_down_exps`` (experts stacked: [n_expert, out, in]), older Mixtral files one ``ffn_gate.E`` per expert;
  ``ffn_gate_inp_shexp`` / ``ffn_{gate,up,down}_shexp`` a Qwen2-MoE-style shared expert (every ``qwen2moe``
  block has one).

The converted checkpoint uses the names ``save_pretrained`` writes (Mixtral's
``block_sparse_moe.experts.E.w1``, Qwen-MoE's ``mlp.experts.E.gate_proj``), so transformers and PEFT read it
too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

_ATTENTION = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
}
_DENSE_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_QWEN_MOE = {"ffn_gate_inp": "mlp.gate", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
             "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
             "ffn_down_shexp": "mlp.shared_expert.down_proj"}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_IGNORED = {"rope_freqs.weight"}
"""Tensors HF models recompute from the config (llama3 rope frequency factors); never converted."""
_EXPERT_KINDS = ("gate", "up", "down")
_LAYER_RE = re.compile(r"^blk\.(?P<layer>\d+)\.(?P<kind>\w+?)(?:\.(?P<expert>\d+))?\.(?P<leaf>weight|bias)$")
_GLOBAL_RE = re.compile(r"^(\w+)\.(weight|bias)$")


@dataclass(frozen=True)
class GgufArch:
    """One GGUF architecture, read as the HF model it was converted from."""

    name: str
    """``general.architecture`` (Mixtral: "llama")."""
    model_type: str
    """The HF ``model_type`` of the config it becomes, e.g. "gemma3_text"."""
    architectures: tuple[str, ...]
    """The HF ``architectures`` written into that config (empty: left to ``model_type``)."""
    config_prefix: str
    """Key of transformers' ``GGUF_CONFIG_MAPPING`` holding this arch's metadata renames."""
    permutes_qk: bool
    """llama.cpp stores ``attn_q`` / ``attn_k`` rows rope-permuted (``llama`` only)."""
    norm_shift: float
    """Added to every ``*norm.weight`` by llama.cpp's converter (Gemma: 1.0, its RMSNorm scales by 1 + w)."""
    layer_names: dict[str, str]
    """GGUF layer tensor kind (``attn_q``) -> HF module path under ``model.layers.N``
    (``self_attn.q_proj``)."""
    experts: tuple[str, tuple[str, str, str]] | None = None
    """MoE: (HF experts module under ``model.layers.N``, its gate / up / down projection names); None:
    dense."""
    required: tuple[str, ...] = ()
    """Layer tensor kinds every block must hold beyond attention and its MLP (e.g. the q/k norms)."""
    finish_config: Callable[[dict[str, Any], "GgufFacts"], None] = field(default=lambda cfg, facts: None)
    """Adds what the metadata leaves implicit to the HF config dict (in place)."""


@dataclass(frozen=True)
class GgufFacts:
    """What a config needs of a file beyond the renamed metadata."""

    arch: str
    """``general.architecture``."""
    metadata: dict[str, Any]
    """Scalar metadata by key (the vocabulary arrays left out)."""
    tensor_names: tuple[str, ...]
    """Every tensor name of the file."""

    def key(self, name: str, default: Any = None) -> Any:
        """The value of ``{arch}.{name}``, or ``default``."""
        return self.metadata.get(f"{self.arch}.{name}", default)

    def has(self, layer: int, kind: str) -> bool:
        """Whether block ``layer`` holds a ``kind`` tensor (e.g. "ffn_gate_exps")."""
        return f"blk.{layer}.{kind}.weight" in self.tensor_names


def _attention_bias(cfg: dict[str, Any], facts: GgufFacts) -> None:
    cfg["attention_bias"] = "blk.0.attn_q.bias" in facts.tensor_names


def _qwen3_config(cfg: dict[str, Any], facts: GgufFacts) -> None:
    _attention_bias(cfg, facts)
    if facts.key("attention.key_length") is not None:
        cfg["head_dim"] = int(facts.key("attention.key_length"))


def _qwen3_moe_config(cfg: dict[str, Any], facts: GgufFacts) -> None:
    """llama.cpp's qwen3moe renormalizes the top-k weights unless ``expert_weights_norm`` says otherwise; a
    block holding a dense MLP instead of experts is one of HF's ``mlp_only_layers``."""
    _qwen3_config(cfg, facts)
    cfg["moe_intermediate_size"] = int(facts.key("expert_feed_forward_length"))
    cfg["norm_topk_prob"] = bool(facts.key("expert_weights_norm", True))
    cfg["decoder_sparse_step"] = 1
    num_layers = int(cfg["num_hidden_layers"])
    cfg["mlp_only_layers"] = [i for i in range(num_layers) if not facts.has(i, "ffn_gate_inp")]
    if facts.key("expert_shared_feed_forward_length"):
        cfg["shared_expert_intermediate_size"] = int(facts.key("expert_shared_feed_forward_length"))


def _qwen2_moe_config(cfg: dict[str, Any], facts: GgufFacts) -> None:
    """llama.cpp's qwen2moe: q/k/v bias, every block sparse with a gated shared expert, the top-k weights not
    renormalized (unless ``expert_weights_norm`` says so)."""
    cfg["qkv_bias"] = "blk.0.attn_q.bias" in facts.tensor_names
    cfg["moe_intermediate_size"] = int(facts.key("expert_feed_forward_length"))
    cfg["shared_expert_intermediate_size"] = int(facts.key("expert_shared_feed_forward_length", 0))
    cfg["norm_topk_prob"] = bool(facts.key("expert_weights_norm", False))
    cfg["decoder_sparse_step"] = 1
    cfg["mlp_only_layers"] = []


def _mixtral_config(cfg: dict[str, Any], facts: GgufFacts) -> None:
    cfg["num_local_experts"] = int(facts.key("expert_count"))
    cfg["num_experts_per_tok"] = int(facts.key("expert_used_count"))
    cfg["sliding_window"] = facts.key("attention.sliding_window")


def _gemma3_config(cfg: dict[str, Any], facts: GgufFacts) -> None:
    """What llama.cpp's gemma3 fixes in code: every 6th layer global (unless the file gives
    ``attention.sliding_window_pattern``, true = sliding), local layers' rope base 10000, global ones' the
    file's (linear scaling where stated), attention scale 1/sqrt(head_dim) (27B, 62 layers: 1/sqrt(hidden /
    heads))."""
    n = int(cfg["num_hidden_layers"])
    pattern = facts.key("attention.sliding_window_pattern")
    if isinstance(pattern, list) and len(pattern) == n:
        cfg["layer_types"] = ["sliding_attention" if s else "full_attention" for s in pattern]
    else:
        cfg["layer_types"] = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)]
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
    cfg["query_pre_attn_scalar"] = (int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]) if n == 62
                                    else head_dim)
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": float(cfg.pop("rope_theta", 1_000_000.0))}
    if facts.key("rope.scaling.type") == "linear":
        full.update(rope_type="linear", factor=float(facts.key("rope.scaling.factor")))
    cfg["rope_parameters"] = {"full_attention": full,
                              "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
    cfg["final_logit_softcapping"] = facts.key("final_logit_softcapping")
    cfg["attn_logit_softcapping"] = facts.key("attn_logit_softcapping")
    _attention_bias(cfg, facts)


_LLAMA_LAYERS = {**_ATTENTION, "ffn_norm": "post_attention_layernorm", **_DENSE_MLP}
_QK_NORMS = tuple(_QK_NORM)

ARCHS: dict[str, GgufArch] = {
    "llama": GgufArch("llama", "llama", (), "llama", True, 0.0, _LLAMA_LAYERS),
    "qwen2": GgufArch("qwen2", "qwen2", (), "qwen2", False, 0.0, _LLAMA_LAYERS),
    "qwen3": GgufArch("qwen3", "qwen3", ("Qwen3ForCausalLM",), "qwen3", False, 0.0,
                      {**_LLAMA_LAYERS, **_QK_NORM}, required=_QK_NORMS, finish_config=_qwen3_config),
    "qwen3moe": GgufArch("qwen3moe", "qwen3_moe", ("Qwen3MoeForCausalLM",), "qwen3_moe", False, 0.0,
                         {**_LLAMA_LAYERS, **_QK_NORM, **_QWEN_MOE},
                         experts=("mlp.experts", ("gate_proj", "up_proj", "down_proj")), required=_QK_NORMS,
                         finish_config=_qwen3_moe_config),
    "qwen2moe": GgufArch("qwen2moe", "qwen2_moe", ("Qwen2MoeForCausalLM",), "qwen2_moe", False, 0.0,
                         {**_LLAMA_LAYERS, **_QWEN_MOE}, experts=("mlp.experts", ("gate_proj", "up_proj", "down_proj")),
                         required=("ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"),
                         finish_config=_qwen2_moe_config),
    "gemma3": GgufArch("gemma3", "gemma3_text", ("Gemma3ForCausalLM",), "gemma3", False, 1.0,
                       {**_ATTENTION, **_QK_NORM, **_DENSE_MLP,
                        "post_attention_norm": "post_attention_layernorm",
                        "ffn_norm": "pre_feedforward_layernorm",
                        "post_ffw_norm": "post_feedforward_layernorm"},
                       required=(*_QK_NORMS, "post_attention_norm", "post_ffw_norm"),
                       finish_config=_gemma3_config),
}
MIXTRAL = GgufArch("llama", "mixtral", ("MixtralForCausalLM",), "llama", True, 0.0,
                   {**_ATTENTION, "ffn_norm": "post_attention_layernorm",
                    "ffn_gate_inp": "block_sparse_moe.gate"},
                   experts=("block_sparse_moe.experts", ("w1", "w3", "w2")), finish_config=_mixtral_config)
"""A ``llama`` file with ``llama.expert_count``: llama.cpp's Mixtral."""


def arch_for(architecture: str, metadata: dict[str, Any]) -> GgufArch:
    """The ``GgufArch`` of a file; ValueError naming the supported ones for any other."""
    if architecture == "llama" and metadata.get("llama.expert_count"):
        return MIXTRAL
    if architecture not in ARCHS:
        raise ValueError(
            f"GGUF architecture {architecture!r} is not supported; Chorus reads {sorted(ARCHS)} GGUF files "
            f"(and llama with experts: Mixtral). Convert the model to a Hugging Face checkpoint directory "
            f"instead.")
    return ARCHS[architecture]


def check_tensors(arch: GgufArch, num_layers: int, tensor_names: tuple[str, ...]) -> None:
    """ValueError, one line naming up to five missing tensors, when the file lacks any the model needs: the
    embedding and final norm, each block's attention, norms and MLP (dense, or router and experts)."""
    present = set(tensor_names)
    missing = [n for n in ("token_embd.weight", "output_norm.weight") if n not in present]
    for i in range(num_layers):
        kinds = [*_ATTENTION, "ffn_norm", *arch.required]
        if arch.experts is None or f"blk.{i}.ffn_gate.weight" in present:
            kinds += list(_DENSE_MLP)
        elif f"blk.{i}.ffn_gate_exps.weight" in present or f"blk.{i}.ffn_gate.0.weight" not in present:
            kinds += ["ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"]
        else:
            kinds += ["ffn_gate_inp", "ffn_gate.0", "ffn_up.0", "ffn_down.0"]
        missing += [f"blk.{i}.{k}.weight" for k in kinds if f"blk.{i}.{k}.weight" not in present]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"the GGUF file lacks tensors its {arch.name} ({arch.model_type}) model needs: "
                         f"{', '.join(missing[:5])}{more}; convert it again with llama.cpp's "
                         f"convert_hf_to_gguf.py.")


def hf_tensors(arch: GgufArch, gguf_name: str, w: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """The HF tensors a GGUF tensor holds (one; one per expert for stacked experts), with llama.cpp's norm
    shift undone and ``ffn_gate_inp_shexp`` as HF's [1, hidden]. ``w`` is float32 in numpy (GGUF) order."""
    if arch.norm_shift and gguf_name.endswith("norm.weight"):
        w = w - np.float32(arch.norm_shift)
    m = _LAYER_RE.match(gguf_name)
    if m is not None:
        layer, kind, expert, leaf = m["layer"], m["kind"], m["expert"], m["leaf"]
        prefix = f"model.layers.{layer}"
        if arch.experts is not None and kind.startswith("ffn_") and kind.endswith("_exps"):
            module, projections = arch.experts
            proj = projections[_EXPERT_KINDS.index(kind[4:-5])]
            return [(f"{prefix}.{module}.{e}.{proj}.{leaf}", w[e]) for e in range(w.shape[0])]
        if arch.experts is not None and expert is not None and kind[4:] in _EXPERT_KINDS:
            module, projections = arch.experts
            return [(f"{prefix}.{module}.{expert}.{projections[_EXPERT_KINDS.index(kind[4:])]}.{leaf}", w)]
        if expert is None and kind in arch.layer_names:
            if kind == "ffn_gate_inp_shexp" and w.ndim == 1:
                w = w[None, :]
            return [(f"{prefix}.{arch.layer_names[kind]}.{leaf}", w)]
    m = _GLOBAL_RE.match(gguf_name)
    if m and m.group(1) in _GLOBAL:
        return [(f"{_GLOBAL[m.group(1)]}.{m.group(2)}", w)]
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face equivalent in Chorus' "
                     f"{arch.name} ({arch.model_type}) mapping.")


def is_ignored(gguf_name: str) -> bool:
    """Whether the converted checkpoint leaves this tensor out (HF recomputes it from the config)."""
    return gguf_name in _IGNORED
