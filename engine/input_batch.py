"""Runner-side per-request state, and the step buffers the flat inputs are built into.

Hot-path rules (ARCHITECTURE.md, Style 7): every step tensor lives in a buffer allocated once and
sized by the budgets (``max_num_batched_tokens`` tokens, ``max_num_seqs`` requests, the blocks
of ``max_model_len``); the host builds each step in numpy views of pinned mirrors and sends them
with non-blocking copies. The mirrors are double-buffered, so the host can build step N+1 while
step N's copies may still be in flight (async scheduling), and every block table row lives in
one persistent host table, so a step gathers rows instead of rebuilding lists.

Tokens not yet on the host: under async scheduling, a request whose previous step sampled a
token the host has not read yet has that token's position scheduled now. Its input id is
filled on the device from the previous step's sampled ids (``StepInputs.num_placeholders``
scatters), so no sync stands between two steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from engine.attention import AttentionMetadata
from engine.request import MultiModalFeature
from engine.sampling_params import SamplingParams

NO_ROW = -1


@dataclass
class CachedRequestState:
    """What the runner remembers about one request between steps."""

    req_id: str
    token_ids: list[int]
    """Prompt + every output token the host has read so far (one may still be on the device)."""
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_ids: set[int]
    block_ids: list[int]
    num_computed_tokens: int
    """Tokens whose KV is in the cache before this step."""
    generator: Optional[torch.Generator]
    """Per-request generator for seeded sampling (kept across preemption)."""
    lora_slot: int = -1
    active: bool = True
    """False while preempted (state kept, row dropped)."""
    row: int = NO_ROW
    """Row of the persistent host block table (NO_ROW while preempted)."""
    mm_features: list[MultiModalFeature] = field(default_factory=list)
    """The request's media items (placeholder ranges, content hashes, encoder inputs)."""
    mrope_positions: Optional[np.ndarray] = None
    """[3, num_prompt_tokens] int64 M-RoPE positions of the prompt (M-RoPE models with media only)."""
    mrope_delta: int = 0
    """M-RoPE: a token at index i past the prompt is at rotary position i + mrope_delta."""
    cross_block_ids: list[int] = field(default_factory=list)
    """Blocks of its cross-attention K/V (encoder-decoder models), in encoder-position order."""
    num_cross_tokens: int = 0
    """Encoder positions its decoder attends to (0: decoder-only)."""
    rules_need_history: bool = False
    """The model's logits rules read this request's generated ids (Whisper's timestamp rules), so its
    step waits for the previous step's ids; otherwise they read only how many there are."""

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


