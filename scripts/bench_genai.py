"""runnx against onnxruntime-genai on onnxruntime-genai's own folders (SmolLM2-135M fp32 and int4, its
weights as Qwen2 and Phi-3 in fp32 and int4, Whisper tiny.en): each engine's own loop on the same files,
the same thread count.

    .venv/bin/python scripts/bench_genai.py [--folders FOLDER,...] [--threads 1,2]
        [--contexts 32,512,2000] [--steps 16] [--rounds 3] [--repeat 3] [--no-whisper] [--no-write]

Each (engine, folder, thread count) runs in a process of its own (BLAS/numba/onnxruntime threads set
before anything starts), the engines alternating round by round; every figure is the median over the
rounds of each process's median step, the ratios also of each engine's best process (in brackets). runnx: `DecoderStep.from_folder` (the KV in the folder's shared
past/present buffer, GroupQueryAttention), its cache restored from random KV of the context length;
onnxruntime-genai: its Generator, the context a prompt of random tokens. Prefill: a prompt of the
largest context's random tokens, once (after a 16-token warm-up for runnx; onnxruntime-genai's is
its last context's prompt). Peak RSS is each process's own. Whisper (whisper-tiny.en-genai, unless
--no-whisper): the seconds to transcribe the short speech clips one after another (audio file to
token ids: features, encoder, greedy decoding), the median of --repeat passes after a warm-up pass,
runnx's `Whisper` against onnxruntime-genai's processor and Generator, the ids compared. Writes its
section of docs/benchmarks.md unless --no-write. Folders come from `make models`
(${RUNNX_CACHE:-~/.cache/runnx}/models).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from report import THREAD_VARIABLES, git_revision, huge_pages_mb, machine, update_section  # scripts/: this script's folder

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("RUNNX_CACHE") or Path.home() / ".cache" / "runnx").expanduser()
MODELS = CACHE / "models"
GENAI_PYTHON = CACHE / "genai-venv" / "bin" / "python"
WHISPER = MODELS / "whisper-tiny.en-genai"
FOLDERS = ("smollm2-135m-genai-int4", "smollm2-135m-genai-fp32", "qwen2-smollm2-135m-genai-fp32",
           "phi3-smollm2-135m-genai-fp32", "qwen2-smollm2-135m-genai-int4",
           "phi3-smollm2-135m-genai-int4")  # `make models` builds them
CLIPS = ("john.wav", "fox.wav", "weather.wav")  # each under 30 s: one call of onnxruntime-genai's processor


def worker_runnx(folder: Path, contexts: list[int], steps: int) -> dict:
    sys.path.insert(0, str(ROOT))
    import numpy as np
    from runnx.generate.decoder import DecoderStep

    start = time.perf_counter()
    decoder = DecoderStep.from_folder(folder, capacity=max(contexts) + steps + 2)
    decoder.wait_prepared()  # its 4-bit tiles made, as onnxruntime-genai's load prepacks its weights
    load_seconds = time.perf_counter() - start
    huge_mb = huge_pages_mb()
    rng = np.random.default_rng(0)
    heads, head_dim, dtype = next(iter(decoder._layout.values()))
    names = [k.past for k in decoder.past_io.kv if not k.is_cross_attention]
    token = np.array([[42]], np.int64)
    decode = {}
    for context in contexts:
        arrays = {name: rng.standard_normal((1, heads, context, head_dim)).astype(dtype) for name in names}
        decoder.restore(arrays, np.ones((1, context), np.int64))
        decoder.step(token)  # warm-up
        times = []
        for _ in range(steps):
            begin = time.perf_counter()
            logits = decoder.step(token)
            token = logits[:, -1:].argmax(-1).astype(np.int64)
            times.append(time.perf_counter() - begin)
        decode[context] = 1.0 / statistics.median(times)
    prompt = rng.integers(3, 40000, size=(1, max(contexts))).astype(np.int64)
    decoder.reset()
    decoder.step(prompt[:, :16])  # warm-up
    decoder.reset()
    begin = time.perf_counter()
    decoder.step(prompt)
    prefill = prompt.shape[1] / (time.perf_counter() - begin)
    return {"load_s": load_seconds, "decode_tps": decode, "prefill_tps": prefill,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "huge_mb": huge_mb}


def worker_genai(folder: Path, threads: int, contexts: list[int], steps: int) -> dict:
    import numpy as np
    import onnxruntime_genai as og

    start = time.perf_counter()
    config = og.Config(str(folder))
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
    model = og.Model(config)
    load_seconds = time.perf_counter() - start
    decode = {}
    for context in contexts:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=context + steps + 2, do_sample=False)
        generator = og.Generator(model, params)
        begin = time.perf_counter()
        generator.append_tokens(np.random.default_rng(context).integers(3, 40000, size=context).astype(np.int32))
        prefill = context / (time.perf_counter() - begin)  # the last (largest) context's is reported
        generator.generate_next_token()  # warm-up
        times = []
        for _ in range(steps):
            begin = time.perf_counter()
            generator.generate_next_token()
            times.append(time.perf_counter() - begin)
        decode[context] = 1.0 / statistics.median(times)
    return {"load_s": load_seconds, "decode_tps": decode, "prefill_tps": prefill,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def whisper_runnx(folder: Path, repeat: int) -> dict:
    sys.path.insert(0, str(ROOT))
    from runnx.generate.whisper import Whisper

    model = Whisper(folder)

    def transcribe(clip: str) -> list[int]:
        return [t for s in model.transcribe(CACHE / "audio" / clip).segments for t in s.tokens]

    return _timed_clips(transcribe, repeat)


def whisper_genai(folder: Path, threads: int, repeat: int) -> dict:
    import onnxruntime_genai as og

    config = og.Config(str(folder))
    options = {"session_options": {"intra_op_num_threads": threads}}
    config.overlay(json.dumps({"model": {"encoder": options, "decoder": options}}))
    model = og.Model(config)
    processor = model.create_multimodal_processor()

    def transcribe(clip: str) -> list[int]:
        inputs = processor(["<|startoftranscript|><|notimestamps|>"], audios=og.Audios.open(str(CACHE / "audio" / clip)))
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=448, batch_size=1)
        generator = og.Generator(model, params)
        generator.set_inputs(inputs)
        while not generator.is_done():
            generator.generate_next_token()
        return [int(t) for t in generator.get_sequence(0)][2:]  # after the prompt

    return _timed_clips(transcribe, repeat)


def _timed_clips(transcribe, repeat: int) -> dict:
    """Seconds to transcribe CLIPS one after another: the median of `repeat` passes after one."""
    tokens = {clip: transcribe(clip) for clip in CLIPS}
    passes = []
    for _ in range(repeat):
        begin = time.perf_counter()
        for clip in CLIPS:
            transcribe(clip)
        passes.append(time.perf_counter() - begin)
    return {"seconds": statistics.median(passes), "tokens": tokens,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _run_worker(engine: str, folder: Path, threads: int, contexts: str, steps: int, repeat: int = 0) -> dict | None:
    python = str(GENAI_PYTHON) if engine.startswith("onnxruntime-genai") else sys.executable
    environment = dict(os.environ, **{v: str(threads) for v in THREAD_VARIABLES}, PYTHONPATH=str(ROOT))
    completed = subprocess.run([python, __file__, "--worker", engine, "--folder", str(folder), "--threads",
                                str(threads), "--contexts", contexts, "--steps", str(steps), "--repeat", str(repeat)],
                               capture_output=True, text=True, env=environment, timeout=3600)
    if completed.returncode:
        print(f"  failed: {engine} {folder.name} {threads}\n{completed.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(completed.stdout.strip().splitlines()[-1])


def _median(results: list) -> dict | None:
    """The processes' medians of every figure, and (under "best") their best speeds."""
    results = [r for r in results if r]
    if not results:
        return None
    return {"load_s": statistics.median(r["load_s"] for r in results),
            "decode_tps": {c: statistics.median(r["decode_tps"][c] for r in results) for c in results[0]["decode_tps"]},
            "prefill_tps": statistics.median(r["prefill_tps"] for r in results),
            "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in results),
            "huge_mb": statistics.median(r.get("huge_mb", 0) for r in results),
            "best": {"decode_tps": {c: max(r["decode_tps"][c] for r in results) for c in results[0]["decode_tps"]},
                     "prefill_tps": max(r["prefill_tps"] for r in results)}}


