"""The token side of Whisper transcription: decoder prompts, the logits rules of greedy decoding, segments.

Three pieces, none of them tied to the engine:

- ``build_decoder_prompt``: OpenAI's (and transformers') decoder prompt,
  ``[<|startofprev|>, *prompt_text_ids] <|startoftranscript|> [<|lang|> <|task|>] [<|notimestamps|>]``;
  the language part only on multilingual models. ``resolve_language`` turns "de" / "German" into a code
  and raises ``ValueError`` (an HTTP 400) for what the model cannot do.
- ``WhisperLogitsRules``: what transformers' Whisper ``generate`` does to each step's logits, applied to
  a batch of rows that each carry their own prompt and history: ``suppress_tokens``, the
  ``begin_suppress_tokens`` of the first step, ``WhisperTimeStampLogitsProcessor`` in timestamp mode, and
  language detection (only language tokens, as ``WhisperForConditionalGeneration.detect_language``).
- ``parse_segments``: generated ids -> ``Segment``s with times, split at timestamp tokens as OpenAI's
  ``transcribe()`` and transformers' ``_retrieve_segment`` do.

A row is in timestamp mode when the sot sequence that ends its prompt has no ``<|notimestamps|>``. Outside
timestamp mode transformers suppresses neither the timestamp tokens nor ``<|notimestamps|>`` (only its
``suppress_tokens`` and, at the first step, ``begin_suppress_tokens``), and neither does this module.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Literal

import torch

from engine.loader.ct2 import TIMESTAMP_STEP_S, WhisperTokenIds

MAX_PROMPT_TOKENS = 223
"""OpenAI's cap on previous-text prompt tokens: ``n_text_ctx // 2 - 1`` for the 448-token decoder."""
MAX_INITIAL_TIMESTAMP_INDEX = 50
"""The first timestamp is at most ``<|1.00|>`` (OpenAI's ``max_initial_timestamp`` of 1 s)."""
MEL_FRAMES_PER_S = 100
"""Log-mel frames per second (hop 160 at 16 kHz): the unit of a segment's ``seek``."""

Task = Literal["transcribe", "translate"]
TASKS = ("transcribe", "translate")


# ------------------------------------------------------------------------------------------ languages

def _language_tables() -> tuple[dict[str, str], dict[str, str]]:
    """(code -> English name, English name or alias -> code), transformers' copy of OpenAI's tables."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES, TO_LANGUAGE_CODE
    return LANGUAGES, TO_LANGUAGE_CODE


def language_name(code: str) -> str:
    """The lowercase English name of a language code ("en" -> "english"), as OpenAI's verbose_json."""
    names, _ = _language_tables()
    return names.get(code, code)


def resolve_language(ids: WhisperTokenIds, language: str | None) -> str | None:
    """The language code ``language`` names for this model ("de", "German", "GERMAN" -> "de"), or None.

    Raises:
        ValueError: an unknown language; a language other than English on an English-only model; a
            language this model's vocabulary lacks.
    """
    if language is None:
        return None
    names, codes = _language_tables()
    key = language.strip().lower()
    code = key if key in names else codes.get(key)
    if code is None:
        raise ValueError(f"Unknown language {language!r}: pass an ISO-639-1 code such as 'en' or 'de', or an "
                         f"English language name such as 'german'.")
    if not ids.is_multilingual:
        if code != "en":
            raise ValueError(f"This model is English-only and cannot transcribe {names[code].capitalize()} "
                             f"({language!r}). Omit `language` or pass 'en', or use a multilingual "
                             f"Whisper model.")
        return code
    if code not in ids.language_ids:
        raise ValueError(f"This model has no {names[code].capitalize()} ({code}) language token; it knows: "
                         f"{', '.join(ids.language_ids)}.")
    return code


def language_token_ids(ids: WhisperTokenIds) -> list[int]:
    """The ids of ``<|en|>``, ``<|zh|>``, ... in vocabulary order (contiguous, right after sot)."""
    return sorted(ids.language_ids.values())


