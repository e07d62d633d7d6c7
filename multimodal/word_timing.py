"""Word timestamps of a Whisper window from its decoder's cross-attention, as OpenAI whisper's ``timing.py``.

Input: the scaled ``Q K^T`` of the model's *alignment heads* (cross-attention heads whose attention follows
the speech) from one teacher-forced pass over ``[<|startoftranscript|> (+ language, task),
<|notimestamps|>, text tokens..., <|endoftext|>]``, cut to the encoder positions that hold audio
(``alignment_scores``: ``[heads, tokens, positions]``). Then, as OpenAI's ``find_alignment``:

1. softmax over the positions of each row (the audio's positions only), per head;
2. each position's column normalised over the tokens (zero mean, unit standard deviation);
3. a median filter of width 7 along the positions (reflect padding);
4. the heads averaged: ``[tokens, positions]``;
5. the rows of the queries that predict a text token or ``<|endoftext|>`` kept (from ``<|notimestamps|>`` to the
   last text token), and the cheapest monotonic path through ``-matrix`` found by dynamic time warping;
6. each row's time is the first position the path reaches on it (``0.02 s`` per position);
7. tokens grouped into words (a new word at a leading space or a punctuation token; at every complete
   UTF-8 character for languages written without spaces), a word starting at its first token's row time
   and ending where the next word starts (the last one where ``<|endoftext|>`` starts);
8. punctuation merged into the neighbouring word (opening marks forward, closing marks backward).

OpenAI's ``transcribe`` then shortens overlong words at sentence ends; that heuristic is not applied here.
The path's tie-breaking is OpenAI's (diagonal only when strictly cheapest, then vertical, else horizontal)
and the costs are float32 as there, so the path is theirs; it is computed one anti-diagonal at a time.
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

SECONDS_PER_POSITION = 0.02
"""One encoder position: 2 mel frames of 10 ms."""
MEDIAN_FILTER_WIDTH = 7
"""Positions in the median filter of step 3 (OpenAI's and transformers' default)."""
PREPEND_PUNCTUATION = "\"'“¿([{-"
"""Marks joined to the word after them (OpenAI's ``prepend_punctuations``)."""
APPEND_PUNCTUATION = "\"'.。,，!！?？:：”)]}、"
"""Marks joined to the word before them (OpenAI's ``append_punctuations``)."""
UNSPACED_LANGUAGES = frozenset({"zh", "ja", "th", "lo", "my", "yue"})
"""Languages whose words are split at every complete character instead of at spaces."""


@dataclass
class WordTiming:
    """One word of a transcript and where it is spoken."""

    word: str
    """Its text as decoded, with the leading space Whisper's tokens carry (" Hello,")."""
    token_ids: list[int] = field(default_factory=list)
    """Its tokens."""
    start_s: float = 0.0
    """Seconds from the start of the audio (the window's offset added)."""
    end_s: float = 0.0


def median_filter(x: torch.Tensor, width: int = MEDIAN_FILTER_WIDTH) -> torch.Tensor:
    """Median over ``width`` (odd) neighbours along the last dimension, edges reflected. x [..., N] (3-d or
    4-d) -> the same shape; returned unchanged when N <= width // 2 (too short to reflect)."""
    if width <= 0 or width % 2 != 1:
        raise ValueError(f"median filter width must be a positive odd number, got {width}")
    half = width // 2
    if x.shape[-1] <= half:
        return x
    padded = F.pad(x, (half, half, 0, 0), mode="reflect")
    return padded.unfold(-1, width, 1).sort(dim=-1).values[..., half]


def alignment_matrix(scores: torch.Tensor, filter_width: int = MEDIAN_FILTER_WIDTH) -> torch.Tensor:
    """Steps 1-4: scores [heads, tokens, positions] (scaled QK^T of the alignment heads over the audio's
    positions) -> float32 [tokens, positions]."""
    weights = scores.float().softmax(dim=-1)                                   # [H, T, P]
    std, mean = torch.std_mean(weights, dim=-2, keepdim=True, unbiased=False)  # [H, 1, P]
    weights = median_filter((weights - mean) / std, filter_width)
    return weights.mean(dim=0)                                                 # [T, P]


def dtw_path(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The monotonic path from (0, 0) to (N-1, M-1) through ``cost`` [N, M] with the least total, as
    OpenAI's ``dtw_cpu`` + ``backtrace``: (row indices, column indices), one entry per step of the path."""
    num_rows, num_cols = cost.shape
    total = np.full((num_rows + 1, num_cols + 1), np.inf, dtype=np.float32)
    trace = np.full((num_rows + 1, num_cols + 1), -1, dtype=np.int8)
    total[0, 0] = 0.0
    x = np.asarray(cost, dtype=np.float64)
    for diagonal in range(2, num_rows + num_cols + 1):                # i + j, every cell of it independent
        i = np.arange(max(1, diagonal - num_cols), min(num_rows, diagonal - 1) + 1)
        j = diagonal - i
        c0, c1, c2 = total[i - 1, j - 1], total[i - 1, j], total[i, j - 1]
        diagonal_step = (c0 < c1) & (c0 < c2)
        vertical_step = ~diagonal_step & (c1 < c0) & (c1 < c2)
        step = np.where(diagonal_step, 0, np.where(vertical_step, 1, 2)).astype(np.int8)
        best = np.where(diagonal_step, c0, np.where(vertical_step, c1, c2))
        total[i, j] = (x[i - 1, j - 1] + best.astype(np.float64)).astype(np.float32)
        trace[i, j] = step
    trace[0, :] = 2
    trace[:, 0] = 1
    rows, cols = [], []
    i, j = num_rows, num_cols
    while i > 0 or j > 0:
        rows.append(i - 1)
        cols.append(j - 1)
        step = trace[i, j]
        if step == 0:
            i, j = i - 1, j - 1
        elif step == 1:
            i -= 1
        else:
            j -= 1
    return np.array(rows[::-1]), np.array(cols[::-1])


def row_start_times(matrix: np.ndarray) -> np.ndarray:
    """Steps 5-6: matrix [rows, positions] -> seconds [rows], the first position the warping path through
    ``-matrix`` reaches on each row."""
    rows, cols = dtw_path(-matrix)
    jumps = np.diff(rows, prepend=-1).astype(bool)        # the path's first cell on each row
    return cols[jumps] * SECONDS_PER_POSITION


def split_words(token_ids: Sequence[int], eot: int, decode: Callable[[list[int]], str],
                split_on_spaces: bool = True) -> tuple[list[str], list[list[int]]]:
    """Step 7's grouping of ``token_ids`` (text tokens, then ``eot``): (words, their tokens). Pieces end
    where the decoded text is complete UTF-8; with ``split_on_spaces`` a piece joins the previous word
    unless it starts with a space, is punctuation or is special (>= eot)."""
    full = decode(list(token_ids))
    pieces: list[str] = []
    piece_tokens: list[list[int]] = []
    current: list[int] = []
    offset = 0
    for token in token_ids:
        current.append(token)
        text = decode(current)
        bad = text.find("\ufffd")
        if bad < 0 or full[offset + bad:offset + bad + 1] == "\ufffd":   # complete, or U+FFFD in the text
            pieces.append(text)
            piece_tokens.append(current)
            current = []
            offset += len(text)
    if not split_on_spaces:
        return pieces, piece_tokens
    words: list[str] = []
    word_tokens: list[list[int]] = []
    for text, tokens in zip(pieces, piece_tokens):
        if tokens[0] >= eot or text.startswith(" ") or text.strip() in string.punctuation or not words:
            words.append(text)
            word_tokens.append(list(tokens))
        else:
            words[-1] += text
            word_tokens[-1].extend(tokens)
    return words, word_tokens


def merge_punctuation(words: list[WordTiming], prepended: str = PREPEND_PUNCTUATION,
                      appended: str = APPEND_PUNCTUATION) -> list[WordTiming]:
    """Step 8: an opening mark (" (") joins the word after it, a closing mark (",") the word before it; the
    joined word keeps its own times. Returns the words left."""
    following = len(words) - 1
    for i in range(len(words) - 2, -1, -1):
        previous, nxt = words[i], words[following]
        if previous.word.startswith(" ") and previous.word.strip() in prepended:
            nxt.word, nxt.token_ids = previous.word + nxt.word, previous.token_ids + nxt.token_ids
            previous.word, previous.token_ids = "", []
        else:
            following = i
    previous_index = 0
    for j in range(1, len(words)):
        previous, nxt = words[previous_index], words[j]
        if not previous.word.endswith(" ") and nxt.word in appended:
            previous.word, previous.token_ids = previous.word + nxt.word, previous.token_ids + nxt.token_ids
            nxt.word, nxt.token_ids = "", []
        else:
            previous_index = j
    return [w for w in words if w.word]


def align_words(scores: torch.Tensor, text_token_ids: Sequence[int], first_row: int, eot: int,
                decode: Callable[[list[int]], str], language: str | None = None,
                offset_s: float = 0.0) -> list[WordTiming]:
    """The words of one window with their times.

    Args:
        scores: [heads, tokens, positions] scaled QK^T of the alignment heads over the teacher-forced
            sequence ``prefix + text_token_ids + [eot]`` (positions: the window's audio only).
        text_token_ids: the window's text tokens (no timestamp or special tokens).
        first_row: the row of ``<|notimestamps|>`` in ``scores`` (the prefix's last token), whose query
            predicts the first text token.
        eot: ``<|endoftext|>``.
        decode: token ids -> text (no clean-up of spaces).
        language: the language code; Chinese, Japanese, Thai, Lao, Burmese and Cantonese split per character.
        offset_s: where the window starts in the audio.
    """
    if not text_token_ids:
        return []
    expected = first_row + len(text_token_ids) + 2
    if scores.dim() != 3 or scores.shape[1] != expected:
        raise ValueError(f"alignment scores must be [heads, {expected}, positions] for {len(text_token_ids)} "
                         f"text tokens after {first_row + 1} prefix tokens and before eot, got {list(scores.shape)}")
    matrix = alignment_matrix(scores)[first_row:-1]                           # [text + 1, positions]
    times = row_start_times(matrix.numpy())                                   # [text + 1]
    words, word_tokens = split_words(list(text_token_ids) + [eot], eot, decode,
                                     split_on_spaces=language not in UNSPACED_LANGUAGES)
    if len(word_tokens) <= 1:
        return []
    boundaries = np.concatenate([[0], np.cumsum([len(t) for t in word_tokens[:-1]])])   # [words + 1]
    timings = [WordTiming(word, tokens, offset_s + float(times[start]), offset_s + float(times[end]))
               for word, tokens, start, end in zip(words[:-1], word_tokens[:-1], boundaries[:-1], boundaries[1:])]
    return merge_punctuation(timings)


# ---------------------------------------------------------------------------------------- alignment heads

OPENAI_ALIGNMENT_HEADS: dict[tuple[int, int, int, int, bool], tuple[tuple[int, int], ...]] = {
    (4, 6, 384, 80, True): ((1, 0), (2, 0), (2, 5), (3, 0), (3, 1), (3, 2), (3, 3), (3, 4)),           # tiny.en
    (4, 6, 384, 80, False): ((2, 2), (3, 0), (3, 2), (3, 3), (3, 4), (3, 5)),                          # tiny
    (6, 8, 512, 80, True): ((3, 3), (4, 7), (5, 1), (5, 5), (5, 7)),                                   # base.en
    (6, 8, 512, 80, False): ((3, 1), (4, 2), (4, 3), (4, 7), (5, 1), (5, 2), (5, 4), (5, 6)),          # base
    (12, 12, 768, 80, True): ((6, 6), (7, 0), (7, 3), (7, 8), (8, 2), (8, 5), (8, 7), (9, 0), (9, 4), (9, 8),
                              (9, 10), (10, 0), (10, 1), (10, 2), (10, 3), (10, 6), (10, 11), (11, 2),
                              (11, 4)),                                                                # small.en
    (12, 12, 768, 80, False): ((5, 3), (5, 9), (8, 0), (8, 4), (8, 7), (8, 8), (9, 0), (9, 7), (9, 9),
                               (10, 5)),                                                               # small
    (24, 16, 1024, 80, True): ((11, 4), (14, 1), (14, 12), (14, 14), (15, 4), (16, 0), (16, 4), (16, 9),
                               (17, 12), (17, 14), (18, 7), (18, 10), (18, 15), (20, 0), (20, 3), (20, 9),
                               (20, 14), (21, 12)),                                                    # medium.en
    (24, 16, 1024, 80, False): ((13, 15), (15, 4), (15, 15), (16, 1), (20, 0), (23, 4)),               # medium
    (32, 20, 1280, 128, False): ((7, 0), (10, 17), (12, 18), (13, 12), (16, 1), (17, 14), (19, 11), (21, 4),
                                 (24, 1), (25, 6)),                                                    # large-v3
    (4, 20, 1280, 128, False): ((2, 4), (2, 11), (3, 3), (3, 6), (3, 11), (3, 14)),                    # turbo
}
"""OpenAI whisper's built-in alignment heads (``_ALIGNMENT_HEADS``, decoded) by (decoder layers, decoder heads,
d_model, mel bins, English-only). large-v1 and large-v2 share a shape and differ in heads: not listed."""


def alignment_heads_of(config) -> list[tuple[int, int]]:
    """(decoder layer, head) pairs whose cross-attention times words: the config's ``alignment_heads`` (a
    checkpoint's generation_config), else OpenAI's built-in ones for a released shape, else every head of
    the upper half of the decoder layers (OpenAI's default for an unknown model)."""
    heads = getattr(config, "alignment_heads", None)
    if heads:
        return [(int(layer), int(head)) for layer, head in heads]
    layers, num_heads = config.decoder_layers, config.decoder_attention_heads
    english_only = config.vocab_size == 51864
    known = OPENAI_ALIGNMENT_HEADS.get((layers, num_heads, config.d_model, config.num_mel_bins, english_only))
    if known is not None:
        return list(known)
    return [(layer, head) for layer in range(layers // 2, layers) for head in range(num_heads)]
