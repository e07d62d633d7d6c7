"""``ModelRunner``: owns every tensor (weights, KV cache, adapter slots, step buffers) and executes steps.

``execute_async(SchedulerOutput) -> PendingOutput``: apply the step's diff to the per-request
state, build flat inputs once into the persistent step buffers (non-blocking copies), run the
decoder (a CUDA graph for decode-only steps on CUDA, eagerly otherwise) and compute logits only
where a token is sampled, sample, and start one non-blocking device->host copy of the sampled
ids. Nothing waits for the device: ``PendingOutput.get()`` is the step's one host sync, so the
engine can schedule and launch step N+1 before reading step N's tokens (async scheduling; step
N's ids reach step N+1's inputs on the device). ``execute(so)`` is the synchronous form.

A constrained step launched with ``sample_with_next`` (async scheduling) leaves its sampling open: the
next ``execute_async`` prepares its own inputs first, then asks for the open step's bitmask, samples it
and launches its forward at once. The host fills a step's bitmask while the device runs that step's
forward, and the device goes from one step's sampling straight to the next forward, with the host's
scheduling and input preparation done before, as unconstrained steps have it. Reading the open step's
output (``PendingOutput.get``) samples it too.

The model is reached only through ``engine.models.interfaces``: its declared capabilities decide, once
here, which parts exist (media encoding, M-RoPE positions, cross-attention inputs, logits rules).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Optional

import torch

from encoders.encoder_graphs import ENCODER_GRAPH_BATCH_SIZES
from engine import envs
from engine.attention import select_backend
from engine.config import EngineConfig
from engine.cuda_graphs import GraphKey, StepGraphs, graph_batch_sizes, graph_token_sizes
from engine.forward_context import forward_context
from engine.kv_scales import KVScales
from engine.input_batch import CachedRequestState, StepBuffers, StepInputs
from engine.kernel_policy import KernelPolicy
from engine.layers.quantized import BF16_MATMUL_MODE_LOCK, packed_weights
from engine.models.interfaces import ModelForCausalLM
from engine.outputs import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from engine.runner.cross_attention import CrossAttentionInputs
from engine.runner.grammar_mask import GrammarSource, to_device
from engine.runner.kv_cache import KVCache, activation_reserve_bytes, kv_cache_dtype
from engine.runner.media import MediaEncoder
from engine.runner.pending import PendingOutput
from engine.runner.row_calls import RowCalls
from engine.runner.sampling import StepSampler, sampling_is_simple
from engine.runner.state import RequestStates
from engine.runner.step_observer import StepObserver
from engine.runner.warm_up import (MediaWarmUpLimits, capture_cuda_graphs, tune_lora_stacked_gemms,
                                   warm_up_attention, warm_up_lora_kernels, warm_up_media)
from kernels.cpu_layer_ops import CpuLayerOps
from kernels.cpu_token_bitmask import CpuTokenBitmask

logger = logging.getLogger("chorus.runner")


@dataclass
class _UnsampledStep:
    """A launched constrained step whose sampling waits for its bitmask (``sample_with_next``)."""
    inputs: StepInputs
    """The step's inputs (its sampling requests in logits-row order)."""
    logits: torch.Tensor
    """[num_sampled, vocab] its sampling rows' logits, computed on the device."""
    states: list[CachedRequestState]
    """The requests that sample, in logits-row order."""
    prompt_logprobs: dict[str, LogprobsLists]
    """req_id -> the prompt logprobs the step computed."""
    num_generated: Optional[dict[str, int]]
    """req_id -> output tokens before this step's sample (models with logits rules; else None)."""
    grammar: GrammarSource
    """Fills the step's bitmask when it samples."""
    handle: PendingOutput
    """What ``execute_async`` returned for the step: it adopts the sampled result."""


