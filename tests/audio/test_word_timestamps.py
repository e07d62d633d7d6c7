"""Word timestamps (``timestamp_granularities[]=word``) with the real Whisper tiny.en on CPU, float32.

- The building blocks are transformers' own: ``dtw_path`` and ``median_filter`` equal transformers'
  ``_dynamic_time_warping`` / ``_median_filter`` exactly, and the engine's alignment pass (our decoder,
  teacher-forced, explicit softmax(QK^T)) gives transformers' cross-attention probabilities of the
  alignment heads to 1e-4.
- Composed as transformers composes them (softmax over all 1500 positions, cropped, the prompt rows
  dropped), those blocks give ``generate(return_token_timestamps=True)``'s token times exactly.
- The served words follow OpenAI whisper's composition instead (softmax over the audio's positions only,
  the rows of ``<|notimestamps|>`` .. last text token). Both warp the same attention rows, so a word's end
  (the start of the next word) and transformers' time of the word's last token differ only where the two
  paths part: by at most ``END_TOLERANCE_S``, and by 0 for most words (measured on the five short clips:
  0 for 32 of 45 words, 0.02 s for 12, 0.04 s for one). Left out: the recording's last word (transformers
  copies the time of the token before ``<|endoftext|>`` onto it) and the first token (transformers' path
  starts on it, so its time is always 0.0).
- Words reassemble to the text; in a 35 s recording the second window's words are past 30 s, where their
  speech is, in increasing order.
- ``word`` without ``verbose_json`` is a 400; with it the response has OpenAI's ``words``.
"""

from __future__ import annotations

import functools
import string

import numpy as np
import pytest
import torch

from engine.llm import LLM
from multimodal.audio_processing import AudioInput
from multimodal.word_timing import (SECONDS_PER_POSITION, alignment_heads_of, dtw_path, median_filter,
                                    row_start_times)
from tests.audio.whisper_reference import (AUDIO_DIR, hf_features, hf_whisper, load_wav, normalized_words,
                                           whisper_dir)

SHORT = ["fox", "hello"]
END_TOLERANCE_S = 0.06
"""Largest allowed difference between a word's end and transformers' time of its last token (3 positions)."""
MEDIAN_TOLERANCE_S = 0.02
"""... and of their median over all compared words (one position)."""


@pytest.fixture(scope="module")
def llm():
    return LLM(model=str(whisper_dir("tiny.en")), device="cpu", dtype="float32")


def _hf():
    return hf_whisper(whisper_dir("tiny.en"))


# --------------------------------------------------------------------------------------- building blocks

@pytest.mark.parametrize("shape", [(1, 1), (3, 40), (17, 9), (30, 200)])
def test_dtw_path_equals_transformers(shape):
    from transformers.models.whisper.generation_whisper import _dynamic_time_warping

    rng = np.random.default_rng(sum(shape))
    matrix = rng.standard_normal(shape)
    matrix[:, ::7] = 0.25                               # ties between steps
    rows, cols = dtw_path(matrix)
    ref_rows, ref_cols = _dynamic_time_warping(matrix)
    np.testing.assert_array_equal(rows, ref_rows)
    np.testing.assert_array_equal(cols, ref_cols)
    assert rows[0] == cols[0] == 0 and rows[-1] == shape[0] - 1 and cols[-1] == shape[1] - 1


@pytest.mark.parametrize("width", [1, 3, 7])
def test_median_filter_equals_transformers(width):
    from transformers.models.whisper.generation_whisper import _median_filter

    x = torch.randn(2, 3, 5, 50, generator=torch.Generator().manual_seed(width))
    torch.testing.assert_close(median_filter(x, width), _median_filter(x, width), rtol=0, atol=0)
    with pytest.raises(ValueError, match="odd"):
        median_filter(x, 4)


def test_alignment_heads_come_from_the_checkpoint_or_openai():
    config = _hf().config
    assert alignment_heads_of(config) == [(1, 0), (2, 0), (2, 5), (3, 0), (3, 1), (3, 2), (3, 3), (3, 4)]
    config_without = type(config)(**{**config.to_dict(), "alignment_heads": None})
    assert alignment_heads_of(config_without) == alignment_heads_of(config)          # OpenAI's tiny.en list
    unknown = type(config)(**{**config.to_dict(), "alignment_heads": None, "decoder_layers": 3})
    assert alignment_heads_of(unknown) == [(1, h) for h in range(6)] + [(2, h) for h in range(6)]


@functools.lru_cache(maxsize=None)
def _hf_token_times(name: str):
    """transformers' greedy ids (prompt included) and token times on the audio-padded features."""
    audio = load_wav(name)[0]
    with torch.no_grad():
        out = _hf().generate(input_features=hf_features(audio, 80), return_token_timestamps=True,
                             return_dict_in_generate=True, num_frames=audio.shape[0] // 160,
                             attention_mask=torch.ones(1, 3000, dtype=torch.long))
    return out["sequences"][0].tolist(), out["token_timestamps"][0].tolist()


