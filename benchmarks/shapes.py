"""The model shapes the benchmarks run with random weights (``--shape NAME``, ``load_format=dummy``): a
config-only checkpoint directory (the config and a word-level tokenizer of one token per id) per shape, and
the bytes a decode step of that shape must read (``decode_bytes``, the floor of benchmarks/latency.py).

Shapes (the released checkpoints' text configs):
  llama3-8b      LlamaForCausalLM, as ``--llama3-8b-dummy``;
  llama3-70b     LlamaForCausalLM, 80 layers of 8192 (with ``--quantization fp8`` its ~70 GB of weights fit one H200);
  qwen3-8b       Qwen3ForCausalLM;
  qwen3-30b-a3b  Qwen3MoeForCausalLM, 128 experts of 768, 8 per token, every layer sparse;
  gemma3-12b     Gemma3ForCausalLM, 5 sliding-window (1024) layers to 1 global, tied embeddings.
``--quantization int4`` serves a GPTQ checkpoint of random 4-bit weights of a dense shape (``int4_checkpoint``).
``tiny=True`` (``--tiny``) keeps each family and its layer pattern with small sizes, for CPU smoke tests.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                 rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)

LLAMA3_70B = dict(LLAMA3_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                  num_attention_heads=64, num_key_value_heads=8)

SHAPES: dict[str, tuple[str, str, dict]] = {
    "llama3-8b": ("llama", "LlamaForCausalLM", LLAMA3_8B),
    "llama3-70b": ("llama", "LlamaForCausalLM", LLAMA3_70B),
    "qwen3-8b": ("qwen3", "Qwen3ForCausalLM",
                 dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, intermediate_size=12288, vocab_size=151936, max_position_embeddings=40960,
                      rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)),
    "qwen3-30b-a3b": ("qwen3_moe", "Qwen3MoeForCausalLM",
                      dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                           head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                           num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                           vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6,
                           tie_word_embeddings=False)),
    "gemma3-12b": ("gemma3_text", "Gemma3ForCausalLM",
                   dict(hidden_size=3840, num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8,
                        head_dim=256, intermediate_size=15360, vocab_size=262208, sliding_window=1024,
                        sliding_window_pattern=6, rope_theta=1e6, rope_local_base_freq=10000.0,
                        query_pre_attn_scalar=256, final_logit_softcapping=None, max_position_embeddings=131072,
                        rms_norm_eps=1e-6, tie_word_embeddings=True)),
}
"""Shape name -> (transformers model_type, architecture, config fields)."""

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, vocab_size=512, max_position_embeddings=2048)
"""``tiny=True``: the sizes every shape shrinks to (then ``TINY_BY_SHAPE``'s)."""
TINY_BY_SHAPE = {
    "qwen3-30b-a3b": dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2),
    "gemma3-12b": dict(num_hidden_layers=6, sliding_window=16, query_pre_attn_scalar=16),
}
"""Per shape, tiny sizes that keep its structure: a few experts, one global layer in six with a small window."""


def write_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """A word-level tokenizer of one token ``t{id}`` per id (the benchmarks send token ids; detokenizing still
    needs a vocabulary that covers every id), unless ``out_dir`` has one."""
    if (out_dir / "tokenizer.json").is_file():
        return
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tk = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="t0", eos_token="t1").save_pretrained(out_dir)


def write_checkpoint(out_dir: Path, model_type: str, architecture: str, fields: dict, dtype: str) -> Path:
    """A config-only HF directory for ``load_format=dummy`` (and the same config for transformers)."""
    from transformers import AutoConfig
    cfg = AutoConfig.for_model(model_type, **fields, dtype=dtype, architectures=[architecture])
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(out_dir)
    write_tokenizer(out_dir, fields["vocab_size"])
    return out_dir


