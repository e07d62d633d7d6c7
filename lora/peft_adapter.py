"""Read and check PEFT LoRA adapter directories against the base model.

A PEFT directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` (or
``adapter_model.bin``). Tensor names look like
``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``; A is ``[r, in]`` and B is
``[out, r]``. The safetensors keys, not ``target_modules``, decide which projections get an
update (as vLLM). Every problem becomes one ``InvalidLoRAAdapterError`` (or
``LoRAAdapterNotFoundError`` for missing files) whose message lists all problems; nothing here
``assert``s on user input.

Loading folds the scale (``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA; per module when
``rank_pattern`` / ``alpha_pattern`` are set) into B, so the kernels run with scale 1.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import torch
import torch.nn as nn

from lora.errors import InvalidLoRAAdapterError, LoRAAdapterNotFoundError
from lora.weights_file import GroupedRead, read_grouped, read_grouped_meta

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")

SUFFIX_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""PEFT module suffixes of a model mapped by suffix (``LoRATargets.from_model`` without the model's own
``LoRALayout.exact_slices``): q/k/v and gate/up land in packed slices, o/down in their own Linear."""
TOWER_TARGET_MODULES = ("qkv", "proj", "linear_1", "linear_2", "0", "2")
"""PEFT module suffixes of vision towers and projectors besides the ones above: Qwen2-VL's attn.qkv and
attn.proj, LLaVA's projector linear_1 / linear_2, Qwen2-VL's merger mlp.0 / mlp.2."""
SUPPORTED_TARGET_MODULES = SUFFIX_TARGET_MODULES + ("out_proj", "fc1", "fc2") + TOWER_TARGET_MODULES
"""PEFT module suffixes some model offers (``out_proj``, ``fc1``, ``fc2``: Whisper's and the vision towers',
through their own mappings). A given model takes only its own (``LoRATargets.suffixes``)."""
EXPERT_TARGET_MODULES = ("w1", "w2", "w3", "gate", "gate_up_proj")
"""PEFT names of a MoE model's routed experts and router besides the ones above: transformers 4's per-expert
``w1`` / ``w3`` / ``w2`` (Mixtral), the router ``gate``, and ``gate_up_proj`` (with ``down_proj``), the stacked
expert parameters of transformers 5 that PEFT adapts through ``target_parameters``."""
SUPPORTED_TARGET_MODULES = SUPPORTED_TARGET_MODULES + EXPERT_TARGET_MODULES
TOWER_LORA_FLAG = "--enable-tower-connector-lora"
"""The engine flag that serves adapters on a vision tower and its projector (``LoRAConfig``)."""
_EMBEDDING_MODULES = ("embed_tokens", "lm_head", "wte", "wpe", "embed_out", "output")

# <module>.<kind>[.<adapter name>][.weight], optionally under PeftModel's "base_model.model." prefix.
_LORA_KEY_RE = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+?)\."
    r"(?P<kind>lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)"
    r"(?:\.[^.]+)?(?:\.weight)?$")
_PREFIX = "base_model.model."


