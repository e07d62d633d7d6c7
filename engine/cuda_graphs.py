"""CUDA graphs for decode-only steps (per batch size) and for mixed steps (per token count).

Two kinds of graph, both reading the runner's persistent step buffers (``StepBuffers``: input
ids, positions, slot mapping, query start locations, sequence lengths, block tables), so a replay
needs no copies of its own: the runner writes the step into those buffers, then replays.

- **Decode graphs** (vLLM's full decode graphs): a decode-only step of ``R`` requests runs the
  graph of the smallest batch bucket ``B >= R``; rows ``R..B`` are padding requests (one token,
  null-block context, KV slot -1, logits ignored). Attention is captured with
  ``max_query_len=1`` and ``max_seq_len=max_model_len``: the kernel's grid depends only on the
  batch size and its split-KV segments are cut on the device from the real lengths. The graph
  ends with the logits of every row.
- **Mixed graphs**: a step with prefill chunks (or media placeholder tokens) of ``T`` tokens in all runs the graph of the
  smallest token bucket ``T_b >= T`` (up to ``max_cudagraph_capture_size``). Requests are padded
  to ``max_num_seqs`` with zero-token requests (their attention programs exit at once) and tokens
  to ``T_b`` with rows that belong to no request (KV slot -1, adapter -1; their hidden states are
  garbage and never read: every op of the decoder is row-wise except attention, which only reads
  rows of real requests). The paged-attention grid is ``T_b // BLOCK_Q + max_num_seqs`` programs
  that find their request on the device, so one graph serves every mix of prefill chunks and
  decodes. The graph ends with the final hidden states; the runner gathers the sampled rows and
  computes their logits eagerly (and prompt logprobs, if asked). Larger steps run eagerly: their
  GEMMs take longer than the launches, which then overlap the device work.

Vision models: mixed graphs read the step's encoder embeddings and a mask of their rows from static
buffers (``StepBuffers.enable_media``) and write them over the token embeddings; M-RoPE models also
read [3, T] positions. Decode graphs stay text-only (a step with a media token is a mixed step).

Encoder-decoder models (Whisper, ``capabilities.cross_attention_graphs``): decode graphs only, their
cross-attention reading each row's cross blocks and lengths from static buffers the runner refills before
every replay (``engine.runner.cross_buffers``; padding rows read one position of block 0); steps with prompt
tokens, which also write new requests' cross K/V, run eagerly over the same buffers. With LoRA their decode
graphs read the LoRA meta buffers as below; the adapted encoder and cross K/V projections run outside them.

Why mixed graphs: an eager step of a 32-layer model issues hundreds of launches, whose host time
exceeds the device time of a step of a few hundred tokens, so while requests keep arriving (every
step mixed) the GPU waited on Python.

With LoRA, graphs are captured with the fixed-grid shrink/expand kernels reading the manager's
static meta tensors (``lora.batch.LoRAMetaBuffers``), refilled by ``set_batch`` before each replay:
one graph serves any mix of adapters and base rows. Every bucket also gets a variant without
LoRA nodes, replayed when no request of the step uses an adapter (the base model pays nothing).
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional
from unittest import mock

import numpy as np
import torch

from engine.attention import AttentionMetadata
from engine.forward_context import forward_context
from engine.input_batch import CachedRequestState, StepBuffers
from engine.kernel_policy import KernelPolicy
from engine.models.interfaces import ModelForCausalLM

logger = logging.getLogger("chorus.cuda_graphs")

BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512, 576, 640,
                      704, 768, 832, 896, 960, 1024)
"""Decode graph batch sizes (requests), capped at ``max_num_seqs`` (which is always added)."""

MIXED_TOKEN_BUCKETS = tuple(range(64, 1024 + 1, 64)) + tuple(range(1024 + 128, 4096 + 1, 128))
"""Mixed graph token counts, capped at ``max_cudagraph_capture_size`` and the step budget.
NOTE: steps of 64 tokens apart up to 1024, then 128: padding costs GEMM rows."""


def graph_batch_sizes(max_num_seqs: int, max_num_tokens: int) -> list[int]:
    """The decode buckets to capture, ascending."""
    cap = min(max_num_seqs, max_num_tokens)
    return sorted({b for b in BATCH_SIZE_BUCKETS if b < cap} | {cap})


def graph_token_sizes(max_num_batched_tokens: int, max_capture_size: int) -> list[int]:
    """The mixed-step token buckets to capture, ascending (empty when ``max_capture_size`` is 0)."""
    cap = min(max_num_batched_tokens, max_capture_size)
    if cap <= 0:
        return []
    return sorted({b for b in MIXED_TOKEN_BUCKETS if b < cap} | {cap})


@dataclass(frozen=True)
class GraphKey:
    """Which captured graph runs a step."""

    mixed: bool
    """False: decode-only graph (one token per request); True: mixed-step graph."""
    size: int
    """Decode: batch size (requests = tokens). Mixed: tokens (requests padded to max_num_seqs)."""
    lora: bool
    """The fixed-grid LoRA kernels are in the graph (False: base model only)."""
    few_adapters: int = 0
    """Decode graphs with lora: > 0 for the variant serving steps whose adapters all sit in slots
    below this, whose fixed-grid LoRA launches cover that many segments (and stacked GEMMs that
    many slots) instead of max_loras (``LoRAManager.few_adapters_bound``); 0 serves any step."""

    @property
    def num_tokens(self) -> int:
        return self.size

    def __str__(self) -> str:
        few = f"<={self.few_adapters}" if self.few_adapters else ""
        return f"{'mixed' if self.mixed else 'decode'}-{self.size}{'-lora' + few if self.lora else ''}"


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    output: torch.Tensor
    """Decode: [batch_size, vocab] logits (model dtype). Mixed: [num_tokens, hidden] hidden states.
    The graph's output buffer, rewritten by every replay."""


