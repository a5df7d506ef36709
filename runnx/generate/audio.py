"""Audio input for speech models: files (WAV/FLAC/OGG/... through libsndfile) or numpy arrays,
mixed down to mono float32 and resampled to the model's rate (16 kHz for Whisper).

`soundfile` and `soxr` are the optional `audio` extra (`pip install 'runnx[audio]'`); they are
imported only when a file must be read or a rate converted, so numpy input at 16 kHz needs neither.
"""
from __future__ import annotations

import os

import numpy as np

from runnx.errors import RunnxError

SAMPLE_RATE = 16000


class AudioError(RunnxError, ValueError):
    """Audio that cannot be read or used: a missing or undecodable file, no samples, a bad array."""


class MissingAudioDependencyError(RunnxError, ImportError):
    """The optional `audio` extra (soundfile, soxr) is needed and not installed."""


def _require(module_name: str, what: str):
    try:
        return __import__(module_name)
    except ImportError as error:
        raise MissingAudioDependencyError(
            f"{what} needs the '{module_name}' package: install runnx's audio extra "
            f"(pip install 'runnx[audio]')") from error


def read_file(path) -> tuple[np.ndarray, int]:
    """(samples as float32 [frames, channels], sample rate) of an audio file."""
    soundfile = _require("soundfile", "reading audio files")
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise AudioError(f"audio file not found: {path}")
    try:
        samples, rate = soundfile.read(path, dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, TypeError) as error:
        raise AudioError(f"cannot decode audio file {path}: {error}") from error
    return samples, int(rate)


def _as_float(samples: np.ndarray) -> np.ndarray:
    """Float samples in [-1, 1]: integer PCM is scaled by its full range, floats are kept."""
    if samples.dtype.kind == "f":
        return samples.astype(np.float32, copy=False)
    if samples.dtype.kind == "i":
        return samples.astype(np.float32) / np.float32(-np.iinfo(samples.dtype).min)
    if samples.dtype.kind == "u":  # unsigned PCM (8-bit WAV) is centred on half the range
        half = np.float32(np.iinfo(samples.dtype).max // 2 + 1)
        return (samples.astype(np.float32) - half) / half
    raise AudioError(f"audio samples must be numbers, got dtype {samples.dtype}")


def to_mono(samples: np.ndarray) -> np.ndarray:
    """Average the channels of [frames, channels] samples (1-D input is already mono)."""
    if samples.ndim == 1:
        return samples
    if samples.ndim != 2:
        raise AudioError(f"audio must be 1-D (mono) or 2-D [frames, channels], got shape {samples.shape}")
    if samples.shape[1] == 1:
        return samples[:, 0]
    return samples.mean(axis=1, dtype=np.float32)


def resample(samples: np.ndarray, rate: int, target_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Mono float32 samples converted from `rate` to `target_rate` (soxr, high quality)."""
    if rate == target_rate:
        return samples
    if rate <= 0:
        raise AudioError(f"sample rate must be positive, got {rate}")
    soxr = _require("soxr", f"resampling audio from {rate} Hz to {target_rate} Hz")
    return soxr.resample(samples, rate, target_rate, quality="HQ").astype(np.float32, copy=False)


def load_audio(source, sample_rate: int | None = None, *, target_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Mono float32 samples at `target_rate` from a file path or an array.

    An array is [frames] or [frames, channels] (soundfile's layout); its rate is `sample_rate`
    (default: already `target_rate`). Integer arrays are PCM and scaled to [-1, 1]."""
    if isinstance(source, (str, os.PathLike)):
        if sample_rate is not None:
            raise AudioError("sample_rate is only for arrays: a file carries its own rate")
        samples, rate = read_file(source)
        what = os.fspath(source)
    else:
        samples = np.asarray(source)
        rate = target_rate if sample_rate is None else int(sample_rate)
        what = f"array of shape {samples.shape}"
        samples = _as_float(samples)
    mono = to_mono(samples)
    if mono.size == 0:
        raise AudioError(f"audio holds no samples: {what}")
    if not np.isfinite(mono).all():
        raise AudioError(f"audio holds NaN or infinite samples: {what}")
    return np.ascontiguousarray(resample(mono, rate, target_rate), dtype=np.float32)
