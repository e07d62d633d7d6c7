"""The engine's fast-path choices in one typed config, built once per engine.

Which decode steps take the fused GEMV, which projections split K into the norm after them, which
decode batches fuse rotary into attention, how LoRA updates overlap and fuse into their consumers:
every such choice is a field of ``KernelPolicy`` with the default measured on an H200 (the ``cpu_*``
fields on the 2-core CPU machine): the numbers and commands are in ``benchmarks/RESULTS.md``, "What sets
each ``KernelPolicy`` default" and "What sets the CPU defaults". The
model runner builds one policy per engine (``KernelPolicy.for_device``) and hands it to the attention
backend and the LoRA layers at construction and to every layer through the forward context; nothing
else reads these choices.

Experiments override fields with one string, ``CHORUS_KERNEL_POLICY`` (``engine.envs``), e.g.
``"gemm_split_k=0,decode_fuse_rotary=1,attn_decode.tile_n=64,lora_expand.block_n=32"``: plain
fields take ``0``/``1`` (switches) or integers, ``decode_fuse_rotary`` takes ``auto``/``0``/``1``,
and the dotted groups override launch-config fields of one kernel family.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

Overrides = tuple[tuple[str, int], ...]
"""Sorted (field, value) pairs of a kernel launch-config override (hashable, frozen)."""

ATTN_DECODE_FIELDS = ("tile_n", "num_warps", "num_stages", "heads_first", "heads_per_prog")
"""Fields of the ``attn_decode`` group (``kernels.paged_attention``'s decode tiles)."""


@dataclass(frozen=True)
class KernelPolicy:
    """Fast-path choices of one engine. Every field only picks between equivalent computations
    (the outputs agree within the kernels' tolerances); none changes what the engine computes."""

    decode_gemv_max_tokens: int = 2
    """On CUDA, steps of at most this many tokens run each projection without an adapter update as
    one ``kernels.gemv`` launch with the RMSNorm / SiLU-and-mul before it fused in; 0: never
    (cuBLAS and separate kernels). 0-16."""
    gemv: Overrides = ()
    """``kernels.gemv.GemvConfig`` field overrides (block_n, block_k, num_warps, num_stages, use_dot,
    reduce_once, fp8_math, swap_ab)."""
    fp8_decode_gemv: bool = True
    """FP8 projections (``engine.layers.fp8.Fp8Weight``) take those GEMV launches too, reading their
    e4m3 weight; off: their decode steps run the W8A8 Triton GEMM of larger steps. How the GEMV meets
    the e4m3 weight is ``gemv.fp8_math``: 0 widens it to the activations' dtype (W8A16, the default),
    1 rounds the rows to e4m3 per token for an FP8 MMA, 2 widens it to float16 (``kernels.gemv``)."""
    moe_decode_max_pairs: int = 64
    """On CUDA, MoE calls of at most this many (token, expert) pairs run ``kernels.fused_moe_decode``
    (each pair reads its own expert, no sort), larger ones the sorted grouped GEMMs of
    ``kernels.fused_moe``; 0: always sorted. 0-4096."""
    moe_router_kernel: bool = True
    """On CUDA, MoE routing (softmax, top-k, renormalisation) runs as one ``kernels.moe_router`` launch per
    layer; off: torch's ops (five or more kernels)."""
    gemm_split_k: bool = True
    """On CUDA in bfloat16, o_proj / down_proj of decode-sized steps (output tiles filling at most
    half the SMs) run as one batched GEMM over two halves of K whose partials the next add +
    RMSNorm sums (``split_k_parts``)."""
    decode_fuse_rotary: str = "auto"
    """Pure-decode CUDA steps that run rotary + KV write inside the decode attention kernel:
    ``auto`` those whose requests x KV heads leave SMs idle (``kernels.paged_attention.
    decode_rotary_pays``), ``1`` every one, ``0`` none."""
    attn_decode: Overrides = ()
    """Decode attention tile overrides (``ATTN_DECODE_FIELDS``; heads_per_prog=0: pure-decode
    batches take the general kernel)."""
    lora_overlap: bool = True
    """On CUDA, each adapted projection's LoRA shrink runs on a side stream beside its base GEMM
    (``lora.layers``); off: one after the other."""
    lora_fuse_silu_mul: bool = True
    """The gate/up projection's LoRA update is added inside the SiLU-and-mul after it (one launch)."""
    lora_fuse_rotary: bool = True
    """On decode-sized CUDA steps the q/k/v projection's LoRA update is added inside the rotary +
    KV-write kernel after it."""
    lora_fuse_norm: bool = True
    """o_proj's and down_proj's LoRA updates are added inside the residual add + RMSNorm after them
    (decode-sized and long-prefill steps; ``kernels.lora_expand_norm.fuses``)."""
    lora_stacked_max_tokens: int = 128
    """On CUDA, steps of at most this many tokens compute each adapted projection's LoRA shrink
    inside its base GEMM (the slots' A rows stacked under the base weight); 0: never. 0-1024."""
    lora_stacked_tune: bool = True
    """At start-up on CUDA, time how many slots the stacked GEMMs of the few-adapters decode graphs
    cover (cuBLAS picks its kernel by shape); off: exactly the graph's slot bound."""
    lora_shrink: Overrides = ()
    """``kernels.lora_shrink.LoRAShrinkConfig`` field overrides."""
    lora_expand: Overrides = ()
    """``kernels.lora_expand.LoRAExpandConfig`` field overrides."""
    cpu_decode_attention: bool = True
    """On CPU, decode rows over a float32 or bfloat16 KV cache attend through ``kernels.cpu_decode_attention``'s
    C kernel (built at start-up with the system C compiler; without one, or off, the torch path gathers the
    rows' blocks and runs SDPA)."""
    cpu_layer_ops: bool = True
    """On CPU, the residual add + RMSNorm, SiLU-and-mul and rotary + KV write run as ``kernels.cpu_layer_ops``'s
    C ops (one pass per row; built like the decode kernel), else as torch ops."""
    cpu_token_bitmask: bool = True
    """On CPU, grammar bitmasks are applied to the logits by ``kernels.cpu_token_bitmask``'s C kernel (built
    like the decode kernel), else by xgrammar's."""
    cpu_amx_gemm: bool = True
    """On CPUs with AMX, int4 and int8 weights run decode batches above the packed kernels' rows through
    ``kernels.cpu_amx_gemm`` (built like the decode kernel), else through a packed bfloat16 copy."""
    cpu_decode_chunk_tokens: int = 128
    """Keys per work item of that kernel: a longer context is cut into chunks of this many keys (whole blocks)
    so that one request spreads over all threads. 16-65536."""
    num_sms: int = 0
    """Streaming multiprocessors of the engine's GPU (0 on CPU); the shape rules count waves of them."""

    def __post_init__(self) -> None:
        if not 0 <= self.decode_gemv_max_tokens <= 16:
            raise ValueError(f"decode_gemv_max_tokens={self.decode_gemv_max_tokens}: use 0-16.")
        if not 0 <= self.moe_decode_max_pairs <= 4096:
            raise ValueError(f"moe_decode_max_pairs={self.moe_decode_max_pairs}: use 0-4096.")
        if not 0 <= self.lora_stacked_max_tokens <= 1024:
            raise ValueError(f"lora_stacked_max_tokens={self.lora_stacked_max_tokens}: use 0-1024.")
        if not 16 <= self.cpu_decode_chunk_tokens <= 65536:
            raise ValueError(f"cpu_decode_chunk_tokens={self.cpu_decode_chunk_tokens}: use 16-65536.")
        if self.decode_fuse_rotary not in ("auto", "0", "1"):
            raise ValueError(f"decode_fuse_rotary={self.decode_fuse_rotary!r}: use auto, 0 or 1.")
        for key, value in self.attn_decode:
            ok = (value in (0, 1) if key == "heads_first" else value in (0, 1, 2, 4, 8) if key == "heads_per_prog"
                  else key in ATTN_DECODE_FIELDS and value >= 1)
            if not ok:
                raise ValueError(f"attn_decode.{key}={value}: use tile_n, num_warps, num_stages >= 1, "
                                 f"heads_first 0 or 1, heads_per_prog 0, 1, 2, 4 or 8.")

    # ------------------------------------------------------------------ construction
    @classmethod
    def for_device(cls, device: torch.device, overrides: Optional[str] = None) -> "KernelPolicy":
        """The measured defaults for ``device``, then ``overrides`` (``CHORUS_KERNEL_POLICY`` syntax;
        None: read it from the environment)."""
        if overrides is None:
            from engine import envs
            overrides = envs.kernel_policy()
        device = torch.device(device)
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0
        return cls(num_sms=sms).with_overrides(overrides)

    def with_overrides(self, text: Optional[str]) -> "KernelPolicy":
        """A copy with the ``field=value`` items of ``text`` applied; ValueError naming the item that
        does not parse, with the accepted fields."""
        if not text or not text.strip():
            return self
        plain: dict[str, object] = {}
        groups: dict[str, dict[str, int]] = {}
        fields = {f.name: f for f in dataclasses.fields(self)}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, value = (p.strip() for p in item.partition("="))
            group, dot, sub = key.partition(".")
            if not sep or not key:
                raise ValueError(f"CHORUS_KERNEL_POLICY item {item!r}: use field=value, e.g. gemm_split_k=0.")
            if dot:
                if group not in _GROUPS or not value.lstrip("-").isdigit():
                    raise ValueError(f"CHORUS_KERNEL_POLICY item {item!r}: groups are {sorted(_GROUPS)} with "
                                     f"integer values, e.g. attn_decode.tile_n=64.")
                groups.setdefault(group, {})[sub] = int(value)
                continue
            if key not in fields or key in _GROUPS or key == "num_sms":
                names = sorted(n for n in fields if n not in _GROUPS and n != "num_sms")
                raise ValueError(f"CHORUS_KERNEL_POLICY item {item!r}: unknown field; use one of {names} "
                                 f"or a group {sorted(_GROUPS)}.")
            plain[key] = _parse_value(key, value, fields[key].type)
        for group, pairs in groups.items():
            merged = dict(getattr(self, group)) | pairs
            _GROUPS[group](merged)
            plain[group] = tuple(sorted(merged.items()))
        return dataclasses.replace(self, **plain)

    # ------------------------------------------------------------------ shape rules
    def split_k_parts(self, num_tokens: int, k: int, n: int) -> int:
        """2 when an [num_tokens, k] x [k, n] GEMM's output tiles (``SPLIT_K_TILE``) fill at most
        half the SMs, the step is larger than the fused GEMV takes and K >= ``SPLIT_K_MIN_K``
        splits into 16-byte aligned halves; else 1 (also with ``gemm_split_k`` off)."""
        if (not self.gemm_split_k or num_tokens <= self.decode_gemv_max_tokens or k < SPLIT_K_MIN_K
                or k % 16):
            return 1
        tiles = -(-num_tokens // SPLIT_K_TILE) * -(-n // SPLIT_K_TILE)
        return 2 if 2 * tiles <= self.num_sms else 1

    def fuses_decode_rotary(self, num_reqs: int, num_kv_heads: int, device: torch.device) -> bool:
        """Whether a pure-decode batch of num_reqs requests runs rotary + KV write in the decode
        attention kernel (``decode_fuse_rotary``)."""
        if self.decode_fuse_rotary == "auto":
            from kernels.paged_attention import decode_rotary_pays
            return decode_rotary_pays(num_reqs, num_kv_heads, device)
        return self.decode_fuse_rotary == "1"

    @property
    def attn_decode_tiles(self) -> dict[str, int]:
        """``attn_decode`` as the keyword dict ``kernels.paged_attention`` takes."""
        return dict(self.attn_decode)


SPLIT_K_TILE = 128
"""Output tile edge (rows and columns) of cuBLAS's kernels for decode-sized bf16 GEMMs on Hopper
(profiled: 128x64 to 256x128); ``KernelPolicy.split_k_parts`` counts tiles of this size."""
SPLIT_K_MIN_K = 2048
"""Smallest input size worth halving: each half keeps >= 1024 of K to accumulate over."""


def _parse_value(key: str, value: str, annotation: str) -> object:
    if annotation == "bool":
        if value not in ("0", "1"):
            raise ValueError(f"CHORUS_KERNEL_POLICY item {key}={value!r}: use 0 or 1.")
        return value == "1"
    if annotation == "int":
        if not value.isdigit():
            raise ValueError(f"CHORUS_KERNEL_POLICY item {key}={value!r}: use a non-negative integer.")
        return int(value)
    return value.lower()


def _check_attn_decode(pairs: dict[str, int]) -> None:
    KernelPolicy(attn_decode=tuple(sorted(pairs.items())))      # __post_init__ checks


def _check_fields(config_path: str):
    """A check of a group's pairs against a kernel launch-config dataclass (imported on use)."""
    def check(pairs: dict[str, int]) -> None:
        import importlib
        module, _, name = config_path.rpartition(".")
        config_cls = getattr(importlib.import_module(module), name)
        names = {f.name for f in dataclasses.fields(config_cls)}
        unknown = sorted(set(pairs) - names)
        if unknown:
            raise ValueError(f"CHORUS_KERNEL_POLICY: {name} has no field {unknown[0]!r}; use {sorted(names)}.")
        dataclasses.replace(config_cls(), **pairs)                # the config's own value checks
    return check


_GROUPS = {
    "attn_decode": _check_attn_decode,
    "gemv": _check_fields("kernels.gemv.GemvConfig"),
    "lora_shrink": _check_fields("kernels.lora_shrink.LoRAShrinkConfig"),
    "lora_expand": _check_fields("kernels.lora_expand.LoRAExpandConfig"),
}
"""Dotted override groups -> the check of their (field, int) pairs."""
