"""Logits -> token ids (+ logprobs), one host sync per call. Follows vLLM V1's sampler.

Algorithm, per step (rows = requests sampling now):
  1. raw logprobs = log_softmax(logits), kept when some row wants logprobs in a raw mode: the model's own
     distribution, before any of the steps below (a constrained row's grammar included);
  2. grammar: a constrained row's tokens its grammar forbids -> -inf (``TokenBitmask``); then min_tokens:
     a row's eos and stop ids -> -inf while it has fewer than min_tokens outputs, except in a constrained
     row whose grammar allows nothing else (it may end);
  3. penalties: repetition (HF, over prompt + outputs), then frequency, then presence (outputs);
  4. greedy rows (temperature 0 or top_k 1): argmax of the penalized logits;
  5. random rows: temperature, top-k, top-p, min-p, then an exponential race
     argmax(probs / q), q ~ Exp(1); a seeded row draws its q from its own generator, so its
     tokens do not depend on the other rows or on its position;
  6. logprobs: the sampled token's logprob and 1-based rank, plus the top-N, from the raw or the
     processed (after steps 2-5) logits.
Everything the host needs (token ids, logprobs) leaves the device in one copy at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from engine.outputs import LogprobsLists
from engine.sampling_metadata import SamplingMetadata
from engine.structured_output.bitmask import apply_token_bitmask

if TYPE_CHECKING:
    from kernels.cpu_token_bitmask import CpuTokenBitmask

_MIN_EXPONENTIAL = 1e-20
"""Floor for the race's Exp(1) draws: a 0 would turn prob 0 / q into NaN, which argmax picks."""

_PROMPT_LOGPROBS_CHUNK_ROWS = 1024
"""Rows of prompt logits turned into log_softmax at a time (bounds the extra [rows, vocab] buffer)."""


@dataclass(frozen=True)
class TokenBitmask:
    """The tokens the grammars of a step's constrained rows allow, on the logits' device."""

    bitmask: torch.Tensor
    """[num_rows, words] int32: bit ``t % 32`` of word ``t // 32`` of row ``r`` set: token ``t`` allowed in
    logits row ``r`` (rows not in ``rows`` are ignored)."""
    rows: torch.Tensor | list[int]
    """The constrained logits rows: [K] int64 on the device (a list on the host)."""


@dataclass
class SamplerOutput:
    """The step's sampled tokens, on device and on host, with logprobs for the rows that asked."""

    sampled_token_ids: torch.Tensor
    """[R] int64 on the logits' device (for feeding the next step without a copy back)."""
    sampled_token_id_list: Optional[list[int]]
    """The same R ids on the host, from the call's single device->host copy; None when the caller
    asked for no copy (``to_host=False``) and no row wants logprobs (the caller copies later)."""
    logprobs: Optional[LogprobsLists]
    """Rows in order; a row that asked for N logprobs has N + 1 entries ([sampled, top1..topN]),
    one that did not has empty lists and rank 0. None when no row asked."""