def language_from_token(ids: WhisperTokenIds, token_id: int) -> str:
    """The language code of a language token id (``<|de|>`` -> "de").

    Raises:
        ValueError: ``token_id`` is not a language token.
    """
    for code, i in ids.language_ids.items():
        if i == token_id:
            return code
    raise ValueError(f"Token {token_id} is not a language token ({min(ids.language_ids.values())}.."
                     f"{max(ids.language_ids.values())}).")


# ------------------------------------------------------------------------------------------- prompts

def language_detection_prompt(ids: WhisperTokenIds) -> list[int]:
    """``[<|startoftranscript|>]``: the next token's logits over the language tokens pick the language
    (transformers' ``detect_language`` and OpenAI's ``detect_language`` use sot alone, no previous text)."""
    return [ids.sot]


def build_decoder_prompt(ids: WhisperTokenIds, tokenizer, *, language: str | None, task: Task = "transcribe",
                         timestamps: bool = False, prompt_text: str | None = None,
                         max_prompt_tokens: int = MAX_PROMPT_TOKENS) -> list[int]:
    """The decoder prompt of one transcription window (OpenAI's ``DecodingTask._get_initial_tokens``).

    Layout: ``[<|startofprev|>, *text]`` when ``prompt_text`` has non-blank text (``" " + text.strip()``
    encoded without special tokens, its last ``max_prompt_tokens`` tokens, as OpenAI and transformers'
    ``get_prompt_ids``); then ``<|startoftranscript|>``; then, on multilingual models only,
    ``<|lang|>`` and ``<|transcribe|>`` or ``<|translate|>``; then ``<|notimestamps|>`` unless
    ``timestamps``. English-only models get ``[sot, <|notimestamps|>]``, as transformers' generate.

    Args:
        ids: the model's special token ids.
        tokenizer: a transformers tokenizer of the model (``load_ct2_tokenizer``).
        language: code or English name; required on multilingual models (detect it first with
            ``language_detection_prompt``); on English-only models only English (or None) is accepted.
        task: "transcribe", or "translate" (to English; multilingual models only).
        timestamps: predict timestamp tokens (no ``<|notimestamps|>``).
        prompt_text: previous text to condition on (OpenAI's ``prompt``), or None.
        max_prompt_tokens: keep at most this many of its last tokens.

    Raises:
        ValueError: the language or task is one the model cannot do, or ``prompt_text`` spells a
            special or timestamp token (transformers' ``get_prompt_ids`` refuses those too).
    """
    if task not in TASKS:
        raise ValueError(f"Unknown task {task!r}; Whisper does {' or '.join(TASKS)}.")
    code = resolve_language(ids, language)
    prompt = _previous_text_prompt(ids, tokenizer, prompt_text, max_prompt_tokens)
    prompt.append(ids.sot)
    if ids.is_multilingual:
        if code is None:
            raise ValueError("A multilingual Whisper prompt needs the language: pass `language`, or "
                             "detect it first (language_detection_prompt).")
        prompt += [ids.language_ids[code], ids.translate if task == "translate" else ids.transcribe]
    elif task == "translate":
        raise ValueError("This model is English-only and cannot translate; use /v1/audio/transcriptions, "
                         "or a multilingual Whisper model for /v1/audio/translations.")
    if not timestamps:
        prompt.append(ids.no_timestamps)
    return prompt


def _previous_text_prompt(ids: WhisperTokenIds, tokenizer, prompt_text: str | None,
                          max_prompt_tokens: int) -> list[int]:
    """``[<|startofprev|>, *last max_prompt_tokens tokens of " " + text]``, or [] without text."""
    if prompt_text is None or not prompt_text.strip() or max_prompt_tokens <= 0:
        return []
    text_ids = tokenizer.encode(" " + prompt_text.strip(), add_special_tokens=False)
    special = next((t for t in text_ids if t >= ids.eot), None)
    if special is not None:
        token = tokenizer.convert_ids_to_tokens(special)
        raise ValueError(f"The prompt contains the special token {token!r}; remove it (the prompt is plain "
                         f"previous text).")
    return [ids.start_of_prev] + text_ids[-max_prompt_tokens:]


# -------------------------------------------------------------------------------------- logits rules

