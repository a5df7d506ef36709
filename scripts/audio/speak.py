"""Build speech clips from text with no system package: scripts/build_models.py runs this in its
audio venv (scripts/audio/requirements.txt).

    python speak.py SPEC.json OUT_DIR

SPEC.json: {"sample_rate": 16000, "gap_seconds": 0.4, "clips": {"john.wav": ["sentence", ...], ...}}.
Each clip is its sentences spoken one by one (espeak_say.py, a fresh process each), joined by
`gap_seconds` of silence, resampled from eSpeak's 22.05 kHz to `sample_rate` with soxr and written
as mono 16-bit PCM. The conversion rounds without dither: the same inputs give the same bytes.
"""
from __future__ import annotations

import json
import subprocess
import sys
import wave
from pathlib import Path

import numpy as np
import soxr

SAY = Path(__file__).with_name("espeak_say.py")


def spoken(text: str) -> tuple[np.ndarray, int]:
    """(int16 samples, their rate) of `text`, spoken by a fresh process."""
    result = subprocess.run([sys.executable, SAY, text], capture_output=True, stdin=subprocess.DEVNULL)
    if result.returncode != 0:
        raise RuntimeError(f"speaking {text!r} failed: {result.stderr.decode(errors='replace').strip()[-500:]}")
    return np.frombuffer(result.stdout[4:], "<i2"), int.from_bytes(result.stdout[:4], "little")


def to_pcm16(samples: np.ndarray, rate_in: int, rate_out: int) -> np.ndarray:
    resampled = soxr.resample(samples.astype(np.float64) / 32768.0, rate_in, rate_out, quality="VHQ")
    return np.clip(np.round(resampled * 32768.0), -32768, 32767).astype(np.int16)


def write_wav(path: Path, samples: np.ndarray, rate: int) -> None:
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(samples.astype("<i2").tobytes())


def main(spec_path: Path, out_dir: Path) -> None:
    spec = json.loads(spec_path.read_text())
    rate = spec["sample_rate"]
    gap = np.zeros(round(spec["gap_seconds"] * rate), np.int16)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, sentences in spec["clips"].items():
        parts = []
        for sentence in sentences:
            parts += [to_pcm16(*spoken(sentence), rate), gap]
        write_wav(out_dir / name, np.concatenate(parts[:-1]), rate)
        print(f"{name}: {len(sentences)} sentence(s)", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