# ----------------------------------------------------------------------------------------
# What the base model offers
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TargetSlice:
    """Where one PEFT projection lands in the base model."""

    module_name: str
    """Our (possibly packed) ``Linear``, e.g. ``model.layers.0.self_attn.qkv_proj``."""
    slice_idx: int
    """Output slice of that Linear (q=0, k=1, v=2; gate=0, up=1; 0 for unpacked)."""
    input_size: int
    """Columns of A (the projection's input features)."""
    output_size: int
    """Rows of B (this slice's output features)."""
    in_encoder: bool = False
    """The Linear runs in the model's encoder (under its ``LoRALayout.encoder_prefix``): an update here
    changes the encoder output, so that output depends on the adapter."""
    output_range: Optional[tuple[int, int]] = None
    """Tensor parallelism, column-parallel Linear: the (start, stop) rows of B this rank keeps (S-LoRA:
    B split with the output, A whole); None: all."""
    input_range: Optional[tuple[int, int]] = None
    """Tensor parallelism, row-parallel Linear: the (start, stop) columns of A this rank keeps (A split
    with the input, B whole: the partial update rides on the layer's all-reduce); None: all."""
    num_experts: int = 0
    """A slice of a MoE layer's routed experts (``engine.layers.moe.FusedMoE``, slots in
    ``lora.expert_layers``: slice 0 gate, 1 up, 2 down), which has this many experts; 0: a ``Linear``."""
    expert: int = -1
    """The expert this PEFT module is (its per-expert name), with ``num_experts``."""

    def shard(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of A [..., r, input_size] and B [..., output_size, r]."""
        if self.input_range is not None:
            a = a[..., self.input_range[0]:self.input_range[1]]
        if self.output_range is not None:
            b = b[..., self.output_range[0]:self.output_range[1], :]
        return a, b


def _target_slice(module_name: str, slice_idx: int, module: nn.Module, in_encoder: bool = False) -> TargetSlice:
    """Where a PEFT projection lands in ``module`` (sizes of the whole projection, and this rank's
    ranges when the Linear is tensor-parallel: ``engine.distributed.sharding.LinearShard``)."""
    shard = getattr(module, "tp_shard", None)
    if shard is None:
        return TargetSlice(module_name, slice_idx, module.input_size, module.output_sizes[slice_idx], in_encoder)
    return TargetSlice(module_name, slice_idx, shard.full_input_size, shard.full_output_sizes[slice_idx],
                       in_encoder, output_range=shard.output_ranges[slice_idx] if shard.output_ranges else None,
                       input_range=shard.input_range)


def _checked_slice(model: nn.Module, peft_module: str, module_name: str, idx: int,
                   in_encoder: bool) -> TargetSlice:
    """The target of an exact mapping entry (``LoRALayout.exact_slices`` / ``encoder_slices``); ValueError
    for one that does not fit the model (a model bug)."""
    from engine.layers.linear import Linear

    module = model.get_submodule(module_name)
    suffix = peft_module.rpartition(".")[2]
    if (not isinstance(module, Linear) or not 0 <= idx < len(module.output_sizes)
            or suffix not in SUPPORTED_TARGET_MODULES):
        raise ValueError(f"{type(model).__name__}.lora_layout() maps {peft_module!r} to slice {idx} "
                         f"of {module_name!r}, which is not an output slice of a Linear (or the suffix "
                         f"is not in {list(SUPPORTED_TARGET_MODULES)}).")
    return _target_slice(module_name, idx, module, in_encoder)


@dataclass
class LoRATargets:
    """Every projection of the base model an adapter may target, by PEFT module name."""

    slices: dict[str, TargetSlice]
    """PEFT module name (``model.layers.0.self_attn.q_proj``) -> its place in our modules."""
    tower_modules: frozenset[str] = frozenset()
    """PEFT module names of a vision tower's and projector's projections that this engine does not adapt
    (started without ``--enable-tower-connector-lora``): an adapter updating one is refused, naming the flag."""
    unused_modules: frozenset[str] = frozenset()
    """PEFT module names of projections the model never runs (``LoRALayout.encoder_slices`` None, with tower
    LoRA served): an adapter's tensors for them change nothing and are skipped."""

    @classmethod
    def from_model(cls, model: nn.Module, tower_lora: bool = False) -> "LoRATargets":
        """The model's declared layout (``lora_layout()``, ``engine.layers.lora_layout.LoRALayout``): its
        exact mapping when it has one, else PEFT names mapped onto the model's ``Linear`` modules by suffix
        through its packed modules, where a model whose checkpoints name modules differently also takes
        their names; plus its encoder-side projections (``LoRALayout.encoder_slices``) when ``tower_lora``
        (``LoRAConfig.enable_tower_connector_lora``), else recorded as ``tower_modules``."""
        layout = model.lora_layout()
        if layout.exact_slices is not None:
            return cls._from_exact(model, layout.exact_slices, layout.encoder_prefix)
        from engine.layers.linear import Linear

        packed, prefixes = layout.packed_modules, layout.checkpoint_prefixes
        encoder_slices = layout.encoder_slices or {}
        tower = {peft_module: _checked_slice(model, peft_module, place[0], place[1], in_encoder=True)
                 for peft_module, place in encoder_slices.items() if place is not None}
        unused = frozenset(name for name, place in encoder_slices.items() if place is None)
        tower_linears = {target.module_name for target in tower.values()}
        slices: dict[str, TargetSlice] = {}
        for name, module in model.named_modules():
            if not isinstance(module, Linear) or name in tower_linears:
                continue
            parent, _, suffix = name.rpartition(".")
            children = [(peft_name, idx) for peft_name, (packed_name, idx) in packed.items()
                        if packed_name == suffix]
            if not children and suffix in SUFFIX_TARGET_MODULES:
                children = [(suffix, 0)]
            for peft_name, idx in children:
                if peft_name not in SUFFIX_TARGET_MODULES:
                    continue
                peft_module = f"{parent}.{peft_name}" if parent else peft_name
                target = _target_slice(name, idx, module)
                slices[peft_module] = target
                for theirs, ours in prefixes:
                    if peft_module.startswith(ours):
                        slices.setdefault(theirs + peft_module[len(ours):], target)
        slices.update(_expert_slices(model, layout))
        if tower_lora:
            return cls({**slices, **tower}, unused_modules=unused)
        return cls(slices, tower_modules=frozenset(tower) | unused)

    @classmethod
    def _from_exact(cls, model: nn.Module, mapping: Mapping[str, tuple[str, int]],
                    encoder_prefix: Optional[str]) -> "LoRATargets":
        """Targets from a model's exact layout (``LoRALayout.exact_slices``); its Linears under
        ``encoder_prefix`` are the encoder's. ValueError for a mapping that does not fit the model (a model bug)."""
        return cls({peft_module: _checked_slice(model, peft_module, module_name, idx, in_encoder=(
                        encoder_prefix is not None and module_name.startswith(encoder_prefix)))
                    for peft_module, (module_name, idx) in mapping.items()})

    @property
    def suffixes(self) -> tuple[str, ...]:
        """The PEFT module suffixes this model offers (in ``SUPPORTED_TARGET_MODULES`` order): what an
        adapter's ``target_modules`` and tensors may name (a tower's too where it is not served: such an
        adapter is refused for its tensors, naming the flag)."""
        have = {name.rpartition(".")[2] for name in (*self.slices, *self.tower_modules, *self.unused_modules)}
        if self.expert_modules:
            have.add("gate_up_proj")                        # the stacked experts (``target_parameters``)
        return tuple(s for s in SUPPORTED_TARGET_MODULES if s in have)

    @property
    def expert_modules(self) -> dict[str, TargetSlice]:
        """Our routed-experts modules that some PEFT projection maps to -> the target of one expert's gate
        (its ``num_experts``, ``input_size`` H, ``output_size`` I and this rank's ``output_range``)."""
        return {t.module_name: t for t in self.slices.values() if t.num_experts and t.slice_idx == 0}

    @property
    def adapts_encoder(self) -> bool:
        """Some target lies in the model's encoder (``TargetSlice.in_encoder``)."""
        return any(s.in_encoder for s in self.slices.values())

    @property
    def module_names(self) -> list[str]:
        """Our Linear modules that some PEFT projection maps to (the ones that get slot buffers)."""
        return sorted({s.module_name for s in self.slices.values()})


# ----------------------------------------------------------------------------------------
# adapter_config.json
# ----------------------------------------------------------------------------------------
@dataclass
class PEFTAdapterConfig:
    """The fields of ``adapter_config.json`` that matter for serving."""

    r: int
    """Default rank."""
    lora_alpha: float
    """Default alpha; the scale is alpha / r (alpha / sqrt(r) with rsLoRA)."""
    use_rslora: bool = False
    target_modules: Union[list[str], str, None] = None
    """Module suffixes or full names (list), or a regex matched against full module names."""
    fan_in_fan_out: bool = False
    """Set for Conv1D-style models; A/B stored transposed are accepted when it is."""
    rank_pattern: dict[str, int] = field(default_factory=dict)
    """Regex -> rank for modules that deviate from ``r``."""
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    """Regex -> alpha for modules that deviate from ``lora_alpha``."""
    base_model_name_or_path: Optional[str] = None
    target_parameters: list[str] = field(default_factory=list)
    """Parameters PEFT adapts directly (a MoE model's stacked experts and router weight)."""

    @property
    def max_rank(self) -> int:
        return max([self.r, *self.rank_pattern.values()])

    def scaling(self, module_name: str) -> float:
        """The factor PEFT multiplies ``B @ A`` by in ``module_name`` (its base-model name)."""
        r = self.rank_pattern.get(_pattern_key(self.rank_pattern, module_name), self.r)
        alpha = self.alpha_pattern.get(_pattern_key(self.alpha_pattern, module_name), self.lora_alpha)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


def _pattern_key(patterns: dict, module_name: str) -> Optional[str]:
    """PEFT's ``get_pattern_key``: the first pattern matching a suffix of the module name."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module_name):
            return key
    return None


def resolve_adapter_path(path: str) -> Path:
    """Absolute local path of an adapter directory (``~`` expanded); raises if it does not exist."""
    if not path:
        raise LoRAAdapterNotFoundError("lora_path is empty: give the adapter's PEFT directory.")
    p = Path(path).expanduser()
    if not os.path.isdir(p):   # False on any OSError too (a name too long, a lone surrogate), unlike is_dir
        raise LoRAAdapterNotFoundError(f"LoRA adapter path {path!r} does not exist or is not a directory.")
    return p.resolve()


def read_adapter_config(path: Union[str, Path], max_lora_rank: Optional[int] = None,
                        supported_modules: Sequence[str] = SUPPORTED_TARGET_MODULES) -> PEFTAdapterConfig:
    """Read ``adapter_config.json`` and reject what we cannot serve.

    Args:
        path: the adapter directory.
        max_lora_rank: the slot rank; larger adapter ranks are rejected (None: not checked).
        supported_modules: the module suffixes ``target_modules`` may name (the base model's
            ``LoRATargets.suffixes``; default: any model's).

    Raises:
        LoRAAdapterNotFoundError: the directory or its config is missing or unreadable.
        InvalidLoRAAdapterError: every unsupported option, listed in one message.
    """
    d = resolve_adapter_path(str(path))
    cfg_file = d / CONFIG_FILE
    try:
        text = cfg_file.read_text()
    except OSError as e:
        raise LoRAAdapterNotFoundError(f"LoRA adapter {str(path)!r}: cannot read {CONFIG_FILE} ({e}).") from e
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidLoRAAdapterError(f"LoRA adapter {str(path)!r}: {CONFIG_FILE} is not valid JSON ({e}).")
    if not isinstance(raw, dict):
        raise InvalidLoRAAdapterError(f"LoRA adapter {str(path)!r}: {CONFIG_FILE} must hold a JSON object.")
    problems = _config_problems(raw, max_lora_rank, tuple(supported_modules))
    if problems:
        raise InvalidLoRAAdapterError(f"LoRA adapter {str(path)!r} cannot be served: " + " ".join(problems))
    return PEFTAdapterConfig(
        r=int(raw["r"]), lora_alpha=float(raw.get("lora_alpha", raw["r"])),
        use_rslora=bool(raw.get("use_rslora", False)), target_modules=raw.get("target_modules"),
        fan_in_fan_out=bool(raw.get("fan_in_fan_out", False)),
        rank_pattern={str(k): int(v) for k, v in (raw.get("rank_pattern") or {}).items()},
        alpha_pattern={str(k): float(v) for k, v in (raw.get("alpha_pattern") or {}).items()},
        base_model_name_or_path=raw.get("base_model_name_or_path"),
        target_parameters=list(raw.get("target_parameters") or []))


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _config_problems(raw: dict, max_lora_rank: Optional[int], supported_modules: tuple[str, ...]) -> list[str]:
    """Every reason the config cannot be served, as sentences (empty when it can)."""
    problems: list[str] = []
    peft_type = raw.get("peft_type", "LORA")
    if peft_type != "LORA":
        problems.append(f"peft_type is {peft_type!r}; only LoRA adapters (peft_type 'LORA') are supported.")
    r = raw.get("r")
    if not _is_int(r) or r < 1:
        problems.append(f"r must be a positive integer, got {r!r}.")
    alpha = raw.get("lora_alpha", r)
    if not _is_number(alpha):
        problems.append(f"lora_alpha must be a number, got {alpha!r}.")
    rank_pattern = raw.get("rank_pattern") or {}
    alpha_pattern = raw.get("alpha_pattern") or {}
    if not isinstance(rank_pattern, dict) or not all(_is_int(v) and v >= 1 for v in rank_pattern.values()):
        problems.append(f"rank_pattern must map patterns to positive integers, got {rank_pattern!r}.")
        rank_pattern = {}
    if not isinstance(alpha_pattern, dict) or not all(_is_number(v) for v in alpha_pattern.values()):
        problems.append(f"alpha_pattern must map patterns to numbers, got {alpha_pattern!r}.")
    if max_lora_rank is not None and _is_int(r):
        rank = max([r, *rank_pattern.values()])
        if rank > max_lora_rank:
            problems.append(f"LoRA rank {rank} is greater than max_lora_rank {max_lora_rank}; "
                            f"start the engine with --max-lora-rank {rank} or more.")
    if raw.get("use_dora"):
        problems.append("DoRA (use_dora) is not supported.")
    if raw.get("modules_to_save"):
        problems.append(f"modules_to_save ({raw['modules_to_save']!r}) is not supported: "
                        "the adapter must not replace base-model modules.")
    bias = raw.get("bias", "none")
    if bias not in (None, "none"):
        problems.append(f"bias={bias!r}: adapters with trained biases are not supported (only 'none').")
    if raw.get("lora_bias"):
        problems.append("lora_bias (a bias on lora_B) is not supported.")
    for key, what in (("trainable_token_indices", "trainable tokens"),
                      ("layer_replication", "layer replication"),
                      ("alora_invocation_tokens", "activated LoRA (aLoRA)"), ("use_qalora", "QA-LoRA")):
        if raw.get(key):
            problems.append(f"{key}: {what} is not supported.")
    problems.extend(_target_parameter_problems(raw.get("target_parameters"), supported_modules))
    problems.extend(_target_module_problems(raw.get("target_modules"), bool(raw.get("target_parameters")),
                                            supported_modules))
    return problems


def _target_module_problems(targets, has_target_parameters: bool, supported_modules: tuple[str, ...]) -> list[str]:
    if targets is None:
        return [] if has_target_parameters else ["target_modules is missing."]
    if isinstance(targets, str):
        if targets == "all-linear":
            return []
        try:
            re.compile(targets)
        except re.error as e:
            return [f"target_modules regex {targets!r} does not compile ({e})."]
        return []
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        return [f"target_modules must be a list of names or a regex string, got {targets!r}."]
    embedding = [t for t in targets if t.rpartition(".")[2] in _EMBEDDING_MODULES]
    unknown = [t for t in targets
               if t.rpartition(".")[2] not in supported_modules and t not in embedding]
    problems = []
    if embedding:
        problems.append(f"LoRA on embeddings or the LM head ({embedding}) is not supported.")
    if unknown:
        problems.append(f"unknown target modules {unknown}; supported: {list(supported_modules)}.")
    return problems


# ----------------------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------------------
@dataclass
class LoRASliceWeights:
    """One projection's update, ready to copy into a slot (scale already folded into B)."""

    lora_a: torch.Tensor
    """[rank, input_size]; an experts slice (``TargetSlice.num_experts``): [E, rank, input_size], zero for
    the experts the adapter does not target."""
    lora_b: torch.Tensor
    """[output_size, rank] ([E, output_size, rank] for an experts slice), multiplied by the module's scale."""


@dataclass
class LoRAAdapter:
    """A validated adapter in host memory: what the store keeps and slots copy from."""

    name: str
    path: str
    """Resolved adapter directory (for reloads after the host LRU evicted it)."""
    rank: int
    """Largest rank over its modules (<= max_lora_rank)."""
    config: PEFTAdapterConfig
    weights: dict[tuple[str, int], LoRASliceWeights]
    """(our Linear module name, slice index) -> weights; projections it does not target are absent."""
    adapts_encoder: bool = False
    """Some update lands in the model's encoder (``TargetSlice.in_encoder``): the encoder output of a
    request running this adapter is its own (the encoder-cache key carries the adapter's name)."""

    def nbytes(self) -> int:
        return sum(w.lora_a.numel() * w.lora_a.element_size() + w.lora_b.numel() * w.lora_b.element_size()
                   for w in self.weights.values())

    def pin_memory(self) -> "LoRAAdapter":
        """Move every tensor to page-locked host memory (fast non-blocking copies to the GPU); those read
        into it already stay."""
        for w in self.weights.values():
            w.lora_a = w.lora_a if w.lora_a.is_pinned() else w.lora_a.pin_memory()
            w.lora_b = w.lora_b if w.lora_b.is_pinned() else w.lora_b.pin_memory()
        return self

    def is_pinned(self) -> bool:
        """Whether every tensor is in page-locked host memory already (``pin_memory`` ran)."""
        return all(w.lora_a.is_pinned() and w.lora_b.is_pinned() for w in self.weights.values())


def read_adapter_tensors(path: Union[str, Path], shapes_only: bool = False,
                         pin_memory: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of ``adapter_model.safetensors`` (preferred) or ``adapter_model.bin``, on CPU; with
    ``shapes_only``, a safetensors file's tensors as ``meta`` tensors of their shapes and dtypes, from its
    header alone (a check of the adapter that reads no weights). A safetensors file's tensors are views of
    one buffer its data is read into (page-locked with ``pin_memory``; ``lora.weights_file``)."""
    return _read_weights(path, shapes_only, pin_memory).tensors


def _read_weights(path: Union[str, Path], shapes_only: bool = False, pin_memory: bool = False,
                  dtype: Optional[torch.dtype] = None,
                  fold: Optional[Callable[[str], Optional[float]]] = None) -> GroupedRead:
    """``read_adapter_tensors``; a safetensors file's tensors in ``dtype`` with the scales ``fold`` gives
    multiplied in (``weights_file.read_grouped``; ``GroupedRead.folded`` says which: none from a ``.bin``
    file, or one ``read_grouped`` leaves to ``safetensors``)."""
    d = resolve_adapter_path(str(path))
    for fname in WEIGHT_FILES:
        f = d / fname
        if not f.is_file():
            continue
        try:
            if fname.endswith(".safetensors"):
                if shapes_only:
                    tensors = read_grouped_meta(f, dtype)
                    if tensors is not None:
                        return GroupedRead(tensors, set())
                else:
                    read = read_grouped(f, dtype, pin_memory, fold)
                    if read is not None:
                        return read
                from safetensors.torch import load_file
                return GroupedRead(load_file(str(f), device="cpu"), set())
            state = torch.load(str(f), map_location="cpu", weights_only=True)
        except OSError as e:
            raise LoRAAdapterNotFoundError(f"LoRA adapter {str(path)!r}: cannot read {fname} ({e}).") from e
        except Exception as e:  # corrupt file: safetensors/pickle raise various types
            raise InvalidLoRAAdapterError(f"LoRA adapter {str(path)!r}: {fname} is not a valid "
                                          f"weights file ({type(e).__name__}: {e}).") from e
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise InvalidLoRAAdapterError(f"LoRA adapter {str(path)!r}: {fname} must hold a dict of tensors.")
        return GroupedRead(state, set())
    raise LoRAAdapterNotFoundError(
        f"LoRA adapter {str(path)!r} has no weights: expected {' or '.join(WEIGHT_FILES)}.")


def load_peft_adapter(name: str, path: str, targets: LoRATargets, max_lora_rank: int,
                      dtype: torch.dtype, shapes_only: bool = False, pin_memory: bool = False) -> LoRAAdapter:
    """Read, check and prepare one PEFT adapter for the base model described by ``targets``.

    Args:
        name: the adapter's name (for messages).
        path: the PEFT directory.
        targets: projections of the base model an adapter may update.
        max_lora_rank: slot rank; larger ranks are rejected.
        dtype: dtype of the returned tensors (the slot dtype).
        shapes_only: check the adapter from its config and its weights file's header only (safetensors);
            the returned adapter's tensors are ``meta`` tensors (``AdapterReader.check``).
        pin_memory: read the weights into page-locked memory. A safetensors file is read in the slot dtype
            with each B's scale folded in as it is read (``lora.weights_file``: few torch calls).

    Raises:
        LoRAAdapterNotFoundError: missing directory or files.
        InvalidLoRAAdapterError: unsupported options, too large a rank, unknown modules or
            shapes that do not fit the base model (all problems in one message).
    """
    config = read_adapter_config(path, max_lora_rank, targets.suffixes)
    read = _read_weights(path, shapes_only, pin_memory, dtype,
                         fold=lambda key: _b_scale(key, config, targets))
    folded = {m.group("module") for m in map(_LORA_KEY_RE.match, read.folded) if m is not None}
    tensors, stacked, scale_names, problems = _stacked_expert_pairs(read.tensors, targets, config)
    pairs, more = _group_lora_tensors(tensors, targets)
    pairs.update(stacked)
    problems += more
    weights: dict[tuple[str, int], LoRASliceWeights] = {}
    per_expert: dict[tuple[str, int], dict[int, LoRASliceWeights]] = {}   # experts' slice -> expert -> weights
    max_rank, adapts_encoder = 0, False
    for peft_module, (a, b) in sorted(pairs.items()):
        target = targets.slices[peft_module]
        fitted = _fit_shapes(peft_module, a, b, target, config.fan_in_fan_out)
        if isinstance(fitted, str):
            problems.append(fitted)
            continue
        a, b = target.shard(*fitted)
        rank = a.shape[0]
        if rank > max_lora_rank:
            problems.append(f"{peft_module} has rank {rank}, greater than max_lora_rank {max_lora_rank}; "
                            f"start the engine with --max-lora-rank {rank} or more.")
            continue
        max_rank = max(max_rank, rank)
        adapts_encoder = adapts_encoder or target.in_encoder
        scale = 1.0 if peft_module in folded else config.scaling(scale_names.get(peft_module, peft_module))
        slice_weights = LoRASliceWeights(lora_a=_in_dtype(a, dtype),            # [rank, in]
                                         lora_b=_scaled(b, scale, dtype))       # [out, rank]
        if target.num_experts:
            per_expert.setdefault((target.module_name, target.slice_idx), {})[target.expert] = slice_weights
        else:
            weights[(target.module_name, target.slice_idx)] = slice_weights
    weights.update(_stack_experts(per_expert, targets))
    if not problems and not weights:
        problems.append("it holds no lora_A/lora_B tensors.")
    if problems:
        raise InvalidLoRAAdapterError(
            f"LoRA adapter {name!r} ({path}) cannot be served: " + " ".join(problems))
    return LoRAAdapter(name=name, path=str(resolve_adapter_path(path)), rank=max_rank, config=config,
                       weights=weights, adapts_encoder=adapts_encoder)


def _b_scale(key: str, config: PEFTAdapterConfig, targets: LoRATargets) -> Optional[float]:
    """The scale to fold into tensor ``key`` while it is read: a B's module's (``PEFTAdapterConfig.scaling``);
    None for any other tensor, and for the stacked experts' B (``_stacked_expert_pairs`` scales those)."""
    m = _LORA_KEY_RE.match(key)
    if m is None or m.group("kind") != "lora_B":
        return None
    module = m.group("module")
    if (module[:-len(_BASE_LAYER)] if module.endswith(_BASE_LAYER) else module) in targets.expert_modules:
        return None
    return config.scaling(module)


def _in_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``, contiguous; itself when it is (no torch call: each releases the GIL, which a loader
    thread must take back from the busy step loop, ``lora.weights_file``)."""
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


def _scaled(b: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``b * scale`` rounded once to ``dtype``, contiguous: float32 maths, in place where ``b`` is contiguous in
    ``dtype`` already (``b`` is a view of this read's own buffer; the reduced-precision kernels compute in
    float32 and round once), in one pass where it is float32, else widened first. A ``meta`` ``b`` (a check)
    only takes the dtype: maths on meta tensors runs torch's Python reference decompositions, the most of a
    check's time."""
    if b.is_meta:
        return b if b.dtype == dtype else b.to(dtype)
    if b.dtype == dtype and b.is_contiguous():
        return b if scale == 1.0 else b.mul_(scale)
    if scale == 1.0:
        return b.to(dtype).contiguous()
    if b.dtype not in (torch.float32, dtype):
        b = b.to(torch.float32)
    return (b * scale).to(dtype).contiguous()


def _group_lora_tensors(tensors: dict[str, torch.Tensor], targets: LoRATargets
                        ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], list[str]]:
    """PEFT module name -> (A, B), plus a sentence per tensor we cannot place."""
    suffixes = targets.suffixes
    halves: dict[str, dict[str, torch.Tensor]] = {}
    embedding, unknown, missing_modules, base_weights, tower = set(), set(), set(), set(), set()
    for key, tensor in tensors.items():
        m = _LORA_KEY_RE.match(key)
        if m is None:
            base_weights.add(key[len(_PREFIX):] if key.startswith(_PREFIX) else key)
            continue
        module, kind = m.group("module"), m.group("kind")
        suffix = module.rpartition(".")[2]
        if kind.startswith("lora_embedding") or suffix in _EMBEDDING_MODULES:
            embedding.add(module)
        elif kind == "lora_magnitude_vector":
            unknown.add(f"{module} (DoRA magnitude)")
        elif module in targets.slices:
            halves.setdefault(module, {})[kind] = tensor
        elif module in targets.tower_modules:
            tower.add(module)
        elif module in targets.unused_modules:
            continue
        elif suffix in suffixes:
            missing_modules.add(module)
        else:
            unknown.add(module)
    problems = []
    if embedding:
        problems.append(f"LoRA on embeddings or the LM head ({sorted(embedding)[:3]}) is not supported.")
    if tower:
        problems.append(f"it updates the vision tower or its projector ({sorted(tower)[:3]}), which this "
                        f"engine adapts only when started with {TOWER_LORA_FLAG}.")
    if base_weights:
        problems.append(f"it carries base-model weights ({sorted(base_weights)[:3]}), e.g. from "
                        "modules_to_save or a resized vocabulary; that is not supported.")
    if unknown:
        problems.append(f"expected target modules in {list(suffixes)} but received "
                        f"{sorted(unknown)[:3]}.")
    if missing_modules:
        problems.append(f"tensors for {sorted(missing_modules)[:3]} do not fit the base model, "
                        "which has no such module (an adapter for a different model?).")
    pairs = {}
    for module, h in halves.items():
        if "lora_A" not in h or "lora_B" not in h:
            problems.append(f"{module} has only {'lora_A' if 'lora_A' in h else 'lora_B'}.")
            continue
        pairs[module] = (h["lora_A"], h["lora_B"])
    return pairs, problems


def _fit_shapes(peft_module: str, a: torch.Tensor, b: torch.Tensor, target: TargetSlice,
                fan_in_fan_out: bool):
    """(A [r, in], B [out, r]) as the base model needs them, or a sentence saying why not."""
    want = f"A [r, {target.input_size}] and B [{target.output_size}, r]"
    if a.dim() != 2 or b.dim() != 2:
        return f"{peft_module}: A and B must be matrices, got shapes {tuple(a.shape)} and {tuple(b.shape)}."

    def fits(a_, b_) -> bool:
        return (a_.shape[1] == target.input_size and b_.shape[0] == target.output_size
                and a_.shape[0] == b_.shape[1])

    if fits(a, b):
        return a, b
    if fan_in_fan_out and fits(a.t(), b.t()):
        return a.t(), b.t()
    return (f"{peft_module}: shapes A {tuple(a.shape)}, B {tuple(b.shape)} do not fit the base model, "
            f"which needs {want} (an adapter for a different model?).")


def max_rank_in(paths: list[str], at_least: int = 16) -> int:
    """Largest rank among the adapters in ``paths`` (configs only), and at least ``at_least``.

    The default for ``max_lora_rank`` when adapters are given at start-up.
    """
    rank = at_least
    for p in paths:
        rank = max(rank, read_adapter_config(p).max_rank)
    return rank


# ----------------------------------------------------------------------------------------
# Routed experts (MoE): per-expert modules, the stacked parameters, the router
# ----------------------------------------------------------------------------------------
STACKED_EXPERT_PARAMETERS = {"gate_up_proj": (0, 1), "down_proj": (2,)}
"""transformers 5's stacked expert parameters (``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj``
[E, H, I]) -> the experts slices they update. PEFT's ``target_parameters`` adapts each with one A
[r * E, in] and one B [out, r * E] (expert e: A rows e * r ..., B columns e of every r-th), one A for
gate and up together."""
_BASE_LAYER = ".base_layer"


def _expert_slices(model: nn.Module, layout) -> dict[str, TargetSlice]:
    """PEFT names of every routed-experts module's per-expert projections (``LoRALayout.expert_projections``)
    and of the router beside it (``LoRALayout.router_modules``), also under ``LoRALayout.module_renames``."""
    from engine.layers.linear import Linear
    from engine.layers.moe import FusedMoE

    if not layout.expert_projections:
        return {}
    slices: dict[str, TargetSlice] = {}
    for name, module in model.named_modules():
        if not isinstance(module, FusedMoE):
            continue
        found = {f"{name}.{e}.{suffix}": _expert_slice(name, s, e, module)
                 for suffix, s in layout.expert_projections for e in range(module.num_experts)}
        parent = name.rpartition(".")[0]
        block = model.get_submodule(parent)
        for router in layout.router_modules:
            linear = block.get_submodule(router) if router in dict(block.named_children()) else None
            if isinstance(linear, Linear):
                found[f"{parent}.{router}"] = _target_slice(f"{parent}.{router}", 0, linear)
        for peft_module, target in found.items():
            slices[peft_module] = target
            for theirs, ours in layout.module_renames:
                if ours in peft_module:
                    slices.setdefault(peft_module.replace(ours, theirs), target)
    return slices


def _expert_slice(module_name: str, slice_idx: int, expert: int, module: nn.Module) -> TargetSlice:
    """Where one expert's gate (0), up (1) or down (2) projection lands in ``module`` (a ``FusedMoE``; with
    tensor parallelism its ``intermediate_range``: B rows of gate/up, A columns of down)."""
    hidden, inter, part = module.hidden_size, module.full_intermediate_size, module.intermediate_range
    if slice_idx == 2:
        return TargetSlice(module_name, 2, inter, hidden, input_range=part, num_experts=module.num_experts,
                           expert=expert)
    return TargetSlice(module_name, slice_idx, hidden, inter, output_range=part, num_experts=module.num_experts,
                       expert=expert)


def _target_parameter_problems(params, supported_modules: tuple[str, ...]) -> list[str]:
    """Why ``target_parameters`` cannot be served (empty when it can): only the stacked experts
    (``STACKED_EXPERT_PARAMETERS``) and the router's ``gate.weight`` of a MoE model."""
    if not params:
        return []
    if not isinstance(params, list) or not all(isinstance(p, str) for p in params):
        return [f"target_parameters must be a list of parameter names, got {params!r}."]
    known = (*STACKED_EXPERT_PARAMETERS, "gate.weight") if "gate_up_proj" in supported_modules else ()
    bad = [p for p in params if not any(p == k or p.endswith("." + k) for k in known)]
    if not bad:
        return []
    if not known:
        return [f"target_parameters {bad}: LoRA on raw parameters is served on the routed experts of MoE models "
                "only, and this model has none."]
    return [f"target_parameters {bad} are not supported; this model takes {list(known)}."]


def _stacked_parameter(module: str, config: PEFTAdapterConfig) -> Optional[str]:
    """Which stacked parameter the tensors of PEFT module ``module`` (``<experts>`` or
    ``<experts>.base_layer``) adapt: PEFT nests one wrapper per parameter, ``gate_up_proj`` innermost."""
    named = {p.rpartition(".")[2] for p in (config.target_parameters or [])} & set(STACKED_EXPERT_PARAMETERS)
    if module.endswith(_BASE_LAYER):
        return "gate_up_proj" if len(named) == 2 else None
    if len(named) == 2:
        return "down_proj"
    return next(iter(named), None)


def _stacked_expert_pairs(tensors: dict[str, torch.Tensor], targets: LoRATargets, config: PEFTAdapterConfig
                          ) -> tuple[dict[str, torch.Tensor], dict[str, tuple[torch.Tensor, torch.Tensor]],
                                     dict[str, str], list[str]]:
    """Split off the tensors of the stacked experts (``target_parameters``) and turn them into per-expert
    pairs under the per-expert PEFT names (gate and up share the stacked A).

    Returns (the other tensors, per-expert name -> (A [r, in], B [out, r]), per-expert name -> the name its
    scale is looked up by (``<experts>.gate_up_proj``), a sentence per problem).
    """
    experts = targets.expert_modules
    if not experts:
        return tensors, {}, {}, []
    names = {(t.module_name, t.expert, t.slice_idx): peft for peft, t in reversed(list(targets.slices.items()))
             if t.num_experts}                                        # the first (our) name of each
    rest: dict[str, torch.Tensor] = {}
    halves: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    problems: list[str] = []
    for key, tensor in tensors.items():
        m = _LORA_KEY_RE.match(key)
        module = m.group("module") if m is not None else ""
        base = module[:-len(_BASE_LAYER)] if module.endswith(_BASE_LAYER) else module
        if base not in experts or m.group("kind") not in ("lora_A", "lora_B"):
            rest[key] = tensor
            continue
        param = _stacked_parameter(module, config)
        if param is None:
            problems.append(f"{module} holds LoRA tensors of the stacked experts, but target_parameters "
                            f"({config.target_parameters}) does not say which of gate_up_proj / down_proj.")
            continue
        halves.setdefault((base, param), {})[m.group("kind")] = tensor
    pairs, scale_names = {}, {}
    for (base, param), h in sorted(halves.items()):
        if "lora_A" not in h or "lora_B" not in h:
            problems.append(f"{base}.{param} has only {'lora_A' if 'lora_A' in h else 'lora_B'}.")
            continue
        gate = experts[base]
        E, hidden, inter = gate.num_experts, gate.input_size, gate.output_size
        a, b = h["lora_A"], h["lora_B"]
        in_size, out_size = (hidden, 2 * inter) if param == "gate_up_proj" else (inter, hidden)
        if (a.dim() != 2 or b.dim() != 2 or a.shape[0] % E or a.shape[0] == 0 or a.shape[1] != in_size
                or tuple(b.shape) != (out_size, a.shape[0])):
            problems.append(f"{base}.{param}: shapes A {tuple(a.shape)}, B {tuple(b.shape)} do not fit the base "
                            f"model, which needs A [r * {E}, {in_size}] and B [{out_size}, r * {E}] (an adapter "
                            "for a different model?).")
            continue
        rank = a.shape[0] // E
        a3 = a.reshape(E, rank, in_size)                                           # [E, r, in]
        b3 = b.reshape(out_size, rank, E).permute(2, 0, 1)                         # [E, out, r]
        slices = STACKED_EXPERT_PARAMETERS[param]
        for e in range(E):
            for i, s in enumerate(slices):
                name = names[(base, e, s)]
                rows = slice(i * inter, (i + 1) * inter) if len(slices) == 2 else slice(None)
                pairs[name] = (a3[e], b3[e, rows])
                scale_names[name] = f"{base}.{param}"
    return rest, pairs, scale_names, problems


def _stack_experts(per_expert: dict[tuple[str, int], dict[int, LoRASliceWeights]], targets: LoRATargets
                   ) -> dict[tuple[str, int], LoRASliceWeights]:
    """Each experts slice's per-expert weights stacked: A [E, r, in], B [E, out, r], ranks zero-padded to the
    slice's largest, zero for the experts the adapter does not target."""
    experts = targets.expert_modules
    out: dict[tuple[str, int], LoRASliceWeights] = {}
    for (module, s), by_expert in per_expert.items():
        some = next(iter(by_expert.values()))
        rank = max(w.lora_a.shape[0] for w in by_expert.values())
        E = experts[module].num_experts
        a = some.lora_a.new_zeros(E, rank, some.lora_a.shape[1])                   # [E, r, in]
        b = some.lora_b.new_zeros(E, some.lora_b.shape[0], rank)                   # [E, out, r]
        for e, w in by_expert.items():
            a[e, :w.lora_a.shape[0]] = w.lora_a
            b[e, :, :w.lora_b.shape[1]] = w.lora_b
        out[(module, s)] = LoRASliceWeights(lora_a=a, lora_b=b)
    return out
