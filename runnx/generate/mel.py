"""Whisper's log-mel features in numpy, matching transformers' `WhisperFeatureExtractor`.

16 kHz audio, 400-sample periodic Hann window, hop 160 (10 ms per frame), centred frames with
reflect padding, power spectrum through a mel filterbank (Slaney mel scale and area
normalisation, as librosa and openai-whisper use), log10, clamped to 8 below the maximum, and
scaled to about [-1, 1]. A window of the model is 30 s: 3000 frames.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

SAMPLE_RATE = 16000
N_FFT = 400
HOP_LENGTH = 160
CHUNK_SECONDS = 30
N_SAMPLES = CHUNK_SECONDS * SAMPLE_RATE  # 480000 samples per window
N_FRAMES = N_SAMPLES // HOP_LENGTH  # 3000 frames per window
FRAME_SECONDS = HOP_LENGTH / SAMPLE_RATE

# Slaney's mel scale: linear below 1 kHz (3 mels per 200 Hz), logarithmic above.
_LINEAR_HZ_PER_MEL = 200.0 / 3.0
_LOG_START_HZ = 1000.0
_LOG_START_MEL = _LOG_START_HZ / _LINEAR_HZ_PER_MEL
_MELS_PER_LOG_HZ = 27.0 / np.log(6.4)


def hz_to_mel(hz):
    hz = np.asarray(hz, dtype=np.float64)
    linear = hz / _LINEAR_HZ_PER_MEL
    logarithmic = _LOG_START_MEL + np.log(np.maximum(hz, _LOG_START_HZ) / _LOG_START_HZ) * _MELS_PER_LOG_HZ
    return np.where(hz >= _LOG_START_HZ, logarithmic, linear)


def mel_to_hz(mel):
    mel = np.asarray(mel, dtype=np.float64)
    linear = mel * _LINEAR_HZ_PER_MEL
    logarithmic = _LOG_START_HZ * np.exp((np.maximum(mel, _LOG_START_MEL) - _LOG_START_MEL) / _MELS_PER_LOG_HZ)
    return np.where(mel >= _LOG_START_MEL, logarithmic, linear)


@lru_cache(maxsize=4)
def mel_filterbank(n_mels: int, n_fft: int = N_FFT, sample_rate: int = SAMPLE_RATE,
                   max_hz: float = 8000.0) -> np.ndarray:
    """[n_mels, n_fft // 2 + 1] triangular filters, evenly spaced on the mel scale from 0 Hz to
    `max_hz`, each scaled by 2 / its width in Hz so that every filter has the same area."""
    fft_hz = np.linspace(0.0, sample_rate / 2, n_fft // 2 + 1)
    edges_hz = mel_to_hz(np.linspace(hz_to_mel(0.0), hz_to_mel(max_hz), n_mels + 2))
    widths = np.diff(edges_hz)
    offsets = edges_hz[:, None] - fft_hz[None, :]  # [n_mels + 2, bins]
    rising = -offsets[:-2] / widths[:-1, None]
    falling = offsets[2:] / widths[1:, None]
    filters = np.maximum(0.0, np.minimum(rising, falling))
    filters *= (2.0 / (edges_hz[2:] - edges_hz[:-2]))[:, None]
    filters.flags.writeable = False
    return filters


@lru_cache(maxsize=1)
def _hann_window(n_fft: int) -> np.ndarray:
    """Periodic Hann window (as torch.hann_window), the one Whisper was trained with."""
    window = 0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(n_fft) / n_fft)
    window.flags.writeable = False
    return window


def _centred_frames(audio: np.ndarray) -> np.ndarray:
    """[1 + len(audio) // hop, n_fft] view of the frames centred on every hop, reflect-padded."""
    half = N_FFT // 2
    if audio.shape[0] <= half:  # reflect padding needs more samples than half a frame
        audio = np.pad(audio, (0, half + 1 - audio.shape[0]))
    padded = np.pad(audio.astype(np.float64), half, mode="reflect")
    n_frames = 1 + (padded.shape[0] - N_FFT) // HOP_LENGTH
    return np.lib.stride_tricks.sliding_window_view(padded, N_FFT)[::HOP_LENGTH][:n_frames]


def power_spectrogram(frames: np.ndarray) -> np.ndarray:
    """|FFT|^2 of Hann-windowed frames [n, n_fft]: [n_fft // 2 + 1, n], float64."""
    spectrum = np.fft.rfft(frames * _hann_window(N_FFT), axis=1)
    return (spectrum.real ** 2 + spectrum.imag ** 2).T


def log_mel_spectrogram(audio: np.ndarray, n_mels: int = 80, *, padding: int = 0) -> np.ndarray:
    """[n_mels, (len(audio) + padding) // hop] float32 log-mel features of 16 kHz mono audio,
    after appending `padding` zero samples, normalised by the maximum over the whole result.
    Computed a window of frames at a time, so an hour of audio needs no gigabytes of spectrum."""
    audio = np.asarray(audio, dtype=np.float32)
    if padding:
        audio = np.pad(audio, (0, padding))
    frames = _centred_frames(audio)[:-1]  # the last centred frame is dropped, as Whisper does
    filters = mel_filterbank(n_mels)
    log_mel = np.empty((n_mels, frames.shape[0]), np.float32)
    for start in range(0, frames.shape[0], N_FRAMES):
        block = filters @ power_spectrogram(frames[start:start + N_FRAMES])
        log_mel[:, start:start + N_FRAMES] = np.log10(np.maximum(block, 1e-10))
    log_mel = np.maximum(log_mel, log_mel.max() - np.float32(8.0))
    return (log_mel + np.float32(4.0)) / np.float32(4.0)


def pad_or_trim(array: np.ndarray, length: int, axis: int = -1) -> np.ndarray:
    """`array` cut or zero-padded to `length` along `axis`."""
    size = array.shape[axis]
    if size > length:
        return np.take(array, np.arange(length), axis=axis)
    if size < length:
        widths = [(0, 0)] * array.ndim
        widths[axis] = (0, length - size)
        return np.pad(array, widths)
    return array


def window_features(audio: np.ndarray, n_mels: int = 80) -> np.ndarray:
    """[1, n_mels, 3000] features of one 30 s window: what `WhisperFeatureExtractor(audio)` gives
    (audio cut or zero-padded to 30 s)."""
    audio = pad_or_trim(np.asarray(audio, dtype=np.float32), N_SAMPLES)
    return log_mel_spectrogram(audio, n_mels)[None]
