"""Attention over the paged KV cache for a mixed batch of prefill chunks and decodes.

The runner builds one ``AttentionMetadata`` per step and enters ``engine.forward_context`` with
it; each ``PagedAttention`` layer reads it, writes this step's K/V into its cache by ``slot_mapping``,
then attends over the request's cached prefix + the new tokens (causal within the chunk).

Two refinements of causal attention, the same in every backend (``kernels.reference.paged_attention_ref``):

- a sliding window (per layer, ``PagedAttention.sliding_window``): the query at position p sees keys
  p - window < k <= p, transformers' ``sliding_window_overlay`` (``kv_idx > q_idx - sliding_window``: the
  query and the window - 1 keys before it). Keys before the window are never read, so their blocks may
  have been returned to the pool (``engine.kv_cache_manager``);
- per-token key limits (``AttentionMetadata.key_limit``): the query token t sees keys up to
  ``key_limit[t]`` instead of its own position: the tokens of one image of Gemma 3 attend to each other
  both ways (``engine.models.gemma3_vl``). The window still applies on top (transformers' sliding layers:
  AND(window, OR(causal, same image))).

Backends: ``torch`` (the reference; used on CPU and as the test oracle) and ``triton``
(``kernels/paged_attention.py``; used on CUDA). Both compute the same function. An FP8 KV cache
(``--kv-cache-dtype fp8``) is the Triton backend's alone: its kernels quantize K/V on write and
dequantize them in registers with each layer's ``k_scale`` / ``v_scale``, passed by the layer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from engine.kernel_policy import KernelPolicy
from kernels.cpu_decode_attention import CpuDecodeAttention, supports as cpu_decode_supports


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, built once by the runner and shared by all layers."""

    slot_mapping: torch.Tensor
    """[num_tokens] int64: flat KV slot (block_id * block_size + offset) of each new token."""
    query_start_loc: torch.Tensor
    """[num_reqs + 1] int32: cumulative query lengths; request i owns tokens [qsl[i], qsl[i+1])."""
    seq_lens: torch.Tensor
    """[num_reqs] int32: context length of each request after this step (cached + new)."""
    block_tables: torch.Tensor
    """[num_reqs, max_num_blocks] int32: KV block ids of each request (padding: 0)."""
    max_query_len: int
    max_seq_len: int
    num_decode_reqs: int = 0
    """Requests with exactly one query token. NOTE: the runner orders decodes first."""
    query_start_loc_cpu: Optional[list[int]] = None
    """Host copy of query_start_loc (the torch backend loops over requests)."""
    seq_lens_cpu: Optional[list[int]] = None
    """Host copy of seq_lens."""
    torch_decode: Optional["TorchDecodePlan"] = None
    """Torch backend: how the step's decode rows read their context (``_decode_plan``), built by the
    first layer and reused by the others."""
    per_token: Optional["AttentionMetadata"] = None
    """Cross-attention on the Triton backend: this metadata as one single-query request per token
    (``per_token_metadata``), built by the step's first layer that needs it and reused by the others."""
    slots_padded: Optional[bool] = None
    """Host flag: some ``slot_mapping`` entry is -1 (a padding token). False lets the torch backend's KV
    write skip its per-layer check; None: unknown (checked per write)."""
    key_limit: Optional[torch.Tensor] = None
    """[num_tokens] int32: the last key position each query token sees (its own position for a causal
    token, the last token of its image for an image token of a bidirectional span); None: every token
    is causal. Filled by a model with bidirectional spans (``engine.models.gemma3_vl``) at the top of its
    forward, on steps with a prefill chunk (eager, or a mixed CUDA graph's capture); a decode row's limit is
    always its own position (the scheduler never ends a prefill chunk inside such a span)."""
    captured: bool = False
    """Built for a CUDA-graph capture: the host fields (max lengths, num_decode_reqs) describe the
    graph's bucket, not the requests a replay will run."""
    kv_groups: tuple["AttentionMetadata", ...] = ()
    """KV cache groups 1.. (``engine.kv_cache_groups``): this metadata with each group's ``slot_mapping`` and
    ``block_tables`` (views of the runner's step buffers), read by that group's layers (``for_group``); this
    one is group 0's. Empty with one group."""

    def for_group(self, group: int) -> "AttentionMetadata":
        """The metadata KV cache group ``group``'s layers read (this one for group 0), with the ``key_limit``
        a model set on this one."""
        if group == 0:
            return self
        meta = self.kv_groups[group - 1]
        meta.key_limit = self.key_limit
        return meta

    def with_groups(self, tables: list[tuple[torch.Tensor, torch.Tensor]]) -> "AttentionMetadata":
        """This metadata with ``kv_groups`` made from each group 1..'s (slot_mapping, block_tables)."""
        self.kv_groups = tuple(replace(self, slot_mapping=slots, block_tables=table)
                               for slots, table in tables)
        return self

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]


