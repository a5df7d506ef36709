"""Write transformers' timestamp-mode token ids for the espeak-ng clips built by `make models` to
tests/fixtures/whisper_features/timestamps.json (run in the export venv, which has transformers
and torch; the HF folder is the one the Whisper build converts before the ONNX export).

    ~/.cache/runnx/export-venv/bin/python scripts/whisper_timestamps_fixture.py HF_WHISPER_DIR AUDIO_DIR OUT.json
"""
import json
import sys
import wave
from pathlib import Path

import numpy as np
import torch
from transformers import WhisperForConditionalGeneration, WhisperProcessor

CLIPS = ("john.wav", "fox.wav", "weather.wav")


def main(hf_dir: Path, audio_dir: Path, out: Path) -> None:
    model = WhisperForConditionalGeneration.from_pretrained(hf_dir).eval()
    processor = WhisperProcessor.from_pretrained(hf_dir)
    expected = {}
    for clip in CLIPS:
        with wave.open(str(audio_dir / clip)) as wav:
            audio = np.frombuffer(wav.readframes(wav.getnframes()), np.int16).astype(np.float32) / 32768.0
        features = processor.feature_extractor(audio, sampling_rate=16000, return_tensors="pt").input_features
        with torch.no_grad():
            ids = model.generate(features, return_timestamps=True, max_new_tokens=220)
        expected[clip] = ids[0].tolist()
    out.write_text(json.dumps(expected) + "\n")
    print(expected)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
