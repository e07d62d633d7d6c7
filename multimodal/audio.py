"""Loading user audio safely: bytes, a local path, a binary file-like object, or an already decoded
``(array, sample_rate)`` pair, decoded to the mono float32 16 kHz waveform Whisper takes.

Decoding follows ``librosa.load(path, sr=16000)`` (what transformers' examples and pipelines use) step for
step: libsndfile through ``soundfile`` reads float32 samples, channels are averaged into one, and soxr
resamples at librosa's default quality (``soxr_hq``), the result trimmed or zero-padded to
``ceil(num_samples * 16000 / sample_rate)`` samples as librosa does. soxr runs as a stream, block by block;
its output is identical to the one-shot call.

libsndfile decodes WAV (and RF64 / W64 / WAVEX), FLAC, Ogg (Vorbis, Opus), MP3, AIFF, CAF and AU; every
other format it could recognise is refused. MP4 / M4A, WebM / Matroska and ADTS AAC are decoded with PyAV
(``av``, FFmpeg's libraries in a PyPI wheel, a dependency of Chorus), told their container explicitly so
FFmpeg probes nothing else. It is imported on first use; where it is missing those formats are refused with
a message saying so. An MP4 decodes to the duration its track declares: FFmpeg drops the encoder's priming
samples that the edit list skips, not the padding after the end, which is cut here.

What a server must not take is refused with an ``AudioError`` whose message can go back to the user as it
is (an HTTP 400 body): more than ``AudioLimits.max_audio_bytes`` (files and file-like objects are read no
further than that), a decoded duration above ``AudioLimits.max_duration_s`` (checked from the header where
it declares its length, and counted block by block while decoding, so a small file that expands into hours
of samples stops at the limit instead of filling memory), bytes that are no audio, an unsupported format, a
corrupt header, data that fails to decode or is truncated, NaN or infinite samples, and audio with zero
samples. Silent audio is not an error here. Truncation is seen where the header declares a length: WAV / AIFF
/ AU data chunk sizes, FLAC's sample count, an MP3's Xing / LAME frame count, an MP4's or a WebM's duration.
Ogg, MP3 without that tag, ADTS AAC and a WebM recorded live (a browser's MediaRecorder) declare none, so a
file cut after its headers decodes to its complete pages / frames, as with any decoder.

``soundfile.SoundFile.read`` cannot read a stream of unknown length (see ``read_sound_file_blocks``), so
blocks are read through libsndfile's ``sf_readf_float`` via soundfile's cffi handles (``soundfile._snd``).
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import math
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Union

import numpy as np
import soundfile
import soxr

SOXR_QUALITY = "soxr_hq"
"""librosa's default ``res_type``: ``librosa.load(sr=16000)`` resamples with exactly this soxr quality."""
DECODE_BLOCK_FRAMES = 1 << 16
"""Frames decoded at a time: the duration limit is checked after each block."""
READ_CHUNK_BYTES = 1 << 20
MAX_CHANNELS = 64
"""More channels than this is not a recording to transcribe (and would make one block large)."""
MIN_SAMPLE_RATE_HZ = 1_000
MAX_SAMPLE_RATE_HZ = 768_000
LIBSNDFILE_FORMATS = {"WAV": "wav", "WAVEX": "wav", "RF64": "rf64", "W64": "w64", "FLAC": "flac",
                      "OGG": "ogg", "MP3": "mp3", "AIFF": "aiff", "CAF": "caf", "AU": "au"}
