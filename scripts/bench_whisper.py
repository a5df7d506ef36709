"""Whisper tiny.en speed, runnx vs onnxruntime at the same thread count: encoder seconds per 30 s
window, decoder milliseconds per token (a first window, and the same window again: steady), the
real-time factor of a whole long clip, and (with --pairs) the time to transcribe the short clips;
with --profile, runnx's time per op type for the encoder and the decoder steps.

    python scripts/bench_whisper.py [--model DIR] [--audio FILE] [--clips FILE ...] [--threads N] [--rounds N]
                                    [--repeat N] [--pairs N] [--profile]

Each engine runs in its own process (two thread pools in one process, onnxruntime's and OpenBLAS's,
busy-wait against each other at 2 threads), --rounds times alternating, and the figures are medians
over the rounds. With --pairs N, both engines then transcribe the clip, decode its first window and
transcribe the short clips (--clips: by default the other .wav files beside --audio, which `make
models` builds) N times each in one process, taking turns (A B B A ...) with a pause between turns
so that neither's spinning threads overlap the other's run: separate processes minutes apart saw
this machine's memory bandwidth move by 10-30%, and turns in one process put a slow spell on both.
Defaults: ${RUNNX_CACHE:-~/.cache/runnx}/models/whisper-tiny.en and .../audio/long.wav (built by
`make models`). onnxruntime is a test dependency; it runs behind the same pipeline code
(tests/generate/_ort_whisper.py), so the two columns differ only in the engine.
RUNNX_OPTIMIZATION_LEVEL=basic in the environment gives runnx without fusion,
compiled plans or branch specialization, for A/B runs (scripts/bench_option.py compares one
Options switch on SmolLM2).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from report import set_threads  # scripts/ is this script's own folder on sys.path

ENGINES = ("runnx", "onnxruntime")
PAUSE_SECONDS = 0.05  # between turns: onnxruntime's pool spins for a few ms after a run, runnx's for 2.5


def parse_args():
    cache = Path(os.environ.get("RUNNX_CACHE") or Path.home() / ".cache" / "runnx").expanduser()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=cache / "models" / "whisper-tiny.en")
    parser.add_argument("--audio", type=Path, default=cache / "audio" / "long.wav")
    parser.add_argument("--clips", type=Path, nargs="*", default=None,
                        help="short clips transcribed each turn of --pairs (default: the other .wav files beside --audio)")
    parser.add_argument("--threads", type=int, default=1, help="BLAS/numba threads and onnxruntime intra-op threads")
    parser.add_argument("--rounds", type=int, default=3, help="processes per engine, alternating; medians over them")
    parser.add_argument("--repeat", type=int, default=3, help="timed encoder runs per process (after one warm-up)")
    parser.add_argument("--pairs", type=int, default=0, help="turns per engine in one process (a transcription and a decode each)")
    parser.add_argument("--profile", action="store_true", help="print runnx's time per op type")
    parser.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)  # one engine's measurements, as JSON
    return parser.parse_args()


ARGS = parse_args()
set_threads(ARGS.threads)  # before numpy and numba start their pools

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    samples_seconds = None
    runs = {engine: [] for engine in ENGINES}
    for _ in range(ARGS.rounds):
        for engine in ENGINES:
            result = _worker(engine)
            runs[engine].append(result)
            samples_seconds = result["audio"]
    print(f"Whisper tiny.en, {ARGS.audio.name} ({samples_seconds:.1f} s), {ARGS.threads} thread(s), "
          f"medians of {ARGS.rounds} process(es) per engine")
    print(f"{'':<14}{'encoder s/window':>18}{'decoder ms/token':>18}{'steady ms/token':>17}{'real-time factor':>18}"
          f"{'(features/encode/decode s)':>30}")
    for engine, results in runs.items():
        m = {key: statistics.median(r[key] for r in results)
             for key in ("encode_window", "ms_per_token", "steady_ms_per_token", "rtf", "features", "encode",
                         "decode")}
        phases = f"{m['features']:.2f}/{m['encode']:.2f}/{m['decode']:.2f}"
        print(f"{engine:<14}{m['encode_window']:>18.3f}{m['ms_per_token']:>18.1f}{m['steady_ms_per_token']:>17.1f}"
              f"{m['rtf']:>18.3f}{phases:>30}   ({results[0]['steps']} steps, {results[0]['windows']} windows)")
    tokens = {engine: {json.dumps(r["tokens"]) for r in results} for engine, results in runs.items()}
    print(f"same segments and token ids: {len(tokens['runnx'] | tokens['onnxruntime']) == 1}")
    if ARGS.pairs:
        print(same_process_pairs(ARGS.pairs))
    if ARGS.profile:
        _in_process("runnx", profile=True)


def _worker(engine: str) -> dict:
    """One engine's measurements in a fresh process."""
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", engine, "--model", str(ARGS.model),
               "--audio", str(ARGS.audio), "--threads", str(ARGS.threads), "--repeat", str(ARGS.repeat)]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    if completed.returncode:
        sys.exit(f"{engine} worker failed:\n{completed.stderr[-2000:]}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def _whisper(engine: str):
    """The pipeline with `engine` behind it."""
    for folder in (str(REPO / "tests" / "generate"), str(REPO)):
        if folder not in sys.path:
            sys.path.insert(0, folder)
    from runnx.generate.whisper import Whisper

    if engine == "onnxruntime":
        from _ort_whisper import OrtModel
        return Whisper(ARGS.model, load=lambda path: OrtModel(path, ARGS.threads))
    return Whisper(ARGS.model)


def same_process_pairs(count: int) -> str:
    """Real-time factors of both engines transcribing the clip, and their decoder ms/token on its
    first window, in one process, taking turns."""
    from runnx.generate.audio import SAMPLE_RATE, load_audio
    from runnx.generate.mel import window_features

    models = {engine: _whisper(engine) for engine in ENGINES}
    samples = load_audio(ARGS.audio)
    hidden = {engine: model.encode(window_features(samples, model.n_mels)) for engine, model in models.items()}
    for engine, model in models.items():  # warm-up
        model.transcribe(samples)
        decoder_ms_per_token(model, hidden[engine])
    clips = [load_audio(path) for path in short_clips()]
    for engine, model in models.items():
        for clip in clips:
            model.transcribe(clip)
    factors = {engine: [] for engine in ENGINES}
    per_token = {engine: [] for engine in ENGINES}
    clip_seconds = {engine: [] for engine in ENGINES}
    for turn in range(count):
        for engine in ENGINES if turn % 2 == 0 else ENGINES[::-1]:
            time.sleep(PAUSE_SECONDS)
            factors[engine].append(models[engine].transcribe(samples).timings.real_time_factor)
            time.sleep(PAUSE_SECONDS)
            per_token[engine].append(decoder_ms_per_token(models[engine], hidden[engine], warm_ups=0)[0])
            time.sleep(PAUSE_SECONDS)
            start = time.perf_counter()
            for clip in clips:
                models[engine].transcribe(clip)
            clip_seconds[engine].append(time.perf_counter() - start)
    line = (f"same process, {count} turns each: real-time factor {_paired(factors, '.3f')}; "
            f"decoder ms/token {_paired(per_token, '.2f')}")
    if clips:
        audio = sum(len(clip) for clip in clips) / SAMPLE_RATE
        line += (f"; {len(clips)} short clips ({audio:.1f} s of audio), seconds to transcribe them all "
                 f"{_paired(clip_seconds, '.3f')}")
    return line


def short_clips() -> list[Path]:
    """--clips, or the .wav files beside --audio but it (`make models` builds three espeak-ng ones)."""
    if ARGS.clips is not None:
        return ARGS.clips
    return sorted(path for path in ARGS.audio.parent.glob("*.wav") if path != ARGS.audio)


def _paired(figures: dict, form: str) -> str:
    """runnx's and onnxruntime's medians and the median of their per-turn ratios."""
    ratios = [mine / theirs for mine, theirs in zip(figures["runnx"], figures["onnxruntime"])]
    return (f"runnx {statistics.median(figures['runnx']):{form}}, onnxruntime "
            f"{statistics.median(figures['onnxruntime']):{form}}, ratio {statistics.median(ratios):.2f}x "
            f"(turns {min(ratios):.2f}-{max(ratios):.2f})")


def _in_process(engine: str, profile: bool = False) -> dict:
    from runnx.generate.audio import load_audio
    from runnx.generate.mel import window_features

    model = _whisper(engine)
    samples = load_audio(ARGS.audio)
    features = window_features(samples, 80)
    if profile:
        profile_runnx(model, features)
        return {}
    encode = encoder_seconds(model, features, ARGS.repeat)
    hidden = model.encode(features)
    per_token, steps = decoder_ms_per_token(model, hidden)
    steady, _ = decoder_ms_per_token(model, hidden, warm_ups=0)  # every length of the window seen
    model.transcribe(samples)  # warm-up: the timestamp rules' path, plans for every prompt length
    transcript = model.transcribe(samples)
    t = transcript.timings
    return {"audio": t.audio, "encode_window": encode, "ms_per_token": per_token, "steady_ms_per_token": steady,
            "steps": steps, "rtf": t.real_time_factor, "features": t.features, "encode": t.encode, "decode": t.decode,
            "windows": t.windows, "tokens": [list(s.tokens) for s in transcript.segments]}


def encoder_seconds(model, features, repeat: int) -> float:
    model.encode(features)  # warm-up: numba compiles, caches fill
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        model.encode(features)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def decoder_ms_per_token(model, hidden, warm_ups: int = 2) -> tuple[float, int]:
    """Greedy decoding of one window, no timestamps: milliseconds per decoder step (prefill included),
    after `warm_ups` short decodes (runnx compiles a plan on its second run; the first step's branch
    runs once per window). After the default two, the timed window's lengths past the warm-ups' are
    new to runnx's shape memos, as in a first window; the same window decoded again (warm_ups=0)
    finds every length seen, as later windows of a transcription mostly do: the steady figure."""
    for _ in range(warm_ups):
        model.decode(hidden, max_new_tokens=4)  # warm-up
    start = time.perf_counter()
    decoded = model.decode(hidden)
    steps = len(decoded.tokens) + 1
    return 1000 * (time.perf_counter() - start) / steps, steps


def profile_runnx(model, features) -> None:
    from runnx import Profile

    encoder_profile = Profile()
    model.encode(features)
    hidden = model.encoder.run({model.encoder_input: features}, profile=encoder_profile)
    print("\n-- encoder, one window --\n" + encoder_profile.summary(top=12))
    model.decoder.profile = Profile()
    decoded = model.decode(next(iter(hidden.values())))
    print(f"\n-- decoder, {len(decoded.tokens) + 1} steps --\n" + model.decoder.profile.summary(top=12))
    model.decoder.profile = None


if __name__ == "__main__":
    if ARGS.worker:
        print(json.dumps(_in_process(ARGS.worker)))
    else:
        main()