# ----------------------------------------------------------------------------------------
# Logits processing (each returns a new tensor or edits one the sampler owns)
# ----------------------------------------------------------------------------------------
def apply_min_tokens(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Set the (row, token) pairs still under min_tokens to -inf, in place."""
    if meta.min_tokens_row_ids is not None:
        logits[meta.min_tokens_row_ids, meta.min_tokens_token_ids] = float("-inf")
    return logits


def apply_grammar_and_min_tokens(logits: torch.Tensor, meta: SamplingMetadata, token_bitmask: TokenBitmask,
                                 cpu_kernel: Optional["CpuTokenBitmask"] = None) -> torch.Tensor:
    """The grammar's mask (with ``cpu_kernel`` where it applies), then min_tokens, in place: a row that
    min_tokens would leave without any allowed token (its grammar allows only its stop tokens) keeps them
    instead. No host sync."""
    apply_token_bitmask(logits, token_bitmask.bitmask, token_bitmask.rows, cpu_kernel=cpu_kernel)
    if meta.min_tokens_row_ids is None:
        return logits
    rows, ids = meta.min_tokens_row_ids, meta.min_tokens_token_ids   # [M] each
    kept = logits[rows, ids]  # [M]
    logits[rows, ids] = float("-inf")
    dead = torch.isneginf(logits).all(dim=-1)  # [R]
    logits[rows, ids] = torch.where(dead[rows], kept, torch.full_like(kept, float("-inf")))
    return logits


def _token_bins(token_ids: torch.Tensor, vocab_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Padded ids [R, L] (pad = vocab_size) -> per-row counts [R, vocab_size]."""
    bins = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=dtype, device=token_ids.device)  # [R, V+1]
    ids = token_ids.clamp(max=vocab_size)
    bins.scatter_add_(1, ids, torch.ones_like(ids, dtype=dtype))
    return bins[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition (HF), frequency and presence penalties (OpenAI), in vLLM's order.

    Semantics, per row r and token t (count = times t was generated, seen = t in prompt or outputs):
        if seen: logit = logit / rep[r] if logit > 0 else logit * rep[r]
        logit -= freq[r] * count
        logit -= pres[r] * (count > 0)
    """
    if meta.no_penalties:
        return logits
    vocab_size = logits.shape[1]
    output_counts = _token_bins(meta.output_token_ids, vocab_size, logits.dtype)  # [R, V]
    output_seen = output_counts > 0  # [R, V]
    if meta.prompt_token_ids is not None:
        seen = output_seen | (_token_bins(meta.prompt_token_ids, vocab_size, logits.dtype) > 0)
        rep = meta.repetition_penalties.unsqueeze(1)  # [R, 1]
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalized, logits)
    logits = logits - meta.frequency_penalties.unsqueeze(1) * output_counts
    logits = logits - meta.presence_penalties.unsqueeze(1) * output_seen.to(logits.dtype)
    return logits


def apply_top_k_top_p(logits: torch.Tensor, top_k: Optional[torch.Tensor],
                      top_p: Optional[torch.Tensor]) -> torch.Tensor:
    """Top-k then top-p (nucleus) filtering: dropped tokens become -inf. Ties at the k-th value stay.

    Semantics, per row: keep tokens whose logit >= the k-th largest; then, over the survivors sorted
    ascending, drop those whose cumulative probability is <= 1 - p (the largest always stays).
    """
    if top_k is None and top_p is None:
        return logits
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)  # [R, V] each
    if top_k is not None:
        kth_value = logits_sort.gather(1, (logits.shape[1] - top_k).unsqueeze(1))  # [R, 1]
        logits_sort.masked_fill_(logits_sort < kth_value, float("-inf"))
    if top_p is not None:
        cum_probs = logits_sort.softmax(dim=-1).cumsum_(dim=-1)  # [R, V]
        drop = cum_probs <= (1 - top_p).unsqueeze(1)
        drop[:, -1] = False
        logits_sort.masked_fill_(drop, float("-inf"))
    return logits_sort.scatter(dim=-1, index=logits_idx, src=logits_sort)


def apply_min_p(logits: torch.Tensor, min_p: Optional[torch.Tensor]) -> torch.Tensor:
    """Drop (-inf) tokens whose probability is below min_p times the row's top probability."""
    if min_p is None:
        return logits
    probs = logits.softmax(dim=-1)  # [R, V]
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [R, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def process_for_sampling(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Temperature, then top-k / top-p, then min-p. Temperature-0 rows carry 1.0 and neutral filters."""
    logits = logits / meta.temperature.unsqueeze(1)
    logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
    return apply_min_p(logits, meta.min_p)


def random_sample(logits: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Sample one token per row from softmax(logits) by an exponential race: argmax(p / q), q ~ Exp(1).

    Rows in ``generators`` draw q from their own generator (one vocab-sized draw per call), so a
    seeded row's token depends only on its logits and its generator's state.
    """
    probs = logits.softmax(dim=-1)  # [R, V]
    q = torch.empty_like(probs)  # [R, V]
    if len(generators) < probs.shape[0]:
        q.exponential_()
    for row, generator in generators.items():
        q[row].exponential_(generator=generator)
    return probs.div_(q.clamp_min_(_MIN_EXPONENTIAL)).argmax(dim=-1)


# ----------------------------------------------------------------------------------------
# Logprobs
# ----------------------------------------------------------------------------------------
def _gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> torch.Tensor:
    """Pack [token, top-N ids] + [its logprob, top-N logprobs] + [rank] per row: [R, 2N + 3] float64.

    float64 holds token ids and ranks exactly, so everything leaves the device in one copy.
    """
    top_lp, top_ids = logprobs.topk(num_logprobs, dim=-1)  # [R, N] each
    token_lp = logprobs.gather(1, token_ids.unsqueeze(1))  # [R, 1]
    rank = (logprobs > token_lp).sum(dim=-1, keepdim=True) + 1  # [R, 1]
    return torch.cat([token_ids.unsqueeze(1).double(), top_ids.double(),
                      token_lp.double(), top_lp.double(), rank.double()], dim=1)


def _unpack_row(packed_row: list[float], num_logprobs: int, width: int) -> tuple[list[int], list[float], int]:
    """One packed row (width = N + 1 ids) -> (ids[:n+1], logprobs[:n+1], rank)."""
    ids = [int(t) for t in packed_row[:num_logprobs + 1]]
    lps = packed_row[width:width + num_logprobs + 1]
    return ids, lps, int(packed_row[-1])


def compute_prompt_logprobs(logits: torch.Tensor, target_token_ids: torch.Tensor,
                            num_logprobs: int) -> LogprobsLists:
    """Logprobs of the actual next prompt tokens (raw log_softmax of the model's logits).

    Args:
        logits: [T, vocab] float, position i predicts ``target_token_ids[i]``.
        target_token_ids: [T] int64 on the logits' device.
        num_logprobs: top-N per position (0: only the target's).

    Returns:
        Row i: token_ids [target, top1..topN], logprobs likewise, ranks[i] the target's 1-based rank.
    """
    assert logits.dim() == 2 and target_token_ids.shape == (logits.shape[0],)
    num_logprobs = min(num_logprobs, logits.shape[1])
    width = num_logprobs + 1
    chunks = []
    for start in range(0, logits.shape[0], _PROMPT_LOGPROBS_CHUNK_ROWS):
        end = start + _PROMPT_LOGPROBS_CHUNK_ROWS
        logprobs = logits[start:end].float().log_softmax(dim=-1)  # [chunk, V]
        chunks.append(_gather_logprobs(logprobs, target_token_ids[start:end].long(), num_logprobs))
    if not chunks:
        return LogprobsLists(token_ids=[], logprobs=[], ranks=[])
    packed = torch.cat(chunks).cpu().tolist()  # the one device->host copy
    rows = [_unpack_row(r, num_logprobs, width) for r in packed]
    return LogprobsLists(token_ids=[r[0] for r in rows], logprobs=[r[1] for r in rows],
                         ranks=[r[2] for r in rows])


# ----------------------------------------------------------------------------------------
# Sampler
# ----------------------------------------------------------------------------------------
class Sampler:
    """Stateless: all per-request state comes in ``SamplingMetadata`` (generators included).

    Args:
        cpu_bitmask: the C kernel that applies grammar bitmasks to CPU logits (None: xgrammar's)."""

    def __init__(self, cpu_bitmask: Optional["CpuTokenBitmask"] = None) -> None:
        self.cpu_bitmask = cpu_bitmask

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata, to_host: bool = True,
                 token_bitmask: Optional[TokenBitmask] = None) -> SamplerOutput:
        """Sample one token per row. ``logits`` [R, vocab] (float32 or the model's dtype; upcast here
        unless the argmax alone decides, which is exact in any dtype) is not modified.

        With ``to_host=False`` nothing waits for the device unless some row wants logprobs: the
        ids stay on the device (``sampled_token_id_list`` None) for an async copy by the caller.
        ``token_bitmask``: the grammars of the constrained rows (None: no row is constrained).
        """
        assert logits.dim() == 2 and logits.shape[0] == meta.num_rows, (logits.shape, meta.num_rows)
        if (meta.all_greedy and meta.no_penalties and meta.max_num_logprobs is None
                and meta.min_tokens_row_ids is None and token_bitmask is None):
            sampled = logits.argmax(dim=-1)  # [R] fast path: nothing else to do
            return SamplerOutput(sampled, sampled.tolist() if to_host else None, None)

        want_logprobs = meta.max_num_logprobs is not None
        raw_mode = meta.logprobs_mode.startswith("raw")
        raw = logits.float() if want_logprobs and raw_mode else None

        logits = logits.to(torch.float32, copy=True)  # [R, V], owned
        if token_bitmask is not None:
            logits = apply_grammar_and_min_tokens(logits, meta, token_bitmask, self.cpu_bitmask)
        else:
            logits = apply_min_tokens(logits, meta)
        logits = apply_penalties(logits, meta)
        greedy_ids = None if meta.all_random else logits.argmax(dim=-1)  # [R]
        processed = logits
        if not meta.all_greedy or (want_logprobs and not raw_mode):
            processed = process_for_sampling(logits, meta)
        if meta.all_greedy:
            sampled = greedy_ids
        else:
            sampled = random_sample(processed, meta.generators)
            if greedy_ids is not None:
                sampled = torch.where(meta.is_greedy, greedy_ids, sampled)

        if not want_logprobs:
            return SamplerOutput(sampled, sampled.tolist() if to_host else None, None)
        source = raw if raw_mode else processed
        if meta.logprobs_mode.endswith("logprobs"):
            source = source.log_softmax(dim=-1)
        packed = _gather_logprobs(source, sampled, meta.max_num_logprobs).cpu().tolist()  # one sync
        return SamplerOutput(sampled, [int(r[0]) for r in packed], _to_logprobs_lists(packed, meta))


def _to_logprobs_lists(packed: list[list[float]], meta: SamplingMetadata) -> LogprobsLists:
    """Packed host rows -> LogprobsLists, each row cut to its own top-N (empty when it asked none)."""
    width = meta.max_num_logprobs + 1
    out = LogprobsLists(token_ids=[], logprobs=[], ranks=[])
    for row, n in zip(packed, meta.num_logprobs):
        ids, lps, rank = _unpack_row(row, n, width) if n is not None else ([], [], 0)
        out.token_ids.append(ids)
        out.logprobs.append(lps)
        out.ranks.append(rank)
    return out