class ModelRunner:
    """Executes ``SchedulerOutput``s on one model (one rank's shard).

    Args:
        config: the engine's resolved configs.
        model: the loaded model (``engine.models.interfaces.ModelForCausalLM`` and what it declares).
        device, dtype: where and in what dtype it runs.
        max_model_len: the resolved context length.
        policy: the engine's kernel policy (``engine.kernel_policy``), shared with the LoRA manager.
        lora_manager: the engine's ``lora.manager.LoRAManager`` when LoRA is enabled, else None.
        encoder_compute_budget: embeddings the scheduler lets one step encode (media models; 0: none). With
            LoRA on an encoder-decoder model, the rows one encoder or cross-attention K/V call runs at most.
        encoder_cache_size: embeddings the scheduler's encoder cache may keep (sizes the memory reserve).
    """

    def __init__(self, config: EngineConfig, model: ModelForCausalLM, device: torch.device,
                 dtype: torch.dtype, max_model_len: int, policy: KernelPolicy, lora_manager=None,
                 encoder_compute_budget: int = 0, encoder_cache_size: int = 0,
                 kv_scales: Optional[dict[int, KVScales]] = None) -> None:
        self.config = config
        self.model = model
        self.device = device
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.policy = policy
        """The engine's fast-path choices, built once; layers read it through the forward context, the
        attention backend and the LoRA layers get it at construction."""
        self.lora_manager = lora_manager
        self.encoder_cache_size = encoder_cache_size
        self.encoder_compute_budget = encoder_compute_budget
        self.block_size = config.cache_config.block_size
        sc = config.scheduler_config
        capabilities = model.capabilities
        self.cpu_kernel_dir = envs.cpu_kernel_dir()
        """Where the CPU C kernels are built once per host (``kernels.cpu_native``)."""
        self.cpu_ops = (CpuLayerOps.load(self.cpu_kernel_dir)
                        if device.type == "cpu" and policy.cpu_layer_ops else None)
        """On CPU, the C layer ops the layers take through the forward context (None: torch's)."""
        self.bf16_weights = any(w.bf16_products_copy is not None for w in packed_weights(model))
        """The model's quantized weights keep bf16-product copies (CPUs with AMX,
        ``engine.layers.quantized``): long prefill chunks attend in bfloat16 too, and steps run without
        ``BF16_MATMUL_MODE_LOCK``."""
        cache_dtype = kv_cache_dtype(config.cache_config.cache_dtype, dtype, device, self.bf16_weights)
        self.kv_cache = KVCache(model.attention_layers(), self.block_size, cache_dtype, device,
                                checkpoint_scales=kv_scales)   # an FP8 cache's per-layer scales
        self.use_cuda_graphs = device.type == "cuda" and not config.enforce_eager
        """Capture step graphs when the KV cache is allocated (off: ``enforce_eager``; encoder-decoder
        models without ``cross_attention_graphs``). With LoRA, an encoder-decoder model's decode graphs read
        the LoRA meta buffers as a text model's do; its adapted encoder and cross K/V projections run outside
        them (``row_calls``), before the step's ``set_batch``."""
        if capabilities.encoder_decoder and self.use_cuda_graphs and not capabilities.cross_attention_graphs:
            logger.info("Encoder-decoder model: CUDA graphs are off (the steps run eagerly).")
            self.use_cuda_graphs = False
        self.encoder_graph_items = (min(encoder_compute_budget // model.num_source_positions,
                                        max(ENCODER_GRAPH_BATCH_SIZES))
                                    if capabilities.encoder_decoder and device.type == "cuda"
                                    and not config.enforce_eager else 0)
        """Encoder-decoder models on CUDA: the encoder's largest CUDA graph, in media items (the items one step
        may encode, at most ``ENCODER_GRAPH_BATCH_SIZES``'s largest; with LoRA too, whose adapted calls run
        eagerly); 0: the encoder runs eagerly."""
        self._graph_sizes = graph_batch_sizes(sc.max_num_seqs, sc.max_num_batched_tokens)
        """Decode graph batch sizes (captured with ``use_cuda_graphs``)."""
        self._graph_token_sizes = (graph_token_sizes(sc.max_num_batched_tokens, config.max_cudagraph_capture_size)
                                   if not capabilities.encoder_decoder else [])
        """Mixed graph token counts (captured with ``use_cuda_graphs``; none for encoder-decoder models, whose
        steps with prompt tokens run eagerly)."""
        max_step_tokens = max(sc.max_num_batched_tokens, max(self._graph_sizes))
        self.lora_rows_per_call = 0
        """Rows one adapted model call may run (the LoRA step buffers' size; 0: LoRA off)."""
        if lora_manager is not None:
            # Encoder-decoder models also run adapters on encoder rows outside the step's tokens.
            self.lora_rows_per_call = max(max_step_tokens,
                                          encoder_compute_budget if capabilities.encoder_decoder else 0)
        self.states = RequestStates(
            sc.max_num_seqs, math.ceil(max_model_len / self.block_size),
            math.ceil(model.num_source_positions / self.block_size) if capabilities.encoder_decoder else 0,
            device, model.logits_rules, model if capabilities.mrope else None, self.kv_cache.groups.num_groups)
        self.encoder_cache: dict[str, torch.Tensor] = {}
        """Media item content hash -> its encoder output [num_embeds, hidden] (the scheduler's
        ``EncoderCacheManager`` decides what stays; evictions arrive in ``free_encoder_identifiers``)."""
        self.num_encoded_items = 0
        """Media items the encoder has run on since start (an item served from the cache is not counted)."""
        self.row_calls = RowCalls(lora_manager, policy, self.cpu_ops)
        """How model calls outside the step's tokens run (encoders, cross-attention K/V, graph captures)."""
        self.media = (MediaEncoder(model, self.encoder_cache, self.row_calls, device,
                                   lora_manager is not None and lora_manager.targets.adapts_encoder)
                      if capabilities.multimodal else None)
        """Runs the media encoders (multimodal models; else None)."""
        self.cross_attention = (CrossAttentionInputs(model, self.encoder_cache, self.states.cross_block_rows,
                                                     self.block_size, device, self.row_calls,
                                                     self.lora_rows_per_call or None, sc.max_num_seqs)
                                if capabilities.encoder_decoder else None)
        """Writes and describes the cross-attention K/V (encoder-decoder models; else None)."""
        self.logits_rules = model.logits_rules
        """The model's per-row logits rules (Whisper's), applied before sampling; None for most models."""
        cpu_bitmask = (CpuTokenBitmask.load(self.cpu_kernel_dir)
                       if device.type == "cpu" and policy.cpu_token_bitmask else None)
        self.sampling = StepSampler(model, model.shape.vocab_size, device, config.model_config.logprobs_mode,
                                    self.logits_rules, cpu_bitmask)
        self.buffers: Optional[StepBuffers] = None
        """The step buffers (``allocate_kv_cache``)."""
        self.graphs: Optional[StepGraphs] = None
        """The captured step graphs (None: every step runs eagerly)."""
        self.step_observer: Optional[StepObserver] = None
        """Sees each step's device work (a profiler, ``benchmarks/step_timer.py``); None: nothing watches."""
        self._unsampled: Optional[_UnsampledStep] = None
        """The launched constrained step whose sampling is open (``sample_with_next``); None: none."""

    # ------------------------------------------------------------------ start-up
    def determine_num_blocks(self, max_needed_blocks: int) -> int:
        """KV blocks this rank's memory holds, at most ``max_needed_blocks``."""
        reserve = 0
        if self.device.type == "cuda":
            sc = self.config.scheduler_config
            graph_tokens = (min(sc.max_num_batched_tokens, self.config.max_cudagraph_capture_size)
                            if self.use_cuda_graphs else 0)
            if self.encoder_graph_items:    # the encoder graphs' pool, held beside eager activations
                graph_tokens += self.encoder_graph_items * self.model.num_source_positions
            reserve = activation_reserve_bytes(self.model.shape, sc, self.dtype, graph_tokens,
                                               self.encoder_cache_size)
        return self.kv_cache.blocks_that_fit(self.config.cache_config, max_needed_blocks, reserve)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """The KV cache of ``num_blocks`` blocks in every attention layer; then the step buffers, the kernels'
        warm-up and the CUDA graphs (CUDA, unless ``enforce_eager``)."""
        # Weights that multiply in bfloat16 (AMX copies) let long prefill chunks attend in bfloat16 too.
        backend = select_backend(self.device, self.policy, self.bf16_weights,
                                 cpu_kernel_dir=self.cpu_kernel_dir)
        self.kv_cache.allocate(num_blocks, backend)
        cuda = self.device.type == "cuda"
        if cuda:
            warm_up_attention(backend, self.model, self.dtype)
        self._init_step_buffers()
        sc = self.config.scheduler_config
        if cuda and self.lora_manager is not None:
            first_eager = max(self._graph_token_sizes, default=0) + 1 if self.use_cuda_graphs else 1
            warm_up_lora_kernels(self.lora_manager, self.model, first_eager, sc.max_num_batched_tokens)
        if self.encoder_graph_items:
            with self.row_calls.rows(None):      # the forward context; no adapter batch (base projections)
                self.model.capture_encoder_graphs(self.encoder_graph_items)
        if self.use_cuda_graphs:
            if self.lora_manager is not None and self.policy.lora_stacked_tune:
                tune_lora_stacked_gemms(self.lora_manager, self._graph_sizes)
            self.graphs = capture_cuda_graphs(self.model, self.buffers, self.max_model_len, self._graph_sizes,
                                              self._graph_token_sizes, sc.max_num_seqs, self.lora_manager,
                                              self.policy,
                                              self.cross_attention.buffers.capture_metadata
                                              if self.cross_attention is not None else None)
        if cuda and self.media is not None:
            self.warm_up_media()

    def warm_up_media(self) -> int:
        """Encode and prefill the model's declared warm-up media once (``warm_up.warm_up_media``; on CUDA at
        start-up), leaving no request, encoder output or count behind. Returns the items run."""
        sc, num_encoded = self.config.scheduler_config, self.num_encoded_items
        limits = MediaWarmUpLimits(self.kv_cache.num_blocks, self.block_size, self.kv_cache.groups.num_groups,
                                   sc.max_num_batched_tokens, self.max_model_len, self.encoder_compute_budget,
                                   sc.max_num_seqs)
        num_run = warm_up_media(self.model.media_warm_up(), self.execute, limits)
        self.num_encoded_items = num_encoded
        return num_run

    def _init_step_buffers(self) -> None:
        sc = self.config.scheduler_config
        max_tokens = max(sc.max_num_batched_tokens, max(self._graph_sizes))
        max_blocks_per_req = math.ceil(self.max_model_len / self.block_size)
        self.buffers = StepBuffers(max_tokens, sc.max_num_seqs, max_blocks_per_req, self.device,
                                   self.kv_cache.groups.num_groups)
        mrope = self.model.capabilities.mrope
        self.buffers.with_mrope = mrope
        if self.media is not None and self.use_cuda_graphs and self._graph_token_sizes:
            self.buffers.enable_media(max(self._graph_token_sizes), self.model.shape.hidden_size, self.dtype,
                                      mrope)
        if self.lora_manager is not None:
            self.lora_manager.allocate_step_buffers(self.lora_rows_per_call)

    # ------------------------------------------------------------------ step
    def execute(self, so: SchedulerOutput, grammar: Optional[GrammarSource] = None) -> ModelRunnerOutput:
        """Run one step and wait for its sampled ids."""
        return self.execute_async(so, grammar).get()

    def execute_async(self, so: SchedulerOutput, grammar: Optional[GrammarSource] = None,
                      sample_with_next: bool = False) -> PendingOutput:
        """Launch one step; the returned handle's ``get()`` waits for its sampled ids. ``grammar``: the
        bitmask of the step's constrained rows, asked for once the forward is launched (a step with
        ``structured_output_req_ids``; ``engine.runner.grammar_mask``). ``sample_with_next``: a step with
        ``grammar`` samples once the next step's inputs are prepared, or when its output is read (models
        without logits rules; the module's docstring). On CPU, a model without bf16-product weights runs
        its step under ``BF16_MATMUL_MODE_LOCK``: its float32 matmuls never see another engine's bf16 mode
        (``engine.layers.quantized``)."""
        defer = sample_with_next and grammar is not None and self.logits_rules is None
        if self.device.type != "cpu" or self.bf16_weights:
            return self._execute_async(so, grammar, defer)
        with BF16_MATMUL_MODE_LOCK:
            return self._execute_async(so, grammar, defer)

    def drop_unsampled(self) -> None:
        """Forget the open constrained step without sampling it (its step failed)."""
        self._unsampled = None

    @torch.inference_mode()
    def _sample_unsampled(self) -> None:
        """Sample the open constrained step, if any: fill its bitmask on the host, sample on the device."""
        step, self._unsampled = self._unsampled, None
        if step is None:
            return
        filled = step.grammar(step.inputs.sample_req_ids)
        token_bitmask = to_device(filled, self.device) if filled is not None else None
        pending = self.sampling.sample(step.inputs, step.logits, step.states, step.prompt_logprobs,
                                       step.num_generated, token_bitmask)
        step.handle.adopt(pending)
        self.states.track(step.handle, step.states)

    def _sample_on_read(self, handle: PendingOutput) -> None:
        """``handle``'s output is read before the next step sampled it: sample it now."""
        if self._unsampled is None or self._unsampled.handle is not handle:
            raise RuntimeError("The output of a constrained step that was dropped unsampled was read.")
        if self.device.type != "cpu" or self.bf16_weights:
            return self._sample_unsampled()
        with BF16_MATMUL_MODE_LOCK:
            return self._sample_unsampled()

    @torch.inference_mode()
    def _execute_async(self, so: SchedulerOutput, grammar: Optional[GrammarSource], defer: bool) -> PendingOutput:
        if self.buffers is None:
            raise RuntimeError("allocate_kv_cache() must run before the first step.")
        self.states.absorb_sampled(keep_last=True)   # at most one step in flight besides this one
        self.states.apply(so)
        if self.lora_manager is not None and so.lora_loads:
            self.lora_manager.load_slots(so.lora_loads)
        if self.media is not None:
            self.media.free(so.free_encoder_identifiers)
            if so.scheduled_encoder_inputs:
                self.num_encoded_items += self.media.encode(so.scheduled_encoder_inputs, self.states.requests)
        if so.total_num_scheduled_tokens == 0:
            return PendingOutput.done(ModelRunnerOutput(req_ids=[], sampled_token_ids=[]))
        requests = self.states.requests
        order = sorted(so.num_scheduled_tokens, key=lambda r: so.num_scheduled_tokens[r] != 1)
        states = [requests[r] for r in order]
        counts = [so.num_scheduled_tokens[r] for r in order]
        if (not all(sampling_is_simple(s.sampling_params) for s in states)
                or any(s.rules_need_history for s in states)):
            self._sample_unsampled()
            self.states.absorb_sampled()   # penalties, min_tokens, history-reading logits rules: every token
        num_generated = None   # the logits rules' view: output tokens before this step's sample
        if self.logits_rules is not None:
            num_generated = {s.req_id: s.num_computed_tokens + n - s.num_prompt_tokens
                             for s, n in zip(states, counts)}
        mm_rows = self.media.gather(states, counts) if self.media is not None else None
        graph_key = (self.graphs.key_for_step(states, counts, mm_rows is not None)
                     if self.graphs is not None else None)
        if self.step_observer is not None:
            self._observe_begin(graph_key, counts)
        inputs = self._prepare(states, counts, graph_key)
        if self.cross_attention is not None:
            self.cross_attention.write_kv(states)
            inputs.cross_attn_metadata = self.cross_attention.metadata(
                states, counts, graph_key.size if graph_key is not None else None)
        if graph_key is not None and graph_key.mixed and self.buffers.mm_mask is not None:
            self.buffers.write_media(graph_key.num_tokens, mm_rows, inputs.mrope_positions)
        if self.lora_manager is not None:
            # LoRA graphs: the fixed-grid launches captured for every adapter mix read the refilled buffers.
            few = graph_key.few_adapters if graph_key is not None else 0
            self.lora_manager.set_batch(inputs.token_lora_slots,
                                        fixed_grid=graph_key is not None and graph_key.lora,
                                        max_active=few or None)
        self._sample_unsampled()   # the open step samples now: its ids are this step's placeholders
        last = self.sampling.last_sampled
        self.buffers.gather_placeholders(inputs.num_placeholders, last[0] if last is not None else None)
        logits, prompt_logprobs = self._forward(inputs, graph_key, mm_rows)
        for s, n in zip(states, counts):
            s.num_computed_tokens += n
        if logits is None:
            pending = PendingOutput(inputs.req_ids, [], None, None, prompt_logprobs=prompt_logprobs)
            self.states.track(pending, [])
        elif defer:
            pending = PendingOutput.unsampled(inputs.req_ids, lambda: self._sample_on_read(pending))
            self._unsampled = _UnsampledStep(inputs, logits, [requests[r] for r in inputs.sample_req_ids],
                                             prompt_logprobs, num_generated, grammar, pending)
        else:
            sampled_states = [requests[r] for r in inputs.sample_req_ids]
            token_bitmask = None
            if grammar is not None:   # the host fills it while the device runs the forward
                filled = grammar(inputs.sample_req_ids)
                token_bitmask = to_device(filled, self.device) if filled is not None else None
            pending = self.sampling.sample(inputs, logits, sampled_states, prompt_logprobs, num_generated,
                                           token_bitmask)
            self.states.track(pending, sampled_states)
        if self.step_observer is not None:
            self.step_observer.end()
        return pending

    def _observe_begin(self, graph_key: Optional[GraphKey], counts: list[int]) -> None:
        kind = "eager" if graph_key is None else ("mixed graph" if graph_key.mixed else "decode graph")
        run = graph_key.num_tokens if graph_key is not None else sum(counts)
        self.step_observer.begin(kind, sum(counts), run)

    def _prepare(self, states: list[CachedRequestState], counts: list[int],
                 graph_key: Optional[GraphKey]) -> StepInputs:
        """The step's flat inputs in the step buffers, padded to the graph that runs it."""
        if graph_key is None:
            reqs_padded = tokens_padded = None
        elif graph_key.mixed:
            reqs_padded, tokens_padded = self.graphs.max_num_reqs, graph_key.num_tokens
        else:
            reqs_padded, tokens_padded = graph_key.size, None
        if self._unsampled is not None:   # the open step's rows: its ids are gathered once it samples
            prev_rows = {rid: i for i, rid in enumerate(self._unsampled.inputs.sample_req_ids)}
        else:
            last = self.sampling.last_sampled
            prev_rows = last[1] if last is not None else None
        return self.buffers.prepare(states, counts, self.states.block_table, self.block_size,
                                    with_lora=self.lora_manager is not None,
                                    num_reqs_padded=reqs_padded, num_tokens_padded=tokens_padded,
                                    prev_sampled_rows=prev_rows, group_tables=self.states.group_tables)

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
                positions = torch.from_numpy(inputs.mrope_positions).to(self.device,
                                                                        non_blocking=True)   # [3, T]
            with forward_context(inputs.attn_metadata, self.policy, inputs.cross_attn_metadata, self.cpu_ops):
                hidden = self.model(inputs.input_ids, positions, inputs_embeds)    # [T, hidden]
        prompt_logprobs = self.sampling.prompt_logprobs(inputs, hidden, self.states.requests)
        if not inputs.sample_req_ids:
            return None, prompt_logprobs
        return self.model.compute_logits(hidden[inputs.logits_indices]), prompt_logprobs  # [R, vocab]
