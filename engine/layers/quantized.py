"""Weight-only quantization for CPU decode: the weights stay int8 or int4 in memory (a quarter or an eighth of
float32's bytes, which is what a batch-1 decode step reads), activations stay float.

- int8 (``Int8Weight``): per output row, symmetric: ``q = round(w / s)``, ``s = max|w_row| / 127``.
- int4 (``Int4Weight``): per group of ``INT4_GROUP_SIZE`` inputs of a row, asymmetric (as GGUF's Q4_1):
  ``q = round((w - min) / s)`` in 0..15, ``s = (max - min) / 15``, so ``w ~ (q - 8) * s + zero`` with
  ``zero = min + 8 s`` (the convention of torch's packed int4 kernel).
- fp16 (``Fp16Weight``): the weight rounded to float16 in fbgemm's packed layout (half float32's bytes,
  outputs within ~1e-3 of float32's), every row count through ``torch.ops.quantized.linear_dynamic_fp16``
  (float32 activations, converted weights, float32 accumulation); which format is fastest at which batch
  on the 2-core machine: RESULTS.md "What sets the CPU defaults".

A projection runs as ``x @ W.T`` in one of these ways, by the number of rows of ``x``: up to
``packed_max_tokens`` rows, torch's packed kernel (``_weight_int8pack_mm`` / ``_weight_int4pack_mm_for_cpu``,
bfloat16 activations and outputs, the quantized weight read once: bandwidth-bound decode steps); above, the
weight's float copies when it keeps them (``keep_float_copies``, no per-call conversion of the weight). On
CPUs with AMX: below ``BF16_PRODUCTS_MIN_TOKENS`` rows (decode batches) ``kernels.cpu_amx_gemm`` on the
int4 / int8 values (``AmxTiles``: dequantized to bfloat16 tile by tile, float32 outputs; a bfloat16 copy in
oneDNN's packed layout, ``Bf16Weight``, where the kernel cannot be built or the shape is not its), from
there (prompts) a float32 copy whose GEMM
multiplies in bfloat16 and accumulates and returns float32 (``Bf16ProductsWeight``; speeds: RESULTS.md
"What sets the CPU defaults"). Elsewhere the fp16 copy (fbgemm's float16 GEMM: decode batches and prefill chunks up to
``FP16_COPY_MAX_TOKENS`` rows), else the weight dequantized to ``x``'s dtype for one ``F.linear``
(compute-bound prefill, where the packed kernels are about half float32's speed). The LM head keeps an fp16
copy everywhere: its logits are float32 at every batch (``QuantizedEmbedding.logits``).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from kernels.cpu_amx_gemm import CpuAmxGemm

PACKED_MAX_TOKENS = 32
"""Rows up to which the packed kernels run: where they beat float32 on the 2-core CPU (faster at decode
sizes, slower at prefill sizes; RESULTS.md "What sets the CPU defaults")."""
FP16_COPY_MIN_TOKENS = 5
"""Rows from which a weight that keeps an fp16 copy runs it instead of its packed kernel: the 2-core AVX2
machine's crossover (RESULTS.md "What sets the CPU defaults")."""
FLOAT_COPY_MAX_MEMORY_FRACTION = 0.25
"""``cpu_float_copy`` unset: the copies are kept when they take at most this fraction of the machine's memory
(SmolLM2-135M: 0.27 GB; a 7B model's 14 GB are not kept on a 24 GB machine)."""
FP16_COPY_MAX_TOKENS = 2048
"""Rows up to which the fp16 copy runs; larger steps (long prompts) dequantize for float32's GEMM, faster there
(RESULTS.md "What sets the CPU defaults")."""
BF16_PRODUCTS_MIN_TOKENS = 20
"""CPUs with AMX: rows from which a weight's bf16-products copy (float32 out) runs instead of its AMX tiles or
bf16 copy: prompts keep float32 outputs, while decode batches take the faster tiles (float32 out) or, where
``kernels.cpu_amx_gemm`` does not build, the bf16 GEMM (bfloat16 out, the packed kernels' rounding below
``FP16_COPY_MIN_TOKENS`` rows). RESULTS.md "What sets the CPU defaults"."""
INT4_GROUP_SIZE = 32
"""Inputs per int4 scale (GGUF's Q4 block)."""
INT4_INNER_K_TILES = 2
"""Layout argument of ``torch._convert_weight_to_int4pack_for_cpu``."""
QUANTIZATIONS = ("int8", "int4", "fp16")
BF16_MATMUL_MODE_LOCK = threading.Lock()
"""oneDNN's float32 matmul mode is process-wide: ``Bf16ProductsWeight`` holds this lock while the mode is
"bf16", and a CPU runner whose model has no such weights holds it around each of its steps
(``engine.runner.runner``), so a float model served in another engine of the same process (e.g. the Whisper
model of ``--transcription-model``) never computes under that mode."""


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles that oneDNN can use, and torch the per-call bf16 matmul mode
    (``torch.backends.mkldnn.matmul.fp32_precision``, torch 2.9+) that ``Bf16ProductsWeight`` sets."""
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    mode = hasattr(getattr(torch.backends.mkldnn, "matmul", None), "fp32_precision")
    return bool(amx is not None and amx() and mode and torch.backends.mkldnn.is_available())


class _PackedWeight:
    """What int8 and int4 weights share: the optional float copies for steps of many rows."""

    fp16_copy: Optional["Fp16Weight"] = None
    """The weight as fbgemm float16 (``keep_float_copies()``), run above ``packed_max_tokens`` rows; None:
    those rows run the dequantized weight."""
    bf16_copy: Optional["Bf16Weight"] = None
    """CPUs with AMX (``keep_float_copies(amx=True)``): the weight as oneDNN-packed bfloat16, run above
    ``packed_max_tokens`` rows and below ``BF16_PRODUCTS_MIN_TOKENS`` (decode batches)."""
    amx_tiles: Optional["AmxTiles"] = None
    """CPUs with AMX, weights of a shape ``kernels.cpu_amx_gemm`` takes: its records, run where ``bf16_copy``
    would (which is then not kept)."""
    bf16_products_copy: Optional["Bf16ProductsWeight"] = None
    """CPUs with AMX: the weight as float32 for bf16-product GEMMs, run from ``BF16_PRODUCTS_MIN_TOKENS`` rows."""

    def linear(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [T, in] -> [T, out] = x @ W.T + bias (``quantized_linear``)."""
        return quantized_linear(x, self, bias)

    @property
    def packed_max_tokens(self) -> int:
        """Rows up to which the packed kernel runs."""
        copies = self.fp16_copy is not None or self.bf16_copy is not None or self.amx_tiles is not None
        return FP16_COPY_MIN_TOKENS - 1 if copies else PACKED_MAX_TOKENS

    def dequantize(self, dtype: torch.dtype, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        raise NotImplementedError

    def keep_float_copies(self, amx: bool = False, amx_gemm: Optional["CpuAmxGemm"] = None) -> None:
        """Also keep the dequantized weight for steps of ``FP16_COPY_MIN_TOKENS`` rows or more: as fbgemm
        float16 (2 bytes per weight); with ``amx``, float32 for bf16-product GEMMs from
        ``BF16_PRODUCTS_MIN_TOKENS`` rows and below that ``amx_gemm``'s records where it takes the weight
        (0.75 bytes per int4 weight, 1 per int8), else packed bfloat16 (2)."""
        w = self.dequantize(torch.float32)
        if amx:
            if self.fits_amx_gemm(amx_gemm):
                self.amx_tiles = AmxTiles(amx_gemm, self)
            else:
                self.bf16_copy = Bf16Weight(w)
            self.bf16_products_copy = Bf16ProductsWeight(w)
        else:
            self.fp16_copy = Fp16Weight(w)

    def fits_amx_gemm(self, amx_gemm: Optional["CpuAmxGemm"]) -> bool:
        """Whether ``amx_gemm`` (None: not loaded) runs this weight (its shapes only)."""
        from kernels.cpu_amx_gemm import supports
        return amx_gemm is not None and supports(*self.q.shape)

    def nbytes_float_copies(self, amx: bool = False, amx_gemm: Optional["CpuAmxGemm"] = None) -> int:
        """Bytes ``keep_float_copies`` adds."""
        if not amx:
            return 2 * self.q.numel()
        decode_copy = self.nbytes_amx_tiles() if self.fits_amx_gemm(amx_gemm) else 2 * self.q.numel()
        return 4 * self.q.numel() + decode_copy

    def nbytes_amx_tiles(self) -> int:
        """Bytes of this weight's ``AmxTiles`` (0.75 per int4 weight with its scales, 1 per int8)."""
        return self.q.numel() * 3 // 4 if isinstance(self, Int4Weight) else self.q.numel()


class Int8Weight(_PackedWeight):
    """A [out, in] weight as int8 with one scale per row."""

    def __init__(self, weight: torch.Tensor) -> None:
        w = weight.detach().float()
        self.scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0                           # [out]
        self.q = torch.clamp(torch.round(w / self.scales[:, None]), -127, 127).to(torch.int8)  # [out, in]
        self.scales_bf16 = self.scales.to(torch.bfloat16)

    def dequantize(self, dtype: torch.dtype, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[out, in] (or the ``rows`` selected) in ``dtype``."""
        q, s = (self.q, self.scales) if rows is None else (self.q[rows], self.scales[rows])
        return q.to(torch.float32).mul_(s[:, None]).to(dtype)

    def packed_mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x.to(torch.bfloat16), self.q, self.scales_bf16)


class Int4Weight(_PackedWeight):
    """A [out, in] weight as int4 with a scale and a zero point per group of ``INT4_GROUP_SIZE`` inputs;
    the packed layout for decode and the 0..15 values (one byte each) for prefill's dequantization."""

    def __init__(self, weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> None:
        out_features, in_features = weight.shape
        if in_features % group_size:
            raise ValueError(f"int4: {in_features} input features are not a multiple of the group size "
                             f"{group_size}; use --quantization int8 for this model.")
        self.group_size = group_size
        w = weight.detach().float().view(out_features, in_features // group_size, group_size)
        low, high = w.amin(dim=-1), w.amax(dim=-1)                                  # [out, groups]
        self.scales = (high - low).clamp(min=1e-12) / 15.0                          # [out, groups]
        self.zeros = low + 8.0 * self.scales                                        # value of q = 8
        self.low = low                                                              # value of q = 0
        self.q = torch.clamp(torch.round((w - low[..., None]) / self.scales[..., None]), 0, 15).to(
            torch.uint8).view(out_features, in_features)                           # [out, in]
        self.packed = torch._convert_weight_to_int4pack_for_cpu(self.q.to(torch.int32), INT4_INNER_K_TILES)
        self.scale_zeros = torch.stack([self.scales, self.zeros], dim=-1).transpose(0, 1).contiguous().to(
            torch.bfloat16)                                                         # [groups, out, 2]

    @classmethod
    def from_quantized(cls, q: torch.Tensor, scales: torch.Tensor, zeros_q: torch.Tensor) -> "Int4Weight":
        """An int4 weight already quantized (a checkpoint's): q uint8 [out, in] 0..15 and per group of
        ``INT4_GROUP_SIZE`` inputs ``scales`` and ``zeros_q`` (the zero point in q units) float32 [out, in /
        INT4_GROUP_SIZE]; W = (q - zeros_q) * scales, exactly (the packed kernel's scale and zero in
        bfloat16)."""
        self = cls.__new__(cls)
        self.group_size = INT4_GROUP_SIZE
        self.scales = scales.float().contiguous()                                     # [out, groups]
        self.low = -zeros_q.float() * self.scales                                     # value of q = 0
        self.zeros = self.low + 8.0 * self.scales                                     # value of q = 8
        self.q = q.to(torch.uint8).contiguous()                                       # [out, in]
        self.packed = torch._convert_weight_to_int4pack_for_cpu(self.q.to(torch.int32), INT4_INNER_K_TILES)
        self.scale_zeros = torch.stack([self.scales, self.zeros], dim=-1).transpose(0, 1).contiguous().to(
            torch.bfloat16)                                                           # [groups, out, 2]
        return self

    def dequantize(self, dtype: torch.dtype, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        q, s, low = (self.q, self.scales, self.low) if rows is None else (self.q[rows], self.scales[rows],
                                                                          self.low[rows])
        n = q.shape[0]
        w = q.view(n, -1, self.group_size).to(torch.float32).mul_(s[..., None]).add_(low[..., None])
        return w.view(n, -1).to(dtype)

    def packed_mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, self.group_size,
                                                 self.scale_zeros)

    def fits_amx_gemm(self, amx_gemm: Optional["CpuAmxGemm"]) -> bool:
        from kernels.cpu_amx_gemm import GROUP_SIZE
        return super().fits_amx_gemm(amx_gemm) and self.group_size == GROUP_SIZE


class AmxTiles:
    """An int4 or int8 weight as ``kernels.cpu_amx_gemm``'s records: ``x @ W.T`` with W's tiles dequantized to
    bfloat16 in registers on AMX, bfloat16 activations, float32 sums and outputs (the bf16 copy's arithmetic
    without its output rounding, reading 0.75 bytes per int4 weight, 1 per int8, instead of 2)."""

    def __init__(self, gemm: "CpuAmxGemm", weight: "Int4Weight | Int8Weight") -> None:
        self.gemm = gemm
        self.out_features = weight.q.shape[0]
        if isinstance(weight, Int4Weight):
            self.records = gemm.pack_int4(weight.q, weight.scales.float(), weight.low.float())    # flat uint8
            self.scales = None
        else:
            self.records = gemm.pack_int8(weight.q)
            self.scales = weight.scales.float().contiguous()                                     # [out]

    def packed_mm(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out] float32."""
        if self.scales is None:
            return self.gemm.int4(x.float(), self.records, self.out_features)
        return self.gemm.int8(x.float(), self.records, self.scales)


class Fp16Weight:
    """A [out, in] weight as float16 packed for fbgemm's GEMM (every row count: ``packed_max_tokens`` None)."""

    packed_max_tokens = None
    fp16_copy = None

    def __init__(self, weight: torch.Tensor) -> None:
        if "fbgemm" not in torch.backends.quantized.supported_engines:
            raise ValueError("--quantization fp16 needs torch's fbgemm kernels (x86 CPUs); use int8 or int4 here.")
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight.detach().float(), None)

    def linear(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [T, in] -> [T, out] = x @ W.T + bias (``quantized_linear``)."""
        return quantized_linear(x, self, bias)

    def dequantize(self, dtype: torch.dtype, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Unpacks the whole weight (tests' reference; the engine never calls it: ``packed_mm`` serves every
        row count and ``QuantizedEmbedding`` looks rows up in its own float16 table)."""
        w = torch.ops.quantized.linear_unpack_fp16(self.packed)[0]
        return (w if rows is None else w[rows]).to(dtype)

    def packed_mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x.float(), self.packed)


class Bf16Weight:
    """An int8 / int4 weight's bfloat16 copy in oneDNN's packed layout (a plain [out, in] tensor where torch lacks
    the packing op): ``x @ W.T`` on bfloat16 activations with float32 accumulation and a bfloat16 output, the
    packed kernels' rounding (AMX tiles)."""

    def __init__(self, weight: torch.Tensor) -> None:
        w = weight.detach().to(torch.bfloat16).contiguous()                          # [out, in]
        reorder = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
        self.packed = reorder(w, 16) if reorder is not None else None             # packed for 16-row batches
        self.weight = w if self.packed is None else None

    def packed_mm(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out] bfloat16."""
        if self.packed is None:
            return F.linear(x.to(torch.bfloat16), self.weight)
        return torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), self.packed, None, "none", [], "")


class Bf16ProductsWeight:
    """An int8 / int4 weight's float32 copy ([out, in]) whose GEMM rounds both operands to bfloat16 and
    accumulates and returns float32 (oneDNN's ``fp32_precision="bf16"`` matmul mode, set for the call only,
    under ``BF16_MATMUL_MODE_LOCK``: AMX tiles). The outputs are within ~3e-3 (relative) of float32's; the
    packed kernels round activations the same way and their outputs too."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.detach().float().contiguous()                          # [out, in]

    def packed_mm(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out] float32."""
        matmul = torch.backends.mkldnn.matmul
        with BF16_MATMUL_MODE_LOCK:
            previous = matmul.fp32_precision
            matmul.fp32_precision = "bf16"
            try:
                return F.linear(x.float(), self.weight)
            finally:
                matmul.fp32_precision = previous


QuantizedWeight = Int8Weight | Int4Weight | Fp16Weight

_FLOAT_GGUF_TYPES = ("F32", "F16", "BF16", "F64")
_LOW_BIT_GGUF_PREFIXES = ("Q4", "IQ4", "Q3", "IQ3", "Q2", "IQ2", "IQ1", "TQ")


def kind_for_gguf_type(gguf_type: str) -> Optional[str]:
    """The weight-only kind that keeps a GGUF tensor type's precision on CPU: float types None, 4-bit
    and smaller "int4" (groups of 32, the Q4 block), 5- to 8-bit types "int8"."""
    if gguf_type in _FLOAT_GGUF_TYPES:
        return None
    return "int4" if gguf_type.startswith(_LOW_BIT_GGUF_PREFIXES) else "int8"


def most_precise(kinds: list[Optional[str]]) -> Optional[str]:
    """The kind that loses least of the weights of every tensor of ``kinds`` (None = float)."""
    for kind in (None, "fp16", "int8"):
        if kind in kinds:
            return kind
    return "int4"


def quantize_weight(weight: torch.Tensor, kind: str) -> QuantizedWeight:
    if kind == "int8":
        return Int8Weight(weight)
    if kind == "int4":
        return Int4Weight(weight)
    if kind == "fp16":
        return Fp16Weight(weight)
    raise ValueError(f"quantization={kind!r}: use one of {QUANTIZATIONS}.")


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [T, in] -> [T, out] = x @ W.T + bias, in x's dtype (see the module docstring)."""
    if x.device.type == "cpu":
        kernel = _cpu_kernel(weight, x.shape[0])
        if kernel is not None:
            y = kernel.packed_mm(x).to(x.dtype)
            return y if bias is None else y + bias
    return F.linear(x, weight.dequantize(x.dtype), bias)


def _cpu_kernel(weight: QuantizedWeight, rows: int):
    """What runs ``rows`` rows of ``weight`` on CPU (module docstring); None: the dequantized weight."""
    limit = weight.packed_max_tokens
    if limit is None or rows <= limit:
        return weight
    if weight.bf16_products_copy is not None:
        if rows >= BF16_PRODUCTS_MIN_TOKENS:
            return weight.bf16_products_copy
        return weight.amx_tiles if weight.amx_tiles is not None else weight.bf16_copy
    return weight.fp16_copy if rows <= FP16_COPY_MAX_TOKENS else None


class QuantizedEmbedding(torch.nn.Module):
    """A token embedding kept quantized (a tied embedding that is also the LM head): ``forward(ids)``
    dequantizes the looked-up rows (fp16: from a float16 copy of the table, as fbgemm's packed layout has
    no row access); ``logits(hidden)`` is the head's ``quantized_linear``."""

    def __init__(self, weight: torch.Tensor, kind: str) -> None:
        super().__init__()
        self.weight_q = quantize_weight(weight, kind)
        self.dtype = weight.dtype
        self.table_fp16 = weight.detach().to(torch.float16) if kind == "fp16" else None   # [vocab, hidden]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> [T, hidden] in ``dtype``."""
        if self.table_fp16 is not None:
            return self.table_fp16[ids].to(self.dtype)
        return self.weight_q.dequantize(self.dtype, rows=ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, hidden] -> [R, vocab], float32 on CPU at every row count (the packed kernels return
        bfloat16, whose 1/16 steps at logits of 8-16 tie greedy choices and coarsen logprobs): from
        ``FP16_COPY_MIN_TOKENS`` rows the AMX tiles when the weight keeps them (bfloat16 activations, as the
        projections' at those rows; RESULTS.md "What sets the CPU defaults"), else the fp16 copy when it
        keeps one."""
        if hidden.device.type == "cpu":
            tiles = getattr(self.weight_q, "amx_tiles", None)
            if tiles is not None and hidden.shape[0] >= FP16_COPY_MIN_TOKENS:
                return tiles.packed_mm(hidden).to(hidden.dtype)
            copy = getattr(self.weight_q, "fp16_copy", None)
            if copy is not None and hidden.shape[0] <= FP16_COPY_MAX_TOKENS:
                return copy.packed_mm(hidden).to(hidden.dtype)
        return quantized_linear(hidden, self.weight_q)


def packed_weights(model: torch.nn.Module) -> list[_PackedWeight]:
    """The int8 / int4 weights of ``model``'s projections and quantized head."""
    return [m.weight_q for m in model.modules() if isinstance(getattr(m, "weight_q", None), _PackedWeight)]


def float_copies_fit(nbytes: int, physical_bytes: int) -> bool:
    """Whether ``nbytes`` of float copies fit the auto rule: at most ``FLOAT_COPY_MAX_MEMORY_FRACTION`` of the
    machine's memory."""
    return nbytes <= FLOAT_COPY_MAX_MEMORY_FRACTION * physical_bytes