@dataclass(frozen=True)
class _RowMask:
    """What one row masks at this step; every range is half-open and in vocabulary ids."""

    below: int = 0
    """Mask ids ``< below`` (eot: no text; timestamp_begin: only timestamps)."""
    from_id: int = 1 << 62
    """Mask ids ``>= from_id``."""
    gap_lo: int = 0
    """Mask ids in ``[gap_lo, gap_hi)`` (timestamps before the last one: they never decrease)."""
    gap_hi: int = 0
    suppress: bool = False
    """Mask ``suppress_tokens``."""
    begin: bool = False
    """Mask ``begin_suppress_tokens`` (first generated token)."""
    timestamp_rules: bool = False
    """Mask ``<|notimestamps|>`` and apply the timestamp-probability rule."""


class WhisperLogitsRules:
    """transformers' Whisper greedy ``generate`` logits processing, one row per request, vectorized.

    Per row, given its decoder prompt and the ids it generated so far (``begin_index`` = prompt length):

    - language detection (multilingual model, prompt ends with sot, nothing generated): every token but
      the language tokens is masked and nothing else applies (``detect_language``);
    - otherwise ``suppress_tokens`` are masked (``SuppressTokensLogitsProcessor``), and at the first
      generated token ``begin_suppress_tokens`` (``SuppressTokensAtBeginLogitsProcessor``);
    - in timestamp mode, ``WhisperTimeStampLogitsProcessor``: ``<|notimestamps|>`` masked; after text
      and a (closing) timestamp only a timestamp (the next segment's opener) or eot; after two timestamps,
      or a first-token timestamp, only text; timestamps never decrease, and one that a pair already used
      is not repeated; the first token is a timestamp of at most ``0.02 * max_initial_timestamp_index``
      s; and where the timestamps together are likelier (logsumexp of the float32 log-softmax) than the
      likeliest text token, text is masked.

    Columns at or past ``ids.vocab_size`` (padding of a wider logits row) are always masked.
    ``max_initial_timestamp_index=None`` lifts the first-timestamp cap (transformers' default when the
    generation config has none; OpenAI's and the released configs use 50).
    """

    def __init__(self, ids: WhisperTokenIds, suppress_tokens: list[int], begin_suppress_tokens: list[int],
                 max_initial_timestamp_index: int | None = MAX_INITIAL_TIMESTAMP_INDEX):
        for name, tokens in (("suppress_tokens", suppress_tokens),
                             ("begin_suppress_tokens", begin_suppress_tokens)):
            bad = [t for t in tokens if not 0 <= t < ids.vocab_size]
            if bad:
                raise ValueError(f"{name} has ids outside the {ids.vocab_size}-token vocabulary: {bad[:5]} "
                                 f"(OpenAI's -1 shorthand must be expanded to the token list).")
        self.ids = ids
        self.suppress_tokens = sorted(set(suppress_tokens))
        self.begin_suppress_tokens = sorted(set(begin_suppress_tokens))
        self.max_initial_timestamp_index = max_initial_timestamp_index
        languages = language_token_ids(ids)
        self._language_range = (languages[0], languages[-1] + 1) if languages else (0, 0)
        self._arange: dict[tuple[int, torch.device], torch.Tensor] = {}   # (vocab, device) -> arange [V]
        # (vocab, device) -> (suppressed columns [N] int64, begin-suppressed columns [M] int64)
        self._columns: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def is_timestamp_mode(self, prompt: list[int]) -> bool:
        """Whether the sot sequence ending ``prompt`` lacks ``<|notimestamps|>`` (scans back to sot)."""
        for token in reversed(prompt):
            if token == self.ids.no_timestamps:
                return False
            if token == self.ids.sot:
                return True
        return False

    def needs_history(self, prompt: list[int]) -> bool:
        """Whether a row with this decoder prompt reads its generated ids (timestamp mode); otherwise its
        rules depend only on whether it has generated any, so ``apply`` may get a placeholder for them."""
        return self.is_timestamp_mode(prompt)

    def is_language_detection(self, prompt: list[int], output: list[int]) -> bool:
        """A multilingual model's prompt ending with sot, before the first token."""
        return self.ids.is_multilingual and not output and bool(prompt) and prompt[-1] == self.ids.sot

    def row_mask(self, prompt: list[int], output: list[int]) -> _RowMask:
        """What the row with decoder prompt ``prompt`` and generated ids ``output`` masks next."""
        ids = self.ids
        if self.is_language_detection(prompt, output):
            return _RowMask(below=self._language_range[0], from_id=self._language_range[1])
        if not self.is_timestamp_mode(prompt):
            return _RowMask(suppress=True, begin=not output)
        below, from_id = 0, ids.vocab_size
        ts_begin = ids.timestamp_begin
        last_was_ts = len(output) >= 1 and output[-1] >= ts_begin
        penultimate_was_ts = len(output) < 2 or output[-2] >= ts_begin
        if last_was_ts:
            if penultimate_was_ts:
                from_id = ts_begin                      # a pair (or the first timestamp): text next
            else:
                below = ids.eot                         # an opener after text: its timestamp or eot
        last_ts = next((t for t in reversed(output) if t >= ts_begin), None)
        if last_ts is None:
            gap_hi = ts_begin
        else:
            gap_hi = last_ts if last_was_ts and not penultimate_was_ts else last_ts + 1
        if not output:                                  # the first token is a timestamp, not too late
            below = ts_begin
            if self.max_initial_timestamp_index is not None:
                from_id = min(from_id, ts_begin + self.max_initial_timestamp_index + 1)
        return _RowMask(below=below, from_id=from_id, gap_lo=ts_begin, gap_hi=gap_hi, suppress=True,
                        begin=not output, timestamp_rules=True)

    def apply(self, logits: torch.Tensor, prompts: list[list[int]], outputs: list[list[int]]) -> torch.Tensor:
        """Mask ``logits`` ([R, V], any float dtype and device) in place for rows with decoder prompts
        ``prompts`` and generated ids ``outputs`` (R each); returns ``logits``.

        Suppression (``suppress_tokens``, and ``begin_suppress_tokens`` at a row's first token) covers every
        row but those detecting their language at once; only the rows in timestamp mode or detecting their
        language then take per-row bounds, over their own rows ([S, 5] int64 sent in one host-to-device copy):
        the work on [R, V] does not grow with those rows. No device-to-host sync.
        """
        num_rows, vocab = logits.shape
        if len(prompts) != num_rows or len(outputs) != num_rows:
            raise ValueError(f"logits has {num_rows} rows but {len(prompts)} prompts and {len(outputs)} "
                             f"outputs")
        if vocab < self.ids.vocab_size:
            raise ValueError(f"logits have {vocab} columns, fewer than the model's {self.ids.vocab_size} "
                             f"tokens.")
        detecting = [self.is_language_detection(p, o) for p, o in zip(prompts, outputs)]
        special = [i for i, (p, d) in enumerate(zip(prompts, detecting)) if d or self.needs_history(p)]
        self._apply_suppression(logits, [not o for o in outputs], detecting if any(detecting) else None)
        if not special:
            return logits
        rows = [self.row_mask(prompts[i], outputs[i]) for i in special]
        bounds = torch.tensor([[r.below, min(r.from_id, self.ids.vocab_size), r.gap_lo, r.gap_hi,
                                r.timestamp_rules] for r in rows], dtype=torch.int64).to(logits.device)   # [S, 5]
        vocab_ids = self._vocab_ids(vocab, logits.device)                          # [V]
        below, from_id, gap_lo, gap_hi = (bounds[:, i:i + 1] for i in range(4))  # [S, 1] each
        use_ts = bounds[:, 4:5].bool()                                             # [S, 1]
        index = torch.tensor(special, dtype=torch.int64).to(logits.device)         # [S]
        sub = logits[index]                     # [S, V] (advanced indexing: on CPU far faster than index_select)
        mask = (vocab_ids < below) | (vocab_ids >= from_id)                        # [S, V]
        mask |= (vocab_ids >= gap_lo) & (vocab_ids < gap_hi)
        mask[:, self.ids.no_timestamps] |= use_ts[:, 0]
        sub.masked_fill_(mask, float("-inf"))
        if any(r.timestamp_rules for r in rows):
            self._prefer_timestamps(sub, use_ts)
        logits.index_copy_(0, index, sub)
        return logits

    def _apply_suppression(self, logits: torch.Tensor, first: list[bool],
                           detecting: list[bool] | None = None) -> torch.Tensor:
        """``suppress_tokens`` (and the columns past the vocabulary) on every row, ``begin_suppress_tokens`` on
        rows at their first token; rows of ``detecting`` (language detection) are left alone. Writes only
        the suppressed columns (an index fill), never a mask over [R, V]."""
        suppress_cols, begin_cols = self._static_columns(logits.shape[1], logits.device)
        neg_inf = torch.full((), float("-inf"), dtype=logits.dtype, device=logits.device)
        first_rows = [i for i, f in enumerate(first) if f and not (detecting and detecting[i])]
        if detecting is None:
            logits.index_fill_(1, suppress_cols, float("-inf"))
        else:
            keep = torch.tensor([i for i, d in enumerate(detecting) if not d],
                                dtype=torch.int64).to(logits.device, non_blocking=True)   # [K]
            logits.index_put_((keep[:, None], suppress_cols[None, :]), neg_inf)
        if first_rows:
            rows = torch.tensor(first_rows, dtype=torch.int64).to(logits.device, non_blocking=True)   # [F]
            logits.index_put_((rows[:, None], begin_cols[None, :]), neg_inf)
        return logits

    def _static_columns(self, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(the suppressed columns: ``suppress_tokens`` and those past the vocabulary, ``begin_suppress_tokens``)
        as int64 index tensors, made once per (width, device)."""
        key = (vocab, device)
        if key not in self._columns:
            suppress = torch.tensor(self.suppress_tokens + list(range(self.ids.vocab_size, vocab)),
                                    dtype=torch.int64, device=device)
            self._columns[key] = (suppress, torch.tensor(self.begin_suppress_tokens, dtype=torch.int64,
                                                         device=device))
        return self._columns[key]

    def _prefer_timestamps(self, logits: torch.Tensor, use_ts: torch.Tensor) -> None:
        """Mask text in timestamp-mode rows whose timestamps' total probability beats every text token."""
        ts_begin = self.ids.timestamp_begin
        logprobs = torch.log_softmax(logits.float(), dim=-1)                       # [R, V] float32
        timestamp_logprob = logprobs[:, ts_begin:].logsumexp(dim=-1)               # [R]
        max_text_logprob = logprobs[:, :ts_begin].max(dim=-1).values               # [R]
        prefer = (timestamp_logprob > max_text_logprob).unsqueeze(-1) & use_ts     # [R, 1]
        logits[:, :ts_begin].masked_fill_(prefer, float("-inf"))

    def _vocab_ids(self, vocab: int, device: torch.device) -> torch.Tensor:
        """arange(vocab) [V] int64 on ``device``, made once per (width, device)."""
        key = (vocab, device)
        if key not in self._arange:
            self._arange[key] = torch.arange(vocab, device=device)
        return self._arange[key]


# ------------------------------------------------------------------------------------------ segments

@dataclass
class Segment:
    """One timed piece of a transcript, with OpenAI verbose_json's per-segment fields."""

    id: int
    """Index in the transcript (0, 1, ...)."""
    seek: int
    """Start of the decoded window, in log-mel frames (10 ms): OpenAI's ``seek``."""
    start_s: float
    """Start time in the audio, seconds."""
    end_s: float
    """End time in the audio, seconds."""
    text: str
    """Decoded text without timestamps (OpenAI keeps the leading space: " Hello.")."""
    token_ids: list[int]
    """The generated ids of the segment, its timestamp tokens included."""
    temperature: float
    """Sampling temperature of the window's decode."""
    avg_logprob: float | None
    """Mean log-probability of the window's generated tokens (eot included), None when not known."""
    compression_ratio: float
    """UTF-8 bytes / zlib-compressed bytes of the window's text (OpenAI's repetition check)."""
    no_speech_prob: float | None
    """Probability of ``<|nospeech|>`` at the window's first step, None when not measured."""


def text_of(ids: WhisperTokenIds, tokenizer, token_ids: list[int]) -> str:
    """``token_ids`` decoded without timestamp or special tokens (only ids below eot)."""
    return tokenizer.decode([t for t in token_ids if t < ids.eot])


def compression_ratio(text: str) -> float:
    """OpenAI's ``get_compression_ratio``: UTF-8 length over zlib-compressed length."""
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data))


