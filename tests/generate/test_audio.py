"""Audio input: files through soundfile, arrays, mono mixdown, resampling, clear errors."""
from pathlib import Path

import numpy as np
import pytest
import soundfile

from runnx.errors import RunnxError
from runnx.generate import audio
from runnx.generate.audio import AudioError, load_audio

CLIP = Path(__file__).resolve().parents[1] / "fixtures" / "whisper_features" / "clip.wav"


def _tone(rate: int, seconds: float = 1.0, hz: float = 440.0) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (0.5 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def test_wav_file_is_read_as_float_in_unit_range():
    samples = load_audio(CLIP)
    raw, rate = soundfile.read(CLIP, dtype="int16")
    assert rate == 16000 and samples.dtype == np.float32 and samples.shape == raw.shape
    np.testing.assert_array_equal(samples, raw.astype(np.float32) / 32768)


@pytest.mark.parametrize("fmt,suffix", [("FLAC", ".flac"), ("OGG", ".ogg"), ("WAV", ".wav")])
def test_formats_stereo_and_rates_become_16k_mono(tmp_path, fmt, suffix):
    left, right = _tone(44100, hz=440.0), _tone(44100, hz=440.0) * 0.5
    path = tmp_path / f"tone{suffix}"
    soundfile.write(path, np.stack([left, right], axis=1), 44100, format=fmt)
    samples = load_audio(path)
    assert samples.dtype == np.float32 and samples.ndim == 1
    assert abs(samples.size - 16000) <= 2
    # mixdown of 0.5 and 0.25 amplitude channels: a 440 Hz tone of amplitude 0.375 at 16 kHz
    expected = 0.375 * np.sin(2 * np.pi * 440.0 * np.arange(samples.size) / 16000)
    middle = slice(2000, 14000)  # away from the resampler's edges
    tolerance = 0.05 if fmt == "OGG" else 2e-3  # Vorbis is lossy
    np.testing.assert_allclose(samples[middle], expected[middle], atol=tolerance)


def test_arrays_are_accepted_directly():
    tone = _tone(16000)
    np.testing.assert_array_equal(load_audio(tone), tone)  # already 16 kHz mono: unchanged
    pcm = (tone * 32767).astype(np.int16)
    np.testing.assert_allclose(load_audio(pcm), tone, atol=1e-4)
    stereo = np.stack([tone, -tone], axis=1)
    np.testing.assert_array_equal(load_audio(stereo), np.zeros_like(tone))
    resampled = load_audio(_tone(8000), sample_rate=8000)
    assert resampled.size == 16000


def test_unsigned_pcm_is_centred():
    np.testing.assert_array_equal(load_audio(np.array([0, 128, 255], np.uint8)), [-1.0, 0.0, 127 / 128])


@pytest.mark.parametrize("bad,message", [
    (np.zeros(0, np.float32), "no samples"),
    (np.zeros((0, 2), np.float32), "no samples"),
    (np.zeros((2, 2, 2), np.float32), "1-D"),
    (np.array([0.0, np.nan], np.float32), "NaN"),
    (np.array(["a", "b"]), "numbers"),
])
def test_bad_arrays_are_clear_errors(bad, message):
    with pytest.raises(AudioError, match=message):
        load_audio(bad)


def test_unreadable_and_missing_files_are_clear_errors(tmp_path):
    garbage = tmp_path / "garbage.wav"
    garbage.write_bytes(b"this is not audio at all")
    with pytest.raises(AudioError, match="cannot decode"):
        load_audio(garbage)
    with pytest.raises(AudioError, match="not found"):
        load_audio(tmp_path / "missing.wav")
    empty = tmp_path / "empty.wav"
    soundfile.write(empty, np.zeros(0, np.float32), 16000)
    with pytest.raises(AudioError, match="no samples"):
        load_audio(empty)
    assert issubclass(AudioError, RunnxError)


def test_missing_extra_names_the_install(monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_soxr(name, *args, **kwargs):
        if name == "soxr":
            raise ImportError("No module named 'soxr'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_soxr)
    with pytest.raises(audio.MissingAudioDependencyError, match=r"runnx\[audio\]"):
        load_audio(_tone(8000), sample_rate=8000)
    np.testing.assert_array_equal(load_audio(_tone(16000)), _tone(16000))  # 16 kHz arrays need neither