class StepGraphs:
    """Captures and replays the step graphs of one model over one set of step buffers.

    Args:
        model: the model (its forward, logits and, for media steps, token embeddings).
        buffers: the runner's step buffers (the graphs' static inputs).
        max_model_len: the attention bound the kernels are captured with.
        batch_sizes: decode buckets to capture.
        token_sizes: mixed-step token buckets to capture (may be empty).
        max_num_reqs: requests of a mixed graph (``max_num_seqs``).
        lora_manager: the engine's ``LoRAManager`` when LoRA is on (its meta buffers are then
            static graph inputs too), else None.
        policy: the engine's kernel policy, entered with each capture's forward context.
        cross_metadata: encoder-decoder models: f(batch size) -> the cross-attention metadata a decode graph
            of that size is captured with, over static buffers the runner refills before each replay
            (``engine.runner.cross_buffers``); such models capture decode graphs only. None: no cross-attention.
    """

    def __init__(self, model: ModelForCausalLM, buffers: StepBuffers, max_model_len: int,
                 batch_sizes: list[int], token_sizes: list[int], max_num_reqs: int,
                 lora_manager=None, policy: Optional[KernelPolicy] = None,
                 cross_metadata: Optional[Callable[[int], AttentionMetadata]] = None) -> None:
        if cross_metadata is not None and token_sizes:
            raise ValueError("mixed-step graphs of an encoder-decoder model: capture decode graphs only")
        self.model = model
        self.cross_metadata = cross_metadata
        self.policy = policy
        self.lora_manager = lora_manager
        self.buffers = buffers
        self.max_model_len = max_model_len
        self.batch_sizes = sorted(batch_sizes)
        self.token_sizes = sorted(token_sizes)
        self.max_num_reqs = max_num_reqs
        self.graphs: dict[GraphKey, _Graph] = {}
        self.num_replays = 0
        """Replays so far, both kinds (tests check that steps took the graph path)."""
        self.num_mixed_replays = 0
        """Replays of mixed-step graphs."""

    # ------------------------------------------------------------------ lookup
    def key_for_step(self, states: list[CachedRequestState], counts: list[int],
                     has_media: bool) -> Optional[GraphKey]:
        """The graph that runs a step of ``states`` with ``counts`` tokens each (None: run it eagerly). A step
        with media placeholder tokens takes a mixed graph (those read the encoder rows), if the buffers hold
        media inputs (``StepBuffers.enable_media``)."""
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
        return self.key_for(len(states), sum(counts), decode_only, num_adapters, slot_bound)

    def key_for(self, num_reqs: int, num_tokens: int, decode_only: bool, num_adapters: int,
                slot_bound: Optional[int] = None) -> Optional[GraphKey]:
        """The graph for a step (None: run eagerly).

        Args:
            num_reqs, num_tokens: the step's real requests and tokens.
            decode_only: every request runs exactly one token.
            num_adapters: distinct adapters the step's requests run (0: base model only).
            slot_bound: 1 + the highest slot they use (None: num_adapters, i.e. slots 0..n-1). The
                few-adapters variant serves steps whose slots all lie below its bound.
        """
        lora = self.lora_manager is not None and num_adapters > 0
        if decode_only:
            size = next((b for b in self.batch_sizes if b >= num_reqs), None)
        elif num_reqs > self.max_num_reqs:
            size = None
        else:
            size = next((t for t in self.token_sizes if t >= num_tokens), None)
        if size is None:
            return None
        if lora and decode_only:
            few = self.lora_manager.few_adapters_bound(size)
            key = GraphKey(False, size, True, few)
            bound = num_adapters if slot_bound is None else slot_bound
            if few is not None and bound <= few and key in self.graphs:
                return key
        key = GraphKey(not decode_only, size, lora)
        return key if key in self.graphs else None

    def batch_size_for(self, num_reqs: int) -> Optional[int]:
        """Smallest captured decode bucket holding ``num_reqs`` requests (None: none)."""
        key = self.key_for(num_reqs, num_reqs, True, int(self.lora_manager is not None))
        return None if key is None else key.size

    # ------------------------------------------------------------------ capture
    def num_reqs_of(self, key: GraphKey) -> int:
        """Requests a graph runs (real + padding)."""
        return self.max_num_reqs if key.mixed else key.size

    def graph_metadata(self, key: GraphKey) -> AttentionMetadata:
        """The attention metadata a graph is captured with: views of the step buffers, and the
        host bounds its kernels are sized by (max_query_len = the bucket for mixed graphs, 1 for
        decode graphs; max_seq_len = max_model_len)."""
        buf = self.buffers
        t, r = key.num_tokens, self.num_reqs_of(key)
        return AttentionMetadata(
            slot_mapping=buf.slot_mapping[:t], query_start_loc=buf.query_start_loc[:r + 1],
            seq_lens=buf.seq_lens[:r], block_tables=buf.block_tables[:r],
            max_query_len=t if key.mixed else 1, max_seq_len=self.max_model_len,
            num_decode_reqs=0 if key.mixed else r, captured=True).with_groups(buf.group_tables(t, r))

    def _fill_padding(self, key: GraphKey) -> None:
        """Fill the buffers with padding only (what a capture runs over)."""
        buf = self.buffers
        t, r = key.num_tokens, self.num_reqs_of(key)
        buf.input_ids[:t].zero_()
        buf.positions[:t].zero_()
        buf.slot_mapping[:t].fill_(-1)
        buf.group_slot_mapping[:, :t].fill_(-1)
        if key.mixed:
            buf.query_start_loc[:r + 1].zero_()
            buf.seq_lens[:r].zero_()
        else:
            buf.query_start_loc[:r + 1].copy_(torch.arange(r + 1, dtype=torch.int32, device=buf.device))
            buf.seq_lens[:r].fill_(1)
        buf.block_tables[:r].zero_()
        buf.group_block_tables[:, :r].zero_()
        if key.mixed and buf.mm_mask is not None:
            buf.write_media(t, None, None)
        if self.lora_manager is not None:
            # fixed_grid=False with no adapter token is "no LoRA": the layers add nothing, and
            # the capture holds no LoRA node.
            self.lora_manager.set_batch(np.full(t, -1, dtype=np.int32), fixed_grid=key.lora,
                                        max_active=key.few_adapters or None)

    def _forward(self, key: GraphKey, meta: AttentionMetadata,
                 cross_meta: Optional[AttentionMetadata] = None) -> torch.Tensor:
        t = key.num_tokens
        buf = self.buffers
        with forward_context(meta, self.policy, cross_meta):
            if key.mixed and buf.mm_mask is not None:
                # Vision models: token embeddings with the step's encoder rows written over them.
                embeds = self.model.embed_input_ids(buf.input_ids[:t])                       # [t, hidden]
                embeds = torch.where(buf.mm_mask[:t, None], buf.mm_embeds[:t], embeds)
                positions = buf.positions[:t] if buf.mrope_positions is None else buf.mrope_positions[:, :t]
                hidden = self.model(buf.input_ids[:t], positions, embeds)                   # [t, hidden]
            else:
                hidden = self.model(buf.input_ids[:t], buf.positions[:t])                   # [t, hidden]
        if key.mixed:
            return hidden
        return self.model.compute_logits(hidden)                    # [batch_size, vocab] model dtype

    def keys_to_capture(self) -> list[GraphKey]:
        """Every graph, largest first (later captures reuse the pool memory of earlier ones)."""
        lora = self.lora_manager is not None
        keys = []
        for mixed, sizes in ((True, self.token_sizes), (False, self.batch_sizes)):
            for size in sizes:
                keys.append(GraphKey(mixed, size, lora))
                if lora:
                    keys.append(GraphKey(mixed, size, False))   # steps where no request runs an adapter
                    few = None if mixed else self.lora_manager.few_adapters_bound(size)
                    if few is not None:                         # decode steps of few adapters: smaller grids
                        keys.append(GraphKey(mixed, size, True, few))
        return sorted(keys, key=lambda k: (k.num_tokens, k.mixed, k.lora, k.few_adapters), reverse=True)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every graph into one shared memory pool."""
        t0 = time.perf_counter()
        pool = None
        gc.collect()
        # NOTE: torch.cuda.graph runs gc.collect() and empty_cache() before every capture (slow
        # with a loaded model, and paid per graph); once above is enough, as vLLM does.
        with mock.patch("gc.collect", lambda *a, **k: 0), mock.patch("torch.cuda.empty_cache", lambda: None):
            for key in self.keys_to_capture():
                self._fill_padding(key)
                meta = self.graph_metadata(key)
                cross_meta = self.cross_metadata(key.size) if self.cross_metadata is not None else None
                self._forward(key, meta, cross_meta)          # warm-up: Triton compiles, cuBLAS picks kernels
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self._forward(key, meta, cross_meta)
                pool = graph.pool()
                self.graphs[key] = _Graph(graph, out)
        torch.cuda.synchronize()
        logger.info("Captured %d CUDA graphs (decode batch sizes %s; mixed steps up to %s tokens) in %.1f s",
                    len(self.graphs), self.batch_sizes, max(self.token_sizes, default=0),
                    time.perf_counter() - t0)

    # ------------------------------------------------------------------ replay
    def replay(self, key: GraphKey) -> torch.Tensor:
        """Run a graph over what the buffers hold now; returns its output buffer (see ``_Graph``)."""
        g = self.graphs[key]
        g.graph.replay()
        self.num_replays += 1
        if key.mixed:
            self.num_mixed_replays += 1
        return g.output
