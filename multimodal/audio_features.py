"""Whisper's log-mel input features, computed in torch on the audio's device (CPU or CUDA), batched.

``WhisperLogMel(num_mel_bins)`` turns mono 16 kHz waveforms into ``[B, num_mel_bins, 3000]`` float32
features, the encoder's 30 s window, by one of two padding rules (see shared/reference/whisper-weights.md,
"Why the short greedy runs differ"):

- ``padding="audio"`` (transformers' ``WhisperFeatureExtractor`` default, OpenAI's ``pad_or_trim(audio)``):
  the audio is zero-padded to 480,000 samples and the log-mel is taken of the whole window, so the padding
  becomes log-mel of silence. Equal to ``WhisperFeatureExtractor(feature_size=num_mel_bins)(audio)``, whose
  torch path it repeats operation for operation.
- ``padding="features"`` (faster-whisper 1.x and OpenAI's ``transcribe()``): the log-mel of the content
  plus 160 zero samples (``num_samples // 160 + 1`` frames, the dynamic-range floor ``max - 8`` taken over
  all of them), of which the first ``num_frames(num_samples)`` frames are kept, then padded with 0.0 to
  3000 frames.

Both rules: a periodic Hann window of 400, hop 160, a centred STFT with reflect padding, the last STFT
frame dropped, power spectrum, slaney mel filters (``mel_filter_bank``, equal to transformers'
``mel_filter_bank(..., norm="slaney", mel_scale="slaney")``, built with numpy at init), ``log10`` of the
mel power clamped at 1e-10, then ``max(x, max_of_the_item - 8)`` and ``(x + 4) / 4``. The filters and the
window are built once and moved to each device once. The floor is per item, over the frames the rule
covers, so one item's features do not depend on the others in its batch.
"""

from __future__ import annotations

import threading
from typing import Literal, Optional, Sequence, Union

import numpy as np
import torch

WHISPER_SAMPLE_RATE_HZ = 16000
N_FFT = 400
"""STFT size (25 ms at 16 kHz); the periodic Hann window has this length too."""
HOP_LENGTH = 160
"""Samples between frames (10 ms at 16 kHz)."""
CHUNK_LENGTH_S = 30
"""The encoder's window."""
LOG_FLOOR = 1e-10
"""Mel power below this is clamped before log10."""
DYNAMIC_RANGE_LOG10 = 8.0
"""Features are floored at the item's maximum minus this (80 dB)."""

Padding = Literal["audio", "features"]
AudioBatch = Union[torch.Tensor, np.ndarray, Sequence[Union[torch.Tensor, np.ndarray]]]


def num_frames(num_samples: int, hop_length: int = HOP_LENGTH) -> int:
    """Log-mel frames that ``num_samples`` of audio make (the STFT's ``num_samples // hop + 1`` frames, the
    last one dropped, as Whisper does): ``num_frames(480_000) == 3000``. Under ``padding="features"`` it is
    also how many frames of an item carry content, the rest being 0.0."""
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
    return num_samples // hop_length


def hertz_to_mel(frequency_hz: np.ndarray) -> np.ndarray:
    """Slaney's mel scale (librosa's default, ``htk=False``): linear below 1 kHz (3 mels per 200 Hz), then
    logarithmic, 27 mels per factor 6.4."""
    frequency_hz = np.asarray(frequency_hz, dtype=np.float64)
    linear = 3.0 * frequency_hz / 200.0
    log_region = 15.0 + np.log(np.maximum(frequency_hz, 1e-300) / 1000.0) * (27.0 / np.log(6.4))
    return np.where(frequency_hz >= 1000.0, log_region, linear)


def mel_to_hertz(mels: np.ndarray) -> np.ndarray:
    """The inverse of ``hertz_to_mel``."""
    mels = np.asarray(mels, dtype=np.float64)
    linear = 200.0 * mels / 3.0
    log_region = 1000.0 * np.exp((np.log(6.4) / 27.0) * (mels - 15.0))
    return np.where(mels >= 15.0, log_region, linear)


