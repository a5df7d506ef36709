"""Write the expected Whisper log-mel features of a test clip, computed by transformers'
WhisperFeatureExtractor, to tests/fixtures/whisper_features/ (run in the export venv, which has
transformers; the clip itself is made with espeak-ng and sox, see that folder's README).

    ~/.cache/runnx/export-venv/bin/python scripts/whisper_features_fixture.py tests/fixtures/whisper_features
"""
import sys
import wave
from pathlib import Path

import numpy as np
from transformers import WhisperFeatureExtractor


def read_pcm16(path: Path) -> np.ndarray:
    with wave.open(str(path)) as wav:
        assert wav.getframerate() == 16000 and wav.getnchannels() == 1 and wav.getsampwidth() == 2
        return np.frombuffer(wav.readframes(wav.getnframes()), np.int16).astype(np.float32) / 32768.0


def main(folder: Path) -> None:
    audio = read_pcm16(folder / "clip.wav")
    features = {}
    for n_mels in (80, 128):
        extractor = WhisperFeatureExtractor(feature_size=n_mels)
        features[f"mel{n_mels}"] = extractor(audio, sampling_rate=16000, return_tensors="np").input_features
    np.savez_compressed(folder / "features.npz", **features)
    print({name: value.shape for name, value in features.items()})


if __name__ == "__main__":
    main(Path(sys.argv[1]))
