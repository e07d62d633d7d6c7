"""multimodal/audio.py: every source kind and format, parity with ``librosa.load(sr=16000)``, and every
refusal with its user-facing message. Files are written here with soundfile; nothing is fetched."""

from __future__ import annotations

import importlib
import io

import librosa
import numpy as np
import pytest
import soundfile as sf

import multimodal.audio as audio_module
from multimodal.audio import DECODE_BLOCK_FRAMES, AudioError, AudioLimits, DecodedAudio, load_audio

SAMPLE_RATE_HZ = 16000


def tone(sample_rate_hz: int, duration_s: float, channels: int = 1) -> np.ndarray:
    """float32 ``[n]`` (mono) or ``[n, channels]``: a different tone per channel, plus a little noise."""
    rng = np.random.default_rng(sample_rate_hz + channels)
    t = np.arange(int(round(sample_rate_hz * duration_s))) / sample_rate_hz
    columns = [0.4 / (c + 1) * np.sin(2 * np.pi * (440.0 * (c + 1)) * t) + 0.01 * rng.standard_normal(t.size)
               for c in range(channels)]
    signal = np.stack(columns, axis=1).astype(np.float32)
    return signal[:, 0] if channels == 1 else signal


def encode(samples: np.ndarray, sample_rate_hz: int, fmt: str, subtype: str) -> bytes:
    buffer = io.BytesIO()
    sf.write(buffer, samples, sample_rate_hz, format=fmt, subtype=subtype)
    return buffer.getvalue()


def refused(pattern: str):
    """Expect an ``AudioError`` whose message matches ``pattern``."""
    return pytest.raises(AudioError, match=pattern)


def librosa_reference(data: bytes) -> np.ndarray:
    """``librosa.load(sr=16000)`` of the file. (librosa's first load imports numba code: about 3 s, once.)"""
    samples, _ = librosa.load(io.BytesIO(data), sr=SAMPLE_RATE_HZ)
    return samples