@dataclass
class _Span:
    """Segment under construction: timestamps and text tokens in generation order."""

    start_ts: int | None
    """Opening timestamp id, or None (the window's start)."""
    token_ids: list[int]
    has_text: bool = False


def parse_segments(ids: WhisperTokenIds, tokenizer, token_ids: list[int], logprobs: list[float] | None, *,
                   time_offset_s: float, chunk_end_s: float, no_speech_prob: float | None,
                   temperature: float = 0.0, first_id: int = 0) -> list[Segment]:
    """Split one window's generated ids into timed segments.

    A timestamp after text closes the segment; a timestamp with no text before it opens one (so a pair
    ``<|t1|><|t1|>`` closes one and opens the next). Times are ``time_offset_s + 0.02 * index``. A segment
    without an opening timestamp starts where the previous one ended, the first at ``time_offset_s``
    (OpenAI and transformers do this for output with no consecutive timestamps); text left open at the
    end (no closing timestamp: no timestamps at all, or the window ended mid-segment) is closed at
    ``chunk_end_s`` (or at its start if that is later), so no words are lost. Generation
    stops at the first eot; a trailing opener with no text joins the previous segment's ids (as
    transformers). ``avg_logprob``, ``compression_ratio``, ``no_speech_prob`` and ``temperature`` are the
    window's, on every segment, as in OpenAI's ``transcribe()``.

    Args:
        token_ids: generated ids (after the prompt), maybe ending with eot.
        logprobs: log-probability of each of ``token_ids`` (aligned), or None.
        time_offset_s: the window's start in the audio.
        chunk_end_s: the window's end in the audio.
        no_speech_prob: the window's no-speech probability, or None.
        temperature: the window's sampling temperature.
        first_id: ``id`` of the first segment.
    """
    eot_at = token_ids.index(ids.eot) if ids.eot in token_ids else len(token_ids)
    generated = list(token_ids[:eot_at])
    window_logprobs = logprobs[:eot_at + 1] if logprobs else []     # the generated ids and their eot
    avg_logprob = sum(window_logprobs) / len(window_logprobs) if window_logprobs else None
    window_text = text_of(ids, tokenizer, generated)
    ratio = compression_ratio(window_text)

    def seconds(timestamp_id: int) -> float:
        return round(time_offset_s + (timestamp_id - ids.timestamp_begin) * TIMESTAMP_STEP_S, 3)

    spans: list[tuple[_Span, float]] = []              # closed spans and their end times
    current = _Span(start_ts=None, token_ids=[])
    for token in generated:
        if token < ids.timestamp_begin:
            current.token_ids.append(token)
            current.has_text |= token < ids.eot
        elif current.has_text:                          # closes the segment
            current.token_ids.append(token)
            spans.append((current, seconds(token)))
            current = _Span(start_ts=None, token_ids=[])
        else:                                           # opens one (a later opener replaces an earlier)
            current.start_ts = token
            current.token_ids.append(token)
    if current.has_text:
        spans.append((current, round(chunk_end_s, 3)))
    elif current.token_ids and spans:
        spans[-1][0].token_ids.extend(current.token_ids)

    segments: list[Segment] = []
    for span, end_s in spans:
        if span.start_ts is not None:
            start_s = seconds(span.start_ts)
        else:                                           # no opener: where the previous segment ended
            start_s = segments[-1].end_s if segments else round(time_offset_s, 3)
        segments.append(Segment(
            id=first_id + len(segments), seek=round(time_offset_s * MEL_FRAMES_PER_S), start_s=start_s,
            end_s=max(end_s, start_s), text=text_of(ids, tokenizer, span.token_ids), token_ids=span.token_ids,
            temperature=temperature, avg_logprob=avg_logprob, compression_ratio=ratio,
            no_speech_prob=no_speech_prob))
    return segments