"""libsndfile's formats a user file may be in, with the name ``DecodedAudio.source_format`` gives them;
libsndfile recognises others (MAT5, HTK, VOC, PAF, ...), which are not offered untrusted bytes."""
PYAV_FORMATS = {"mp4": "mp4", "webm": "matroska", "aac": "aac"}
"""Formats decoded with PyAV, by the name sniffed from their first bytes, with the FFmpeg demuxer named."""
SUPPORTED_FORMATS_TEXT = "wav, flac, ogg (vorbis/opus), mp3, aiff, caf, au"
UNKNOWN_LENGTH_FRAMES = 2**63 - 1
"""libsndfile's ``SF_COUNT_MAX``: the frame count of a stream whose header does not say its length."""
DECLARED_SIZE_RE = re.compile(r"^\s*(?:data|SSND|Data Size)\s*: (\d+) \(should be (\d+)\)", re.MULTILINE)
"""libsndfile's log line for a data chunk whose declared size is larger than the bytes that follow it."""
STREAMING_SIZE_PLACEHOLDER = 0x7FFFF000
"""Writers that cannot seek back (a pipe) declare a huge or zero data size; at or above this it is not a
claim about the length, so a shortfall is not truncation."""
DECLARED_SIZE_SLACK_BYTES = 64
"""A data chunk this much longer than its file is a writer's off-by-a-few (a missing pad byte), not a cut."""
MP3_SHORTFALL_FRAMES = 2 * 1152
"""MP3 headers without a Xing / LAME tag give an estimated length: two MPEG frames of slack, or 1%."""

AudioSource = Union[bytes, bytearray, memoryview, str, os.PathLike, io.IOBase, tuple]


class AudioError(ValueError):
    """Audio could not be loaded; the message says why, for the user (an HTTP 400 body)."""


@dataclass(frozen=True)
class AudioLimits:
    """What a request's audio may be, and the rate it is decoded to."""

    max_audio_bytes: int = 25 << 20
    """Largest encoded file, bytes object or file-like object, in bytes (OpenAI's upload limit)."""
    max_duration_s: float = 3600.0
    """Longest decoded audio, in seconds: from the header when it declares the length, and counted while
    decoding (a tiny compressed file must not expand into hours of samples in memory)."""
    sample_rate_hz: int = 16000
    """The rate the samples are resampled to (Whisper's)."""


@dataclass(frozen=True)
class DecodedAudio:
    """One decoded recording, mono at ``sample_rate_hz``."""

    samples: np.ndarray
    """float32 ``[num_samples]``, mono (the mean of the source's channels), nominally in [-1, 1]."""
    sample_rate_hz: int
    """The rate of ``samples`` (``AudioLimits.sample_rate_hz``)."""
    duration_s: float
    """``num_samples / sample_rate_hz``."""
    source_format: str
    """What was decoded: ``wav``, ``flac``, ``ogg/vorbis``, ``ogg/opus``, ``mp3``, ... (libsndfile),
    ``mp4/aac``, ``matroska/opus``, ... (PyAV: container/codec), or ``array`` for an (array, rate) pair."""
    source_sample_rate_hz: int
    """The source's own sample rate, before resampling."""
    num_source_channels: int
    """Channels in the source, before the down-mix."""


def load_audio(source: AudioSource, limits: AudioLimits = AudioLimits()) -> DecodedAudio:
    """Decode ``source`` (encoded bytes, a local path as ``str`` / ``Path``, a binary file-like object, or an
    ``(np.ndarray, sample_rate_hz)`` pair whose array is ``[num_samples]`` or ``[num_samples, num_channels]``)
    to mono float32 at ``limits.sample_rate_hz``. Raises ``AudioError``."""
    if isinstance(source, tuple):
        return decode_array(source, limits)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return decode_audio_bytes(bytes(source), limits)
    if isinstance(source, (str, os.PathLike)):
        return decode_audio_bytes(read_local_file(Path(source), limits), limits)
    if callable(getattr(source, "read", None)):
        return decode_audio_bytes(read_file_object(source, limits), limits)
    raise AudioError(f"audio must be bytes, a file path, a binary file object or an (array, sample_rate) "
                     f"pair, not {type(source).__name__}")