@dataclass
class TorchDecodePlan:
    """The torch backend's reading of one step's decode rows (the first ``num_decode_reqs`` requests)."""

    num_blocks: int
    """Blocks that cover the longest decode context."""
    first_block: Optional[int]
    """A lone decode row whose blocks are consecutive ids from ``first_block`` (a fresh or lone request's
    usual layout): its context is a view of the cache, read in place with no gather; else None."""
    key_mask: Optional[torch.Tensor]
    """[num_decode_reqs, 1, 1, num_blocks * block_size] float32, 0 on each row's real keys and -inf on the
    padding of the gathered rows (an additive mask: SDPA on CPU converts a bool one per call); None for a
    single row (its keys are sliced to its length)."""
    block_ids: Optional[torch.Tensor] = None
    """[num_decode_reqs * num_blocks] int64: the blocks the gathered rows read (None: ``first_block``)."""


# ----------------------------------------------------------------------------------------
# Torch reference backend
# ----------------------------------------------------------------------------------------
BF16_PREFILL_MIN_TOKENS = 128
"""Query tokens from which a CPU prefill chunk of a model with bf16-product weights attends in bfloat16: the
flash kernel's crossover on the 2-core AMX machine, casts included (RESULTS.md "What sets the CPU defaults")."""
SLICE_WRITE_MIN_TOKENS = 64
"""Rows from which ``write_kv_torch`` checks for consecutive slots (a fresh prefill over consecutive blocks)
and writes them as one slice."""