def shape_fields(name: str, tiny: bool = False) -> tuple[str, str, dict]:
    """(model_type, architecture, config fields) of shape ``name``, shrunk with ``tiny``."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; use one of {sorted(SHAPES)}")
    model_type, arch, fields = SHAPES[name]
    if tiny:
        fields = {**fields, **TINY, **TINY_BY_SHAPE.get(name, {})}
    return model_type, arch, fields


def dummy_model(name: str, tiny: bool = False, dtype: Optional[str] = None, windows: bool = True) -> str:
    """The checkpoint directory of shape ``name`` (bfloat16, float32 with ``tiny``) under $TMPDIR (default
    /tmp): ``chorus-NAME-dummy``, ``chorus-NAME-tiny-dummy``; ``windows=False``: every layer global
    (``layer_types`` all full attention; ``chorus-NAME-nowindow-dummy``), the shape without its sliding windows."""
    model_type, arch, fields = shape_fields(name, tiny)
    if not windows:
        fields = {**fields, "layer_types": ["full_attention"] * fields["num_hidden_layers"]}
    out = Path(os.environ.get("TMPDIR", "/tmp")) / (f"chorus-{name}{'-tiny' if tiny else ''}"
                                                    f"{'' if windows else '-nowindow'}-dummy")
    return str(write_checkpoint(out, model_type, arch, fields, dtype or ("float32" if tiny else "bfloat16")))


def expected_distinct_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Expected experts a layer runs for ``batch`` tokens each routed to ``top_k`` of ``num_experts``, routing
    uniform and independent per token: E * (1 - (1 - k/E)^B)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def decode_bytes(cfg, batch: int, context_len: float, elem_bytes: int = 2, kv_elem_bytes: Optional[int] = None,
                 fp8: bool = False, int4_group_size: Optional[int] = None) -> dict:
    """Bytes one decode step of ``batch`` sequences at ``context_len`` tokens must read, from the HF text
    config ``cfg``: every projection, norm and the LM head once; the embedding only for ``batch`` rows; of a
    MoE layer the router, the shared expert and ``expected_distinct_experts`` of the routed ones (uniform
    routing); the KV of ``context_len`` tokens per sequence, at most ``sliding_window`` in a sliding layer.
    ``fp8`` (``--quantization fp8``): the projections and the routed experts (not the LM head, the embedding
    or a router, which the engine keeps in ``elem_bytes``) at 1 byte per weight + a float32 scale per output
    channel.
    ``int4_group_size`` G (``--quantization int4``): the projections as the engine's W4A16 layer reads them,
    half a byte per weight + a scale and a zero point (``elem_bytes`` each) per G inputs of an output."""
    from engine.models.qwen3_moe import is_sparse_layer
    from engine.models.sliding_window import layer_windows
    kv_elem = kv_elem_bytes or elem_bytes
    h, n = cfg.hidden_size, cfg.num_hidden_layers
    head_dim = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q_out, kv_out = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim

    def proj(d_in: int, d_out: int) -> int:
        if int4_group_size:
            return d_in * d_out // 2 + 2 * (d_in // int4_group_size) * d_out * elem_bytes
        return d_in * d_out + 4 * d_out if fp8 else d_in * d_out * elem_bytes

    norms = 2 * head_dim if getattr(cfg, "model_type", "").startswith(("qwen3", "gemma3")) else 0   # q/k norms
    norms += (4 if getattr(cfg, "model_type", "").startswith("gemma3") else 2) * h
    attention = proj(h, q_out + 2 * kv_out) + proj(q_out, h) + norms * elem_bytes
    num_experts = int(getattr(cfg, "num_experts", 0) or 0)
    mlp_bytes, experts_read = [], []
    for i in range(n):
        if num_experts and is_sparse_layer(cfg, i):
            k = cfg.num_experts_per_tok
            read = expected_distinct_experts(num_experts, k, batch)
            shared = int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0)
            shared_bytes = proj(h, 2 * shared) + proj(shared, h) + proj(h, 1) if shared else 0
            inter = cfg.moe_intermediate_size
            expert = 3 * h * inter + 4 * (2 * inter + h) if fp8 else 3 * h * inter * elem_bytes
            mlp_bytes.append(h * num_experts * elem_bytes + shared_bytes + read * expert)   # the router stays float
            experts_read.append(read)
        else:
            mlp_bytes.append(proj(h, 2 * cfg.intermediate_size) + proj(cfg.intermediate_size, h))
    weights = int(n * attention + sum(mlp_bytes) + h * elem_bytes                          # + final norm
                  + cfg.vocab_size * h * elem_bytes + batch * h * elem_bytes)              # LM head, B embeddings
    windows = layer_windows(cfg)
    kv_tokens = sum(min(context_len, w) if w else context_len for w in windows)            # over the layers
    kv = int(batch * kv_tokens * 2 * cfg.num_key_value_heads * head_dim * kv_elem)
    out = dict(weight_bytes=weights, kv_bytes=kv, total_bytes=weights + kv)
    if experts_read:
        out["experts_read_per_layer"] = experts_read[0]
    return out


def add_shape_args(ap) -> None:
    """``--shape``, ``--tiny``, ``--llama3-8b-dummy``, ``--quantization`` and ``--kv-cache-dtype`` on a benchmark's
    parser."""
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None,
                    help="a model shape with random weights (benchmarks/shapes.py) instead of --model")
    ap.add_argument("--tiny", action="store_true", help="with --shape: its tiny float32 variant (CPU smoke tests)")
    ap.add_argument("--llama3-8b-dummy", action="store_true", help="Llama-3-8B shape, random bf16 weights "
                    "(--shape llama3-8b)")
    ap.add_argument("--quantization", default=None, choices=["fp8", "int4"],
                    help="the engine's weight quantization (transformers keeps the float weights): fp8 quantized at "
                         "load; int4 a GPTQ checkpoint of random 4-bit weights in groups of 128 "
                         "(``int4_checkpoint``), served as it is")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="the engine's KV cache dtype: auto (the model's) or fp8 (e4m3, CUDA; the bytes floor counts "
                         "1 byte per KV element)")


def kv_elem_bytes(kv_cache_dtype: str, model_elem_bytes: int) -> int:
    """Bytes per KV cache element of ``--kv-cache-dtype`` (auto: the model's ``model_elem_bytes``)."""
    from engine.config import FP8_KV_CACHE_DTYPES
    from engine.dtypes import TORCH_DTYPES
    if kv_cache_dtype in FP8_KV_CACHE_DTYPES:
        return 1
    if kv_cache_dtype == "auto":
        return model_elem_bytes
    return TORCH_DTYPES[kv_cache_dtype].itemsize


def resolve_shape_args(args) -> None:
    """Sets ``args.model`` and ``args.load_format`` (dummy for a shape) from ``add_shape_args``'s flags."""
    args.load_format = "auto"
    if args.llama3_8b_dummy:
        args.shape = "llama3-8b"
    if args.shape and args.quantization == "int4":
        args.model = int4_checkpoint(args.shape, args.tiny)
    elif args.shape:
        args.model = dummy_model(args.shape, args.tiny)
        args.load_format = "dummy"


def engine_quantization(args) -> Optional[str]:
    """The ``quantization`` the engine takes for ``add_shape_args``'s flags: None for int4 (the GPTQ
    checkpoint carries its own), else ``--quantization``."""
    return None if args.quantization == "int4" else args.quantization


INT4_GROUP_SIZE = 128
"""Inputs per scale of ``int4_checkpoint`` (``--tiny``: 32, its inputs are 64 and 128)."""


def int4_group_size(tiny: bool) -> int:
    """The group size of ``int4_checkpoint``."""
    return 32 if tiny else INT4_GROUP_SIZE


def int4_checkpoint(name: str, tiny: bool = False) -> str:
    """A GPTQ (v1, symmetric, no act order) checkpoint of shape ``name`` with random 4-bit weights under
    $TMPDIR (default /tmp): ``chorus-NAME[-tiny]-gptq-dummy``, written once (a ``complete`` file marks it).
    Dense shapes (Llama, Qwen3). Scales ~ 0.02 / 4.6 (the float dummy's std), the embedding and LM head
    random bfloat16 (float32 with ``tiny``), norms ones; one safetensors file per layer, drawn on the GPU
    when there is one, so no float model is ever built."""
    import torch
    from safetensors.torch import save_file

    model_type, arch, fields = shape_fields(name, tiny)
    if fields.get("num_experts") or model_type.startswith("gemma"):
        raise ValueError(f"--quantization int4 writes dense Llama / Qwen3 checkpoints; {name} is not one.")
    group = int4_group_size(tiny)
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"chorus-{name}{'-tiny' if tiny else ''}-gptq-dummy"
    if (out / "complete").is_file():
        return str(out)
    dtype = "float32" if tiny else "bfloat16"
    quant = dict(quant_method="gptq", bits=4, group_size=group, desc_act=False, sym=True, checkpoint_format="gptq")
    write_checkpoint(out, model_type, arch, {**fields, "quantization_config": quant}, dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(0)
    h, inter = fields["hidden_size"], fields["intermediate_size"]
    head_dim = fields.get("head_dim") or h // fields["num_attention_heads"]
    q_out, kv_out = fields["num_attention_heads"] * head_dim, fields["num_key_value_heads"] * head_dim
    float_dtype = getattr(torch, dtype)

    def gptq(d_in: int, d_out: int) -> dict:
        groups = d_in // group
        return dict(qweight=torch.randint(-2 ** 31, 2 ** 31 - 1, (d_in // 8, d_out), generator=gen, device=device,
                                          dtype=torch.int32),
                    scales=((0.5 + torch.rand(groups, d_out, generator=gen, device=device)) * (0.02 / 4.6)).half(),
                    qzeros=torch.full((groups, d_out // 8), 0x77777777, dtype=torch.int32, device=device),  # v1: 8 - 1
                    g_idx=(torch.arange(d_in, device=device, dtype=torch.int32) // group))

    def ones(size: int) -> "torch.Tensor":
        return torch.ones(size, dtype=float_dtype, device=device)

    def randn(*shape: int) -> "torch.Tensor":
        return (torch.randn(*shape, generator=gen, device=device) * 0.02).to(float_dtype)

    head = {"model.embed_tokens.weight": randn(fields["vocab_size"], h), "model.norm.weight": ones(h)}
    if not fields.get("tie_word_embeddings"):
        head["lm_head.weight"] = randn(fields["vocab_size"], h)
    save_file({k: v.cpu() for k, v in head.items()}, str(out / "model-embed.safetensors"))
    projections = {"self_attn.q_proj": (h, q_out), "self_attn.k_proj": (h, kv_out), "self_attn.v_proj": (h, kv_out),
                   "self_attn.o_proj": (q_out, h), "mlp.gate_proj": (h, inter), "mlp.up_proj": (h, inter),
                   "mlp.down_proj": (inter, h)}
    for i in range(fields["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        layer = {prefix + "input_layernorm.weight": ones(h), prefix + "post_attention_layernorm.weight": ones(h)}
        if model_type.startswith("qwen3"):
            layer.update({prefix + "self_attn.q_norm.weight": ones(head_dim), prefix + "self_attn.k_norm.weight": ones(head_dim)})
        for proj, (d_in, d_out) in projections.items():
            layer.update({f"{prefix}{proj}.{k}": v for k, v in gptq(d_in, d_out).items()})
        save_file({k: v.cpu() for k, v in layer.items()}, str(out / f"model-layer-{i:03d}.safetensors"))
    (out / "complete").write_text("")
    return str(out)
