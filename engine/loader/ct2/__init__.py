"""Read CTranslate2 (faster-whisper) Whisper directories natively: weights, config and tokenizer.

A faster-whisper directory holds ``model.bin`` (or ``model.bin.part1``, ``model.bin.part2``, ...),
``config.json`` (suppress lists, language ids, alignment heads), ``tokenizer.json`` and
``vocabulary.txt`` / ``vocabulary.json``. This package turns it into what transformers'
``WhisperForConditionalGeneration`` loads, without CTranslate2 installed::

    model = read_ct2_model(path)                          # CT2Model: dequantized tensors + scalar flags
    config, weights = ct2_whisper_to_hf(model, dtype)     # WhisperConfig, iterator of (hf_name, tensor)
    generation_config = ct2_whisper_generation_config(config)
    tokenizer = load_ct2_tokenizer(path)                  # PreTrainedTokenizerFast with timestamp tokens
    ids = read_whisper_token_ids(path)                    # sot, eot, no_timestamps, languages, ...
    is_ct2_whisper_dir(path)                              # model.bin header says "WhisperSpec"

One module per part: ``reader`` (the ``model.bin`` format), ``token_ids`` (Whisper's special tokens),
``tokenizer`` and ``weights`` (the mapping to transformers' names and config).
"""

from engine.loader.ct2.reader import CT2Model, ct2_model_files, is_ct2_whisper_dir, read_ct2_model
from engine.loader.ct2.token_ids import (TIMESTAMP_STEP_S, WhisperTokenIds, default_whisper_token_ids,
                                         read_ct2_vocabulary, read_whisper_token_ids, whisper_token_ids)
from engine.loader.ct2.tokenizer import load_ct2_tokenizer
from engine.loader.ct2.weights import ct2_whisper_generation_config, ct2_whisper_to_hf

__all__ = ["CT2Model", "TIMESTAMP_STEP_S", "WhisperTokenIds", "ct2_model_files",
           "ct2_whisper_generation_config", "ct2_whisper_to_hf", "default_whisper_token_ids",
           "is_ct2_whisper_dir", "load_ct2_tokenizer", "read_ct2_model", "read_ct2_vocabulary",
           "read_whisper_token_ids", "whisper_token_ids"]
