"""Transcription and translation of one recording with a Whisper model: which engine requests to run, and
how their outputs become one transcript.

No engine calls here: ``Transcriber`` plans requests (an optional language-detection request, then one
request per 30 s window, all independent so they run in parallel in the batch) and assembles outputs;
``LLM.transcribe`` runs them offline, the server's ``/v1/audio/*`` routes through ``AsyncLLM``.

Windows come from the transcriber's chunker (``multimodal.audio_chunking``: ``quiet`` cuts at the quietest
100 ms of each window's last second; ``vad`` (``multimodal.vad``) keeps the speech only, windows split
between utterances); their offsets are sample counts / rate, so they do not drift. Each window's text and
timed segments come from ``multimodal.whisper_decoding.parse_segments``; a segment left open at a cut
is closed at the window's end.

Word timestamps (``TranscriptionOptions.word_timestamps``) take one more engine call per finished window
with text: ``alignment_call`` asks the engine for the alignment heads' attention over the window's text
tokens (``core_messages.AlignmentScores``), and ``multimodal.word_timing.align_words`` turns it into timed
words, offset by the window's start.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from engine.core_messages import AlignmentScores
from engine.loader.ct2 import WhisperTokenIds, default_whisper_token_ids, whisper_token_ids
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from multimodal.audio import AudioError, DecodedAudio
from multimodal.audio_chunking import AUDIO_CHUNKING_MODES, AudioChunk, AudioChunker, QuietChunker
from multimodal.whisper_decoding import (Segment, build_decoder_prompt, language_detection_prompt,
                                         language_from_token, parse_segments, resolve_language)
from multimodal.word_timing import WordTiming, align_words

SILENCE_PEAK = 1e-4
"""Audio whose every sample is below this (absolute) has nothing to transcribe: a 400."""
NO_SPEECH_TOP_LOGPROBS = 20
"""Top logprobs read at the token after ``<|startoftranscript|>`` to find ``<|nospeech|>``'s probability."""


@dataclass(frozen=True)
class TranscriptionOptions:
    """What one transcription request asks for (OpenAI's form fields)."""

    task: str = "transcribe"
    """"transcribe", or "translate" (into English; multilingual models)."""
    language: Optional[str] = None
    """Code or English name; None: English on English-only models, detected on multilingual ones."""
    prompt: Optional[str] = None
    """Previous text to condition every window on (OpenAI's ``prompt``)."""
    timestamps: bool = False
    """Predict timestamp tokens (segments with times: verbose_json, srt, vtt)."""
    temperature: float = 0.0
    """Sampling temperature (0: greedy)."""
    max_tokens: Optional[int] = None
    """Cap on tokens per window; None: up to the decoder's room."""
    seed: Optional[int] = None
    word_timestamps: bool = False
    """Time every word (``timestamp_granularities[]=word``): one alignment pass per window after decoding."""


@dataclass
class WindowPlan:
    """One engine request: a window of the audio and its decoder prompt."""

    index: int
    chunk: AudioChunk
    prompt_token_ids: list[int]
    samples: np.ndarray
    """float32 [chunk.num_samples] at the model's rate."""


@dataclass
class TranscriptionResult:
    text: str
    """The whole transcript (windows' texts joined)."""
    segments: list[Segment]
    """Timed segments over the whole audio, numbered from 0."""
    language: Optional[str]
    """Language code of the audio (given or detected); None if unknown."""
    duration_s: float
    task: str
    window_texts: list[str] = field(default_factory=list)
    """Each window's text, in order."""
    words: list[WordTiming] = field(default_factory=list)
    """Timed words over the whole audio, when word timestamps were asked for."""


def token_ids_of(tokenizer, vocab_size: int) -> WhisperTokenIds:
    """The Whisper special ids of ``tokenizer``'s vocabulary (its timestamp tokens may be missing from
    older tokenizers: then the released layout for ``vocab_size``)."""
    vocabulary = tokenizer.convert_ids_to_tokens(list(range(vocab_size)))
    try:
        return whisper_token_ids([t if t is not None else "" for t in vocabulary], "the tokenizer")
    except ValueError:
        return default_whisper_token_ids(vocab_size)


