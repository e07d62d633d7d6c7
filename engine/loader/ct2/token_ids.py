"""The ids of Whisper's special tokens: read from a model's vocabulary file and checked against
Whisper's fixed layout (``read_whisper_token_ids``), or the layout every released Whisper has
(``default_whisper_token_ids``)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

VOCABULARY_FILES = ("vocabulary.json", "vocabulary.txt")

# Seconds between two timestamp tokens, and how many there are (<|0.00|> .. <|30.00|>).
TIMESTAMP_STEP_S = 0.02
NUM_TIMESTAMP_TOKENS = 1501
# The tokens after the language tokens, in the order of every Whisper vocabulary.
_TASK_TOKENS = ("<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>",
                ("<|nospeech|>", "<|nocaptions|>"), "<|notimestamps|>")
_LANGUAGE_TOKEN_RE = re.compile(r"^<\|([a-z]{2,3})\|>$")
# transformers' rule for a multilingual Whisper (generation_whisper, modeling_whisper).
_MULTILINGUAL_MIN_VOCAB = 51865


@dataclass(frozen=True)
class WhisperTokenIds:
    """The ids of Whisper's special tokens, as placed in the model's vocabulary."""

    vocab_size: int
    """Number of tokens (51864 English-only, 51865 multilingual, 51866 large-v3)."""
    eot: int
    """``<|endoftext|>``: end of transcript; also the eos and pad token."""
    sot: int
    """``<|startoftranscript|>``: the decoder's first token."""
    language_ids: dict[str, int]
    """Language code ("en", "zh", ...) -> id of ``<|en|>`` ..., in vocabulary order."""
    translate: int
    """``<|translate|>``."""
    transcribe: int
    """``<|transcribe|>``."""
    start_of_lm: int
    """``<|startoflm|>``."""
    start_of_prev: int
    """``<|startofprev|>``: starts the previous-text prompt."""
    no_speech: int
    """``<|nospeech|>`` (``<|nocaptions|>`` in English-only vocabularies)."""
    no_timestamps: int
    """``<|notimestamps|>``."""
    timestamp_begin: int
    """``<|0.00|>``; timestamp ``i`` (``i * 0.02`` s) is ``timestamp_begin + i``, up to ``<|30.00|>``."""

    @property
    def is_multilingual(self) -> bool:
        """transformers' rule: a multilingual Whisper has at least 51865 tokens."""
        return self.vocab_size >= _MULTILINGUAL_MIN_VOCAB

    @property
    def special_ids(self) -> list[int]:
        """Every special (non-text, non-timestamp) id, from eot to no_timestamps."""
        return list(range(self.eot, self.no_timestamps + 1))