def read_local_file(path: Path, limits: AudioLimits) -> bytes:
    """The bytes of a regular local file, at most ``max_audio_bytes`` (its size checked before reading)."""
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):   # a directory; a FIFO or a device would block or never end
            kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
            raise AudioError(f"{path} is {kind}, not an audio file")
        if info.st_size > limits.max_audio_bytes:
            raise AudioError(f"the audio file {path} is {info.st_size} bytes, above the limit of "
                             f"{limits.max_audio_bytes} bytes")
        with open(path, "rb") as f:
            return read_file_object(f, limits)
    except FileNotFoundError as e:
        raise AudioError(f"audio file not found: {path}") from e
    except OSError as e:
        raise AudioError(f"audio file {path} cannot be read ({e.strerror or e})") from e


def read_file_object(file: Any, limits: AudioLimits) -> bytes:
    """The rest of a binary file-like object, read up to one byte past ``max_audio_bytes`` and no further."""
    chunks, size = [], 0
    while size <= limits.max_audio_bytes:
        try:
            chunk = file.read(min(READ_CHUNK_BYTES, limits.max_audio_bytes + 1 - size))
        except OSError as e:
            raise AudioError(f"the audio could not be read from the file object ({e})") from e
        if isinstance(chunk, str):
            raise AudioError("the audio file object is open in text mode; open it in binary mode ('rb')")
        if not chunk:
            break
        chunks.append(bytes(chunk))
        size += len(chunk)
    if size > limits.max_audio_bytes:
        raise AudioError(f"the audio is larger than the limit of {limits.max_audio_bytes} bytes")
    return b"".join(chunks)


def sniff_format(data: bytes) -> Optional[str]:
    """The format ``data`` starts like, from its magic number, or None: names what a file that fails to open
    was meant to be, and routes the formats libsndfile cannot read to PyAV."""
    if data[:4] in (b"RIFF", b"RIFX") and data[8:12] == b"WAVE":
        return "wav"
    if data[:4] == b"RF64":
        return "rf64"
    if data[:4] == b"riff":
        return "w64"
    if data[:4] == b"fLaC":
        return "flac"
    if data[:4] == b"OggS":
        return "ogg"
    if data[:4] == b"FORM" and data[8:12] in (b"AIFF", b"AIFC"):
        return "aiff"
    if data[:4] == b"caff":
        return "caf"
    if data[:4] == b".snd":
        return "au"
    if data[4:8] == b"ftyp":
        return "mp4"
    if data[:4] == b"\x1a\x45\xdf\xa3":   # EBML: WebM or Matroska
        return "webm"
    if data[:3] == b"ID3":
        return "mp3"
    if len(data) >= 2 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0:   # an MPEG audio frame sync
        return "aac" if data[1] & 0x06 == 0 else "mp3"   # layer bits 00: ADTS AAC
    if data[:5] == b"#!AMR":
        return "amr"
    if data[:4] == b"\x30\x26\xb2\x75":
        return "wma"
    return None


def decode_audio_bytes(data: bytes, limits: AudioLimits) -> DecodedAudio:
    """Decode an encoded audio file in full, refusing what ``load_audio`` documents."""
    if not data:
        raise AudioError("the audio file is empty (0 bytes)")
    if len(data) > limits.max_audio_bytes:
        raise AudioError(f"the audio is {len(data)} bytes, above the limit of {limits.max_audio_bytes} bytes")
    kind = sniff_format(data)
    if kind in PYAV_FORMATS:
        return decode_with_pyav(data, kind, limits)
    if kind in ("amr", "wma"):
        raise AudioError(f"unsupported audio format {kind}; send {SUPPORTED_FORMATS_TEXT}, m4a/mp4 or webm")
    try:
        sound_file = soundfile.SoundFile(io.BytesIO(data))
    except soundfile.LibsndfileError as e:
        reason = libsndfile_reason(e)
        if kind is None:
            raise AudioError(f"the data is not audio in a supported format ({SUPPORTED_FORMATS_TEXT}, and "
                             f"m4a/mp4 or webm with PyAV installed)") from e
        raise AudioError(f"the data starts like {kind} audio but its header could not be read, it is corrupt "
                         f"or truncated ({reason})") from e
    except (RuntimeError, ValueError, TypeError) as e:
        raise AudioError(f"the audio could not be opened ({e})") from e
    with sound_file:
        return decode_sound_file(sound_file, limits)


