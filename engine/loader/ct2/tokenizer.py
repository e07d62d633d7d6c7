"""The tokenizer of a faster-whisper directory: its ``tokenizer.json`` checked against its vocabulary,
with Whisper's timestamp tokens added (``load_ct2_tokenizer``)."""

from __future__ import annotations

import json
from pathlib import Path

from engine.loader.ct2.token_ids import read_ct2_vocabulary, vocabulary_file, whisper_token_ids

TOKENIZER_JSON = "tokenizer.json"


def load_ct2_tokenizer(path: str | Path):
    """A ``transformers.PreTrainedTokenizerFast`` for the Whisper model directory ``path``.

    Built from ``tokenizer.json``, plus the timestamp tokens ``<|0.00|>`` .. ``<|30.00|>`` (as non-special
    added tokens at their vocabulary ids; faster-whisper's tokenizer.json often lacks them). Decoding
    does not clean up tokenization spaces (as OpenAI's and faster-whisper's tokenizers). bos, eos, unk
    and pad are ``<|endoftext|>``; Whisper's special tokens are marked special (dropped by
    ``skip_special_tokens``). Every vocabulary token is checked to map to its vocabulary id.

    NOTE: tokenizer.json's post-processor adds ``<|startoftranscript|><|notimestamps|>`` ...
    ``<|endoftext|>``; encode plain text with ``add_special_tokens=False``.

    Raises:
        ValueError: tokenizer.json or the vocabulary is missing, or they disagree on an id.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    directory = Path(path) if Path(path).is_dir() else Path(path).parent
    vocabulary = read_ct2_vocabulary(directory)
    vocab_source = vocabulary_file(directory)
    ids = whisper_token_ids(vocabulary, source=str(vocab_source))
    tokenizer_path = directory / TOKENIZER_JSON
    if not tokenizer_path.is_file():
        raise ValueError(f"{directory}: no {TOKENIZER_JSON}; faster-whisper directories carry the Hugging "
                         f"Face tokenizer file next to model.bin (copy it from the original Whisper "
                         f"checkpoint).")
    try:
        spec = json.loads(tokenizer_path.read_text(encoding="utf-8"))
        added_tokens = spec["added_tokens"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{tokenizer_path}: not a tokenizers JSON file ({e!r}).") from None

    specials = set(ids.special_ids)
    present = set()
    for token in added_tokens:
        i = token["id"]
        if i >= len(vocabulary) or vocabulary[i] != token["content"]:
            raise ValueError(f"{tokenizer_path}: added token {token['content']!r} has id {i}, but "
                             f"{vocab_source} has {vocabulary[i] if i < len(vocabulary) else 'no token'!r} "
                             f"there.")
        token["special"] = i in specials          # Whisper's specials special, timestamps not
        present.add(i)
    for i in range(ids.timestamp_begin, ids.vocab_size):
        if i not in present:
            added_tokens.append({"id": i, "content": vocabulary[i], "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": True, "special": False})
    backend = Tokenizer.from_str(json.dumps(spec))
    eot = vocabulary[ids.eot]
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=eot, eos_token=eot, unk_token=eot,
                                        pad_token=eot, clean_up_tokenization_spaces=False)
    got = tokenizer.convert_tokens_to_ids(vocabulary)
    if len(tokenizer) != len(vocabulary) or got != list(range(len(vocabulary))):
        bad = next((i for i, g in enumerate(got) if g != i), len(vocabulary))
        detail = (f"{vocabulary[bad]!r} (id {bad} in {vocab_source}) gets id {got[bad]}"
                  if bad < len(vocabulary)
                  else f"it has {len(tokenizer)} tokens, {vocab_source} {len(vocabulary)}")
        raise ValueError(f"{tokenizer_path} and {vocab_source} disagree: {detail}.")
    return tokenizer
