"""Regenerate the committed test audio from clips.json (see README.md here).

    .venv/bin/python tests/data/audio/make_audio.py

Needs espeak-ng on PATH (``apt-get install espeak-ng``; the tests do not, they read the committed files) and
PyAV for the m4a / webm twins. Each speech clip is espeak-ng's 22,050 Hz output resampled to 16 kHz with
soxr (librosa's default quality) and written as 16-bit PCM mono wav; the measured durations are written back
into clips.json. Voices and speeds were chosen (among en-us, en-gb, en-gb-x-rp, their +m3 / +f3 / +klatt
variants and 110-155 words per minute) for what transformers' Whisper tiny.en / base recognise best.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tempfile
from fractions import Fraction
from pathlib import Path

import numpy as np
import soundfile
import soxr

HERE = Path(__file__).resolve().parent
MANIFEST = HERE / "clips.json"
SAMPLE_RATE_HZ = 16000


def synthesize(text: str, voice: str, words_per_minute: int) -> np.ndarray:
    """espeak-ng speech as float32 ``[num_samples]`` at 16 kHz."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "speech.wav"
        subprocess.run(["espeak-ng", "-v", voice, "-s", str(words_per_minute), "-w", str(path), text],
                       check=True)
        samples, rate = soundfile.read(path, dtype="float32")
    return np.clip(soxr.resample(samples, rate, SAMPLE_RATE_HZ, quality="soxr_hq"), -1.0, 1.0)


def write_wav(name: str, samples: np.ndarray) -> float:
    """Write ``<name>.wav`` (PCM_16 mono 16 kHz); returns its duration in seconds."""
    soundfile.write(HERE / f"{name}.wav", samples, SAMPLE_RATE_HZ, subtype="PCM_16")
    return round(len(samples) / SAMPLE_RATE_HZ, 4)


def encode_with_pyav(samples: np.ndarray, container_format: str, codec: str) -> bytes:
    """Mono float32 16 kHz samples encoded by FFmpeg through PyAV (``ipod`` + aac is .m4a). The first frame's
    timestamp makes the muxer record the encoder's priming (an MP4 edit list, WebM's codec delay), so a
    decoder drops it, as with files from ffmpeg or a phone."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container_format) as container:
        stream = container.add_stream(codec, rate=SAMPLE_RATE_HZ, layout="mono")
        frame = av.AudioFrame.from_ndarray(samples[None, :].astype(np.float32), format="flt", layout="mono")
        frame.sample_rate = SAMPLE_RATE_HZ
        frame.pts, frame.time_base = 0, Fraction(1, SAMPLE_RATE_HZ)   # so the encoder's priming is declared
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            container.mux(packet)
    return buffer.getvalue()


def write_twin(samples: np.ndarray, name: str, fmt: str) -> None:
    """``<name>.<fmt>``: the same samples in another container / codec."""
    path = HERE / f"{name}.{fmt}"
    if fmt == "flac":
        soundfile.write(path, samples, SAMPLE_RATE_HZ, format="FLAC", subtype="PCM_16")
    elif fmt == "ogg":
        soundfile.write(path, samples, SAMPLE_RATE_HZ, format="OGG", subtype="VORBIS")
    elif fmt == "mp3":
        soundfile.write(path, samples, SAMPLE_RATE_HZ, format="MP3", subtype="MPEG_LAYER_III")
    elif fmt == "m4a":
        path.write_bytes(encode_with_pyav(samples, "ipod", "aac"))
    elif fmt == "webm":
        path.write_bytes(encode_with_pyav(samples, "webm", "libopus"))
    else:
        raise ValueError(f"no writer for {fmt}")


def main() -> None:
    manifest = json.loads(MANIFEST.read_text(encoding="utf-8"))
    for clip in manifest["speech"]:
        samples = synthesize(clip["text"], clip["voice"], clip["words_per_minute"])
        clip["duration_s"] = write_wav(clip["name"], samples)
        print(f"{clip['name']}.wav: {clip['duration_s']} s", file=sys.stderr)
    silence = manifest["silence"]
    write_wav(silence["name"], np.zeros(int(silence["duration_s"] * SAMPLE_RATE_HZ), np.float32))
    twins = manifest["twins"]
    samples, _ = soundfile.read(HERE / f"{twins['of']}.wav", dtype="float32")
    for fmt in twins["formats"]:
        write_twin(samples, twins["of"], fmt)
    MANIFEST.write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
