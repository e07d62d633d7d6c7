"""Per-step sampling tensors: what the sampler needs to turn one logits row per request into a token.

Built once per step by the model runner from the requests that sample this step (one row each,
in the order of the logits rows). Host lists are turned into tensors here, with one pinned,
non-blocking host-to-device copy per tensor; the sampler never reads ``SamplingParams``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from engine.sampling_params import _SAMPLING_EPS, SamplingParams

LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
"""What the logprobs of sampled tokens are computed from (vLLM's ``logprobs_mode``):
raw: the model's logits as they came; processed: after min_tokens masking, penalties,
temperature and top-k / top-p / min-p filtering. *_logprobs: log_softmax of those; *_logits: the
values themselves."""


@dataclass
class SamplingMetadata:
    """Everything the sampler needs for one step; R = number of rows (requests sampling now)."""

    temperature: torch.Tensor
    """[R] float32. Temperature of each row; 1.0 for temperature-0 rows (they take the argmax)."""
    is_greedy: torch.Tensor
    """[R] bool. The row's token is the argmax of the penalized logits (temperature 0 or top_k 1)."""
    all_greedy: bool
    """Host flag: every row is greedy, so no random sampling runs."""
    all_random: bool
    """Host flag: no row is greedy, so no argmax runs."""
    top_k: Optional[torch.Tensor]
    """[R] int64. Tokens kept per row (vocab_size when disabled); None when no row filters."""
    top_p: Optional[torch.Tensor]
    """[R] float32 in (0, 1]; None when every row has top_p 1."""
    min_p: Optional[torch.Tensor]
    """[R] float32 in [0, 1]; None when every row has min_p 0."""
    generators: dict[int, torch.Generator]
    """Row index -> the request's own generator, for seeded random rows only (on the logits' device)."""
    no_penalties: bool
    """Host flag: no row has a presence, frequency or repetition penalty; the tensors below are None."""
    presence_penalties: Optional[torch.Tensor]
    """[R] float32. Subtracted once from each token already generated."""
    frequency_penalties: Optional[torch.Tensor]
    """[R] float32. Subtracted once per time a token was generated."""
    repetition_penalties: Optional[torch.Tensor]
    """[R] float32. HF repetition penalty over prompt + output tokens (1.0: none)."""
    output_token_ids: Optional[torch.Tensor]
    """[R, max_num_output_tokens] int64. Each row's generated tokens, padded with vocab_size."""
    prompt_token_ids: Optional[torch.Tensor]
    """[R, max_num_prompt_tokens] int64. Each row's prompt, padded with vocab_size; None when no
    row has a repetition penalty (only that penalty looks at the prompt)."""
    min_tokens_row_ids: Optional[torch.Tensor]
    """[M] int64. With ``min_tokens_token_ids``: the (row, token) pairs forced to -inf because the
    row has fewer than min_tokens outputs (its stop_token_ids, and eos unless ignore_eos)."""
    min_tokens_token_ids: Optional[torch.Tensor]
    """[M] int64. Token ids paired with ``min_tokens_row_ids``; both None when nothing is masked."""
    max_num_logprobs: Optional[int]
    """Host int: the largest top-N any row asked for; None when no row wants logprobs."""
    num_logprobs: list[Optional[int]]
    """Host list [R]: each row's top-N, capped at vocab_size (None: the row asked for no logprobs)."""
    logprobs_mode: str = "raw_logprobs"
    """One of LOGPROBS_MODES."""

    @property
    def num_rows(self) -> int:
        return len(self.num_logprobs)


def _to_device(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host list -> device tensor through pinned memory (a non-blocking copy on CUDA)."""
    pin = device.type == "cuda"
    host = torch.tensor(data, dtype=dtype)
    if pin:
        host = host.pin_memory()
    return host.to(device, non_blocking=pin)


def _pad_ids(rows: list[list[int]], pad_id: int, device: torch.device) -> torch.Tensor:
    """Ragged token id lists -> [len(rows), max(1, longest)] int64, padded with pad_id."""
    width = max([len(r) for r in rows] + [1])
    padded = [list(r) + [pad_id] * (width - len(r)) for r in rows]
    return _to_device(padded, torch.int64, device)  # [R, width]


def build_sampling_metadata(params: list[SamplingParams], generators: list[Optional[torch.Generator]],
                            prompt_token_ids: list[list[int]], output_token_ids: list[list[int]],
                            eos_token_ids: list[set[int]], vocab_size: int, device: torch.device,
                            logprobs_mode: str = "raw_logprobs") -> SamplingMetadata:
    """Turn the step's per-request parameters into sampling tensors (one row per request).

    Args:
        params: each row's sampling parameters.
        generators: each row's generator (created from the request's seed), or None.
        prompt_token_ids: each row's prompt tokens (for the repetition penalty).
        output_token_ids: each row's tokens generated so far (penalties, min_tokens).
        eos_token_ids: each row's EOS ids (masked while below min_tokens unless ignore_eos).
        vocab_size: logits width; ids at or above it are ignored.
        device: where the logits live.
        logprobs_mode: one of LOGPROBS_MODES.
    """
    if logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}.")
    num_rows = len(params)
    assert len(generators) == len(prompt_token_ids) == len(output_token_ids) == len(eos_token_ids) == num_rows

    temp_zero = [p.temperature < _SAMPLING_EPS for p in params]
    greedy = [tz or p.top_k == 1 for tz, p in zip(temp_zero, params)]
    top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    penalties = [(p.presence_penalty, p.frequency_penalty, p.repetition_penalty) for p in params]
    no_penalties = all(pp == 0.0 and fp == 0.0 and rp == 1.0 for pp, fp, rp in penalties)
    any_repetition = any(rp != 1.0 for _, _, rp in penalties)
    num_logprobs = [None if p.logprobs is None else min(p.logprobs, vocab_size) for p in params]
    asked = [n for n in num_logprobs if n is not None]

    mask_rows: list[int] = []
    mask_ids: list[int] = []
    for row, (p, outs, eos) in enumerate(zip(params, output_token_ids, eos_token_ids)):
        if len(outs) < p.min_tokens:
            ids = set(p.stop_token_ids or ()) | (set() if p.ignore_eos else set(eos))
            ids = sorted(t for t in ids if 0 <= t < vocab_size)
            mask_rows += [row] * len(ids)
            mask_ids += ids

    def floats(values: list[float]) -> torch.Tensor:
        return _to_device(values, torch.float32, device)  # [R]

    return SamplingMetadata(
        temperature=floats([1.0 if tz else p.temperature for tz, p in zip(temp_zero, params)]),
        is_greedy=_to_device(greedy, torch.bool, device),  # [R]
        all_greedy=all(greedy),
        all_random=not any(greedy),
        top_k=_to_device(top_ks, torch.int64, device) if any(k < vocab_size for k in top_ks) else None,
        top_p=floats([p.top_p for p in params]) if any(p.top_p < 1.0 for p in params) else None,
        min_p=floats([p.min_p for p in params]) if any(p.min_p > 0.0 for p in params) else None,
        generators={row: g for row, g in enumerate(generators) if g is not None and not greedy[row]},
        no_penalties=no_penalties,
        presence_penalties=None if no_penalties else floats([pp for pp, _, _ in penalties]),
        frequency_penalties=None if no_penalties else floats([fp for _, fp, _ in penalties]),
        repetition_penalties=None if no_penalties else floats([rp for _, _, rp in penalties]),
        output_token_ids=None if no_penalties else _pad_ids(output_token_ids, vocab_size, device),
        prompt_token_ids=_pad_ids(prompt_token_ids, vocab_size, device) if any_repetition else None,
        min_tokens_row_ids=_to_device(mask_rows, torch.int64, device) if mask_rows else None,
        min_tokens_token_ids=_to_device(mask_ids, torch.int64, device) if mask_ids else None,
        max_num_logprobs=max(asked) if asked else None,
        num_logprobs=num_logprobs,
        logprobs_mode=logprobs_mode,
    )