def _table(results: dict, contexts: list[int]) -> str:
    header = ["folder", "threads"] + [f"runnx / genai tok/s @{c}" for c in contexts] + \
             [f"ratio @{c}" for c in contexts] + [f"prefill tok/s ({contexts[-1]}) runnx / genai", "ratio",
                                                  "peak RSS MiB runnx / genai", "runnx's huge pages MiB"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (folder, threads) in sorted({(f, t) for _, f, t in results}):
        mine, theirs = results.get(("runnx", folder, threads)), results.get(("onnxruntime-genai", folder, threads))
        if not (mine and theirs):
            lines.append(f"| {folder} | {threads} | " + " | ".join(["failed"] * (len(header) - 2)) + " |")
            continue
        speeds = [f"{mine['decode_tps'][str(c)]:.1f} / {theirs['decode_tps'][str(c)]:.1f}" for c in contexts]
        best_mine, best_theirs = mine["best"], theirs["best"]
        ratios = [f"{mine['decode_tps'][str(c)] / theirs['decode_tps'][str(c)]:.2f}x "
                  f"({best_mine['decode_tps'][str(c)] / best_theirs['decode_tps'][str(c)]:.2f}x)" for c in contexts]
        prefill = (f"{mine['prefill_tps']:.0f} / {theirs['prefill_tps']:.0f} | "
                   f"{mine['prefill_tps'] / theirs['prefill_tps']:.2f}x "
                   f"({best_mine['prefill_tps'] / best_theirs['prefill_tps']:.2f}x)")
        lines.append(f"| {folder} | {threads} | " + " | ".join(speeds + ratios) + f" | {prefill}"
                     + f" | {mine['peak_rss_mb']:.0f} / {theirs['peak_rss_mb']:.0f} | {mine['huge_mb']:.0f} |")
    return "\n".join(lines)


def _whisper_line(runs: dict, thread_counts: list[int]) -> str:
    """One line a thread count: runnx / onnxruntime-genai seconds, the ratio, peak RSS; then whether
    every process of both gave the same ids."""
    parts, same = [], True
    for threads in thread_counts:
        mine = [r for r in runs.get(("runnx-whisper", threads), []) if r]
        theirs = [r for r in runs.get(("onnxruntime-genai-whisper", threads), []) if r]
        if not (mine and theirs):
            parts.append(f"{threads} thread(s) failed")
            continue
        ours, genai = (statistics.median(r["seconds"] for r in rs) for rs in (mine, theirs))
        rss = " / ".join(f"{statistics.median(r['peak_rss_mb'] for r in rs):.0f}" for rs in (mine, theirs))
        same = same and all(r["tokens"] == theirs[0]["tokens"] for r in mine + theirs)
        parts.append(f"{threads} thread(s) {ours:.2f} / {genai:.2f} s ({genai / ours:.2f}x; peak RSS {rss} MiB)")
    return "; ".join(parts) + f"; same ids: {same}."


def main(args) -> None:
    contexts = [int(c) for c in args.contexts.split(",")]
    folders = [MODELS / name for name in args.folders.split(",") if name]
    missing = [str(f) for f in folders if not (f / "genai_config.json").exists()]
    if missing or not GENAI_PYTHON.exists():
        sys.exit(f"missing: {', '.join(missing) or GENAI_PYTHON} (run `make models`)")
    runs = {}
    for round_index in range(args.rounds):
        for folder in folders:
            for threads in (int(t) for t in args.threads.split(",")):
                for engine in ("runnx", "onnxruntime-genai") if round_index % 2 == 0 else ("onnxruntime-genai", "runnx"):
                    result = _run_worker(engine, folder, threads, args.contexts, args.steps)
                    print(f"{engine}, {folder.name}, {threads} thread(s), round {round_index + 1}: {result}", flush=True)
                    runs.setdefault((engine, folder.name, threads), []).append(result)
    thread_counts = [int(t) for t in args.threads.split(",")]
    whisper_runs = {}
    if not args.no_whisper and (WHISPER / "genai_config.json").exists():
        for round_index in range(args.rounds):
            for threads in thread_counts:
                engines = ("runnx-whisper", "onnxruntime-genai-whisper")
                for engine in engines if round_index % 2 == 0 else engines[::-1]:
                    result = _run_worker(engine, WHISPER, threads, args.contexts, args.steps, args.repeat)
                    print(f"{engine}, {threads} thread(s), round {round_index + 1}: "
                          f"{result and round(result['seconds'], 3)} s", flush=True)
                    whisper_runs.setdefault((engine, threads), []).append(result)
    results = {key: _median(values) for key, values in runs.items()}
    table = _table(results, contexts) if results else ""
    whisper = ""
    if whisper_runs:
        whisper = f"""
Whisper tiny.en (whisper-tiny.en-genai, `-p fp32`), seconds to transcribe {", ".join(CLIPS)} in turn (median of
{args.repeat} passes after a warm-up, of {args.rounds} processes each), runnx / genai: {_whisper_line(whisper_runs, thread_counts)}
"""
        print(whisper)
    print(table)
    if args.no_write:
        return
    command = (f".venv/bin/python scripts/bench_genai.py --folders {args.folders} --threads {args.threads} "
               f"--contexts {args.contexts} --steps {args.steps} --rounds {args.rounds} --repeat {args.repeat}")
    update_section("genai-folders", f"""## onnxruntime-genai's folders, each engine's own loop (`scripts/bench_genai.py`)

SmolLM2-135M and its weights as Qwen2 and Phi-3 as onnxruntime-genai's model builder writes them (`-p fp32`; `-p int4
-e cpu`: MatMulNBits block 32 with zero points, accuracy_level 1; GroupQueryAttention over a shared past/present buffer).
runnx: `DecoderStep.from_folder` and `wait_prepared` (4-bit tiles made, as genai's load prepacks); genai: its Generator.
Decode tokens/s: the median step of {args.steps}, the median of {args.rounds} processes per engine, alternating (ratios: of
the medians, then in brackets of each engine's best process); prefill: a prompt of
the largest context. runnx's huge pages: its process's after the load (the median), the part of its weights that got
them (genai keeps its own in 4 KiB pages). runnx {git_revision()}; {machine()}. Command: `{command}`.

{table}
{whisper}""")


def _parse():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folders", default=",".join(FOLDERS), help="folders under models/")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--contexts", default="32,512,2000")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=3, help="timed passes over the speech clips per process")
    parser.add_argument("--no-whisper", action="store_true", help="leave out Whisper's genai folder")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    parser.add_argument("--worker", choices=["runnx", "onnxruntime-genai", "runnx-whisper",
                                             "onnxruntime-genai-whisper"], help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args()


if __name__ == "__main__":
    ARGS = _parse()
    if ARGS.worker == "runnx-whisper":
        print(json.dumps(whisper_runnx(ARGS.folder, ARGS.repeat)))
    elif ARGS.worker == "onnxruntime-genai-whisper":
        print(json.dumps(whisper_genai(ARGS.folder, int(ARGS.threads), ARGS.repeat)))
    elif ARGS.worker == "runnx":
        print(json.dumps(worker_runnx(ARGS.folder, [int(c) for c in ARGS.contexts.split(",")], ARGS.steps)))
    elif ARGS.worker:
        print(json.dumps(worker_genai(ARGS.folder, int(ARGS.threads), [int(c) for c in ARGS.contexts.split(",")],
                                      ARGS.steps)))
    else:
        main(ARGS)