def test_engine_alignment_pass_gives_transformers_cross_attention_and_token_times(llm):
    """Our decoder's alignment-head probabilities = transformers' cross-attentions; composed as transformers
    does, they give its token timestamps exactly."""
    audio = load_wav("fox")[0]
    ids, hf_times = _hf_token_times("fox")
    model = llm.llm_engine.runner.model
    processor = llm.llm_engine.processor.transcriber.audio_processor
    item = AudioInput(audio, processor.log_mel, processor.settings.padding)
    with torch.inference_mode():
        encoder_out = model.embed_multimodal("audio", [item])[0]
        scores = model.alignment_scores(encoder_out, torch.tensor(ids), 1500)          # [heads, T, 1500]
        hf = _hf()(input_features=hf_features(audio, 80), decoder_input_ids=torch.tensor([ids]),
                   output_attentions=True)
    heads = model.alignment_heads
    expected = torch.stack([hf.cross_attentions[layer][0, head] for layer, head in heads])
    torch.testing.assert_close(scores.softmax(dim=-1), expected, atol=1e-4, rtol=0)

    # transformers' composition: probabilities over all positions, cropped; rows of the generated tokens
    # but the last; normalised, filtered, averaged; token k's time is row k's first position on the path.
    num_prompt = 2
    weights = scores.softmax(dim=-1)[:, num_prompt:-1, :audio.shape[0] // 160 // 2]
    std, mean = torch.std_mean(weights, dim=-2, keepdim=True, unbiased=False)
    matrix = median_filter(((weights - mean) / std)[None], 7)[0].mean(dim=0)
    times = row_start_times(matrix.double().numpy())
    ours = [0.0] * num_prompt + [float(t) for t in times] + [float(times[-1])]
    np.testing.assert_allclose(ours, hf_times, atol=1e-6)


# --------------------------------------------------------------------------------------------- the words

def _last_spoken_token(tokens: list[int], tokenizer) -> int:
    """Index in ``tokens`` of the last token that is not punctuation merged into the word."""
    spoken = [i for i, t in enumerate(tokens) if tokenizer.decode([t]).strip() not in string.punctuation]
    return spoken[-1] if spoken else len(tokens) - 1


def test_words_agree_with_transformers_token_timestamps(llm):
    tokenizer = llm.llm_engine.processor.transcriber.tokenizer
    differences = []
    for name in SHORT:
        result = llm.transcribe(str(AUDIO_DIR / f"{name}.wav"), word_timestamps=True)
        ids, hf_times = _hf_token_times(name)
        words = result.words
        assert words and "".join(w.word for w in words).strip() == result.text, name
        assert all(0.0 <= w.start_s <= w.end_s <= result.duration_s for w in words), name
        assert all(a.end_s <= b.start_s for a, b in zip(words, words[1:])), name
        generated = ids[2:]                                          # after [sot, notimestamps]
        flat = [t for w in words for t in w.token_ids]
        assert flat == [t for t in generated if t < 50256], name     # the same greedy tokens
        position = 2
        for word in words[:-1]:
            last = position + _last_spoken_token(word.token_ids, tokenizer)
            if last > 2:   # transformers' first generated token is at its path's start, 0.0
                differences.append((name, word.word, round(abs(word.end_s - hf_times[last]), 4)))
            position += len(word.token_ids)
    differences = [d for _, _, d in differences]
    assert max(differences) <= END_TOLERANCE_S, differences
    assert float(np.median(differences)) <= MEDIAN_TOLERANCE_S, differences
    assert all(round(d / SECONDS_PER_POSITION, 6).is_integer() for d in differences)


def test_words_past_30_s_keep_their_window_offset(llm):
    """fox, 27 s of silence, hello (35.4 s): two windows cut at a quiet point; hello's words are timed in
    the second window and offset by its start."""
    fox, hello = load_wav("fox")[0], load_wav("hello")[0]
    samples = np.concatenate([fox, np.zeros(27 * 16000, np.float32), hello])
    hello_start_s = (fox.shape[0] + 27 * 16000) / 16000
    result = llm.transcribe((samples, 16000), timestamps=True, word_timestamps=True)
    words = result.words
    assert len(result.window_texts) == 2 and "".join(w.word for w in words).strip() == result.text
    starts = [w.start_s for w in words]
    assert starts == sorted(starts) and all(w.start_s <= w.end_s <= result.duration_s + 1e-6 for w in words)
    later = [w for w in words if w.start_s > 30.0]
    assert {"this", "test", "service"} <= {n for w in later for n in normalized_words(w.word)}
    assert all(hello_start_s - 0.5 <= w.start_s for w in later)           # hello's words, where hello is
    assert later[-1].end_s <= result.duration_s + 1e-6


def test_words_without_word_timestamps_cost_nothing(llm):
    result = llm.transcribe(str(AUDIO_DIR / "fox.wav"))
    assert result.words == [] and result.text