class BlockTableRows:
    """Persistent host block table: one row of block ids per active request.

    ``rows`` [capacity, max_blocks_per_req] int32; rows are handed out on admission and taken
    back when a request finishes or is preempted. Grows (doubling) if ever full.
    """

    def __init__(self, capacity: int, max_blocks_per_req: int) -> None:
        self.rows = np.zeros((capacity, max_blocks_per_req), dtype=np.int32)  # [capacity, max_blocks]
        self.num_blocks = np.zeros(capacity, dtype=np.int64)                  # [capacity]
        self._free = list(range(capacity - 1, -1, -1))

    def add(self, block_ids: list[int]) -> int:
        if not self._free:
            old = self.rows.shape[0]
            self._grow()
            self._free = list(range(2 * old - 1, old - 1, -1))
        row = self._free.pop()
        self.num_blocks[row] = 0
        self.append(row, block_ids)
        return row

    def set_row(self, row: int, block_ids: list[int]) -> None:
        """Fill ``row`` with ``block_ids`` (the row another table gave the request: a KV cache group's table
        takes the rows of group 0's)."""
        while row >= self.rows.shape[0]:
            self._grow()
        self.num_blocks[row] = 0
        self.append(row, block_ids)

    def _grow(self) -> None:
        self.rows = np.concatenate([self.rows, np.zeros_like(self.rows)])
        self.num_blocks = np.concatenate([self.num_blocks, np.zeros_like(self.num_blocks)])

    def append(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        n = int(self.num_blocks[row])
        if n + len(block_ids) > self.rows.shape[1]:
            raise RuntimeError(f"request holds {n + len(block_ids)} blocks, more than max_model_len "
                               f"allows ({self.rows.shape[1]})")
        self.rows[row, n:n + len(block_ids)] = block_ids
        self.num_blocks[row] = n + len(block_ids)

    def remove(self, row: int) -> None:
        if row != NO_ROW:
            self._free.append(row)


@dataclass
class StepInputs:
    """Views of the step buffers for one forward pass, plus where to read logits."""

    req_ids: list[str]
    """Scheduled requests in row order (decodes first)."""
    num_tokens: int
    """Real tokens this step (the model runs ``num_tokens_padded``)."""
    num_tokens_padded: int
    """Tokens the forward pass runs: num_tokens, or the CUDA-graph batch size (1 token per row)."""
    input_ids: torch.Tensor
    """[num_tokens_padded] int64."""
    positions: torch.Tensor
    """[num_tokens_padded] int64."""
    attn_metadata: AttentionMetadata
    sample_req_ids: list[str]
    """Requests that sample a token this step (their chunk reaches the end of known tokens)."""
    logits_indices: torch.Tensor
    """[num_sampled] int64: token index whose hidden state yields each sampled request's logits."""
    all_rows_sample: bool
    """Every request samples, one row each in request order (logits_indices = last token of each)."""
    token_lora_slots: Optional[np.ndarray] = None
    """[num_tokens_padded] int32 host array: adapter slot per token (-1: base model and graph
    padding); None when LoRA is off. ``LoRAManager.set_batch`` groups it on the host."""
    prompt_logprob_ranges: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    """req_id -> (first token index in the batch, count, first prompt position) for prompt logprobs."""
    num_placeholders: int = 0
    """Input ids taken on the device from the previous step's sampled ids."""
    mrope_positions: Optional[np.ndarray] = None
    """[3, num_tokens] int64 host M-RoPE positions when the step has prompt tokens of a request with
    media (its rows differ at image tokens); ``positions`` then holds row 0. None otherwise."""
    cross_attn_metadata: Optional[AttentionMetadata] = None
    """Encoder-decoder models: each step token as a one-query request over its request's cross blocks."""


class _HostMirror:
    """One set of host staging arrays (pinned on CUDA), as torch tensors and numpy views."""

    def __init__(self, max_num_tokens: int, max_num_reqs: int, max_blocks: int, pin: bool,
                 num_groups: int) -> None:
        def alloc(shape, dtype):
            return torch.zeros(shape, dtype=dtype, pin_memory=pin)

        self.input_ids = alloc(max_num_tokens, torch.int64)                   # [max_tokens]
        self.positions = alloc(max_num_tokens, torch.int64)                   # [max_tokens]
        self.slot_mapping = alloc(max_num_tokens, torch.int64)                # [max_tokens]
        self.token_lora_slots = alloc(max_num_tokens, torch.int32)            # [max_tokens]
        self.query_start_loc = alloc(max_num_reqs + 1, torch.int32)           # [max_reqs + 1]
        self.seq_lens = alloc(max_num_reqs, torch.int32)                      # [max_reqs]
        self.block_tables = alloc((max_num_reqs, max_blocks), torch.int32)    # [max_reqs, max_blocks]
        # KV cache groups 1..: their slots and block tables.
        self.group_slot_mapping = alloc((num_groups - 1, max_num_tokens), torch.int64)    # [G-1, max_tokens]
        self.group_block_tables = alloc((num_groups - 1, max_num_reqs, max_blocks),
                                        torch.int32)                         # [G-1, max_reqs, max_blocks]
        self.logits_indices = alloc(max_num_reqs, torch.int64)                # [max_reqs]
        self.placeholder_dst = alloc(max_num_reqs, torch.int64)               # [max_reqs] token index
        self.placeholder_src = alloc(max_num_reqs, torch.int64)               # [max_reqs] previous row
        self.np = {k: v.numpy() for k, v in vars(self).items()}
        self.copied: Optional[torch.cuda.Event] = torch.cuda.Event() if pin else None
        """Recorded after this mirror's copies; waited on before the mirror is written again."""


class StepBuffers:
    """Device step tensors sized by the budgets, with two host mirrors used in turn.

    Args:
        max_num_tokens: ``max_num_batched_tokens`` (and at least the largest CUDA-graph batch).
        max_num_reqs: ``max_num_seqs``.
        max_blocks_per_req: blocks of a ``max_model_len`` request.
        device: where the model runs; on CUDA the mirrors are pinned and copies non-blocking.
        num_groups: KV cache groups (``engine.kv_cache_groups``): groups 1.. have their own slots and block
            tables (``group_slot_mapping``, ``group_block_tables``).
    """

    def __init__(self, max_num_tokens: int, max_num_reqs: int, max_blocks_per_req: int,
                 device: torch.device, num_groups: int = 1) -> None:
        self.device = device
        self.max_num_tokens = max_num_tokens
        self.max_num_reqs = max_num_reqs
        self.max_blocks_per_req = max_blocks_per_req
        self.with_mrope = False
        """Lay out M-RoPE positions (set by the runner for M-RoPE models)."""
        pin = device.type == "cuda"

        def alloc(shape, dtype):
            return torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids = alloc(max_num_tokens, torch.int64)                   # [max_tokens]
        self.positions = alloc(max_num_tokens, torch.int64)                   # [max_tokens]
        self.slot_mapping = alloc(max_num_tokens, torch.int64)                # [max_tokens]
        self.query_start_loc = alloc(max_num_reqs + 1, torch.int32)           # [max_reqs + 1]
        self.seq_lens = alloc(max_num_reqs, torch.int32)                      # [max_reqs]
        self.block_tables = alloc((max_num_reqs, max_blocks_per_req), torch.int32)  # [max_reqs, max_blocks]
        self.num_groups = num_groups
        self.group_slot_mapping = alloc((num_groups - 1, max_num_tokens), torch.int64)    # [G-1, max_tokens]
        self.group_block_tables = alloc((num_groups - 1, max_num_reqs, max_blocks_per_req),
                                        torch.int32)                         # [G-1, max_reqs, max_blocks]
        self.logits_indices = alloc(max_num_reqs, torch.int64)                # [max_reqs]
        self.placeholder_dst = alloc(max_num_reqs, torch.int64)               # [max_reqs]
        self.placeholder_src = alloc(max_num_reqs, torch.int64)               # [max_reqs]
        self._mirrors = [_HostMirror(max_num_tokens, max_num_reqs, max_blocks_per_req, pin, num_groups)
                         for _ in range(2)]
        self._turn = 0
        self._non_blocking = pin
        # Media inputs of mixed CUDA graphs (``enable_media``); None for text-only models.
        self.mm_embeds: Optional[torch.Tensor] = None
        """[max_graph_tokens, hidden] model dtype: encoder embeddings at their tokens' rows."""
        self.mm_mask: Optional[torch.Tensor] = None
        """[max_graph_tokens] bool: the row takes ``mm_embeds`` instead of its token's embedding."""
        self.mrope_positions: Optional[torch.Tensor] = None
        """[3, max_graph_tokens] int64 M-RoPE positions (M-RoPE models)."""

    def enable_media(self, max_graph_tokens: int, hidden_size: int, dtype: torch.dtype, mrope: bool) -> None:
        """Allocate the media inputs mixed graphs of a vision model read (steps of up to
        ``max_graph_tokens`` tokens)."""
        self.mm_embeds = torch.zeros((max_graph_tokens, hidden_size), dtype=dtype, device=self.device)
        self.mm_mask = torch.zeros(max_graph_tokens, dtype=torch.bool, device=self.device)
        if mrope:
            self.mrope_positions = torch.zeros((3, max_graph_tokens), dtype=torch.int64, device=self.device)

    def write_media(self, num_tokens_padded: int, mm_rows: Optional[tuple[torch.Tensor, torch.Tensor]],
                    mrope_positions: Optional[np.ndarray]) -> None:
        """Fill the media inputs for a mixed graph step (after ``prepare``): the step's encoder rows
        (token indices [M], embeddings [M, hidden]) and its M-RoPE positions ([3, T] host, or None:
        every row equals ``positions``)."""
        t = num_tokens_padded
        self.mm_mask[:t].zero_()
        if mm_rows is not None:
            idx, rows = mm_rows
            self.mm_embeds.index_copy_(0, idx, rows.to(self.mm_embeds.dtype))
            self.mm_mask.index_fill_(0, idx, True)
        if self.mrope_positions is not None:
            if mrope_positions is None:
                self.mrope_positions[:, :t].copy_(self.positions[:t].expand(3, t))
            else:
                n = mrope_positions.shape[1]
                self.mrope_positions[:, :n].copy_(torch.from_numpy(mrope_positions))
                self.mrope_positions[:, n:t].zero_()

    def _next_mirror(self) -> _HostMirror:
        mirror = self._mirrors[self._turn]
        self._turn ^= 1
        if mirror.copied is not None:
            mirror.copied.synchronize()   # its previous copies are done (normally long ago)
        return mirror

    def _send(self, mirror: _HostMirror, name: str, count: int) -> None:
        getattr(self, name)[:count].copy_(getattr(mirror, name)[:count], non_blocking=self._non_blocking)

    def group_tables(self, num_tokens: int, num_reqs: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """KV cache groups 1..'s (slot_mapping [num_tokens], block_tables [num_reqs, max_blocks]) views."""
        return [(self.group_slot_mapping[g, :num_tokens], self.group_block_tables[g, :num_reqs])
                for g in range(self.num_groups - 1)]

    def prepare(self, states: list[CachedRequestState], num_scheduled: list[int], table: BlockTableRows,
                block_size: int, with_lora: bool, num_reqs_padded: Optional[int] = None,
                num_tokens_padded: Optional[int] = None,
                prev_sampled_rows: Optional[dict[str, int]] = None,
                group_tables: Sequence[BlockTableRows] = ()) -> StepInputs:
        """Lay the step's tokens out flat and send them to the device.

        Args:
            states, num_scheduled: the scheduled requests and their token counts, decodes first.
            table: the persistent block table holding each state's row.
            block_size: tokens per KV block.
            with_lora: also fill per-token adapter slots.
            num_reqs_padded: pad to this many requests. Without num_tokens_padded (a decode
                graph's batch size) each padding request has one token that attends one
                null-block key, writes no KV (slot -1) and is not read.
            num_tokens_padded: pad to this many tokens (a mixed graph's size): padding requests
                then have no tokens, and the padding tokens belong to no request (KV slot -1,
                adapter -1; their outputs are garbage and never read).
            prev_sampled_rows: each request's row in the previous step's sampled ids, for input ids the
                host does not have yet: ``gather_placeholders`` writes them once those ids exist on the
                device.
            group_tables: the persistent block tables of KV cache groups 1.. (rows as ``table``'s).
        """
        m = self._next_mirror()
        a = m.np
        num_reqs = len(states)
        padded_reqs = num_reqs_padded or num_reqs
        counts = np.asarray(num_scheduled, dtype=np.int64)                    # [R]
        num_tokens = int(counts.sum())
        pad_req_tokens = 1 if num_tokens_padded is None else 0               # tokens per padding request
        padded_tokens = (num_tokens + (padded_reqs - num_reqs)) if num_tokens_padded is None else num_tokens_padded
        if (padded_tokens > self.max_num_tokens or padded_reqs > self.max_num_reqs
                or padded_tokens < num_tokens or padded_reqs < num_reqs):
            raise RuntimeError(f"step of {num_tokens} tokens / {num_reqs} requests padded to {padded_tokens} / "
                               f"{padded_reqs} does not fit the buffers ({self.max_num_tokens} / "
                               f"{self.max_num_reqs})")

        qsl = a["query_start_loc"]
        qsl[0] = 0
        np.cumsum(counts, out=qsl[1:num_reqs + 1])
        qsl[num_reqs + 1:padded_reqs + 1] = num_tokens + pad_req_tokens * np.arange(1, padded_reqs - num_reqs + 1)
        computed = np.fromiter((s.num_computed_tokens for s in states), np.int64, num_reqs)  # [R]
        rows = np.fromiter((s.row for s in states), np.int64, num_reqs)                      # [R]
        seq_lens = computed + counts                                                         # [R]
        a["seq_lens"][:num_reqs] = seq_lens
        a["seq_lens"][num_reqs:padded_reqs] = pad_req_tokens
        req_of_token = np.repeat(np.arange(num_reqs), counts)                                # [T]
        pos = computed[req_of_token] + np.arange(num_tokens) - qsl[req_of_token]            # [T]
        a["positions"][:num_tokens] = pos
        mrope = self._mrope_positions(states, counts, qsl, computed, a["positions"]) if self.with_mrope else None
        a["positions"][num_tokens:padded_tokens] = 0
        row_of_token, block_of_token, offset = rows[req_of_token], pos // block_size, pos % block_size  # [T]
        per_group = [(a["slot_mapping"], a["block_tables"], table)] + [
            (a["group_slot_mapping"][g], a["group_block_tables"][g], t) for g, t in enumerate(group_tables)]
        for slots, tables, t in per_group:
            slots[:num_tokens] = t.rows[row_of_token, block_of_token].astype(np.int64) * block_size + offset
            slots[num_tokens:padded_tokens] = -1
            tables[:num_reqs] = t.rows[rows]
            tables[num_reqs:padded_reqs] = 0
        a["input_ids"][num_tokens:padded_tokens] = 0

        ids = a["input_ids"]
        sample_req_ids: list[str] = []
        sample_token_idx: list[int] = []
        prompt_ranges: dict[str, tuple[int, int, int]] = {}
        num_ph = 0
        num_decodes = 0
        for i, s in enumerate(states):
            start, n, c = int(qsl[i]), int(counts[i]), int(computed[i])
            known = len(s.token_ids)
            end_known = min(c + n, known)
            if n == 1:
                if c < known:
                    ids[start] = s.token_ids[c]
                if i == num_decodes:
                    num_decodes += 1
            elif end_known > c:
                ids[start:start + end_known - c] = s.token_ids[c:end_known]
            if c + n > known:
                # NOTE: only the one token sampled by the previous step can be unknown here.
                assert c + n == known + 1 and prev_sampled_rows is not None, (s.req_id, c, n, known)
                a["placeholder_dst"][num_ph] = start + n - 1
                a["placeholder_src"][num_ph] = prev_sampled_rows[s.req_id]
                num_ph += 1
            if c + n >= known:
                sample_req_ids.append(s.req_id)
                sample_token_idx.append(start + n - 1)
            if with_lora:
                a["token_lora_slots"][start:start + n] = s.lora_slot
            if s.sampling_params.prompt_logprobs is not None and c < s.num_prompt_tokens:
                # Logits at position p score prompt token p + 1; the last prompt position scores
                # the first output token, which is not a prompt logprob.
                last = min(c + n, s.num_prompt_tokens - 1)
                if last > c:
                    prompt_ranges[s.req_id] = (start, last - c, c + 1)
        num_sampled = len(sample_req_ids)
        a["logits_indices"][:num_sampled] = sample_token_idx
        lora_slots = None
        if with_lora:
            a["token_lora_slots"][num_tokens:padded_tokens] = -1     # graph padding runs the base model
            lora_slots = a["token_lora_slots"][:padded_tokens].copy()

        for name, count in (("input_ids", padded_tokens), ("positions", padded_tokens),
                            ("slot_mapping", padded_tokens), ("query_start_loc", padded_reqs + 1),
                            ("seq_lens", padded_reqs), ("block_tables", padded_reqs),
                            ("logits_indices", num_sampled), ("placeholder_dst", num_ph),
                            ("placeholder_src", num_ph)):
            self._send(m, name, count)
        if group_tables:
            self.group_slot_mapping[:, :padded_tokens].copy_(m.group_slot_mapping[:, :padded_tokens],
                                                             non_blocking=self._non_blocking)
            self.group_block_tables[:, :padded_reqs].copy_(m.group_block_tables[:, :padded_reqs],
                                                           non_blocking=self._non_blocking)
        if m.copied is not None:
            m.copied.record()

        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:padded_tokens],
            query_start_loc=self.query_start_loc[:padded_reqs + 1],
            seq_lens=self.seq_lens[:padded_reqs],
            block_tables=self.block_tables[:padded_reqs],
            max_query_len=int(counts.max()) if num_reqs else 0,
            max_seq_len=int(seq_lens.max()) if num_reqs else 0,
            num_decode_reqs=num_decodes + pad_req_tokens * (padded_reqs - num_reqs),
            query_start_loc_cpu=qsl[:padded_reqs + 1].tolist(),
            seq_lens_cpu=a["seq_lens"][:padded_reqs].tolist(),
            slots_padded=padded_tokens > num_tokens,
        )
        if group_tables:
            meta.with_groups(self.group_tables(padded_tokens, padded_reqs))
        all_rows_sample = num_sampled == num_reqs and num_tokens == num_reqs
        return StepInputs(
            req_ids=[s.req_id for s in states], num_tokens=num_tokens, num_tokens_padded=padded_tokens,
            input_ids=self.input_ids[:padded_tokens], positions=self.positions[:padded_tokens],
            attn_metadata=meta, sample_req_ids=sample_req_ids,
            logits_indices=self.logits_indices[:num_sampled], all_rows_sample=all_rows_sample,
            token_lora_slots=lora_slots,
            prompt_logprob_ranges=prompt_ranges, num_placeholders=num_ph, mrope_positions=mrope)

    def gather_placeholders(self, num_placeholders: int, prev_sampled: Optional[torch.Tensor]) -> None:
        """Write the prepared step's input ids the host does not have: the previous step's samples
        (``prev_sampled``: [num_sampled] on the device), gathered on the device by the rows ``prepare`` was
        given. A step without placeholders needs no ``prev_sampled``."""
        if num_placeholders:
            self.input_ids.index_copy_(0, self.placeholder_dst[:num_placeholders],
                                       prev_sampled.index_select(0, self.placeholder_src[:num_placeholders]))

    @staticmethod
    def _mrope_positions(states: list[CachedRequestState], counts: np.ndarray, qsl: np.ndarray,
                         computed: np.ndarray, positions: np.ndarray) -> Optional[np.ndarray]:
        """Rewrite ``positions`` ([T] host) to rotary positions for requests with an M-RoPE table
        (row 0 in the prompt, index + delta after it), and return the step's [3, T] positions when
        any scheduled token lies in such a prompt (None otherwise: all rows equal ``positions``)."""
        segments: list[tuple[int, np.ndarray]] = []   # (first token in the step, [3, n] table slice)
        for i, s in enumerate(states):
            if s.mrope_positions is None:
                continue
            start, n, c = int(qsl[i]), int(counts[i]), int(computed[i])
            in_prompt = max(0, min(c + n, s.mrope_positions.shape[1]) - c)
            positions[start + in_prompt:start + n] += s.mrope_delta
            if in_prompt:
                table = s.mrope_positions[:, c:c + in_prompt]                          # [3, in_prompt]
                positions[start:start + in_prompt] = table[0]
                segments.append((start, table))
        if not segments:
            return None
        full = np.tile(positions[:int(counts.sum())], (3, 1))                         # [3, T]
        for start, table in segments:
            full[:, start:start + table.shape[1]] = table
        return full
