"""Model runner: owns every tensor (weights, KV cache, adapter slots, step buffers) and executes steps.

``execute_async(SchedulerOutput) -> PendingOutput``: apply the step's diff to the per-request
state, build flat inputs once into the persistent step buffers (non-blocking copies), run the
decoder (a CUDA graph for decode-only steps on CUDA, eagerly otherwise) and compute logits only
where a token is sampled, sample, and start one non-blocking device->host copy of the sampled
ids. Nothing waits for the device: ``PendingOutput.get()`` is the step's one host sync, so the
engine can schedule and launch step N+1 before reading step N's tokens (async scheduling; step
N's ids reach step N+1's inputs on the device). ``execute(so)`` is the synchronous form.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from typing import Optional

import numpy as np
import torch
import torch.nn as nn

from engine import envs
from engine.attention import AttentionMetadata, select_backend
from engine.forward_context import forward_context
from engine.kernel_policy import KernelPolicy
from engine.layers.quantized import BF16_MATMUL_MODE_LOCK, packed_weights
from engine.cuda_graphs import GraphKey
from engine.config import EngineConfig
from engine.dtypes import TORCH_DTYPES
from engine.input_batch import NO_ROW, BlockTableRows, CachedRequestState, StepBuffers, StepInputs
from engine.outputs import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from engine.request import MultiModalFeature
from engine.sampler import Sampler, compute_prompt_logprobs
from engine.sampling_metadata import SamplingMetadata, build_sampling_metadata
from engine.sampling_params import SamplingParams
from kernels.cpu_layer_ops import CpuLayerOps
from lora import NO_LORA

logger = logging.getLogger("chorus.runner")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA GPU is visible; use device='cpu' or 'auto'.")
    return torch.device(name)


def resolve_dtype(name: str, checkpoint_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    if name != "auto":
        return TORCH_DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # bf16 prefill is several times slower on CPUs without AMX
    return checkpoint_dtype if checkpoint_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


def _sampling_is_simple(p: SamplingParams) -> bool:
    """Sampling that needs no token history on the host (no penalties, no min_tokens)."""
    return (p.presence_penalty == 0.0 and p.frequency_penalty == 0.0 and p.repetition_penalty == 1.0
            and p.min_tokens == 0)


class PendingOutput:
    """One step's result, possibly still on the device; ``get()`` waits for it (the step's sync).

    Resolving appends the sampled ids to the runner's request states, in step order (the runner
    resolves every earlier step first).
    """

    def __init__(self, runner: "ModelRunner", req_ids: list[str], sampled_states: list[CachedRequestState],
                 host_ids: Optional[torch.Tensor | list[int]], ready: Optional[torch.cuda.Event],
                 logprobs: Optional[dict[str, LogprobsLists]] = None,
                 prompt_logprobs: Optional[dict[str, LogprobsLists]] = None) -> None:
        self._runner = runner
        self._req_ids = req_ids
        self._sampled_states = sampled_states
        self._host_ids = host_ids
        """[num_sampled] int64 pinned host tensor filled by a non-blocking copy, or a host list."""
        self._ready = ready
        """Recorded after the copy (None: already on the host)."""
        self._logprobs = logprobs or {}
        self._prompt_logprobs = prompt_logprobs or {}
        self._output: Optional[ModelRunnerOutput] = None

    @classmethod
    def done(cls, runner: "ModelRunner", output: ModelRunnerOutput) -> "PendingOutput":
        p = cls(runner, output.req_ids, [], None, None)
        p._output = output
        return p

    @property
    def resolved(self) -> bool:
        return self._output is not None

    def get(self) -> ModelRunnerOutput:
        if self._output is None:
            self._runner.resolve_through(self)
        assert self._output is not None
        return self._output

    def _resolve(self) -> None:
        if self._ready is not None:
            self._ready.synchronize()
        ids = self._host_ids.tolist() if isinstance(self._host_ids, torch.Tensor) else (self._host_ids or [])
        sampled = {}
        for state, token_id in zip(self._sampled_states, ids):
            state.token_ids.append(token_id)
            sampled[state.req_id] = [token_id]
        self._output = ModelRunnerOutput(
            req_ids=self._req_ids, sampled_token_ids=[sampled.get(r, []) for r in self._req_ids],
            logprobs=self._logprobs, prompt_logprobs=self._prompt_logprobs)


class StepTimer:
    """CUDA events around each step's device work, for the GPU-busy fraction of wall time.

    Step i's interval runs from the event recorded before its input copies to the one after its
    sampled-id copy; intervals never overlap (one stream). busy = sum(intervals) / span, where
    span runs from the first start to the last end. NOTE: launch gaps inside an eager step count
    as busy; CUDA-graph steps have none. Each step also carries its kind ("decode graph",
    "mixed graph", "eager") and token counts, so ``summary`` can say where the device time went.
    """

    def __init__(self) -> None:
        self.intervals: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.kinds: list[tuple[str, int, int]] = []   # (kind, num_tokens, num_tokens run incl. padding)
        self._start: Optional[torch.cuda.Event] = None

    def begin(self, kind: str = "step", num_tokens: int = 0, num_tokens_run: int = 0) -> None:
        self._start = torch.cuda.Event(enable_timing=True)
        self._start.record()
        self.kinds.append((kind, num_tokens, num_tokens_run or num_tokens))

    def end(self) -> None:
        stop = torch.cuda.Event(enable_timing=True)
        stop.record()
        self.intervals.append((self._start, stop))

    def summary(self) -> dict:
        torch.cuda.synchronize()
        if not self.intervals:
            return dict(steps=0, gpu_busy_ms=0.0, span_ms=0.0, busy_fraction=0.0, by_kind={})
        times = [a.elapsed_time(b) for a, b in self.intervals]
        busy = sum(times)
        span = self.intervals[0][0].elapsed_time(self.intervals[-1][1])
        by_kind: dict[str, dict] = {}
        for (kind, n, n_run), ms in zip(self.kinds, times):
            k = by_kind.setdefault(kind, dict(steps=0, gpu_ms=0.0, tokens=0, tokens_run=0))
            k["steps"] += 1
            k["gpu_ms"] += ms
            k["tokens"] += n
            k["tokens_run"] += n_run
        return dict(steps=len(self.intervals), gpu_busy_ms=busy, span_ms=span,
                    busy_fraction=busy / span if span > 0 else 0.0, by_kind=by_kind)


def rotary_qkv_consumer(attn_module: nn.Module):
    """f(pending, qkv) for ``LoRAManager.warm_up_kernels``: the attention module's rotary + KV write
    on a [T, q + 2 kv] q/k/v projection output with its pending LoRA update added first, as a decode
    step runs it (``engine.models.llama.LlamaAttention``: split, heads, ``rotary_emb.apply_and_write_kv``),
    at position 0 with every cache write skipped (slot -1)."""
    paged = attn_module.attn

    def consume(pending, qkv: torch.Tensor) -> None:
        q, k, v = qkv.split([attn_module.q_size, attn_module.kv_size, attn_module.kv_size], dim=-1)
        num_tokens = qkv.shape[0]
        positions = torch.zeros(num_tokens, dtype=torch.int64, device=qkv.device)           # [T]
        slot_mapping = torch.full((num_tokens,), -1, dtype=torch.int64, device=qkv.device)  # [T]: no write
        attn_module.rotary_emb.apply_and_write_kv(
            positions, q.reshape(-1, paged.num_heads, paged.head_dim),
            k.reshape(-1, paged.num_kv_heads, paged.head_dim), v.reshape(-1, paged.num_kv_heads, paged.head_dim),
            paged.k_cache, paged.v_cache, slot_mapping, pending)
    return consume


class ModelRunner:
    def __init__(self, config: EngineConfig, model: torch.nn.Module, hf_config, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.config = config
        self.model = model
        self.hf_config = hf_config
        self.device = device
        self.dtype = dtype
        self.block_size = config.cache_config.block_size
        text_config = hf_config.get_text_config()
        self.vocab_size = text_config.vocab_size
        self.max_model_len = config.model_config.max_model_len or getattr(
            text_config, "max_position_embeddings", 2048)
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}
        self.lora_manager = None  # set by the engine when LoRA is enabled
        self.policy = KernelPolicy.for_device(device)
        """The engine's fast-path choices (``engine.kernel_policy``), built once; layers read it through
        the forward context, the attention backend and the LoRA layers get it at construction."""
        self.cpu_kernel_dir = envs.cpu_kernel_dir()
        """Where the CPU C kernels are built once per host (``kernels.cpu_native``)."""
        self.cpu_ops = (CpuLayerOps.load(self.cpu_kernel_dir)
                        if device.type == "cpu" and self.policy.cpu_layer_ops else None)
        """On CPU, the C layer ops the layers take through the forward context (None: torch's)."""
        self.bf16_weights = any(w.bf16_products_copy is not None for w in packed_weights(model))
        """The model's quantized weights keep bf16-product copies (CPUs with AMX, ``engine.layers.quantized``):
        long prefill chunks attend in bfloat16 too, and steps run without ``BF16_MATMUL_MODE_LOCK``."""
        self.kv_cache_dtype = self._kv_cache_dtype(config.cache_config.cache_dtype)
        """The KV cache's element type (``CacheConfig.cache_dtype`` resolved)."""
        self.num_blocks = 0
        self.logprobs_mode = config.model_config.logprobs_mode
        self.use_cuda_graphs = device.type == "cuda" and not config.enforce_eager
        """Capture decode graphs when the KV cache is allocated (off: ``enforce_eager``)."""
        self.buffers: Optional[StepBuffers] = None
        self.block_table: Optional[BlockTableRows] = None
        self.graphs = None
        self.step_timer: Optional[StepTimer] = None
        """Set to a ``StepTimer`` (CUDA) to record each step's device interval."""
        self._unresolved: list[PendingOutput] = []
        self._prev_sampled: Optional[tuple[torch.Tensor, dict[str, int]]] = None
        """The last sampling step's ids on the device, and each request's row in them."""
        self._sampling_cache: Optional[tuple[tuple[str, ...], SamplingMetadata]] = None
        self.is_multimodal = hasattr(model, "embed_multimodal")
        self.is_encoder_decoder = bool(getattr(model, "is_encoder_decoder", False))
        """Whisper: the decoder cross-attends to K/V the runner writes before each request's first token."""
        if self.is_encoder_decoder and self.use_cuda_graphs:
            logger.info("Encoder-decoder model: CUDA graphs are off (the steps run eagerly).")
            self.use_cuda_graphs = False
        self.logits_rules = getattr(model, "logits_rules", None)
        """The model's per-row logits rules (Whisper's token suppression and timestamp rules), applied
        before sampling with each row's prompt and outputs; None for most models."""
        self.uses_mrope = bool(getattr(model, "uses_mrope", False))
        self.encoder_cache: dict[str, torch.Tensor] = {}
        """Media item content hash -> its encoder output [num_embeds, hidden] (the scheduler's
        ``EncoderCacheManager`` decides what stays; evictions arrive in ``free_encoder_identifiers``)."""
        self.encoder_cache_size = 0
        """Embeddings the scheduler's encoder cache may keep (set by the engine; sizes the memory reserve)."""
        self.encoder_compute_budget = 0
        """Embeddings the scheduler lets one step encode (set by the engine): with LoRA on an encoder-decoder
        model, the rows one encoder or cross-attention K/V call runs at most (``lora_rows_per_call``)."""
        self.lora_rows_per_call = 0
        """Rows one adapted model call may run (the LoRA step buffers' size, ``_init_step_buffers``)."""
        self.num_encoded_items = 0
        """Media items the encoder has run on since start (an item served from the cache is not counted)."""

    # ------------------------------------------------------------------ KV cache
    def _kv_cache_dtype(self, name: str) -> torch.dtype:
        """``CacheConfig.cache_dtype`` as a dtype: auto is the model's, or bfloat16 on a CPU whose quantized
        weights multiply in bfloat16 (their activations are rounded to bfloat16 already; the decode step reads
        half the KV bytes: RESULTS.md "What sets the CPU defaults")."""
        if name == "auto":
            return torch.bfloat16 if self.device.type == "cpu" and self.bf16_weights else self.dtype
        dtype = TORCH_DTYPES[name]
        if self.device.type == "cuda" and dtype != self.dtype:
            raise ValueError(f"kv_cache_dtype={name}: on CUDA the KV cache takes the model's dtype "
                             f"({self.dtype}); use auto.")
        return dtype

    def kv_bytes_per_block(self) -> int:
        layers = self.model.attention_layers()
        elem_bytes = torch.finfo(self.kv_cache_dtype).bits // 8
        per_token = sum(2 * a.num_kv_heads * a.head_dim for a in layers) * elem_bytes
        return per_token * self.block_size

    def determine_num_blocks(self, max_needed_blocks: int) -> int:
        cc = self.config.cache_config
        if cc.num_gpu_blocks_override is not None:
            return cc.num_gpu_blocks_override
        per_block = self.kv_bytes_per_block()
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            activation_reserve = self._activation_reserve_bytes()
            budget = total * cc.gpu_memory_utilization - (total - free) - activation_reserve
            budget = max(budget, 0)
        else:
            budget = cc.kv_cache_space * (1 << 30)
        num = int(budget // per_block)
        num = min(num, max_needed_blocks)
        if num < 2:
            raise ValueError(
                f"The KV cache budget fits only {num} blocks of {self.block_size} tokens "
                f"({per_block} bytes each); raise kv_cache_space (CPU) or gpu_memory_utilization (CUDA).")
        return num

    def _activation_reserve_bytes(self) -> int:
        sc = self.config.scheduler_config
        h = self.hf_config.get_text_config()
        elem = torch.finfo(self.dtype).bits // 8
        intermediate = getattr(h, "intermediate_size", None) or getattr(h, "decoder_ffn_dim", 4 * h.hidden_size)
        per_token = (4 * h.hidden_size + 3 * intermediate) * elem
        logits = sc.max_num_seqs * h.vocab_size * 4 * 3
        tokens = sc.max_num_batched_tokens
        if self.use_cuda_graphs:
            # The graph pool keeps the largest graph's activations while eager steps need their own.
            tokens += min(sc.max_num_batched_tokens, self.config.max_cudagraph_capture_size)
        encoder_cache = self.encoder_cache_size * h.hidden_size * elem   # one hidden-size row per embedding
        return int(tokens * per_token + logits + encoder_cache + (512 << 20))

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """One [num_blocks, block_size, num_kv_heads, head_dim] K and V tensor per layer; then the
        step buffers, and the decode CUDA graphs (CUDA, unless ``enforce_eager``)."""
        self.num_blocks = num_blocks
        # Weights that multiply in bfloat16 (AMX copies) let long prefill chunks attend in bfloat16 too.
        backend = select_backend(self.device, self.policy, self.bf16_weights,
                                 cpu_kernel_dir=self.cpu_kernel_dir)
        for attn in self.model.attention_layers():
            shape = (num_blocks, self.block_size, attn.num_kv_heads, attn.head_dim)
            # Zeroed: padded block-table entries point at block 0 and are masked, but must not be NaN.
            attn.k_cache = zeros(shape, self.kv_cache_dtype, self.device)
            attn.v_cache = zeros(shape, self.kv_cache_dtype, self.device)
            attn.backend = backend
        logger.info("KV cache: %d blocks x %d tokens (%.2f GiB)", num_blocks, self.block_size,
                    num_blocks * self.kv_bytes_per_block() / (1 << 30))
        if self.device.type == "cuda":
            attn = self.model.attention_layers()[0]
            t0 = time.perf_counter()
            calls = backend.warm_up(attn.k_cache, attn.v_cache, attn.num_heads, attn.scale,
                                    getattr(self.model, "rotary_dim", None))
            logger.info("Attention kernels for eager steps compiled (%d calls) in %.1f s", calls,
                        time.perf_counter() - t0)
        self._init_step_buffers()
        self.warm_up_lora_kernels()
        if self.use_cuda_graphs:
            self.tune_lora_stacked_gemms()
            self.capture_cuda_graphs()

    def _init_step_buffers(self) -> None:
        from engine.cuda_graphs import graph_batch_sizes, graph_token_sizes
        sc = self.config.scheduler_config
        max_blocks_per_req = math.ceil(self.max_model_len / self.block_size)
        self._graph_sizes = graph_batch_sizes(sc.max_num_seqs, sc.max_num_batched_tokens)
        self._graph_token_sizes = graph_token_sizes(sc.max_num_batched_tokens,
                                                    self.config.max_cudagraph_capture_size)
        max_tokens = max(sc.max_num_batched_tokens, max(self._graph_sizes))
        self.buffers = StepBuffers(max_tokens, sc.max_num_seqs, max_blocks_per_req, self.device)
        self.buffers.uses_mrope = self.uses_mrope
        if self.is_multimodal and self.use_cuda_graphs and self._graph_token_sizes:
            self.buffers.enable_media(max(self._graph_token_sizes), self.hf_config.get_text_config().hidden_size,
                                      self.dtype, self.uses_mrope)
        self.block_table = BlockTableRows(sc.max_num_seqs, max_blocks_per_req)
        if self.is_encoder_decoder:   # cross blocks of each persistent row (one encoder input per request)
            max_cross_blocks = math.ceil(self.model.num_source_positions / self.block_size)
            self._cross_block_rows = np.zeros((sc.max_num_seqs, max_cross_blocks), dtype=np.int32)
        if self.lora_manager is not None:
            # Encoder-decoder models also run adapters on encoder rows outside the step's tokens.
            self.lora_rows_per_call = max(max_tokens, self.encoder_compute_budget if self.is_encoder_decoder else 0)
            self.lora_manager.allocate_step_buffers(self.lora_rows_per_call)

    def warm_up_lora_kernels(self) -> None:
        """Compile the LoRA kernels of eager steps (those no CUDA graph covers) at start-up (CUDA)."""
        if self.lora_manager is None or self.device.type != "cuda":
            return
        sc = self.config.scheduler_config
        first_eager = max(self._graph_token_sizes, default=0) + 1 if self.use_cuda_graphs else 1
        t0 = time.perf_counter()
        calls = self.lora_manager.warm_up_kernels(first_eager, sc.max_num_batched_tokens,
                                                  qkv_consumer=self._lora_qkv_consumer())
        logger.info("LoRA kernels for eager steps of %d-%d tokens compiled (%d calls) in %.1f s", first_eager,
                    sc.max_num_batched_tokens, calls, time.perf_counter() - t0)

    def _lora_qkv_consumer(self):
        """``rotary_qkv_consumer`` of the model's first attention layer, where its rotary + KV write
        is fused (CUDA, Triton attention backend, KV cache allocated); else None."""
        attn = next((m for m in self.model.modules()
                     if all(hasattr(m, a) for a in ("rotary_emb", "attn", "q_size", "kv_size"))), None)
        if attn is None or attn.attn.k_cache is None or not attn.attn.fuses_rotary_write(attn.attn.k_cache):
            return None
        return rotary_qkv_consumer(attn)

    def tune_lora_stacked_gemms(self) -> None:
        """How many slots the few-adapters decode graphs' stacked GEMMs cover, timed before capture."""
        if self.lora_manager is None or self.device.type != "cuda" or not self.policy.lora_stacked_tune:
            return
        bound = self.lora_manager.few_adapters_bound(max(self._graph_sizes))
        if bound is None:
            return
        t0 = time.perf_counter()
        chosen = self.lora_manager.tune_stacked_cover(self._graph_sizes, bound)
        wider = {k: v for k, v in chosen.items() if v != bound}
        logger.info("LoRA stacked GEMMs of steps over %d slots: %d of %d (shape, batch) cases cover more "
                    "slots (%s) (%.1f s)", bound, len(wider), len(chosen),
                    ", ".join(f"{k[0][0]}->{'+'.join(map(str, k[0][1]))} at {k[1]} tokens: {v}"
                              for k, v in sorted(wider.items())[:8]) or "none",
                    time.perf_counter() - t0)

    def capture_cuda_graphs(self) -> None:
        from engine.cuda_graphs import StepGraphs
        self.graphs = StepGraphs(self.model, self.buffers, self.max_model_len, self._graph_sizes,
                                 self._graph_token_sizes, self.config.scheduler_config.max_num_seqs,
                                 lora_manager=self.lora_manager, policy=self.policy)
        self.graphs.capture()

    # ------------------------------------------------------------------ state updates
    def _apply_diff(self, so: SchedulerOutput) -> None:
        table = self.block_table
        for rid in so.finished_req_ids:
            s = self.requests.pop(rid, None)
            if s is not None:
                table.remove(s.row)
                s.row = NO_ROW
        for rid in so.preempted_req_ids:
            s = self.requests.get(rid)
            if s is not None:
                s.active = False
                table.remove(s.row)
                s.row = NO_ROW
        for new in so.scheduled_new_reqs:
            old = self.requests.get(new.req_id)
            if old is not None:
                table.remove(old.row)
                old.row = NO_ROW
            generator = old.generator if old is not None else self._make_generator(new.sampling_params.seed)
            state = CachedRequestState(
                req_id=new.req_id, token_ids=list(new.all_token_ids), num_prompt_tokens=new.num_prompt_tokens,
                sampling_params=new.sampling_params,
                eos_token_ids=set(new.eos_token_ids),
                block_ids=list(new.block_ids), num_computed_tokens=new.num_computed_tokens,
                generator=generator, lora_slot=new.lora_slot, row=table.add(new.block_ids),
                mm_features=new.mm_features, cross_block_ids=list(new.cross_block_ids),
                num_cross_tokens=sum(f.num_cross_embeds for f in new.mm_features))
            if state.cross_block_ids:
                self._cross_block_rows[state.row, :len(state.cross_block_ids)] = state.cross_block_ids
            if self.logits_rules is not None:
                state.rules_need_history = self.logits_rules.needs_history(state.token_ids[:state.num_prompt_tokens])
            if self.uses_mrope and new.mm_features:
                if old is not None and old.mrope_positions is not None:
                    state.mrope_positions, state.mrope_delta = old.mrope_positions, old.mrope_delta
                else:
                    state.mrope_positions, state.mrope_delta = self.model.mrope_positions(
                        new.num_prompt_tokens, new.mm_features)
            self.requests[new.req_id] = state
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            s = self.requests[rid]
            s.block_ids.extend(cached.new_block_ids[i])
            table.append(s.row, cached.new_block_ids[i])
            s.num_computed_tokens = cached.num_computed_tokens[i]
            if cached.lora_slots:
                s.lora_slot = cached.lora_slots[i]
            s.active = True

    def _make_generator(self, seed: Optional[int]) -> Optional[torch.Generator]:
        if seed is None:
            return None
        g = torch.Generator(device=self.device)
        g.manual_seed(seed)
        return g

    # ------------------------------------------------------------------ resolving outputs
    def resolve_through(self, pending: PendingOutput) -> None:
        """Resolve every unresolved step up to and including ``pending``, oldest first."""
        while self._unresolved:
            p = self._unresolved.pop(0)
            p._resolve()
            if p is pending:
                return

    def _resolve_all(self, keep_last: bool = False) -> None:
        while len(self._unresolved) > (1 if keep_last else 0):
            self._unresolved.pop(0)._resolve()

    # ------------------------------------------------------------------ step
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its sampled ids."""
        return self.execute_async(so).get()

    def execute_async(self, so: SchedulerOutput) -> PendingOutput:
        """Launch one step; the returned handle's ``get()`` waits for its sampled ids. On CPU, a model without
        bf16-product weights runs its step under ``BF16_MATMUL_MODE_LOCK``: its float32 matmuls never see
        another engine's bf16 mode (``engine.layers.quantized``)."""
        if self.device.type != "cpu" or self.bf16_weights:
            return self._execute_async(so)
        with BF16_MATMUL_MODE_LOCK:
            return self._execute_async(so)

    @torch.inference_mode()
    def _execute_async(self, so: SchedulerOutput) -> PendingOutput:
        if self.buffers is None:
            raise RuntimeError("allocate_kv_cache() must run before the first step.")
        self._resolve_all(keep_last=True)   # at most one step in flight besides this one
        self._apply_diff(so)
        if self.lora_manager is not None and so.lora_loads:
            self.lora_manager.load_slots(so.lora_loads)
        for identifier in so.free_encoder_identifiers:
            self.encoder_cache.pop(identifier, None)
        if so.scheduled_encoder_inputs:
            self._run_encoders(so.scheduled_encoder_inputs)
        if so.total_num_scheduled_tokens == 0:
            return PendingOutput.done(self, ModelRunnerOutput(req_ids=[], sampled_token_ids=[]))
        order = sorted(so.num_scheduled_tokens, key=lambda r: so.num_scheduled_tokens[r] != 1)
        states = [self.requests[r] for r in order]
        counts = [so.num_scheduled_tokens[r] for r in order]
        if (not all(_sampling_is_simple(s.sampling_params) for s in states)
                or any(s.rules_need_history for s in states)):
            self._resolve_all()   # penalties / min_tokens / history-reading logits rules need every token on the host
        num_generated = None   # the logits rules' view: output tokens before this step's sample
        if self.logits_rules is not None:
            num_generated = {s.req_id: s.num_computed_tokens + n - s.num_prompt_tokens for s, n in zip(states, counts)}
        mm_rows = self._gather_mm_embeds(states, counts) if self.is_multimodal else None
        graph_key = self._graph_key(states, counts, has_media=mm_rows is not None)
        if self.step_timer is not None:
            kind = "eager" if graph_key is None else ("mixed graph" if graph_key.mixed else "decode graph")
            run = graph_key.num_tokens if graph_key is not None else sum(counts)
            self.step_timer.begin(kind, sum(counts), run)
        prev_ids, prev_rows = self._prev_sampled if self._prev_sampled is not None else (None, None)
        if graph_key is None:
            reqs_padded = tokens_padded = None
        elif graph_key.mixed:
            reqs_padded, tokens_padded = self.graphs.max_num_reqs, graph_key.num_tokens
        else:
            reqs_padded, tokens_padded = graph_key.size, None
        inputs = self.buffers.prepare(states, counts, self.block_table, self.block_size,
                                      with_lora=self.lora_manager is not None,
                                      num_reqs_padded=reqs_padded, num_tokens_padded=tokens_padded,
                                      prev_sampled_rows=prev_rows, prev_sampled=prev_ids)
        if self.is_encoder_decoder:
            self._write_cross_kv(states)
            inputs.cross_attn_metadata = self._cross_attn_metadata(states, counts)
        if graph_key is not None and graph_key.mixed and self.buffers.mm_mask is not None:
            self.buffers.write_media(graph_key.num_tokens, mm_rows, inputs.mrope_positions)
        if self.lora_manager is not None:
            # LoRA graphs: the fixed-grid launches captured for every adapter mix read the refilled buffers.
            few = graph_key.few_adapters if graph_key is not None else 0
            self.lora_manager.set_batch(inputs.token_lora_slots,
                                        fixed_grid=graph_key is not None and graph_key.lora,
                                        max_active=few or None)
        logits, prompt_logprobs = self._forward(inputs, graph_key, mm_rows)
        pending = self._sample(inputs, logits, prompt_logprobs, num_generated)
        for s, n in zip(states, counts):
            s.num_computed_tokens += n
        if self.step_timer is not None:
            self.step_timer.end()
        self._unresolved.append(pending)
        return pending

    def _graph_key(self, states: list[CachedRequestState], counts: list[int],
                   has_media: bool = False) -> Optional[GraphKey]:
        """The CUDA graph that runs this step, or None to run eagerly. A step with media placeholder
        tokens takes a mixed graph (those read the encoder rows), if the model's graphs read media."""
        if self.graphs is None:
            return None
        if has_media and self.buffers.mm_mask is None:
            return None
        decode_only = max(counts) == 1 and not has_media
        if decode_only and any(s.sampling_params.prompt_logprobs is not None
                               and s.num_computed_tokens < s.num_prompt_tokens for s in states):
            return None   # decode graphs end in logits of the sampled rows only
        num_adapters, slot_bound = 0, 0
        if self.lora_manager is not None:
            used = {s.lora_slot for s in states if s.lora_slot >= 0}
            num_adapters, slot_bound = len(used), max(used, default=-1) + 1     # distinct adapters, slots
        return self.graphs.key_for(len(states), sum(counts), decode_only, num_adapters, slot_bound)

    def _forward(self, inputs: StepInputs, graph_key: Optional[GraphKey],
                 mm_rows: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                 ) -> tuple[Optional[torch.Tensor], dict[str, LogprobsLists]]:
        """Logits [num_sampled, vocab] (model dtype) of the sampling rows (None if none), prompt logprobs.

        ``mm_rows``: (token indices [M], embeddings [M, hidden]) of the step's media placeholder tokens,
        written over the token embeddings (eager steps; graph steps read them from the step buffers)."""
        if graph_key is not None and not graph_key.mixed:
            all_logits = self.graphs.replay(graph_key)                   # [batch_size, vocab]
            if inputs.all_rows_sample:
                return all_logits[:len(inputs.req_ids)], {}
            return all_logits[inputs.logits_indices], {}
        if graph_key is not None:
            hidden = self.graphs.replay(graph_key)                       # [T_padded, hidden]
        else:
            inputs_embeds = None
            if mm_rows is not None:
                inputs_embeds = self.model.embed_input_ids(inputs.input_ids)       # [T, hidden]
                inputs_embeds[mm_rows[0]] = mm_rows[1].to(inputs_embeds.dtype)
            positions = inputs.positions
            if inputs.mrope_positions is not None:
                positions = torch.from_numpy(inputs.mrope_positions).to(self.device, non_blocking=True)  # [3, T]
            with forward_context(inputs.attn_metadata, self.policy, inputs.cross_attn_metadata, self.cpu_ops):
                hidden = self.model(inputs.input_ids, positions, inputs_embeds)    # [T, hidden]
        prompt_logprobs = self._prompt_logprobs(inputs, hidden)
        if not inputs.sample_req_ids:
            return None, prompt_logprobs
        return self.model.compute_logits(hidden[inputs.logits_indices]), prompt_logprobs  # [R, vocab]

    # ------------------------------------------------------------------ media
    def _run_encoders(self, scheduled: dict[str, list[int]]) -> None:
        """Encode the step's scheduled media items (one batched call per modality) into the cache; an item
        keyed under an adapter (``MultiModalFeature.encoder_lora_name``) runs with its request's slot."""
        by_modality: dict[str, dict[str, tuple[MultiModalFeature, int]]] = {}
        for req_id, input_ids in scheduled.items():
            state = self.requests[req_id]
            for i in input_ids:
                f = state.mm_features[i]
                # NOTE: one identifier, one adapter: every request naming it runs the same slot.
                lora_slot = state.lora_slot if f.encoder_lora_name is not None else NO_LORA
                by_modality.setdefault(f.modality, {})[f.identifier] = (f, lora_slot)
        for modality, items in by_modality.items():
            features = [f for f, _ in items.values()]
            row_slots = None
            if self.lora_manager is not None and self.lora_manager.targets.adapts_encoder:
                row_slots = np.repeat(np.fromiter((s for _, s in items.values()), np.int32, len(items)),
                                      [f.num_embeds for f in features])                  # [num_rows]
            with self._lora_rows(row_slots), forward_context(None, self.policy, cpu_ops=self.cpu_ops):
                outputs = self.model.embed_multimodal(modality, [f.data for f in features])
            for f, out in zip(features, outputs):
                if out.shape[0] != f.num_embeds:
                    raise RuntimeError(f"the encoder gave {out.shape[0]} embeddings for a {modality} of "
                                       f"{f.num_embeds}")
                self.encoder_cache[f.identifier] = out
            self.num_encoded_items += len(features)

    def _lora_rows(self, row_lora_slots: Optional[np.ndarray]) -> contextlib.AbstractContextManager:
        """The LoRA batch of a model call on rows outside the step's tokens (``LoRAManager.rows_batch``);
        nothing without LoRA or without row slots (the call's Linears have no adapters to run)."""
        if self.lora_manager is None or row_lora_slots is None:
            return contextlib.nullcontext()
        return self.lora_manager.rows_batch(row_lora_slots)

    def _gather_mm_embeds(self, states: list[CachedRequestState], counts: list[int]
                          ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """(token indices [M] in the step, embeddings [M, hidden]) of the step's placeholder tokens,
        from the encoder cache; None when the step has none."""
        token_idx: list[torch.Tensor] = []
        rows: list[torch.Tensor] = []
        step_start = 0
        for s, n in zip(states, counts):
            c = s.num_computed_tokens
            if c >= s.num_prompt_tokens:   # placeholders lie in the prompt
                step_start += n
                continue
            for f in s.mm_features:
                if f.placeholder is None:
                    continue   # a cross-attention input (``_write_cross_kv``)
                lo = max(f.placeholder.offset, c)
                hi = min(f.placeholder.offset + f.placeholder.length, c + n)
                if lo < hi:
                    embeds = self.encoder_cache.get(f.identifier)
                    if embeds is None:
                        raise RuntimeError(f"request {s.req_id}: its {f.modality} {f.identifier[:12]} is not in the "
                                           "encoder cache (the scheduler should have scheduled it)")
                    rows.append(embeds[lo - f.placeholder.offset:hi - f.placeholder.offset])
                    token_idx.append(torch.arange(step_start + lo - c, step_start + hi - c))
            step_start += n
        if not rows:
            return None
        return torch.cat(token_idx).to(self.device, non_blocking=True), torch.cat(rows)

    def _write_cross_kv(self, states: list[CachedRequestState]) -> None:
        """Project the encoder outputs of requests about to compute token 0 into their cross blocks
        (every decoder layer's cross-attention K/V), batched: one call, or with LoRA calls of at most
        ``lora_rows_per_call`` rows, each row under its request's adapter slot."""
        bs = self.block_size
        outputs: list[torch.Tensor] = []
        slots: list[np.ndarray] = []
        lora_slots: list[int] = []
        for s in states:
            if s.num_computed_tokens != 0 or not s.num_cross_tokens:
                continue
            feature = next(f for f in s.mm_features if f.placeholder is None)
            encoded = self.encoder_cache.get(feature.identifier)            # [num_cross_tokens, d_model]
            if encoded is None:
                raise RuntimeError(f"request {s.req_id}: its {feature.modality} {feature.identifier[:12]} is not "
                                   "in the encoder cache at its first step (the scheduler should have scheduled it)")
            position = np.arange(s.num_cross_tokens)
            blocks = np.asarray(s.cross_block_ids, dtype=np.int64)
            slots.append(blocks[position // bs] * bs + position % bs)
            outputs.append(encoded)
            lora_slots.append(s.lora_slot)
        start = 0
        while start < len(outputs):
            stop, rows = start + 1, outputs[start].shape[0]
            while (stop < len(outputs) and
                   (self.lora_manager is None or rows + outputs[stop].shape[0] <= self.lora_rows_per_call)):
                rows += outputs[stop].shape[0]
                stop += 1
            slot_mapping = torch.from_numpy(np.concatenate(slots[start:stop])).to(self.device, non_blocking=True)
            row_slots = None
            if self.lora_manager is not None:
                row_slots = np.repeat(np.asarray(lora_slots[start:stop], dtype=np.int32),
                                      [o.shape[0] for o in outputs[start:stop]])        # [rows]
            with self._lora_rows(row_slots), forward_context(None, self.policy, cpu_ops=self.cpu_ops):
                self.model.write_cross_kv(torch.cat(outputs[start:stop]), slot_mapping)
            start = stop

    def _cross_attn_metadata(self, states: list[CachedRequestState], counts: list[int]) -> AttentionMetadata:
        """The step's requests over their cross blocks: every position visible to every query token."""
        rows = np.fromiter((s.row for s in states), np.int64, len(states))
        tables = self._cross_block_rows[rows]                                    # [R, max_cross_blocks]
        lengths = np.fromiter((s.num_cross_tokens for s in states), np.int32, len(states))   # [R]
        qsl = np.zeros(len(states) + 1, dtype=np.int32)
        np.cumsum(counts, out=qsl[1:])
        dev = self.device
        return AttentionMetadata(
            slot_mapping=torch.empty(0, dtype=torch.int64, device=dev),           # cross-attention writes nothing
            query_start_loc=torch.from_numpy(qsl).to(dev, non_blocking=True),
            seq_lens=torch.from_numpy(lengths).to(dev, non_blocking=True),
            block_tables=torch.from_numpy(tables).to(dev, non_blocking=True),
            max_query_len=max(counts), max_seq_len=int(lengths.max()),
            num_decode_reqs=sum(1 for n in counts if n == 1),
            query_start_loc_cpu=qsl.tolist(), seq_lens_cpu=lengths.tolist())

    def _sample(self, inputs: StepInputs, logits: Optional[torch.Tensor],
                prompt_logprobs: dict[str, LogprobsLists],
                num_generated: Optional[dict[str, int]] = None) -> PendingOutput:
        """``num_generated``: req_id -> output tokens before this step's sample (with logits rules only)."""
        if logits is None:
            return PendingOutput(self, inputs.req_ids, [], None, None, prompt_logprobs=prompt_logprobs)
        states = [self.requests[r] for r in inputs.sample_req_ids]
        if self.logits_rules is not None:
            # Rows whose rules read only the output count get placeholders (their last id may be in flight).
            outputs = [s.output_token_ids if s.rules_need_history else [-1] * num_generated[s.req_id]
                       for s in states]
            logits = self.logits_rules.apply(logits, [s.token_ids[:s.num_prompt_tokens] for s in states], outputs)
        out = self.sampler(logits, self._sampling_metadata(states), to_host=False)
        self._prev_sampled = (out.sampled_token_ids, {s.req_id: i for i, s in enumerate(states)})
        logprobs = {}
        if out.logprobs is not None:
            for i, s in enumerate(states):
                if s.sampling_params.logprobs is not None:
                    n = s.sampling_params.logprobs + 1
                    logprobs[s.req_id] = LogprobsLists(token_ids=[out.logprobs.token_ids[i][:n]],
                                                       logprobs=[out.logprobs.logprobs[i][:n]],
                                                       ranks=[out.logprobs.ranks[i]])
        if out.sampled_token_id_list is not None:
            host_ids, ready = out.sampled_token_id_list, None
        elif self.device.type == "cuda":
            host_ids = torch.empty(len(states), dtype=torch.int64, pin_memory=True)   # [num_sampled]
            host_ids.copy_(out.sampled_token_ids, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        else:
            host_ids, ready = out.sampled_token_ids.tolist(), None
        return PendingOutput(self, inputs.req_ids, states, host_ids, ready, logprobs, prompt_logprobs)

    def _sampling_metadata(self, states: list[CachedRequestState]) -> SamplingMetadata:
        """The step's sampling tensors; reused while the same requests sample with simple params."""
        key = tuple(s.req_id for s in states)
        simple = all(_sampling_is_simple(s.sampling_params) for s in states)
        if simple and self._sampling_cache is not None and self._sampling_cache[0] == key:
            return self._sampling_cache[1]
        if simple:
            prompts = outputs = [[] for _ in states]   # only penalties and min_tokens read them
        else:
            prompts = [s.token_ids[:s.num_prompt_tokens] for s in states]
            outputs = [s.output_token_ids for s in states]
        meta = build_sampling_metadata(
            [s.sampling_params for s in states], [s.generator for s in states], prompts, outputs,
            [s.eos_token_ids for s in states], self.vocab_size, self.device, self.logprobs_mode)
        self._sampling_cache = (key, meta) if simple else None
        return meta

    def _prompt_logprobs(self, inputs: StepInputs, hidden: torch.Tensor) -> dict[str, LogprobsLists]:
        out: dict[str, LogprobsLists] = {}
        for rid, (start, count, first_pos) in inputs.prompt_logprob_ranges.items():
            s = self.requests[rid]
            logits = self.model.compute_logits(hidden[start:start + count])   # [count, vocab]
            targets = torch.tensor(s.token_ids[first_pos:first_pos + count], device=self.device)
            out[rid] = compute_prompt_logprobs(logits, targets, s.sampling_params.prompt_logprobs)
        return out


_NUMPY_OF = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.uint16}
"""Same-width numpy dtypes (bfloat16: its bits as uint16, viewed back)."""


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on CPU from numpy's calloc, whose pages the OS maps as zeros when first touched, so a
    4 GiB KV cache costs nothing until used (``torch.zeros`` writes every byte; RESULTS.md "What sets the CPU
    defaults")."""
    if device.type != "cpu" or dtype not in _NUMPY_OF:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.from_numpy(np.zeros(shape, dtype=_NUMPY_OF[dtype])).view(dtype)


def max_blocks_needed(max_num_seqs: int, max_model_len: int, block_size: int, cross_tokens: int = 0) -> int:
    """Blocks that could ever be in use at once (+1 for the reserved null block); ``cross_tokens``: the
    cross-attention K/V positions each request of an encoder-decoder model holds."""
    per_request = math.ceil(max_model_len / block_size) + math.ceil(cross_tokens / block_size)
    return max_num_seqs * per_request + 1
