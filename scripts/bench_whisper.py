"""Whisper tiny.en speed, runnx vs onnxruntime at the same thread count: encoder seconds per 30 s
window, decoder milliseconds per token, and the real-time factor of a whole long clip; with
--profile, runnx's time per op type for the encoder and the decoder steps.

    python scripts/bench_whisper.py [--model DIR] [--audio FILE] [--threads N] [--repeat N] [--profile]

Defaults: ${RUNNX_CACHE:-~/.cache/runnx}/models/whisper-tiny.en and .../audio/long.wav (built by
`make models`). onnxruntime is a test dependency; it runs behind the same pipeline code
(tests/generate/_ort_whisper.py), so the two columns differ only in the engine.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path


def parse_args():
    cache = Path(os.environ.get("RUNNX_CACHE") or Path.home() / ".cache" / "runnx").expanduser()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=cache / "models" / "whisper-tiny.en")
    parser.add_argument("--audio", type=Path, default=cache / "audio" / "long.wav")
    parser.add_argument("--threads", type=int, default=1, help="BLAS/numba threads and onnxruntime intra-op threads")
    parser.add_argument("--repeat", type=int, default=3, help="timed encoder runs (after one warm-up)")
    parser.add_argument("--profile", action="store_true", help="print runnx's time per op type")
    return parser.parse_args()


ARGS = parse_args()
for variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ[variable] = str(ARGS.threads)  # before numpy and numba start their pools

import numpy as np  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "generate")]
from _ort_whisper import OrtModel  # noqa: E402

from runnx import Profile  # noqa: E402
from runnx.generate.audio import load_audio  # noqa: E402
from runnx.generate.mel import window_features  # noqa: E402
from runnx.generate.whisper import Whisper  # noqa: E402


def encoder_seconds(model: Whisper, features, repeat: int) -> float:
    model.encode(features)  # warm-up: numba compiles, caches fill
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        model.encode(features)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def decoder_ms_per_token(model: Whisper, hidden) -> tuple[float, int]:
    """Greedy decoding of one window, no timestamps: milliseconds per decoder step (prefill included)."""
    model.decode(hidden, max_new_tokens=4)  # warm-up
    start = time.perf_counter()
    decoded = model.decode(hidden)
    steps = len(decoded.tokens) + 1
    return 1000 * (time.perf_counter() - start) / steps, steps


def main() -> None:
    samples = load_audio(ARGS.audio)
    features = window_features(samples, 80)
    engines = {"runnx": Whisper(ARGS.model),
               "onnxruntime": Whisper(ARGS.model, load=lambda path: OrtModel(path, ARGS.threads))}
    print(f"Whisper tiny.en, {ARGS.audio.name} ({samples.size / 16000:.1f} s), {ARGS.threads} thread(s)")
    print(f"{'':<14}{'encoder s/window':>18}{'decoder ms/token':>18}{'real-time factor':>18}"
          f"{'(features/encode/decode s)':>30}")
    results = {}
    for name, model in engines.items():
        encode = encoder_seconds(model, features, ARGS.repeat)
        per_token, steps = decoder_ms_per_token(model, model.encode(features))
        transcript = model.transcribe(samples)
        t = transcript.timings
        results[name] = transcript
        print(f"{name:<14}{encode:>18.3f}{per_token:>18.1f}{t.real_time_factor:>18.3f}"
              f"{f'{t.features:.2f}/{t.encode:.2f}/{t.decode:.2f}':>30}   ({steps} steps, {t.windows} windows)")
    same = [s.tokens for s in results["runnx"].segments] == [s.tokens for s in results["onnxruntime"].segments]
    print(f"same segments and token ids: {same}")
    if ARGS.profile:
        profile_runnx(engines["runnx"], features)


def profile_runnx(model: Whisper, features) -> None:
    encoder_profile = Profile()
    hidden = model.encoder.run({model.encoder_input: features}, profile=encoder_profile)
    print("\n-- encoder, one window --\n" + encoder_profile.summary(top=12))
    model.decoder.profile = Profile()
    decoded = model.decode(next(iter(hidden.values())))
    print(f"\n-- decoder, {len(decoded.tokens) + 1} steps --\n" + model.decoder.profile.summary(top=12))
    model.decoder.profile = None


if __name__ == "__main__":
    main()