def write_kv_torch(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, slots_padded: Optional[bool] = None) -> None:
    """Store new K/V rows at their slots (rows with slot -1 are skipped).

    k, v: [num_tokens, num_kv_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim].
    slots_padded: ``AttentionMetadata.slots_padded`` (False: no -1 slots, nothing to check).
    """
    nb, bs, h, d = k_cache.shape
    if slots_padded is not False:
        keep = slot_mapping >= 0                  # slot -1: padding token, writes nothing (as the kernel)
        if not bool(keep.all()):
            k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    n = slot_mapping.numel()
    if n >= SLICE_WRITE_MIN_TOKENS:
        # A prefill chunk over consecutive blocks: one slice copy, faster than index_copy_
        # (RESULTS.md "What sets the CPU defaults").
        first = int(slot_mapping[0])
        if torch.equal(slot_mapping, torch.arange(first, first + n, device=slot_mapping.device,
                                                  dtype=slot_mapping.dtype)):
            k_cache.view(nb * bs, h, d)[first:first + n].copy_(k)
            v_cache.view(nb * bs, h, d)[first:first + n].copy_(v)
            return
    k_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks, block_size, Hkv, D], block_ids [N] int64 -> [N, block_size * Hkv * D].

    ``index_select`` on a flat view: several times faster on CPU than advanced indexing.
    """
    return cache.view(cache.shape[0], -1).index_select(0, block_ids)


def _context_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table_row: torch.Tensor,
                seq_len: int, first_block: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's cached K and V at positions [first_block * block_size, seq_len) ([len, num_kv_heads,
    head_dim] each), gathered from its block table row (blocks before ``first_block`` are not read)."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    nblk = (seq_len + block_size - 1) // block_size - first_block
    block_ids = block_table_row[first_block:first_block + nblk].to(torch.long)
    length = seq_len - first_block * block_size
    k = _gather_blocks(k_cache, block_ids).view(nblk * block_size, num_kv_heads, head_dim)[:length]
    v = _gather_blocks(v_cache, block_ids).view(nblk * block_size, num_kv_heads, head_dim)[:length]
    return k, v


def window_start(position: int, window: Optional[int]) -> int:
    """The first key position the query at ``position`` sees under a sliding ``window`` (None: 0)."""
    return 0 if window is None else max(0, position - window + 1)


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: AttentionMetadata, scale: float, k_new: Optional[torch.Tensor] = None,
                          v_new: Optional[torch.Tensor] = None, bf16_min_tokens: Optional[int] = None,
                          decode_kernel: Optional[CpuDecodeAttention] = None,
                          window: Optional[int] = None) -> torch.Tensor:
    """Causal attention of each request's new tokens over its whole cached context (within the last
    ``window`` positions of each query when given, and up to ``meta.key_limit`` where set: the module
    docstring).

    q: [num_tokens, num_heads, head_dim] -> out: [num_tokens, num_heads, head_dim].
    Decodes (one query token) are batched into one padded attention; prefill chunks run one
    SDPA call each, with the mask shifted by the cached prefix length. A chunk with no cached
    prefix attends to this step's ``k_new``/``v_new`` ([num_tokens, num_kv_heads, head_dim])
    directly (plain causal SDPA, no gather), when they are given. A chunk of at least ``bf16_min_tokens``
    queries (None: never) attends with bfloat16 q, k and v (the CPU flash kernel's AMX path; float32
    softmax, sums and output), as a model whose weights multiply in bfloat16 asks (``AttentionBackend``).
    With ``decode_kernel`` (CPU, a float32 or bfloat16 cache), the decode rows attend through it, reading the
    blocks in place (of their window only), instead of through a gathered copy and SDPA (without it, decode rows
    whose context is longer than ``window`` gather their window's blocks, ``_windowed_decode``). Chunks whose
    window or key limits change the causal mask take the masked call, over their window's blocks only.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    qsl = meta.query_start_loc_cpu if meta.query_start_loc_cpu is not None else meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens_cpu if meta.seq_lens_cpu is not None else meta.seq_lens.tolist()
    nd = meta.num_decode_reqs

    if nd > 0 and decode_kernel is not None and q.dtype == torch.float32:
        od = decode_kernel(q[:nd], k_cache, v_cache, meta.block_tables, meta.seq_lens[:nd],
                           max(seq_lens[:nd]), scale, window=window)              # [nd, H, d]
        if nd == num_tokens:
            return od
        out = torch.empty_like(q)
        out[:nd] = od
    elif nd > 0 and window is not None and max(seq_lens[:nd]) > window:
        od = _windowed_decode(q[:nd], k_cache, v_cache, meta.block_tables, seq_lens[:nd], window, scale)
        if nd == num_tokens:
            return od
        out = torch.empty_like(q)
        out[:nd] = od
    elif nd > 0:
        plan = meta.torch_decode
        if plan is None:
            plan = _decode_plan(meta, seq_lens, block_size)
            if not meta.captured:      # a captured step's buffers change between replays
                meta.torch_decode = plan
        padded = plan.num_blocks * block_size
        if plan.first_block is not None:
            first = plan.first_block
            k = k_cache[first:first + plan.num_blocks].view(1, padded, num_kv_heads, head_dim)
            v = v_cache[first:first + plan.num_blocks].view(1, padded, num_kv_heads, head_dim)
        else:
            k = _gather_blocks(k_cache, plan.block_ids).view(nd, padded, num_kv_heads, head_dim)
            v = _gather_blocks(v_cache, plan.block_ids).view(nd, padded, num_kv_heads, head_dim)
        mask = plan.key_mask
        if mask is None:                              # one row: its keys, no mask
            k, v = k[:, :seq_lens[0]], v[:, :seq_lens[0]]
        # A KV head's query heads as the query length: each KV head's keys are read once for its whole
        # group, no K/V repeat (faster on CPU than enable_gqa; RESULTS.md "What sets the CPU defaults").
        # Decode rows attend to every cached key, so no causal mask.
        qd = q[:nd].view(nd, num_kv_heads, group, head_dim).float()                  # [nd, Hkv, G, d]
        od = F.scaled_dot_product_attention(qd, k.transpose(1, 2).float(), v.transpose(1, 2).float(),
                                            attn_mask=mask, scale=scale)          # [nd, Hkv, G, d]
        od = od.reshape(nd, num_heads, head_dim).to(q.dtype)
        if nd == num_tokens:
            return od                                 # a pure decode step: no copy into an output
        out = torch.empty_like(q)
        out[:nd] = od
    else:
        out = torch.empty_like(q)

    # Fresh prefills (no cached prefix) of equal length go through one batched causal SDPA call.
    fresh: dict[int, list[int]] = {}
    if k_new is not None:
        for i in range(nd, len(seq_lens)):
            qlen = qsl[i + 1] - qsl[i]
            if qlen > 1 and seq_lens[i] == qlen and not _masked(qlen, window, meta):
                fresh.setdefault(qlen, []).append(i)
    for qlen, reqs in fresh.items():
        if len(reqs) < 2:
            continue
        starts = torch.tensor([qsl[i] for i in reqs], device=q.device)
        rows = (starts[:, None] + torch.arange(qlen, device=q.device)[None, :]).reshape(-1)  # [B * qlen]
        shape = (len(reqs), qlen)
        dtype = _prefill_dtype(qlen, bf16_min_tokens, q.device)
        qb = q.index_select(0, rows).view(*shape, num_heads, head_dim).transpose(1, 2).to(dtype)
        kb = k_new.index_select(0, rows).view(*shape, num_kv_heads, head_dim).transpose(1, 2).to(dtype)
        vb = v_new.index_select(0, rows).view(*shape, num_kv_heads, head_dim).transpose(1, 2).to(dtype)
        o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=group > 1)
        out.index_copy_(0, rows, o.transpose(1, 2).reshape(-1, num_heads, head_dim).to(q.dtype))
    batched = {i for reqs in fresh.values() if len(reqs) > 1 for i in reqs}

    for i in range(nd, len(seq_lens)):
        start, end = qsl[i], qsl[i + 1]
        qlen, slen = end - start, seq_lens[i]
        if qlen == 0 or i in batched:
            continue
        ctx = slen - qlen
        if _masked(slen, window, meta):
            out[start:end] = _masked_prefill(q[start:end], k_cache, v_cache, meta, i, ctx, window, scale,
                                             (k_new[start:end], v_new[start:end]) if ctx == 0 and k_new is not None
                                             else None).to(q.dtype)
            continue
        dtype = _prefill_dtype(qlen, bf16_min_tokens, q.device)
        # NOTE: 4-D (a batch of one): on CPU, 3-D inputs take SDPA's generic path, several times slower.
        qi = _heads_first(q[start:end], dtype)                               # [1, H, qlen, d]
        if ctx > 0 and k_new is not None and q.device.type == "cpu" and _FLASH_WITH_LSE is not None:
            kp, vp = _context_kv(k_cache, v_cache, meta.block_tables[i], ctx)  # the cached prefix only
            o = _prefix_then_chunk(qi, _heads_first(kp, dtype), _heads_first(vp, dtype),
                                   _heads_first(k_new[start:end], dtype), _heads_first(v_new[start:end], dtype),
                                   scale)
            out[start:end] = o[0].transpose(0, 1).to(q.dtype)
            continue
        if ctx == 0 and k_new is not None:
            k, v = k_new[start:end], v_new[start:end]
        else:
            k, v = _context_kv(k_cache, v_cache, meta.block_tables[i], slen)
            qi, dtype = qi.float(), torch.float32      # the masked call (no flash kernel): float32
        ki, vi = _heads_first(k, dtype), _heads_first(v, dtype)             # [1, Hkv, slen, d]
        if ctx == 0:
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=group > 1)
        else:
            # Query j (absolute position ctx + j) sees keys 0..ctx + j.
            mask = (torch.arange(slen, device=q.device)[None, :]
                    <= (ctx + torch.arange(qlen, device=q.device))[:, None])
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask[None, None], scale=scale,
                                               enable_gqa=group > 1)
        out[start:end] = o[0].transpose(0, 1).to(q.dtype)
    return out