def libsndfile_reason(error: soundfile.LibsndfileError) -> str:
    """libsndfile's message without soundfile's ``Error opening <object repr>:`` prefix."""
    return str(getattr(error, "error_string", None) or error).strip().rstrip(".")


def decode_sound_file(sound_file: soundfile.SoundFile, limits: AudioLimits) -> DecodedAudio:
    """Decode an opened libsndfile stream block by block, checking the limits as it goes."""
    fmt = LIBSNDFILE_FORMATS.get(sound_file.format)
    if fmt is None:
        raise AudioError(f"unsupported audio format {sound_file.format.lower()}; send "
                         f"{SUPPORTED_FORMATS_TEXT}, m4a/mp4 or webm")
    if fmt == "ogg":
        fmt = f"ogg/{sound_file.subtype.lower()}"
    sample_rate_hz, num_channels = int(sound_file.samplerate), int(sound_file.channels)
    check_stream(sample_rate_hz, num_channels)
    header_frames = None if sound_file.frames >= UNKNOWN_LENGTH_FRAMES else int(sound_file.frames)
    if header_frames is not None:
        check_declared_duration(header_frames / sample_rate_hz, limits)
    mixer = DownmixResampler(sample_rate_hz, num_channels, limits)
    for block in read_sound_file_blocks(sound_file, num_channels):
        mixer.add(block)
    check_not_truncated(sound_file, header_frames, mixer.num_source_frames, fmt)
    return mixer.finish(fmt)


def check_stream(sample_rate_hz: int, num_channels: int) -> None:
    """Refuse sample rates and channel counts no recording has."""
    if not MIN_SAMPLE_RATE_HZ <= sample_rate_hz <= MAX_SAMPLE_RATE_HZ:
        raise AudioError(f"the audio's sample rate is {sample_rate_hz} Hz, outside the supported "
                         f"{MIN_SAMPLE_RATE_HZ}..{MAX_SAMPLE_RATE_HZ} Hz")
    if not 1 <= num_channels <= MAX_CHANNELS:
        raise AudioError(f"the audio has {num_channels} channels; at most {MAX_CHANNELS} are supported")


def check_declared_duration(duration_s: float, limits: AudioLimits,
                            source: str = " (from its header)") -> None:
    """Refuse audio whose length, known before decoding, is above the limit."""
    if duration_s > limits.max_duration_s:
        raise AudioError(f"the audio lasts {duration_s:.1f} s{source}, above the limit of "
                         f"{limits.max_duration_s:g} s; send a shorter recording")


def read_sound_file_blocks(sound_file: soundfile.SoundFile, num_channels: int) -> Iterator[np.ndarray]:
    """float32 ``[frames, num_channels]`` blocks of at most ``DECODE_BLOCK_FRAMES``, to the stream's end.

    libsndfile's ``sf_readf_float`` is called directly: ``SoundFile.read`` seeks to its new position after
    every read, which fails on a stream whose header does not give its length (a FLAC written to a pipe
    has ``total_samples`` 0), and those are the streams whose duration must be counted while decoding."""
    snd, ffi = soundfile._snd, soundfile._ffi
    buffer = np.empty((DECODE_BLOCK_FRAMES, num_channels), dtype=np.float32)
    pointer = ffi.cast("float *", buffer.ctypes.data)
    while True:
        frames = int(snd.sf_readf_float(sound_file._file, pointer, DECODE_BLOCK_FRAMES))
        error = snd.sf_error(sound_file._file)
        if error:
            reason = libsndfile_reason(soundfile.LibsndfileError(error))
            raise AudioError(f"the audio data could not be decoded, it is corrupt or truncated ({reason})")
        if frames <= 0:
            return
        yield buffer[:frames]