def silent_flac(sample_rate_hz: int, duration_s: int) -> bytes:
    """Digital silence as FLAC, written a minute at a time: an hour at 8 kHz is about 90 KB."""
    buffer = io.BytesIO()
    minute = np.zeros(sample_rate_hz * 60, np.int16)
    with sf.SoundFile(buffer, "w", samplerate=sample_rate_hz, channels=1, format="FLAC",
                      subtype="PCM_16") as f:
        for _ in range(duration_s // 60):
            f.write(minute)
        f.write(minute[:sample_rate_hz * (duration_s % 60)])
    return buffer.getvalue()


def without_declared_length(flac: bytes) -> bytes:
    """The FLAC with STREAMINFO's total_samples set to 0 (unknown), as encoders writing to a pipe leave it."""
    data = bytearray(flac)
    assert data[:4] == b"fLaC" and data[4] & 0x7F == 0   # STREAMINFO is the first metadata block
    streaminfo = 8   # after "fLaC" and the 4-byte block header
    data[streaminfo + 13] &= 0xF0   # total_samples: the low 4 bits of byte 13 and bytes 14..17
    data[streaminfo + 14:streaminfo + 18] = b"\x00\x00\x00\x00"
    return bytes(data)


WRITABLE = [("WAV", "PCM_16"), ("WAV", "FLOAT"), ("FLAC", "PCM_16"), ("OGG", "VORBIS"), ("OGG", "OPUS"),
            ("MP3", "MPEG_LAYER_III")]


def writable(fmt: str, subtype: str) -> bool:
    return fmt in sf.available_formats() and subtype in sf.available_subtypes(fmt)


@pytest.mark.parametrize("fmt,subtype", WRITABLE)
def test_each_format_decodes_like_librosa(fmt, subtype):
    if not writable(fmt, subtype):
        pytest.skip(f"this libsndfile cannot write {fmt}/{subtype}")
    data = encode(tone(SAMPLE_RATE_HZ, 1.25), SAMPLE_RATE_HZ, fmt, subtype)
    decoded = load_audio(data)
    reference = librosa_reference(data)
    assert isinstance(decoded, DecodedAudio)
    assert decoded.samples.dtype == np.float32 and decoded.samples.ndim == 1
    assert decoded.samples.shape == reference.shape
    np.testing.assert_allclose(decoded.samples, reference, rtol=0, atol=1e-6)
    assert decoded.sample_rate_hz == SAMPLE_RATE_HZ
    assert decoded.duration_s == reference.shape[0] / SAMPLE_RATE_HZ
    expected_format = {"WAV": "wav", "FLAC": "flac", "MP3": "mp3"}.get(fmt, f"ogg/{subtype.lower()}")
    assert decoded.source_format == expected_format
    assert decoded.num_source_channels == 1
    if (fmt, subtype) == ("WAV", "FLOAT"):   # lossless float: the written samples exactly
        np.testing.assert_array_equal(decoded.samples, tone(SAMPLE_RATE_HZ, 1.25))


def test_wav_int16_is_read_as_libsndfile_scales_it():
    pcm = np.array([0, 1, -1, 16384, -32768, 32767], np.int16)
    buffer = io.BytesIO()
    sf.write(buffer, pcm, SAMPLE_RATE_HZ, format="WAV", subtype="PCM_16")
    decoded = load_audio(buffer.getvalue())
    np.testing.assert_array_equal(decoded.samples, pcm.astype(np.float32) / 32768)


def test_stereo_is_the_mean_of_its_channels():
    stereo = tone(SAMPLE_RATE_HZ, 0.5, channels=2)
    decoded = load_audio(encode(stereo, SAMPLE_RATE_HZ, "WAV", "FLOAT"))
    assert decoded.num_source_channels == 2
    np.testing.assert_array_equal(decoded.samples, stereo.mean(axis=1, dtype=np.float32))
    np.testing.assert_array_equal(decoded.samples, (stereo[:, 0] + stereo[:, 1]) / np.float32(2))


@pytest.mark.parametrize("sample_rate_hz,channels,fmt,subtype", [
    (8000, 1, "WAV", "PCM_16"), (44100, 1, "WAV", "FLOAT"), (44100, 2, "FLAC", "PCM_16"),
    (48000, 2, "WAV", "PCM_16"), (22050, 1, "OGG", "VORBIS")])
def test_resampling_matches_librosa_load(sample_rate_hz, channels, fmt, subtype):
    data = encode(tone(sample_rate_hz, 2.3, channels), sample_rate_hz, fmt, subtype)
    decoded = load_audio(data)
    reference = librosa_reference(data)
    assert decoded.samples.shape == reference.shape == (int(np.ceil(round(sample_rate_hz * 2.3) * 16000
                                                                    / sample_rate_hz)),)
    np.testing.assert_allclose(decoded.samples, reference, rtol=0, atol=1e-4)
    assert decoded.source_sample_rate_hz == sample_rate_hz and decoded.num_source_channels == channels
    # The resampled tone keeps its pitch: the spectrum's peak stays at 440 Hz.
    spectrum = np.abs(np.fft.rfft(decoded.samples))
    peak_hz = np.argmax(spectrum) * SAMPLE_RATE_HZ / decoded.samples.shape[0]
    assert abs(peak_hz - 440.0) < 1.0


def test_resampling_across_many_blocks_matches_librosa():
    """Several decode blocks at 44.1 kHz: soxr as a stream equals librosa's one-shot call."""
    data = encode(tone(44100, 4.0), 44100, "FLAC", "PCM_16")
    assert 44100 * 4 > 2 * DECODE_BLOCK_FRAMES
    np.testing.assert_allclose(load_audio(data).samples, librosa_reference(data), rtol=0, atol=1e-6)


def test_every_source_kind(tmp_path):
    data = encode(tone(SAMPLE_RATE_HZ, 0.3), SAMPLE_RATE_HZ, "FLAC", "PCM_16")
    expected = load_audio(data).samples
    path = tmp_path / "speech.flac"
    path.write_bytes(data)
    with open(path, "rb") as f:
        from_file = load_audio(f).samples
    for source in (bytearray(data), memoryview(data), str(path), path, io.BytesIO(data)):
        np.testing.assert_array_equal(load_audio(source).samples, expected)
    np.testing.assert_array_equal(from_file, expected)


def test_array_sources():
    mono = tone(SAMPLE_RATE_HZ, 0.4)
    decoded = load_audio((mono, SAMPLE_RATE_HZ))
    np.testing.assert_array_equal(decoded.samples, mono)
    assert decoded.source_format == "array" and decoded.duration_s == 0.4
    pcm = np.array([0, 16384, -32768], np.int16)
    np.testing.assert_array_equal(load_audio((pcm, SAMPLE_RATE_HZ)).samples, [0.0, 0.5, -1.0])
    stereo = tone(44100, 0.7, channels=2).astype(np.float64)   # [num_samples, num_channels], float64
    resampled = load_audio((stereo, 44100)).samples
    reference = librosa.resample(librosa.to_mono(stereo.T.astype(np.float32)), orig_sr=44100, target_sr=16000)
    np.testing.assert_allclose(resampled, reference, rtol=0, atol=1e-6)


def test_silent_audio_is_not_an_error():
    decoded = load_audio(encode(np.zeros(8000, np.float32), SAMPLE_RATE_HZ, "WAV", "PCM_16"))
    assert decoded.samples.shape == (8000,) and not decoded.samples.any()


def test_a_flac_of_unknown_length_decodes_in_full():
    """total_samples 0 in STREAMINFO: the length is only known by decoding (soundfile's own read() fails)."""
    data = encode(tone(SAMPLE_RATE_HZ, 5.0), SAMPLE_RATE_HZ, "FLAC", "PCM_16")
    np.testing.assert_array_equal(load_audio(without_declared_length(data)).samples, load_audio(data).samples)


# ---- refusals ----------------------------------------------------------------------------------------------


def test_empty_file():
    with refused(r"^the audio file is empty \(0 bytes\)$"):
        load_audio(b"")


@pytest.mark.parametrize("data", [b"hello, this is plain text and not a recording" * 4,
                                  b"\x89PNG\r\n\x1a\n" + bytes(64), bytes(1000)])
def test_not_audio(data):
    with refused(r"^the data is not audio in a supported format \(wav, flac, ogg"):
        load_audio(data)


def test_corrupt_header():
    wav = encode(tone(SAMPLE_RATE_HZ, 0.2), SAMPLE_RATE_HZ, "WAV", "PCM_16")
    with refused(r"^the data starts like wav audio but its header could not be read, it is "
                                         r"corrupt or truncated \(.*data"):
        load_audio(wav[:40])   # cut inside the header, before the data chunk
    flac = bytearray(encode(tone(SAMPLE_RATE_HZ, 0.2), SAMPLE_RATE_HZ, "FLAC", "PCM_16"))
    flac[4:8] = b"\x7f\xff\xff\xff"   # a metadata block header with an unknown type and an impossible length
    with refused(r"^the data starts like flac audio but its header could not be read"):
        load_audio(bytes(flac))


def test_truncated_wav():
    wav = encode(tone(SAMPLE_RATE_HZ, 1.0), SAMPLE_RATE_HZ, "WAV", "PCM_16")
    with refused(r"^the wav file is truncated: its header declares 32000 bytes of audio "
                                         r"data but only 15978 follow; send the complete file$"):
        load_audio(wav[:16022])
    # A data chunk a few bytes longer than the file (a writer's missing pad byte) is not a cut.
    assert load_audio(wav[:-32]).samples.shape == (16000 - 16,)


def test_truncated_flac():
    flac = encode(tone(SAMPLE_RATE_HZ, 2.0), SAMPLE_RATE_HZ, "FLAC", "PCM_16")
    with refused(r"truncated"):
        load_audio(flac[:len(flac) // 2])


def test_truncated_mp3():
    if not writable("MP3", "MPEG_LAYER_III"):
        pytest.skip("this libsndfile cannot write MP3")
    mp3 = encode(tone(SAMPLE_RATE_HZ, 2.0), SAMPLE_RATE_HZ, "MP3", "MPEG_LAYER_III")
    with refused(r"^the mp3 file is truncated: its header declares 32000 samples but only "
                                         r"\d+ could be decoded; send the complete file$"):
        load_audio(mp3[:len(mp3) // 2])


def test_ogg_cut_inside_its_headers():
    """Ogg declares no total length, so an Ogg file cut after its headers decodes to its complete pages (as
    with any decoder); one cut inside its header pages is refused."""
    ogg = encode(tone(SAMPLE_RATE_HZ, 2.0), SAMPLE_RATE_HZ, "OGG", "VORBIS")
    with refused(r"^the data starts like ogg audio but its header could not be read, it is "
                                         r"corrupt or truncated"):
        load_audio(ogg[:200])


def test_libsndfile_formats_outside_the_list_are_refused():
    voc = encode(tone(8000, 0.2), 8000, "VOC", "PCM_16")
    with refused(r"^unsupported audio format voc; send wav, flac, ogg"):
        load_audio(voc)
    with refused(r"^unsupported audio format amr"):
        load_audio(b"#!AMR\n" + bytes(100))


def without_pyav(monkeypatch):
    """Make ``import av`` fail inside multimodal.audio, whether or not PyAV is installed here."""
    real_import = importlib.import_module

    def import_module(name, *args):
        if name == "av":
            raise ImportError("No module named 'av'")
        return real_import(name, *args)
    monkeypatch.setattr(audio_module.importlib, "import_module", import_module)


@pytest.mark.parametrize("data,kind", [(b"\x00\x00\x00\x1cftypM4A \x00\x00\x02\x00" + bytes(64), "mp4"),
                                       (b"\x1a\x45\xdf\xa3\x9f\x42\x86\x81\x01" + bytes(64), "webm"),
                                       (b"\xff\xf1\x50\x80" + bytes(64), "aac")])
def test_pyav_formats_without_pyav(monkeypatch, data, kind):
    without_pyav(monkeypatch)
    with refused(rf"^unsupported audio format {kind} on this server: decoding m4a/mp4/webm/"
                                         rf"aac needs PyAV \(install av\); send wav, flac"):
        load_audio(data)


def test_m4a_with_pyav_when_installed():
    av = pytest.importorskip("av")
    samples = tone(44100, 1.0, channels=2)
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="ipod") as container:   # .m4a
        stream = container.add_stream("aac", rate=44100, layout="stereo")
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples.T), format="fltp", layout="stereo")
        frame.sample_rate = 44100
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            container.mux(packet)
    data = buffer.getvalue()
    decoded = load_audio(data)
    assert decoded.source_format == "mp4/aac" and decoded.num_source_channels == 2
    assert abs(decoded.duration_s - 1.0) < 0.1
    spectrum = np.abs(np.fft.rfft(decoded.samples))
    assert abs(np.argmax(spectrum) * SAMPLE_RATE_HZ / decoded.samples.shape[0] - 440.0) < 2.0
    with refused(r"^the audio lasts 1\.0 s \(from its header\), above the limit of 0\.5 s"):
        load_audio(data, AudioLimits(max_duration_s=0.5))
    with refused(r"^the data starts like mp4 audio but could not be opened"):
        load_audio(data[:100])


def pyav_encode(samples: np.ndarray, sample_rate_hz: int, container_format: str, codec: str,
                bit_rate: int = 0) -> bytes:
    """Mono float32 samples encoded by FFmpeg through PyAV. The first frame's timestamp lets the muxer record
    the encoder's priming (an MP4 edit list, WebM's codec delay), as ffmpeg and phones do."""
    av = pytest.importorskip("av")
    from fractions import Fraction

    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container_format) as container:
        stream = container.add_stream(codec, rate=sample_rate_hz, layout="mono")
        if bit_rate:
            stream.bit_rate = bit_rate
        frame = av.AudioFrame.from_ndarray(samples[None, :].astype(np.float32), format="flt", layout="mono")
        frame.sample_rate, frame.pts, frame.time_base = sample_rate_hz, 0, Fraction(1, sample_rate_hz)
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            container.mux(packet)
    return buffer.getvalue()


def without_webm_duration(webm: bytes) -> bytes:
    """The WebM with its Segment Info Duration element voided, as a live recording (a browser's
    MediaRecorder) leaves it: ID 0x4489, size 8, a float64 become an 11-byte Void element."""
    start = webm.index(b"\x44\x89\x88")
    return webm[:start] + b"\xec\x89" + bytes(9) + webm[start + 11:]


def relative_error(decoded: np.ndarray, reference: np.ndarray) -> float:
    n = min(decoded.shape[0], reference.shape[0])
    return float(np.sqrt(np.mean((decoded[:n] - reference[:n]) ** 2) / np.mean(reference[:n] ** 2)))


@pytest.mark.parametrize("container_format,codec,source_format",
                         [("ipod", "aac", "mp4/aac"), ("webm", "libopus", "matroska/opus")])
def test_m4a_and_webm_decode_to_the_encoded_samples(container_format, codec, source_format):
    """m4a and webm through PyAV, 24 kHz in: the encoder's priming is dropped and an MP4 is cut to its
    declared duration (FFmpeg leaves the padding after the end), so the samples line up with the input's."""
    samples = tone(24000, 1.5)
    decoded = load_audio(pyav_encode(samples, 24000, container_format, codec))
    reference = load_audio((samples, 24000)).samples
    assert decoded.source_format == source_format and decoded.num_source_channels == 1
    assert decoded.source_sample_rate_hz == (48000 if codec == "libopus" else 24000)   # Opus decodes at 48k
    assert 0 <= decoded.samples.shape[0] - reference.shape[0] <= 8
    assert relative_error(decoded.samples, reference) < 0.1


def test_a_webm_without_its_duration_decodes_in_full():
    samples = tone(SAMPLE_RATE_HZ, 1.0)
    data = without_webm_duration(pyav_encode(samples, SAMPLE_RATE_HZ, "webm", "libopus"))
    decoded = load_audio(data)
    assert decoded.samples.shape == samples.shape
    assert relative_error(decoded.samples, samples) < 0.1


def test_an_adts_file_whose_bitrate_changes_is_not_taken_for_truncated():
    """FFmpeg estimates an ADTS file's length from the first frames' bitrate: 3 s of silence then 3 s of
    noise "lasts" 37 s by that estimate. It is not a header, so neither truncation nor the limit uses it."""
    noise = 0.5 * np.random.default_rng(0).standard_normal(3 * SAMPLE_RATE_HZ)
    samples = np.concatenate([np.zeros(3 * SAMPLE_RATE_HZ), noise]).astype(np.float32)
    data = pyav_encode(samples, SAMPLE_RATE_HZ, "adts", "aac")
    assert abs(load_audio(data, AudioLimits(max_duration_s=10.0)).duration_s - 6.0) < 0.2


@pytest.mark.parametrize("container_format,codec,duration_s",
                         [("adts", "aac", 600), ("webm", "libopus", 180)])
def test_duration_limit_while_decoding_with_pyav(monkeypatch, container_format, codec, duration_s):
    """Minutes of silence (ten in ADTS: 100 KB) in a file that declares no length (ADTS; a WebM without its
    Duration) against a 60 s limit: decoding stops at the limit instead of expanding all of it."""
    data = pyav_encode(np.zeros(duration_s * SAMPLE_RATE_HZ, np.float32), SAMPLE_RATE_HZ, container_format,
                       codec, bit_rate=8000)
    if container_format == "webm":
        data = without_webm_duration(data)
    assert len(data) < 400_000
    seconds_decoded = []
    real_decode = audio_module.decode_pyav_frames

    def counting_decode(frames, limits):
        def counted():
            for frame in frames:
                seconds_decoded.append(frame.samples / frame.sample_rate)
                yield frame
        return real_decode(counted(), limits)
    monkeypatch.setattr(audio_module, "decode_pyav_frames", counting_decode)
    with refused(r"^the audio lasts more than 60 s, the limit; send a shorter recording$"):
        load_audio(data, AudioLimits(max_duration_s=60.0))
    assert 60.0 < sum(seconds_decoded) <= 60.0 + max(seconds_decoded)   # one frame past the limit


def test_over_the_byte_limit(tmp_path):
    data = encode(tone(SAMPLE_RATE_HZ, 0.5), SAMPLE_RATE_HZ, "WAV", "PCM_16")   # 16,044 bytes
    limits = AudioLimits(max_audio_bytes=10_000)
    with refused(r"^the audio is 16044 bytes, above the limit of 10000 bytes$"):
        load_audio(data, limits)
    path = tmp_path / "long.wav"
    path.write_bytes(data)
    with refused(rf"^the audio file {path} is 16044 bytes, above the limit of 10000 bytes$"):
        load_audio(path, limits)

    class CountingReader(io.BytesIO):
        bytes_read = 0

        def read(self, size=-1):
            chunk = super().read(size)
            self.bytes_read += len(chunk)
            return chunk
    reader = CountingReader(data)
    with refused(r"^the audio is larger than the limit of 10000 bytes$"):
        load_audio(reader, limits)
    assert reader.bytes_read == 10_001   # read one byte past the limit and no further
    assert load_audio(data, AudioLimits(max_audio_bytes=len(data))).samples.shape == (8000,)


def test_an_hour_of_silence_is_refused_from_the_flac_header():
    """Just over an hour of 8 kHz silence compresses to about 90 KB; its header gives it away before
    decoding."""
    data = silent_flac(8000, 3601)
    assert len(data) < 200_000
    with refused(r"^the audio lasts 3601\.0 s \(from its header\), above the limit of "
                                         r"3600 s; send a shorter recording$"):
        load_audio(data)


def test_duration_limit_while_decoding_a_flac_of_unknown_length(monkeypatch):
    """Ten minutes of silence whose header does not declare its length, against a 60 s limit: decoding stops
    within one block of the limit instead of expanding all of it."""
    data = without_declared_length(silent_flac(8000, 600))
    frames_decoded = []
    real_blocks = audio_module.read_sound_file_blocks

    def counting_blocks(sound_file, num_channels):
        for block in real_blocks(sound_file, num_channels):
            frames_decoded.append(block.shape[0])
            yield block
    monkeypatch.setattr(audio_module, "read_sound_file_blocks", counting_blocks)
    with refused(r"^the audio lasts more than 60 s, the limit; send a shorter recording$"):
        load_audio(data, AudioLimits(max_duration_s=60.0))
    assert 60 * 8000 < sum(frames_decoded) <= 60 * 8000 + DECODE_BLOCK_FRAMES
    assert load_audio(data, AudioLimits(max_duration_s=600.0)).duration_s == 600.0   # exactly the limit


def test_duration_limit_for_arrays():
    with refused(r"^the audio lasts 2\.0 s, above the limit of 1\.5 s; send a shorter"):
        load_audio((np.zeros(32000, np.float32), SAMPLE_RATE_HZ), AudioLimits(max_duration_s=1.5))


def test_zero_samples():
    with refused(r"^the audio has no samples \(it decodes to 0 samples\)$"):
        load_audio(encode(np.zeros(0, np.float32), SAMPLE_RATE_HZ, "WAV", "PCM_16"))
    with refused(r"^the audio has no samples"):
        load_audio((np.zeros(0, np.float32), SAMPLE_RATE_HZ))


def test_nan_samples():
    samples = tone(SAMPLE_RATE_HZ, 0.2)
    samples[100] = np.nan
    with refused(r"^the audio contains NaN or infinite sample values$"):
        load_audio(encode(samples, SAMPLE_RATE_HZ, "WAV", "FLOAT"))


def test_bad_sources(tmp_path):
    with refused(r"^audio file not found: .*missing\.wav$"):
        load_audio(tmp_path / "missing.wav")
    with refused(r"is a directory, not an audio file$"):
        load_audio(str(tmp_path))
    text_file = tmp_path / "notes.txt"
    text_file.write_text("hello")
    with open(text_file) as f, refused(r"open it in binary mode \('rb'\)$"):
        load_audio(f)
    with refused(r"^audio must be bytes, a file path, a binary file object or an "
                                         r"\(array, sample_rate\) pair, not int$"):
        load_audio(42)
    with refused(r"looks like \[num_channels, num_samples\]; pass \[num_samples, "
                                         r"num_channels\] \(transpose it\)$"):
        load_audio((np.zeros((2, 16000), np.float32), SAMPLE_RATE_HZ))
    with refused(r"^the audio's sample rate is 100 Hz, outside the supported 1000\.\.768000"):
        load_audio((np.zeros(100, np.float32), 100))
    with refused(r"^the sample rate must be an integer number of Hz, not 16000\.0$"):
        load_audio((np.zeros(100, np.float32), 16000.0))
    with refused(r"^decoded audio must be an \(array, sample_rate_hz\) pair, not a 3-tuple$"):
        load_audio((np.zeros(100, np.float32), 16000, 1))


def test_audio_error_is_a_value_error():
    assert issubclass(AudioError, ValueError)   # the server maps ValueError to HTTP 400