def read_ct2_vocabulary(path: str | Path) -> list[str]:
    """The tokens of ``vocabulary.json`` (a JSON list) or ``vocabulary.txt`` (one per line), by id."""
    directory = Path(path) if Path(path).is_dir() else Path(path).parent
    json_path, txt_path = (directory / n for n in VOCABULARY_FILES)
    if json_path.is_file():
        try:
            tokens = json.loads(json_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{json_path}: not valid JSON ({e}).") from None
        if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
            raise ValueError(f"{json_path}: expected a JSON list of token strings.")
        return tokens
    if txt_path.is_file():
        tokens = txt_path.read_text(encoding="utf-8").split("\n")
        return tokens[:-1] if tokens and tokens[-1] == "" else tokens
    raise ValueError(f"{directory}: no vocabulary.json or vocabulary.txt; a faster-whisper directory holds "
                     f"one of them next to model.bin.")


def whisper_token_ids(vocabulary: list[str], source: str = "vocabulary") -> WhisperTokenIds:
    """Find and check the special tokens in a Whisper vocabulary.

    Raises:
        ValueError: a special token is missing or out of Whisper's fixed order, or the timestamp
            tokens are not ``<|0.00|>`` .. ``<|30.00|>`` at the end of the vocabulary.
    """
    def index(token: str) -> int:
        try:
            return vocabulary.index(token)
        except ValueError:
            raise ValueError(f"{source}: no {token} token; this is not a Whisper vocabulary.") from None

    eot, sot, translate = index("<|endoftext|>"), index("<|startoftranscript|>"), index("<|translate|>")
    if sot != eot + 1:
        raise ValueError(f"{source}: <|startoftranscript|> is at {sot}, expected right after <|endoftext|> "
                         f"({eot}).")
    languages = {}
    for i in range(sot + 1, translate):
        match = _LANGUAGE_TOKEN_RE.match(vocabulary[i])
        if match is None:
            raise ValueError(f"{source}: token {i} {vocabulary[i]!r} sits between <|startoftranscript|> and "
                             f"<|translate|>, where Whisper has only language tokens.")
        languages[match.group(1)] = i
    ids = [translate]
    for offset, names in enumerate(_TASK_TOKENS[1:], start=1):
        names = names if isinstance(names, tuple) else (names,)
        i = translate + offset
        if i >= len(vocabulary) or vocabulary[i] not in names:
            raise ValueError(f"{source}: expected {' or '.join(names)} at id {i} (after <|translate|> at "
                             f"{translate}), found {vocabulary[i] if i < len(vocabulary) else 'the end'!r}.")
        ids.append(i)
    timestamp_begin = ids[-1] + 1
    expected_timestamps = [f"<|{i * TIMESTAMP_STEP_S:.2f}|>" for i in range(NUM_TIMESTAMP_TOKENS)]
    if vocabulary[timestamp_begin:] != expected_timestamps:
        raise ValueError(f"{source}: the tokens after <|notimestamps|> ({timestamp_begin - 1}) should be "
                         f"exactly <|0.00|> .. <|30.00|> ({NUM_TIMESTAMP_TOKENS} tokens), ending the "
                         f"vocabulary; found {len(vocabulary) - timestamp_begin} tokens starting with "
                         f"{vocabulary[timestamp_begin:timestamp_begin + 2]}.")
    _, transcribe, start_of_lm, start_of_prev, no_speech, no_timestamps = ids
    return WhisperTokenIds(vocab_size=len(vocabulary), eot=eot, sot=sot, language_ids=languages,
                           translate=translate, transcribe=transcribe, start_of_lm=start_of_lm,
                           start_of_prev=start_of_prev, no_speech=no_speech, no_timestamps=no_timestamps,
                           timestamp_begin=timestamp_begin)


def default_whisper_token_ids(vocab_size: int) -> WhisperTokenIds:
    """The special ids every released Whisper has for ``vocab_size`` (used when no vocabulary file exists).

    English-only (51864): eot 50256; multilingual: eot 50257. Then sot, the languages in OpenAI's
    order (99, or 100 for large-v3's 51866), the 6 task tokens and 1501 timestamps.
    """
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    eot = 50256 + (vocab_size >= _MULTILINGUAL_MIN_VOCAB)
    num_languages = vocab_size - NUM_TIMESTAMP_TOKENS - len(_TASK_TOKENS) - (eot + 2)
    if not 1 <= num_languages <= len(LANGUAGES):
        raise ValueError(f"A Whisper vocabulary of {vocab_size} tokens does not fit the released layouts "
                         f"(51864-51866); add the model's vocabulary.json or vocabulary.txt.")
    vocabulary = [f"t{i}" for i in range(eot)] + ["<|endoftext|>", "<|startoftranscript|>"]
    vocabulary += [f"<|{code}|>" for code in list(LANGUAGES)[:num_languages]]
    vocabulary += [t if isinstance(t, str) else t[0] for t in _TASK_TOKENS]
    vocabulary += [f"<|{i * TIMESTAMP_STEP_S:.2f}|>" for i in range(NUM_TIMESTAMP_TOKENS)]
    return whisper_token_ids(vocabulary, f"the default {vocab_size}-token Whisper layout")


def read_whisper_token_ids(path: str | Path) -> WhisperTokenIds:
    """The checked special ids of the Whisper model directory ``path`` (from its vocabulary file)."""
    return whisper_token_ids(read_ct2_vocabulary(path), source=str(vocabulary_file(path)))


def vocabulary_file(path: str | Path) -> Path:
    """The vocabulary file of the model directory ``path`` (``vocabulary.txt`` when there is none)."""
    directory = Path(path) if Path(path).is_dir() else Path(path).parent
    for name in VOCABULARY_FILES:
        if (directory / name).is_file():
            return directory / name
    return directory / VOCABULARY_FILES[-1]
