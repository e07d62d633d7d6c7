"""Model runner: owns every tensor (weights, KV cache, adapter slots) and executes steps.

``execute(SchedulerOutput) -> ModelRunnerOutput``: apply the step's diff to the per-request
state, build flat inputs once, run the decoder under ``forward_context``, compute logits only
where a token is sampled (or prompt logprobs were asked for), sample, and return host lists.
"""

from __future__ import annotations

import logging
import math
from typing import Optional

import torch

from engine.attention import forward_context, select_backend
from engine.config import EngineConfig
from engine.input_batch import CachedRequestState, StepInputs, build_step_inputs
from engine.outputs import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from engine.sampler import Sampler, compute_prompt_logprobs
from engine.sampling_metadata import build_sampling_metadata

logger = logging.getLogger("chorus.runner")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA GPU is visible; use device='cpu' or 'auto'.")
    return torch.device(name)


def resolve_dtype(name: str, checkpoint_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # bf16 prefill is ~6x slower on CPUs without AMX
    return checkpoint_dtype if checkpoint_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


class ModelRunner:
    def __init__(self, config: EngineConfig, model: torch.nn.Module, hf_config, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.config = config
        self.model = model
        self.hf_config = hf_config
        self.device = device
        self.dtype = dtype
        self.block_size = config.cache_config.block_size
        self.vocab_size = hf_config.vocab_size
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}
        self.lora_manager = None  # set by the engine when LoRA is enabled
        self.num_blocks = 0
        self.logprobs_mode = config.model_config.logprobs_mode

    # ------------------------------------------------------------------ KV cache
    def kv_bytes_per_block(self) -> int:
        layers = self.model.attention_layers()
        per_token = sum(2 * a.num_kv_heads * a.head_dim for a in layers) * torch.finfo(self.dtype).bits // 8
        return per_token * self.block_size

    def determine_num_blocks(self, max_needed_blocks: int) -> int:
        cc = self.config.cache_config
        if cc.num_gpu_blocks_override is not None:
            return cc.num_gpu_blocks_override
        per_block = self.kv_bytes_per_block()
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used_by_us = torch.cuda.memory_allocated(self.device)
            activation_reserve = self._activation_reserve_bytes()
            budget = total * cc.gpu_memory_utilization - (total - free) - activation_reserve
            budget = max(budget, 0)
            del used_by_us
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
        h = self.hf_config
        elem = torch.finfo(self.dtype).bits // 8
        per_token = (4 * h.hidden_size + 3 * h.intermediate_size) * elem
        logits = sc.max_num_seqs * h.vocab_size * 4 * 3
        return int(sc.max_num_batched_tokens * per_token + logits + (512 << 20))

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """One [num_blocks, block_size, num_kv_heads, head_dim] K and V tensor per layer."""
        self.num_blocks = num_blocks
        backend = select_backend(self.device)
        for attn in self.model.attention_layers():
            shape = (num_blocks, self.block_size, attn.num_kv_heads, attn.head_dim)
            # Zeroed: padded block-table entries point at block 0 and are masked, but must not be NaN.
            attn.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            attn.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            attn.backend = backend
        logger.info("KV cache: %d blocks x %d tokens (%.2f GiB)", num_blocks, self.block_size,
                    num_blocks * self.kv_bytes_per_block() / (1 << 30))

    # ------------------------------------------------------------------ state updates
    def _apply_diff(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
        for rid in so.preempted_req_ids:
            if rid in self.requests:
                self.requests[rid].active = False
        for new in so.scheduled_new_reqs:
            old = self.requests.get(new.req_id)
            generator = old.generator if old is not None else self._make_generator(new.sampling_params.seed)
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id, token_ids=list(new.all_token_ids), num_prompt_tokens=new.num_prompt_tokens,
                sampling_params=new.sampling_params, eos_token_ids=set(getattr(new, "eos_token_ids", ()) or ()),
                block_ids=list(new.block_ids), num_computed_tokens=new.num_computed_tokens,
                generator=generator, lora_slot=new.lora_slot)
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            s = self.requests[rid]
            s.block_ids.extend(cached.new_block_ids[i])
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

    # ------------------------------------------------------------------ step
    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._apply_diff(so)
        if self.lora_manager is not None and so.lora_loads:
            self.lora_manager.load_slots(so.lora_loads)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        order = sorted(so.num_scheduled_tokens, key=lambda r: so.num_scheduled_tokens[r] != 1)
        states = [self.requests[r] for r in order]
        counts = [so.num_scheduled_tokens[r] for r in order]
        inputs = build_step_inputs(states, counts, self.block_size, self.device,
                                   with_lora=self.lora_manager is not None)
        if self.lora_manager is not None:
            self.lora_manager.set_batch(inputs.token_lora_slots)
        with forward_context(inputs.attn_metadata):
            hidden = self.model(inputs.input_ids, inputs.positions)          # [T, hidden]
        prompt_logprobs = self._prompt_logprobs(inputs, hidden)
        sampled = self._sample(inputs, hidden)
        for s, n in zip(states, counts):
            s.num_computed_tokens += n
        sampled_lists = [sampled.get(r, ([], None))[0] for r in inputs.req_ids]
        logprobs = {r: lp for r, (_, lp) in sampled.items() if lp is not None}
        return ModelRunnerOutput(req_ids=inputs.req_ids, sampled_token_ids=sampled_lists,
                                 logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    def _sample(self, inputs: StepInputs, hidden: torch.Tensor) -> dict[str, tuple[list[int], Optional[LogprobsLists]]]:
        if not inputs.sample_req_ids:
            return {}
        logits = self.model.compute_logits(hidden[inputs.logits_indices])   # [R, vocab] f32
        states = [self.requests[r] for r in inputs.sample_req_ids]
        meta = build_sampling_metadata(
            [s.sampling_params for s in states], [s.generator for s in states],
            [s.token_ids[:s.num_prompt_tokens] for s in states], [s.output_token_ids for s in states],
            [s.eos_token_ids for s in states], self.vocab_size, self.device, self.logprobs_mode)
        out = self.sampler(logits, meta)
        token_ids = out.sampled_token_id_list
        result = {}
        for i, s in enumerate(states):
            s.token_ids.append(token_ids[i])
            lp = None
            if out.logprobs is not None and s.sampling_params.logprobs is not None:
                n = s.sampling_params.logprobs + 1
                lp = LogprobsLists(token_ids=[out.logprobs.token_ids[i][:n]],
                                   logprobs=[out.logprobs.logprobs[i][:n]],
                                   ranks=[out.logprobs.ranks[i]])
            result[s.req_id] = ([token_ids[i]], lp)
        return result

    def _prompt_logprobs(self, inputs: StepInputs, hidden: torch.Tensor) -> dict[str, LogprobsLists]:
        out: dict[str, LogprobsLists] = {}
        for rid, (start, count, first_pos) in inputs.prompt_logprob_ranges.items():
            s = self.requests[rid]
            logits = self.model.compute_logits(hidden[start:start + count])   # [count, vocab]
            targets = torch.tensor(s.token_ids[first_pos:first_pos + count], device=self.device)
            out[rid] = compute_prompt_logprobs(logits, targets, s.sampling_params.prompt_logprobs)
        return out


def max_blocks_needed(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """Blocks that could ever be in use at once (+1 for the reserved null block)."""
    return max_num_seqs * math.ceil(max_model_len / block_size) + 1