def _masked(seq_len: int, window: Optional[int], meta: AttentionMetadata) -> bool:
    """Whether a prefill chunk of a ``seq_len`` context needs more than the causal mask: a window shorter
    than its context, or per-token key limits in the step."""
    return (window is not None and seq_len > window) or meta.key_limit is not None


def _masked_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    req: int, ctx: int, window: Optional[int], scale: float,
                    kv_new: Optional[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """One prefill chunk (q [qlen, H, d], its queries at positions ctx ..) under the window and the key limits
    -> [qlen, H, d] float32: one masked SDPA call over the keys from its first query's window start (read from
    the cache a block at a time, or ``kv_new`` ([qlen, Hkv, d] each) for a chunk with no cached prefix)."""
    qlen, num_heads, _ = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    first_block = window_start(ctx, window) // block_size
    if kv_new is not None:
        (k, v), first_block = kv_new, 0
    else:
        k, v = _context_kv(k_cache, v_cache, meta.block_tables[req], ctx + qlen, first_block)
    dev = q.device
    kpos = first_block * block_size + torch.arange(k.shape[0], device=dev)              # [L]
    qpos = ctx + torch.arange(qlen, device=dev)                                          # [qlen]
    qsl = meta.query_start_loc_cpu if meta.query_start_loc_cpu is not None else meta.query_start_loc.tolist()
    hi = qpos if meta.key_limit is None else meta.key_limit[qsl[req]:qsl[req] + qlen].to(qpos.dtype)
    mask = kpos[None, :] <= hi[:, None]                                                  # [qlen, L]
    if window is not None:
        mask &= kpos[None, :] > (qpos - window)[:, None]
    o = F.scaled_dot_product_attention(_heads_first(q), _heads_first(k), _heads_first(v), attn_mask=mask[None, None],
                                       scale=scale, enable_gqa=num_heads != num_kv_heads)  # [1, H, qlen, d]
    return o[0].transpose(0, 1)


def _windowed_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: list[int], window: int, scale: float) -> torch.Tensor:
    """Decode rows (q [nd, H, d], one query each, at position seq_len - 1) over their last ``window`` keys:
    each row gathers only the blocks its window touches -> [nd, H, d] in q's dtype."""
    nd, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    dev = q.device
    first = torch.tensor([max(0, s - window) // block_size for s in seq_lens], device=dev)   # [nd]
    lens = torch.tensor(seq_lens, device=dev)                                                 # [nd]
    num_blocks = max(-(-s // block_size) - max(0, s - window) // block_size for s in seq_lens)
    cols = (first[:, None] + torch.arange(num_blocks, device=dev)[None, :]).clamp_(max=block_tables.shape[1] - 1)
    ids = block_tables[:nd].gather(1, cols).reshape(-1).to(torch.long)                       # [nd * num_blocks]
    padded = num_blocks * block_size
    k = _gather_blocks(k_cache, ids).view(nd, padded, num_kv_heads, head_dim)
    v = _gather_blocks(v_cache, ids).view(nd, padded, num_kv_heads, head_dim)
    kpos = first[:, None] * block_size + torch.arange(padded, device=dev)[None, :]            # [nd, padded]
    real = (kpos < lens[:, None]) & (kpos >= (lens - window)[:, None])
    mask = torch.zeros(real.shape, dtype=torch.float32, device=dev).masked_fill_(~real, float("-inf"))
    qd = q.view(nd, num_kv_heads, num_heads // num_kv_heads, head_dim).float()              # [nd, Hkv, G, d]
    od = F.scaled_dot_product_attention(qd, k.transpose(1, 2).float(), v.transpose(1, 2).float(),
                                        attn_mask=mask[:, None, None, :], scale=scale)      # [nd, Hkv, G, d]
    return od.reshape(nd, num_heads, head_dim).to(q.dtype)


_FLASH_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
"""SDPA's CPU flash kernel, which also returns each query's log-sum-exp (None where torch lacks it: the masked
SDPA call serves instead)."""


def _prefill_dtype(qlen: int, bf16_min_tokens: Optional[int], device: torch.device) -> torch.dtype:
    """The dtype a prefill chunk of ``qlen`` queries attends in (``paged_attention_torch``)."""
    low = bf16_min_tokens is not None and qlen >= bf16_min_tokens and device.type == "cpu"
    return torch.bfloat16 if low else torch.float32


def _heads_first(x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[len, heads, d] -> [1, heads, len, d] in ``dtype`` (a view where x has it)."""
    return x.transpose(0, 1)[None].to(dtype)


def _prefix_then_chunk(q: torch.Tensor, k_prefix: torch.Tensor, v_prefix: torch.Tensor, k_chunk: torch.Tensor,
                       v_chunk: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of a prefill chunk over its cached prefix and itself, as two flash calls merged by their
    log-sum-exps: the prefix unmasked, the chunk causal (its queries and keys start together). One masked call
    over both reads an explicit [qlen, ctx + qlen] mask and cannot skip the chunk's upper triangle.

    q: [1, H, qlen, d]; k/v_prefix: [1, Hkv, ctx, d]; k/v_chunk: [1, Hkv, qlen, d] -> [1, H, qlen, d] float32
    (inputs float32 or bfloat16; the log-sum-exps and the merge are float32).
    """
    o1, lse1 = _FLASH_WITH_LSE(q, k_prefix, v_prefix, 0.0, False, scale=scale)   # [1, H, qlen, d], [1, H, qlen]
    o2, lse2 = _FLASH_WITH_LSE(q, k_chunk, v_chunk, 0.0, True, scale=scale)
    top = torch.maximum(lse1, lse2)
    w1 = (lse1 - top).exp_().unsqueeze(-1)                                          # [1, H, qlen, 1]
    w2 = (lse2 - top).exp_().unsqueeze(-1)
    return (o1.float() * w1).add_(o2.float() * w2).div_(w1 + w2)


def _decode_plan(meta: AttentionMetadata, seq_lens: list[int], block_size: int) -> TorchDecodePlan:
    nd = meta.num_decode_reqs
    num_blocks = (max(seq_lens[:nd]) + block_size - 1) // block_size
    block_ids = meta.block_tables[:nd, :num_blocks].reshape(-1).to(torch.long)
    if nd > 1:
        padded = num_blocks * block_size
        real = torch.arange(padded, device=meta.seq_lens.device)[None, :] < meta.seq_lens[:nd, None]
        mask = torch.zeros(real.shape, dtype=torch.float32, device=real.device).masked_fill_(~real, float("-inf"))
        return TorchDecodePlan(num_blocks=num_blocks, first_block=None, key_mask=mask[:, None, None, :],
                               block_ids=block_ids)
    row = block_ids.tolist()
    consecutive = row == list(range(row[0], row[0] + num_blocks))
    return TorchDecodePlan(num_blocks=num_blocks, first_block=row[0] if consecutive else None, key_mask=None,
                           block_ids=None if consecutive else block_ids)


def cross_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: AttentionMetadata, scale: float,
                          decode_kernel: Optional[CpuDecodeAttention] = None) -> torch.Tensor:
    """Cross-attention: every query token of request i attends to all ``seq_lens[i]`` encoder positions
    held in its blocks ``block_tables[i]`` (no causal mask).

    q: [num_tokens, num_heads, head_dim] -> out: [num_tokens, num_heads, head_dim]. With ``decode_kernel``
    (float32 queries), every token attends in one call of it as a one-query request over its request's
    blocks, read in place (a query sees all positions, so this is exact); else one gather and one SDPA call
    per request (its tokens share the K/V).
    """
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    qsl = meta.query_start_loc_cpu if meta.query_start_loc_cpu is not None else meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens_cpu if meta.seq_lens_cpu is not None else meta.seq_lens.tolist()
    if decode_kernel is not None and q.dtype == torch.float32 and q.shape[0] > 0:
        tables, lengths = meta.block_tables, meta.seq_lens                   # [R, blocks], [R]
        if meta.max_query_len > 1 or q.shape[0] != len(seq_lens):           # not one token per request
            counts = torch.tensor([qsl[i + 1] - qsl[i] for i in range(len(seq_lens))])     # [R]
            tables = tables.repeat_interleave(counts, dim=0)                 # [T, blocks]
            lengths = lengths.repeat_interleave(counts)                      # [T]
        max_len = max(slen for i, slen in enumerate(seq_lens) if qsl[i + 1] > qsl[i])
        return decode_kernel(q, k_cache, v_cache, tables, lengths, max_len, scale)   # [T, H, D]
    out = torch.empty_like(q)
    for i, slen in enumerate(seq_lens):
        start, end = qsl[i], qsl[i + 1]
        if start == end:
            continue
        k, v = _context_kv(k_cache, v_cache, meta.block_tables[i], slen)
        qi = _heads_first(q[start:end])                                      # [1, H, qlen, d]
        o = F.scaled_dot_product_attention(qi, k.transpose(0, 1)[None].float(), v.transpose(0, 1)[None].float(),
                                           scale=scale, enable_gqa=num_heads != num_kv_heads)
        out[start:end] = o[0].transpose(0, 1).to(q.dtype)
    return out


def per_token_metadata(meta: AttentionMetadata, num_tokens: int) -> AttentionMetadata:
    """``meta`` (requests over their cross blocks) as one single-query request per token, on the device
    without a host sync: the paged kernel's decode path then attends each token to all of its request's
    positions (a one-token query sees its whole context)."""
    counts = meta.query_start_loc[1:] - meta.query_start_loc[:-1]                       # [R]
    req_of_token = torch.repeat_interleave(torch.arange(counts.shape[0], device=counts.device), counts,
                                           output_size=num_tokens)                      # [T]
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping, query_start_loc=torch.arange(num_tokens + 1, dtype=torch.int32,
                                                                     device=counts.device),
        seq_lens=meta.seq_lens.index_select(0, req_of_token), block_tables=meta.block_tables.index_select(0, req_of_token),
        max_query_len=1, max_seq_len=meta.max_seq_len, num_decode_reqs=num_tokens)


# ----------------------------------------------------------------------------------------
# Backend choice
# ----------------------------------------------------------------------------------------
class AttentionBackend:
    """Writes K/V and attends; ``torch`` everywhere, ``triton`` on CUDA.

    Args:
        name: "torch" or "triton".
        policy: the engine's kernel policy (decode tiles, which decode steps fuse rotary);
            None: ``KernelPolicy()``'s defaults.
        bf16_prefill: torch backend: prefill chunks of ``BF16_PREFILL_MIN_TOKENS`` queries or more attend in
            bfloat16 (``paged_attention_torch``); set where the model's weights multiply in bfloat16
            (``engine.layers.quantized``'s AMX copies), never for float weights, which stay exact.
        cpu_decode: torch backend: ``kernels.cpu_decode_attention``'s kernel for the decode rows of the
            caches it supports (``select_backend`` loads it per ``KernelPolicy.cpu_decode_attention``).
    """

    def __init__(self, name: str, policy: Optional[KernelPolicy] = None, bf16_prefill: bool = False,
                 cpu_decode: Optional[CpuDecodeAttention] = None) -> None:
        if name not in ("torch", "triton"):
            raise ValueError(f"attention backend {name!r}: use 'torch' or 'triton'.")
        self.name = name
        self.cpu_decode = cpu_decode if name == "torch" else None
        """Torch backend: the CPU decode attention kernel, for the caches it supports (None: SDPA)."""
        self.bf16_min_tokens = BF16_PREFILL_MIN_TOKENS if bf16_prefill and name == "torch" else None
        """Query tokens from which a prefill chunk attends in bfloat16 (None: never)."""
        self.policy = policy or KernelPolicy()
        self.decode_tiles = self.policy.attn_decode_tiles
        """Decode attention tile overrides (``KernelPolicy.attn_decode``)."""

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping, slots_padded: Optional[bool] = None, *,
                 k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        """Store k, v ([T, Hkv, D]) at ``slot_mapping``; ``k_scale`` / ``v_scale``: an FP8 cache's scales
        (Triton backend; the cache stores k / k_scale, v / v_scale)."""
        if self.name == "triton":
            from kernels.kv_write import write_kv
            write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
        else:
            write_kv_torch(k, v, k_cache, v_cache, slot_mapping, slots_padded)

    def attend(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, k_new=None,
               v_new=None, *, k_scale: float = 1.0, v_scale: float = 1.0,
               window: Optional[int] = None) -> torch.Tensor:
        """Causal attention of q ([T, H, D]) over the cached context (``paged_attention_torch``'s
        semantics: within ``window`` positions when given, up to ``meta.key_limit`` where set) -> [T, H, D];
        ``k_scale`` / ``v_scale`` as ``write_kv``'s."""
        if self.name == "triton":
            from kernels.paged_attention import paged_attention
            return paged_attention(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens,
                                   meta.block_tables, meta.max_query_len, meta.max_seq_len, scale,
                                   has_decodes=meta.captured or meta.num_decode_reqs > 0,
                                   decode_tiles=self.decode_tiles, k_scale=k_scale, v_scale=v_scale,
                                   window=window, key_limit=meta.key_limit)
        decode_kernel = self.cpu_decode if self.cpu_decode is not None and cpu_decode_supports(
            q.shape[1], k_cache.shape[2], k_cache.shape[3], k_cache.shape[1], k_cache.dtype) else None
        return paged_attention_torch(q, k_cache, v_cache, meta, scale, k_new, v_new, self.bf16_min_tokens,
                                     decode_kernel, window)

    def attend_cross(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, *, k_scale: float = 1.0,
                     v_scale: float = 1.0) -> torch.Tensor:
        """Cross-attention (``cross_attention_torch``'s semantics): q [T, H, D] -> [T, H, D]; ``meta``
        describes requests over their cross blocks (``max_query_len`` its longest query); ``k_scale`` /
        ``v_scale`` as ``write_kv``'s."""
        if self.name == "triton":
            from kernels.paged_attention import paged_attention
            if meta.max_query_len > 1:
                if meta.per_token is None:
                    meta.per_token = per_token_metadata(meta, q.shape[0])
                meta = meta.per_token
            return paged_attention(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                   1, meta.max_seq_len, scale, has_decodes=True, decode_tiles=self.decode_tiles,
                                   k_scale=k_scale, v_scale=v_scale)
        decode_kernel = self.cpu_decode if self.cpu_decode is not None and cpu_decode_supports(
            q.shape[1], k_cache.shape[2], k_cache.shape[3], k_cache.shape[1], k_cache.dtype) else None
        return cross_attention_torch(q, k_cache, v_cache, meta, scale, decode_kernel)

    def attend_decode_rotary(self, q, k, v, positions, rotary, k_cache, v_cache, meta: AttentionMetadata,
                             scale: float, *, k_scale: float = 1.0, v_scale: float = 1.0,
                             window: Optional[int] = None, qk_norm=None) -> Optional[torch.Tensor]:
        """Rotary + KV write + attention of a pure-decode step as one kernel
        (``kernels.paged_attention.paged_decode_rotary``; q, k, v before rotary, q not written
        back) -> out [T, H, D]; None where this step does not take it (torch backend, a step
        with more than one query token per request, or a batch the policy does not fuse,
        ``KernelPolicy.fuses_decode_rotary``): then the caller rotates, writes and attends as usual.
        ``k_scale`` / ``v_scale`` as ``write_kv``'s; ``window`` as ``attend``'s; ``qk_norm``
        (``kernels.kv_write.QKNormWeights``): q and k RMS-normalized per head before rotary, in the kernel."""
        if (meta.max_query_len > 1 or q.shape[0] != meta.seq_lens.shape[0]
                or not self._fuses_decode_rotary(q.shape[0], k_cache.shape[2], q.device)):
            return None
        from kernels.paged_attention import paged_decode_rotary
        half = rotary.rotary_dim // 2
        return paged_decode_rotary(q, k, v, positions, rotary.cos[:, :half], rotary.sin[:, :half],
                                   rotary.rotary_dim, k_cache, v_cache, meta.slot_mapping, meta.query_start_loc,
                                   meta.seq_lens, meta.block_tables, meta.max_seq_len, scale,
                                   decode_tiles=self.decode_tiles, k_scale=k_scale, v_scale=v_scale,
                                   window=window, qk_norm=qk_norm)

    def _fuses_decode_rotary(self, num_reqs: int, num_kv_heads: int, device: torch.device) -> bool:
        """Whether a pure-decode batch of ``num_reqs`` takes ``attend_decode_rotary``'s kernel."""
        return self.name == "triton" and self.policy.fuses_decode_rotary(num_reqs, num_kv_heads, device)

    def warm_up(self, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, scale: float,
                rotary_dim: Optional[int] = None, q_dtype: Optional[torch.dtype] = None, qk_norm=None) -> int:
        """Compile the attention kernel's eager-step variants now, at start-up, instead of in the
        first steps that need them; returns the number of attention calls made (0: torch backend).

        Why: an eager (prefill or mixed) step picks its launch constants from its shape (prefill
        tiles of 16 or 64 rows, a separate decode launch, ``find_chunk``), and Triton compiles each
        new combination when first launched. Without this warm-up the first burst of requests after
        start waited longer for its first tokens than the same burst right after (benchmarks/RESULTS.md,
        "Launch configs and constants inside the kernels").
        The calls attend 2 or 17 requests of zero queries over block 0 of the cache (read only),
        with the longest query below and at the 64-token prefill tile, with and without decodes,
        and one pure-decode batch large enough for the decode kernel's small tiles. With
        ``rotary_dim`` (the model's) the pure-decode batches that take the fused rotary kernel
        (``attend_decode_rotary``) also run it, writing nowhere (slots -1). ``q_dtype``: the model's
        activations (None: the cache's dtype, which an FP8 cache cannot be: then it is required).
        ``qk_norm``: the model's q/k norms (``kernels.kv_write.QKNormWeights``), which its fused decode
        kernel applies (``PagedAttention.qk_norm``), so that variant is the one compiled.
        """
        if self.name != "triton":
            return 0
        from kernels.paged_attention import min_reqs_for_small_decode_tiles, paged_attention, paged_decode_rotary

        dev, dtype = k_cache.device, q_dtype or k_cache.dtype
        if not dtype.is_floating_point or dtype.itemsize < 2:
            raise ValueError(f"warm_up: q_dtype is required with a {k_cache.dtype} KV cache (the model's dtype).")
        block_size, head_dim = k_cache.shape[1], k_cache.shape[3]
        big_decode = max(18, min_reqs_for_small_decode_tiles(dev, k_cache.shape[2]))
        calls = 0
        for num_reqs in (2, 17, big_decode):                       # both find_chunk widths; large decodes
            for max_query_len, others in ((1, 1), (2, 2), (2, 1), (64, 2), (64, 1)):
                if num_reqs == big_decode and max_query_len > 1:
                    continue
                qlens = [max_query_len] + [others] * (num_reqs - 1)
                qsl = torch.tensor([0] + qlens, dtype=torch.int32).cumsum(0).to(torch.int32).to(dev)
                seq_lens = torch.tensor(qlens, dtype=torch.int32, device=dev)           # no cached prefix
                block_tables = torch.zeros(num_reqs, -(-max_query_len // block_size), dtype=torch.int32,
                                           device=dev)                                  # block 0 only
                q = torch.zeros(int(sum(qlens)), num_heads, head_dim, dtype=dtype, device=dev)
                paged_attention(q, k_cache, v_cache, qsl, seq_lens, block_tables, max_query_len,
                                max_query_len, scale, has_decodes=1 in qlens, decode_tiles=self.decode_tiles)
                calls += 1
                if (max_query_len == 1 and rotary_dim is not None
                        and self._fuses_decode_rotary(num_reqs, k_cache.shape[2], dev)):
                    kv = torch.zeros(num_reqs, k_cache.shape[2], head_dim, dtype=dtype, device=dev)
                    zeros = torch.zeros(num_reqs, dtype=torch.int64, device=dev)
                    cos = torch.zeros(1, rotary_dim // 2, dtype=torch.float32, device=dev)
                    paged_decode_rotary(q, kv, kv, zeros, cos, cos, rotary_dim, k_cache, v_cache, zeros - 1, qsl,
                                        seq_lens, block_tables, 1, scale, decode_tiles=self.decode_tiles,
                                        qk_norm=qk_norm)
                    calls += 1
        return calls


def select_backend(device: torch.device, policy: Optional[KernelPolicy] = None, bf16_prefill: bool = False,
                   cpu_kernel_dir: Optional[Path] = None) -> AttentionBackend:
    """Triton on CUDA; elsewhere torch, with the CPU decode kernel built into ``cpu_kernel_dir`` where the
    policy takes it (None: not built)."""
    policy = policy or KernelPolicy()
    if device.type == "cuda":
        return AttentionBackend("triton", policy, bf16_prefill)
    cpu_decode = None
    if device.type == "cpu" and policy.cpu_decode_attention and cpu_kernel_dir is not None:
        cpu_decode = CpuDecodeAttention.load(cpu_kernel_dir, policy.cpu_decode_chunk_tokens)
    return AttentionBackend("torch", policy, bf16_prefill, cpu_decode)