def check_not_truncated(sound_file: soundfile.SoundFile, header_frames: Optional[int], decoded_frames: int,
                        fmt: str) -> None:
    """Refuse a stream that decoded to fewer frames than its header declares."""
    for declared, actual in DECLARED_SIZE_RE.findall(sound_file.extra_info):
        if int(actual) + DECLARED_SIZE_SLACK_BYTES < int(declared) < STREAMING_SIZE_PLACEHOLDER:
            raise AudioError(f"the {fmt} file is truncated: its header declares {declared} bytes of audio "
                             f"data but only {actual} follow; send the complete file")
    if header_frames is None:
        return
    slack = max(MP3_SHORTFALL_FRAMES, header_frames // 100) if fmt == "mp3" else 0
    if decoded_frames < header_frames - slack:
        raise AudioError(f"the {fmt} file is truncated: its header declares {header_frames} samples but only "
                         f"{decoded_frames} could be decoded; send the complete file")


class DownmixResampler:
    """Takes native-rate float32 ``[frames, channels]`` blocks, averages the channels, counts the duration
    against the limit and resamples to ``limits.sample_rate_hz`` as a soxr stream."""

    def __init__(self, sample_rate_hz: int, num_channels: int, limits: AudioLimits):
        self.sample_rate_hz = sample_rate_hz
        """The source's rate."""
        self.num_channels = num_channels
        """The source's channels."""
        self.limits = limits
        self.max_source_frames = int(math.floor(limits.max_duration_s * sample_rate_hz))
        """The most source frames within ``limits.max_duration_s``."""
        self.num_source_frames = 0
        """Source frames taken so far."""
        self.outputs: list[np.ndarray] = []
        """float32 ``[n]`` blocks at the target rate."""
        self.stream = (None if sample_rate_hz == limits.sample_rate_hz else
                       soxr.ResampleStream(sample_rate_hz, limits.sample_rate_hz, 1, dtype="float32",
                                           quality=SOXR_QUALITY))

    def add(self, block: np.ndarray) -> None:
        """Take the next ``[frames, channels]`` block (float32; copied, so the caller may reuse it)."""
        self.num_source_frames += block.shape[0]
        if self.num_source_frames > self.max_source_frames:
            raise AudioError(f"the audio lasts more than {self.limits.max_duration_s:g} s, the limit; send a "
                             f"shorter recording")
        if not np.isfinite(block).all():
            raise AudioError("the audio contains NaN or infinite sample values")
        mono = block[:, 0].copy() if block.shape[1] == 1 else block.mean(axis=1, dtype=np.float32)
        self.outputs.append(mono if self.stream is None else self.stream.resample_chunk(mono, last=False))

    def finish(self, source_format: str) -> DecodedAudio:
        """The decoded audio, ``ceil(source_frames * target_rate / source_rate)`` samples long (librosa's
        ``fix_length``: soxr's tail is trimmed, or zeros pad a very short input)."""
        if self.num_source_frames == 0:
            raise AudioError("the audio has no samples (it decodes to 0 samples)")
        target_rate_hz = self.limits.sample_rate_hz
        if self.stream is not None:
            self.outputs.append(self.stream.resample_chunk(np.zeros(0, np.float32), last=True))
        samples = np.concatenate(self.outputs) if len(self.outputs) != 1 else self.outputs[0]
        self.outputs = []
        num_samples = -(-self.num_source_frames * target_rate_hz // self.sample_rate_hz)
        if samples.shape[0] >= num_samples:
            samples = samples[:num_samples]
        else:
            samples = np.concatenate([samples, np.zeros(num_samples - samples.shape[0], np.float32)])
        return DecodedAudio(samples=np.ascontiguousarray(samples, dtype=np.float32),
                            sample_rate_hz=target_rate_hz, duration_s=num_samples / target_rate_hz,
                            source_format=source_format, source_sample_rate_hz=self.sample_rate_hz,
                            num_source_channels=self.num_channels)


def pcm_to_float32(samples: np.ndarray) -> np.ndarray:
    """Samples as float32 in [-1, 1]: integer PCM scaled as libsndfile scales it (int16 / 32768, unsigned
    8-bit centred on 128), float as it is."""
    if samples.dtype.kind == "f":
        return samples.astype(np.float32, copy=False)
    if samples.dtype.kind == "i":
        return (samples.astype(np.float64) / float(2 ** (8 * samples.dtype.itemsize - 1))).astype(np.float32)
    if samples.dtype.kind == "u":
        half = float(2 ** (8 * samples.dtype.itemsize - 1))
        return ((samples.astype(np.float64) - half) / half).astype(np.float32)
    raise AudioError(f"audio samples must be float or integer PCM, not {samples.dtype}")


def decode_array(source: tuple, limits: AudioLimits) -> DecodedAudio:
    """An ``(np.ndarray, sample_rate_hz)`` pair, checked, down-mixed and resampled like a decoded file."""
    if len(source) != 2:
        raise AudioError(f"decoded audio must be an (array, sample_rate_hz) pair, not a {len(source)}-tuple")
    samples, sample_rate_hz = source
    if not isinstance(samples, np.ndarray):
        raise AudioError(f"decoded audio must be a numpy array, not {type(samples).__name__}")
    if isinstance(sample_rate_hz, bool) or not isinstance(sample_rate_hz, (int, np.integer)):
        raise AudioError(f"the sample rate must be an integer number of Hz, not {sample_rate_hz!r}")
    if samples.ndim == 1:
        samples = samples[:, None]
    elif samples.ndim != 2:
        raise AudioError(f"decoded audio must be [num_samples] or [num_samples, num_channels], not shape "
                         f"{list(samples.shape)}")
    elif samples.shape[1] > MAX_CHANNELS and samples.shape[0] <= MAX_CHANNELS:
        raise AudioError(f"decoded audio of shape {list(samples.shape)} looks like [num_channels, "
                         f"num_samples]; pass [num_samples, num_channels] (transpose it)")
    check_stream(int(sample_rate_hz), samples.shape[1])
    check_declared_duration(samples.shape[0] / int(sample_rate_hz), limits, source="")
    mixer = DownmixResampler(int(sample_rate_hz), samples.shape[1], limits)
    for start in range(0, samples.shape[0], DECODE_BLOCK_FRAMES):
        mixer.add(np.ascontiguousarray(pcm_to_float32(samples[start:start + DECODE_BLOCK_FRAMES])))
    return mixer.finish("array")


def decode_with_pyav(data: bytes, kind: str, limits: AudioLimits) -> DecodedAudio:
    """Decode MP4 / M4A, WebM / Matroska or ADTS AAC with PyAV, the container named to FFmpeg up front."""
    try:
        av = importlib.import_module("av")
    except ImportError as e:
        raise AudioError(f"unsupported audio format {kind} on this server: decoding m4a/mp4/webm/aac needs "
                         f"PyAV (install av); send {SUPPORTED_FORMATS_TEXT} instead") from e
    ffmpeg_error = getattr(av, "FFmpegError", None) or av.error.FFmpegError
    try:
        container = av.open(io.BytesIO(data), mode="r", format=PYAV_FORMATS[kind])
    except (ffmpeg_error, OSError, ValueError) as e:
        raise AudioError(f"the data starts like {kind} audio but could not be opened, it is corrupt or "
                         f"truncated ({pyav_reason(e)})") from e
    with container:
        stream = next((s for s in container.streams if s.type == "audio"), None)
        if stream is None:
            raise AudioError(f"the {kind} file has no audio track")
        if stream.codec_context is None:   # FFmpeg has no decoder for the track's codec
            raise AudioError(f"the {kind} file's audio track uses a codec this server cannot decode; send "
                             f"{SUPPORTED_FORMATS_TEXT}, or m4a/mp4 (AAC) or webm (Opus, Vorbis)")
        codec = stream.codec_context.name
        source_format = f"{container.format.name.split(',')[0]}/{codec}"
        declared_s = pyav_declared_duration_s(container, stream, kind)
        if declared_s is not None:
            check_declared_duration(declared_s, limits)
        try:
            mixer = decode_pyav_frames(container.decode(stream), limits)
        except AudioError:
            raise
        except (ffmpeg_error, OSError, ValueError) as e:
            raise AudioError(f"the {kind} audio could not be decoded, it is corrupt or truncated "
                             f"({pyav_reason(e)})") from e
    if mixer is None:
        raise AudioError("the audio has no samples (it decodes to 0 samples)")
    if declared_s is not None:
        decoded_s = mixer.num_source_frames / mixer.sample_rate_hz
        if decoded_s < declared_s * 0.99 - 0.1:
            raise AudioError(f"the {kind} file is truncated: its header declares {declared_s:.2f} s but only "
                             f"{decoded_s:.2f} s could be decoded; send the complete file")
    decoded = mixer.finish(source_format)
    if kind == "mp4" and declared_s is not None:
        return cut_to_duration(decoded, declared_s)
    return decoded


def pyav_declared_duration_s(container: Any, stream: Any, kind: str) -> Optional[float]:
    """The length the container declares, in seconds, or None: an MP4 track's duration (its edit list's,
    without the encoder's priming and padding), a Matroska segment's duration (absent from a live recording).
    ADTS AAC declares none: FFmpeg's figure for it is an estimate from the bitrate of the first frames, off
    by any factor for audio whose loudness changes (seconds of silence and then speech)."""
    if kind == "aac":
        return None
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / 1_000_000
    return None


def cut_to_duration(decoded: DecodedAudio, duration_s: float) -> DecodedAudio:
    """``decoded`` without the samples past ``duration_s`` (rounded up to a whole sample)."""
    num_samples = math.ceil(round(duration_s * decoded.sample_rate_hz, 6))
    if decoded.samples.shape[0] <= num_samples:
        return decoded
    return dataclasses.replace(decoded, samples=decoded.samples[:num_samples].copy(),
                               duration_s=num_samples / decoded.sample_rate_hz)


def pyav_reason(error: Exception) -> str:
    """FFmpeg's message without the errno and the ``'<none>'`` file name PyAV adds for in-memory files."""
    return str(getattr(error, "strerror", None) or error)


def decode_pyav_frames(frames: Iterable[Any], limits: AudioLimits) -> Optional[DownmixResampler]:
    """Feed decoded PyAV frames to a ``DownmixResampler`` (None when there were none)."""
    mixer = None
    for frame in frames:
        num_channels = len(frame.layout.channels)
        if mixer is None:
            check_stream(int(frame.sample_rate), num_channels)
            mixer = DownmixResampler(int(frame.sample_rate), num_channels, limits)
        elif (frame.sample_rate, num_channels) != (mixer.sample_rate_hz, mixer.num_channels):
            raise AudioError(f"the audio changes from {mixer.sample_rate_hz} Hz x {mixer.num_channels} "
                             f"channels to {frame.sample_rate} Hz x {num_channels} channels mid-stream; "
                             f"this is not supported")
        array = frame.to_ndarray()
        if frame.format.is_planar:
            array = array.T                                  # [channels, n] -> [n, channels]
        else:
            array = array.reshape(-1, num_channels)          # [1, n * channels] interleaved -> [n, channels]
        mixer.add(np.ascontiguousarray(pcm_to_float32(array)))
    return mixer