def mel_filter_bank(num_mel_bins: int, n_fft: int = N_FFT, sample_rate_hz: int = WHISPER_SAMPLE_RATE_HZ,
                    min_frequency_hz: float = 0.0, max_frequency_hz: float = 8000.0) -> np.ndarray:
    """Slaney-style triangular mel filters with slaney area normalisation, float64
    ``[n_fft // 2 + 1, num_mel_bins]`` (one column per filter): the construction of transformers'
    ``mel_filter_bank(num_frequency_bins, num_mel_bins, min_frequency, max_frequency, sampling_rate,
    norm="slaney", mel_scale="slaney")``, which Whisper's own ``mel_filters.npz`` was made with (librosa)."""
    if num_mel_bins < 1:
        raise ValueError(f"num_mel_bins must be >= 1, got {num_mel_bins}")
    if not 0.0 <= min_frequency_hz < max_frequency_hz <= sample_rate_hz / 2:
        raise ValueError(f"need 0 <= min_frequency_hz < max_frequency_hz <= sample_rate_hz / 2, got "
                         f"{min_frequency_hz}, {max_frequency_hz}, {sample_rate_hz}")
    num_frequency_bins = n_fft // 2 + 1
    # Filter edges: num_mel_bins + 2 points evenly spaced in mels, back in Hz.
    edge_mels = np.linspace(hertz_to_mel(min_frequency_hz), hertz_to_mel(max_frequency_hz), num_mel_bins + 2)
    edges_hz = mel_to_hertz(edge_mels)                                          # [num_mel_bins + 2]
    fft_frequencies_hz = np.linspace(0, sample_rate_hz // 2, num_frequency_bins)  # [num_frequency_bins]
    widths_hz = np.diff(edges_hz)                                               # [num_mel_bins + 1]
    offsets_hz = edges_hz[None, :] - fft_frequencies_hz[:, None]                # [frequency_bins, edges]
    rising = -offsets_hz[:, :-2] / widths_hz[:-1]                               # up from the left edge
    falling = offsets_hz[:, 2:] / widths_hz[1:]                                 # down to the right edge
    filters = np.maximum(0.0, np.minimum(rising, falling))                      # [frequency_bins, mel_bins]
    filters *= 2.0 / (edges_hz[2:] - edges_hz[:-2])[None, :]                    # equal area per filter
    return filters


class WhisperLogMel:
    """Whisper's log-mel features for one configuration (80 bins: Whisper v1/v2 and distil; 128: large-v3).

    Holds the mel filters (numpy, built at init) and, per device, their float32 torch copy and the window;
    safe to share between threads."""

    def __init__(self, num_mel_bins: int = 80, sample_rate_hz: int = WHISPER_SAMPLE_RATE_HZ,
                 n_fft: int = N_FFT, hop_length: int = HOP_LENGTH, chunk_length_s: int = CHUNK_LENGTH_S):
        self.num_mel_bins = num_mel_bins
        """Mel filters, the features' second dimension."""
        self.sample_rate_hz = sample_rate_hz
        """The rate the audio must be at (this class does not resample)."""
        self.n_fft = n_fft
        """STFT size and window length."""
        self.hop_length = hop_length
        """Samples between frames."""
        self.window_samples = chunk_length_s * sample_rate_hz
        """Samples in the encoder's window (480,000); longer audio must be chunked first."""
        self.window_frames = num_frames(self.window_samples, hop_length)
        """Frames in the encoder's window (3000), the features' last dimension."""
        self.mel_filters = mel_filter_bank(num_mel_bins, n_fft, sample_rate_hz, 0.0, sample_rate_hz / 2)
        """float64 ``[n_fft // 2 + 1, num_mel_bins]``."""
        self._device_constants: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        """Picklable (the engine process sends its processor to clients): without the lock and the
        per-device tensors, which are rebuilt on use."""
        state = dict(self.__dict__)
        state["_device_constants"] = {}
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def constants(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The float32 filters transposed, ``[num_mel_bins, n_fft // 2 + 1]``, and the periodic Hann window
        ``[n_fft]``, on ``device``."""
        constants = self._device_constants.get(device)
        if constants is None:
            with self._lock:
                constants = self._device_constants.get(device)
                if constants is None:
                    filters = torch.from_numpy(self.mel_filters).to(device=device, dtype=torch.float32).T
                    window = torch.hann_window(self.n_fft, device=device)
                    constants = (filters.contiguous(), window)
                    self._device_constants[device] = constants
        return constants

    def __call__(self, audio: AudioBatch, num_samples: Optional[Sequence[int]] = None,
                 padding: Padding = "audio",
                 device: Optional[Union[str, torch.device]] = None) -> torch.Tensor:
        """float32 features ``[B, num_mel_bins, 3000]`` of a batch of mono waveforms at ``sample_rate_hz``.

        ``audio``: a ``[B, num_samples]`` tensor or array (``[num_samples]`` is a batch of one), or a sequence
        of 1-D tensors / arrays of different lengths. ``num_samples``: for a 2-D ``audio`` whose rows are
        padded, each row's real length (samples past it are ignored); without it every row is its full
        width. Each item is at most 30 s (480,000 samples): chunk longer audio first
        (``multimodal.audio_chunking``). ``padding``: ``"audio"`` (transformers' features) or
        ``"features"`` (faster-whisper's / OpenAI ``transcribe()``'s), see the module docstring.
        ``device``: where to compute; by default the audio's device (CPU for numpy input)."""
        if padding not in ("audio", "features"):
            raise ValueError(f"padding must be 'audio' or 'features', got {padding!r}")
        extra_samples = 0 if padding == "audio" else self.hop_length
        waveforms, lengths = self.batch(audio, num_samples, self.window_samples + extra_samples, device)
        log_mel = self.log_mel(waveforms)                  # [B, num_mel_bins, frames]
        if padding == "audio":
            floor = log_mel.amax(dim=(1, 2), keepdim=True) - DYNAMIC_RANGE_LOG10
            return (torch.maximum(log_mel, floor) + 4.0) / 4.0
        # "features": frames 0 .. num_samples // hop (content plus 160 zeros) set the floor; the first
        # num_samples // hop are kept and the rest of the window is 0.0.
        frame_index = torch.arange(log_mel.shape[-1], device=log_mel.device)          # [frames]
        content_frames = torch.div(lengths, self.hop_length, rounding_mode="floor")   # [B]
        in_floor = frame_index[None, :] <= content_frames[:, None]                     # [B, frames]
        floor = torch.where(in_floor[:, None, :], log_mel, torch.finfo(log_mel.dtype).min)
        floor = floor.amax(dim=(1, 2), keepdim=True) - DYNAMIC_RANGE_LOG10              # [B, 1, 1]
        features = (torch.maximum(log_mel, floor) + 4.0) / 4.0
        kept = (frame_index[None, :] < content_frames[:, None])[:, None, :]            # [B, 1, frames]
        return torch.where(kept, features, torch.zeros((), dtype=features.dtype, device=features.device))[
            ..., :self.window_frames].contiguous()

    def log_mel(self, waveforms: torch.Tensor) -> torch.Tensor:
        """``log10(max(mel power, 1e-10))`` of float32 ``[B, num_samples]``: ``[B, num_mel_bins,
        num_samples // hop]`` (the centred STFT's last frame dropped), as transformers computes it."""
        filters, window = self.constants(waveforms.device)
        stft = torch.stft(waveforms, self.n_fft, self.hop_length, window=window, return_complex=True)
        power = (stft[..., :-1].abs() ** 2).contiguous()   # [B, n_fft // 2 + 1, frames]
        mel = filters @ power                               # [B, num_mel_bins, frames]
        return torch.clamp(mel, min=LOG_FLOOR).log10()

    def batch(self, audio: AudioBatch, num_samples: Optional[Sequence[int]], width: int,
              device: Optional[Union[str, torch.device]]) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``[B, width]`` zero-padded waveforms and their int64 lengths ``[B]``, on the device."""
        if isinstance(audio, (torch.Tensor, np.ndarray)):
            rows = torch.as_tensor(audio)
            if rows.dim() == 1:
                rows = rows[None]
            if rows.dim() != 2:
                raise ValueError(f"audio must be [num_samples] or [B, num_samples], got shape "
                                 f"{list(rows.shape)}")
            if device is not None:
                rows = rows.to(device)
            rows = rows.to(torch.float32)
            if num_samples is None:
                lengths = [rows.shape[1]] * rows.shape[0]
            else:
                lengths = [int(n) for n in num_samples]
                if len(lengths) != rows.shape[0] or any(not 0 <= n <= rows.shape[1] for n in lengths):
                    raise ValueError(f"num_samples must give each of the {rows.shape[0]} rows a length in "
                                     f"0..{rows.shape[1]}, got {lengths}")
            self.check_lengths(lengths)
            rows = rows[:, :min(rows.shape[1], width)]
            waveforms = torch.nn.functional.pad(rows, (0, width - rows.shape[1]))
            if num_samples is not None:   # padded rows may hold anything past their length
                sample_index = torch.arange(width, device=waveforms.device)
                length_tensor = torch.tensor(lengths, device=waveforms.device)
                waveforms = waveforms * (sample_index[None, :] < length_tensor[:, None])
        else:
            items = [torch.as_tensor(item) for item in audio]
            if not items:
                raise ValueError("audio is an empty batch")
            if any(item.dim() != 1 for item in items):
                raise ValueError("each waveform in a batch must be 1-D [num_samples]")
            if num_samples is not None:
                raise ValueError("num_samples is only for a padded 2-D audio tensor; a list gives its own "
                                 "lengths")
            lengths = [item.shape[0] for item in items]
            self.check_lengths(lengths)
            if device is None:
                device = items[0].device
            waveforms = torch.zeros((len(items), width), dtype=torch.float32, device=device)
            for row, item in enumerate(items):
                waveforms[row, :item.shape[0]] = item.to(device=device, dtype=torch.float32)
        return waveforms, torch.tensor(lengths, dtype=torch.int64, device=waveforms.device)

    def check_lengths(self, lengths: Sequence[int]) -> None:
        longest = max(lengths, default=0)
        if longest > self.window_samples:
            raise ValueError(f"a waveform has {longest} samples, more than the {self.window_samples} "
                             f"({self.window_samples // self.sample_rate_hz} s) of one window; split long "
                             f"audio with multimodal.audio_chunking.chunk_audio first")
