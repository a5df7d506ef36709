"""Whisper log-mel features against transformers' WhisperFeatureExtractor (stored fixture) and
against properties of the filterbank."""
from pathlib import Path

import numpy as np
import pytest

from runnx.generate import mel
from runnx.generate.audio import load_audio

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "whisper_features"


@pytest.mark.parametrize("n_mels", [80, 128])
def test_features_match_transformers(n_mels):
    expected = np.load(FIXTURE / "features.npz")[f"mel{n_mels}"]
    features = mel.window_features(load_audio(FIXTURE / "clip.wav"), n_mels)
    assert features.shape == expected.shape == (1, n_mels, 3000)
    assert features.dtype == np.float32
    np.testing.assert_allclose(features, expected, rtol=0, atol=1e-4)


def test_mel_scale_round_trip_and_slaney_break():
    hz = np.array([0.0, 300.0, 999.0, 1000.0, 4000.0, 8000.0])
    np.testing.assert_allclose(mel.mel_to_hz(mel.hz_to_mel(hz)), hz, rtol=1e-12, atol=1e-9)
    assert mel.hz_to_mel(1000.0) == pytest.approx(15.0)  # linear part: 3 mels per 200 Hz
    assert mel.hz_to_mel(6400.0) == pytest.approx(15.0 + 27.0)  # 27 mels per factor 6.4 above 1 kHz


@pytest.mark.parametrize("n_mels", [80, 128])
def test_filterbank_shape_and_equal_area(n_mels):
    filters = mel.mel_filterbank(n_mels)
    assert filters.shape == (n_mels, 201)
    assert (filters >= 0).all() and (filters.sum(axis=1) > 0).all()
    # Slaney normalisation: each triangle has area 1 in Hz; the 40 Hz FFT grid samples the wide
    # upper filters well enough to see it (the low ones are narrower than a bin)
    areas = filters.sum(axis=1) * (16000 / 2 / 200)
    np.testing.assert_allclose(areas[n_mels // 2:], 1.0, rtol=0.1)


def test_window_is_cut_or_padded_to_30_seconds():
    rng = np.random.default_rng(0)
    long_audio = rng.uniform(-0.5, 0.5, 40 * 16000).astype(np.float32)
    np.testing.assert_array_equal(mel.window_features(long_audio), mel.window_features(long_audio[:480000]))
    assert mel.window_features(long_audio[:16000]).shape == (1, 80, 3000)


def test_whole_audio_features_equal_window_features_inside_the_first_window():
    # Long-form transcription computes features once, padded by a window of silence, and slices.
    audio = np.random.default_rng(1).uniform(-0.3, 0.3, 10 * 16000).astype(np.float32)
    whole = mel.log_mel_spectrogram(audio, 80, padding=mel.N_SAMPLES)
    assert whole.shape == (80, (audio.size + mel.N_SAMPLES) // mel.HOP_LENGTH)
    np.testing.assert_allclose(whole[None, :, :mel.N_FRAMES], mel.window_features(audio), atol=1e-6)


def test_dynamic_range_is_clamped_to_8_below_the_peak():
    audio = np.zeros(16000, np.float32)
    audio[8000] = 1.0
    features = mel.log_mel_spectrogram(audio)
    assert features.max() - features.min() == pytest.approx(2.0)  # 8 decades / 4