class Transcriber:
    """Plans and assembles transcriptions for one Whisper model.

    Args:
        tokenizer: the model's tokenizer.
        token_ids: its special token ids.
        max_model_len: decoder positions (448): prompt + output tokens of a window.
        sample_rate_hz: the rate audio is decoded at (16 kHz).
        window_s: the encoder's window (30 s).
        audio_processor: the model's ``AudioPromptProcessor`` (the encoder input of a word-timing call).
        chunker: how long audio becomes windows (``--audio-chunking``; default: quiet cuts).
    """

    def __init__(self, tokenizer, token_ids: WhisperTokenIds, max_model_len: int, sample_rate_hz: int,
                 window_s: float, audio_processor=None, chunker: Optional[AudioChunker] = None) -> None:
        self.tokenizer = tokenizer
        self.ids = token_ids
        self.max_model_len = max_model_len
        self.sample_rate_hz = sample_rate_hz
        self.window_s = window_s
        self.audio_processor = audio_processor
        self.chunker: AudioChunker = chunker or QuietChunker()

    def with_chunking(self, mode: str) -> "Transcriber":
        """This transcriber cutting long audio by ``mode`` ("quiet" or "vad"). ValueError with the install
        command when "vad" is asked for and silero-vad or onnxruntime is missing."""
        return Transcriber(self.tokenizer, self.ids, self.max_model_len, self.sample_rate_hz, self.window_s,
                           self.audio_processor, audio_chunker(mode))

    @property
    def is_multilingual(self) -> bool:
        return self.ids.is_multilingual

    # ------------------------------------------------------------------ checks
    def check_options(self, options: TranscriptionOptions) -> Optional[str]:
        """The language code the options fix (None: to detect). ValueError for what the model cannot do."""
        if options.task not in ("transcribe", "translate"):
            raise ValueError(f"task: {options.task!r}; use 'transcribe' or 'translate'.")
        if options.task == "translate" and not self.is_multilingual:
            raise ValueError("This model is English-only and cannot translate; serve a multilingual Whisper "
                             "model for /v1/audio/translations.")
        if not 0.0 <= options.temperature <= 2.0:
            raise ValueError(f"temperature: {options.temperature} is outside [0, 2].")
        code = resolve_language(self.ids, options.language)
        if code is None and not self.is_multilingual:
            code = "en"
        # Fail early on a prompt the tokenizer refuses (special or timestamp tokens spelled out).
        build_decoder_prompt(self.ids, self.tokenizer, language=code or _any_language(self.ids), task=options.task,
                             timestamps=options.timestamps, prompt_text=options.prompt)
        return code

    @staticmethod
    def check_audio(audio: DecodedAudio) -> None:
        """AudioError for audio with nothing to transcribe (no samples, or silence only)."""
        if audio.samples.size == 0:
            raise AudioError("the audio has no samples.")
        if float(np.max(np.abs(audio.samples))) < SILENCE_PEAK:
            raise AudioError("the audio is silent (every sample is below 1e-4 of full scale); nothing to transcribe.")

    # ------------------------------------------------------------------ planning
    def chunks(self, audio: DecodedAudio) -> list[AudioChunk]:
        """The windows of ``audio`` by the transcriber's chunker (seconds of model time for ``vad`` on long
        audio: call it once, off an event loop, and pass the result on)."""
        return self.chunker.chunks(audio.samples, self.sample_rate_hz, self.window_s)

    def detection_request(self, audio: DecodedAudio,
                          chunks: Optional[list[AudioChunk]] = None) -> tuple[dict, SamplingParams]:
        """A one-token request on the first window (of ``chunks``, default ``self.chunks(audio)``; the
        first 30 s when there is none) whose only allowed tokens are the languages (the model's logits
        rules restrict a ``[<|startoftranscript|>]`` prompt to them)."""
        chunks = self.chunks(audio) if chunks is None else chunks
        first = chunks[0] if chunks else QuietChunker().chunks(audio.samples, self.sample_rate_hz, self.window_s)[0]
        prompt = {"prompt_token_ids": language_detection_prompt(self.ids),
                  "multi_modal_data": {"audio": (audio.samples[first.start_sample:first.end_sample],
                                                 self.sample_rate_hz)}}
        return prompt, SamplingParams(temperature=0.0, max_tokens=1, skip_special_tokens=False)

    def language_of(self, output: RequestOutput) -> str:
        token_ids = output.outputs[0].token_ids
        if not token_ids:
            raise RuntimeError("language detection produced no token")
        return language_from_token(self.ids, token_ids[0])

    def windows(self, audio: DecodedAudio, options: TranscriptionOptions, language: Optional[str],
                chunks: Optional[list[AudioChunk]] = None) -> list[WindowPlan]:
        """One engine request per window (``chunks``, default ``self.chunks(audio)``)."""
        chunks = self.chunks(audio) if chunks is None else chunks
        prompt = build_decoder_prompt(self.ids, self.tokenizer, language=language, task=options.task,
                                      timestamps=options.timestamps, prompt_text=options.prompt)
        return [WindowPlan(i, c, list(prompt), audio.samples[c.start_sample:c.end_sample])
                for i, c in enumerate(chunks)]

    def window_request(self, window: WindowPlan, options: TranscriptionOptions) -> tuple[dict, SamplingParams]:
        room = self.max_model_len - len(window.prompt_token_ids)
        max_tokens = room if options.max_tokens is None else min(room, options.max_tokens)
        params = SamplingParams(temperature=options.temperature, max_tokens=max_tokens, seed=options.seed,
                                logprobs=NO_SPEECH_TOP_LOGPROBS, skip_special_tokens=True)
        if self._sot_index(window.prompt_token_ids) + 1 < len(window.prompt_token_ids):
            params.prompt_logprobs = NO_SPEECH_TOP_LOGPROBS
        prompt = {"prompt_token_ids": window.prompt_token_ids,
                  "multi_modal_data": {"audio": (window.samples, self.sample_rate_hz)}}
        return prompt, params

    # ------------------------------------------------------------------ assembling
    def window_segments(self, window: WindowPlan, output: RequestOutput, options: TranscriptionOptions,
                        first_id: int) -> list[Segment]:
        completion = output.outputs[0]
        token_ids = list(completion.token_ids)
        logprobs = None
        if completion.logprobs:
            logprobs = [step[t].logprob for step, t in zip(completion.logprobs, token_ids) if t in step]
        return parse_segments(self.ids, self.tokenizer, token_ids, logprobs, time_offset_s=window.chunk.start_s,
                              chunk_end_s=window.chunk.end_s, no_speech_prob=self._no_speech_prob(window, output),
                              temperature=options.temperature, first_id=first_id)

    def window_text(self, output: RequestOutput) -> str:
        return self.tokenizer.decode([t for t in output.outputs[0].token_ids if t < self.ids.eot])

    def assemble(self, audio: DecodedAudio, windows: list[WindowPlan], outputs: list[RequestOutput],
                 options: TranscriptionOptions, language: Optional[str],
                 alignments: Optional[list[Optional[np.ndarray]]] = None) -> TranscriptionResult:
        """The transcript of ``windows``' finished ``outputs``; ``alignments``: each window's answer to its
        ``alignment_call`` (None where it had none), when word timestamps were asked for."""
        segments: list[Segment] = []
        texts: list[str] = []
        words: list[WordTiming] = []
        for i, (window, output) in enumerate(zip(windows, outputs)):
            texts.append(self.window_text(output))
            segments += self.window_segments(window, output, options, first_id=len(segments))
            if alignments is not None and alignments[i] is not None:
                words += self.window_words(window, output, options, language, alignments[i])
        return TranscriptionResult(text=join_texts(texts), segments=segments, language=language,
                                   duration_s=audio.duration_s, task=options.task, window_texts=texts,
                                   words=words)

    # ------------------------------------------------------------------ word timestamps
    def _text_tokens(self, output: RequestOutput) -> list[int]:
        return [t for t in output.outputs[0].token_ids if t < self.ids.eot]

    def _alignment_prefix(self, options: TranscriptionOptions, language: Optional[str]) -> list[int]:
        """``<|startoftranscript|>`` (+ language, task) and ``<|notimestamps|>``: OpenAI's alignment prompt
        (no previous text, no timestamps)."""
        return build_decoder_prompt(self.ids, self.tokenizer, language=language, task=options.task,
                                    timestamps=False, prompt_text=None)

    def alignment_call(self, window: WindowPlan, output: RequestOutput, options: TranscriptionOptions,
                       language: Optional[str]) -> Optional[AlignmentScores]:
        """The engine call that times ``window``'s words (None when it has no text)."""
        text = self._text_tokens(output)
        if not text:
            return None
        if self.audio_processor is None:
            raise ValueError("word timestamps need the model's audio processor.")
        from multimodal.audio_processing import AudioInput

        processor = self.audio_processor
        frames = window.samples.shape[0] // processor.settings.hop_length
        num_positions = min(processor.num_embeds, max(1, frames // 2))
        audio = AudioInput(np.ascontiguousarray(window.samples, dtype=np.float32), processor.log_mel,
                           processor.settings.padding)
        token_ids = self._alignment_prefix(options, language) + text + [self.ids.eot]
        return AlignmentScores(audio, tuple(token_ids), num_positions)

    def window_words(self, window: WindowPlan, output: RequestOutput, options: TranscriptionOptions,
                     language: Optional[str], scores: np.ndarray) -> list[WordTiming]:
        """``window``'s timed words from the engine's answer to its ``alignment_call``."""
        import torch

        first_row = len(self._alignment_prefix(options, language)) - 1
        return align_words(torch.from_numpy(np.asarray(scores)), self._text_tokens(output), first_row,
                           self.ids.eot, self.tokenizer.decode, language, offset_s=window.chunk.start_s)

    def _sot_index(self, prompt: list[int]) -> int:
        return prompt.index(self.ids.sot)

    def _no_speech_prob(self, window: WindowPlan, output: RequestOutput) -> Optional[float]:
        """P(``<|nospeech|>``) after ``<|startoftranscript|>`` (OpenAI's no_speech_prob): from the prompt
        logprobs at the token after sot, or the first generated step's when sot ends the prompt. 0.0 when
        it is not among the top ``NO_SPEECH_TOP_LOGPROBS``."""
        position = self._sot_index(window.prompt_token_ids) + 1
        if position < len(window.prompt_token_ids):
            steps = output.prompt_logprobs or []
            step = steps[position] if position < len(steps) else None
        else:
            steps = output.outputs[0].logprobs or []
            step = steps[0] if steps else None
        if step is None:
            return None
        entry = step.get(self.ids.no_speech)
        return math.exp(entry.logprob) if entry is not None else 0.0


def audio_chunker(mode: str) -> AudioChunker:
    """The chunker of ``--audio-chunking mode``. ValueError for an unknown mode, or for "vad" without its
    packages (``multimodal.vad.VadUnavailableError``: the message says how to install them)."""
    if mode == "quiet":
        return QuietChunker()
    if mode == "vad":
        from multimodal.vad import VoiceChunker

        return VoiceChunker.load()
    raise ValueError(f"--audio-chunking {mode!r}: use one of {', '.join(AUDIO_CHUNKING_MODES)}.")


def join_texts(texts: list[str]) -> str:
    """Windows' texts as one transcript (each decoded text starts with its own space, as Whisper writes)."""
    return "".join(texts).strip()


def _any_language(ids: WhisperTokenIds) -> Optional[str]:
    return next(iter(ids.language_ids)) if ids.is_multilingual else None


def options_from_form(task: str, language: Optional[str], prompt: Optional[str], response_format: str,
                      temperature: Optional[float], granularities: Optional[list[str]]) -> TranscriptionOptions:
    """The options an OpenAI audio request's fields ask for. ValueError for unsupported ones (word timestamps
    come in verbose_json only, as OpenAI's)."""
    granularities = list(granularities or [])
    for g in granularities:
        if g not in ("segment", "word"):
            raise ValueError(f"timestamp_granularities[]: {g!r}; use 'segment' or 'word'.")
    words = "word" in granularities
    if words and response_format != "verbose_json":
        raise ValueError(f"timestamp_granularities[]=word needs response_format=verbose_json, not "
                         f"{response_format!r}.")
    timestamps = response_format in ("verbose_json", "srt", "vtt") or "segment" in granularities
    return TranscriptionOptions(task=task, language=language or None, prompt=prompt or None, timestamps=timestamps,
                                temperature=0.0 if temperature is None else float(temperature),
                                word_timestamps=words)
