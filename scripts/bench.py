"""The benchmark suite: runnx against onnxruntime (and onnx's ReferenceEvaluator) on the same
models, same machine, same thread counts, one run. Writes docs/benchmarks.md with a plot.

    .venv/bin/python scripts/bench.py [--threads 1,2] [--contexts 32,512,2000] [--rounds 3] [--no-write]

Each (runner, thread count) runs in its own process, so load time and peak resident memory are
its own, and BLAS/numba/onnxruntime thread counts are set before anything starts its pools.
Sections: SmolLM2-135M decode tokens/s at each context (random past KV of that length, median of
the steps) and prefill tokens/s for a 512-token prompt, model load time, peak RSS; Whisper
tiny.en encoder seconds per 30 s window and decoder ms/token (scripts/bench_whisper.py);
per-node dispatch on 1000-node chains of small elementwise ops (scripts/bench_dispatch.py);
SmolLM2 decode with runnx and onnxruntime in one process, in alternating blocks of steps
(scripts/bench_pairs.py); runnx and onnxruntime-genai on onnxruntime-genai's fp32 and int4 folders,
each in its own loop (scripts/bench_genai.py); runnx beside this machine's memory and compute
ceilings (scripts/bench_roofline.py).
Models come from `make models` (${RUNNX_CACHE:-~/.cache/runnx}/models).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from report import THREAD_VARIABLES, git_revision, machine, update_section  # scripts/: this script's folder

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("RUNNX_CACHE") or Path.home() / ".cache" / "runnx").expanduser()
SMOLLM2 = CACHE / "models" / "smollm2-135m" / "model.onnx"
# onnxruntime-genai (its own venv: its model builder needs transformers 5) and its fp32 build of
# SmolLM2, both made by `make models` (scripts/build_models.py, target smollm2-genai)
GENAI_PYTHON = CACHE / "genai-venv" / "bin" / "python"
GENAI_MODEL = CACHE / "models" / "smollm2-135m-genai-fp32"
PREFILL_LENGTH = 512
DECODE_STEPS = 8
WHISPER_PAIRS = 6  # turns per engine in bench_whisper.py's same process (a transcription and a decode each)


# -- workers: one runner, one thread count, one process ---------------------------------------------
def _decoder_feeds(ids, past_length, past):
    return {"input_ids": ids, "attention_mask": np.ones((1, past_length + ids.shape[1]), np.int64),
            "position_ids": np.arange(past_length, past_length + ids.shape[1], dtype=np.int64)[None], **past}


class _Runnx:
    def __init__(self, path, threads):
        self.model = runnx.load(path)  # BLAS/numba threads come from the environment set by main()
        self.kv = [(i.name, i.shape) for i in self.model.inputs if i.name.startswith("past_key_values.")]

    def step(self, ids, past_length, past, capacity):
        """One decoder run; past is a dict of arrays, handed over with room for `capacity` positions."""
        feeds = {name: runnx.with_capacity(value, 2, capacity) if not isinstance(value, runnx.Owned) else value
                 for name, value in past.items()}
        result = self.model.run(_decoder_feeds(ids, past_length, feeds))
        return {name: runnx.Owned(result[name.replace("past_key_values", "present")]) for name, _ in self.kv}


class _OnnxRuntime:
    def __init__(self, path, threads):
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        self.session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.kv = [(i.name, i.shape) for i in self.session.get_inputs() if i.name.startswith("past_key_values.")]
        self.names = [o.name for o in self.session.get_outputs()]

    def step(self, ids, past_length, past, capacity):
        result = dict(zip(self.names, self.session.run(None, _decoder_feeds(ids, past_length, past))))
        return {name: result[name.replace("past_key_values", "present")] for name, _ in self.kv}


class _Reference:
    def __init__(self, path, threads):
        from onnx.reference import ReferenceEvaluator
        self.evaluator = ReferenceEvaluator(str(path))
        self.kv = [(i.name, [d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim])
                   for i in self.evaluator.proto_.graph.input if i.name.startswith("past_key_values.")]
        self.names = self.evaluator.output_names

    def step(self, ids, past_length, past, capacity):
        result = dict(zip(self.names, self.evaluator.run(None, _decoder_feeds(ids, past_length, past))))
        return {name: result[name.replace("past_key_values", "present")] for name, _ in self.kv}


RUNNERS = {"runnx": _Runnx, "onnxruntime": _OnnxRuntime, "reference": _Reference}


def _random_past(kv, length, rng):
    return {name: rng.standard_normal((1, shape[1], length, shape[3])).astype(np.float32) for name, shape in kv}


def worker_llm(runner: str, threads: int, contexts: list[int], steps: int, prefill: bool) -> dict:
    start = time.perf_counter()
    engine = RUNNERS[runner](SMOLLM2, threads)
    load_seconds = time.perf_counter() - start
    rng = np.random.default_rng(0)
    token = np.array([[42]], np.int64)
    decode = {}
    for context in contexts:
        past = _random_past(engine.kv, context, rng)
        past = engine.step(token, context, past, context + steps + 2)  # warm-up, and the cache in its own form
        times = []
        for step in range(steps):
            begin = time.perf_counter()
            past = engine.step(token, context + 1 + step, past, 0)
            times.append(time.perf_counter() - begin)
        decode[context] = 1.0 / statistics.median(times)
    prefill_tps = None
    if prefill:
        ids = rng.integers(3, 40000, size=(1, PREFILL_LENGTH), dtype=np.int64)
        empty = _random_past(engine.kv, 0, rng)
        engine.step(ids[:, :16], 0, empty, 64)  # warm-up
        begin = time.perf_counter()
        engine.step(ids, 0, _random_past(engine.kv, 0, rng), PREFILL_LENGTH + 64)
        prefill_tps = PREFILL_LENGTH / (time.perf_counter() - begin)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"load_s": load_seconds, "decode_tps": decode, "prefill_tps": prefill_tps, "peak_rss_mb": peak}


PAUSE_SECONDS = 0.02  # onnxruntime's pool spins for a few ms after a run, runnx's decode pool for 2.5


def alternating_blocks(engines: dict, context: int, blocks: int, steps: int) -> dict:
    """{runner: [tokens/s of each block]} for one context, the runners' turns alternating."""
    token = np.array([[42]], np.int64)
    states = {}
    for name, engine in engines.items():
        rng = np.random.default_rng(0)
        past = engine.step(token, context, _random_past(engine.kv, context, rng),
                           context + blocks * steps + 2)  # warm-up, the cache in its own form
        states[name] = (past, context + 1)
    speeds = {name: [] for name in engines}
    order = list(engines)
    for block in range(blocks):
        for name in order if block % 2 == 0 else order[::-1]:
            time.sleep(PAUSE_SECONDS)
            past, length = states[name]
            times = []
            for _ in range(steps):
                begin = time.perf_counter()
                past = engines[name].step(token, length, past, 0)
                times.append(time.perf_counter() - begin)
                length += 1
            states[name] = (past, length)
            speeds[name].append(1.0 / statistics.median(times))
    return speeds


class GenAI:
    """onnxruntime-genai's own loop on its own model (static KV buffer, GroupQueryAttention), in
    the engines' form: `past` is its generator, made by a call with a capacity (its max_length)
    from `past_length` random tokens (its prefill, then one token), advanced one token by each
    other call."""

    def __init__(self, path, threads):
        import onnxruntime_genai as og

        self.og = og
        config = og.Config(str(path))
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
        self.model = og.Model(config)
        self.kv = []  # no past arrays: the generator holds its cache

    def step(self, ids, past_length, past, capacity):
        if capacity:
            params = self.og.GeneratorParams(self.model)
            params.set_search_options(max_length=capacity, do_sample=False)
            past = self.og.Generator(self.model, params)
            tokens = np.random.default_rng(past_length).integers(3, 40000, size=past_length)
            past.append_tokens(tokens.astype(np.int32))
        past.generate_next_token()
        return past


def worker_genai(threads: int, contexts: list[int], steps: int) -> dict:
    start = time.perf_counter()
    engine = GenAI(GENAI_MODEL, threads)
    load_seconds = time.perf_counter() - start
    decode = {}
    for context in contexts:
        generator = engine.step(None, context, None, context + steps + 2)
        times = []
        for _ in range(steps):
            begin = time.perf_counter()
            engine.step(None, context, generator, 0)
            times.append(time.perf_counter() - begin)
        decode[context] = 1.0 / statistics.median(times)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"load_s": load_seconds, "decode_tps": decode, "prefill_tps": None, "peak_rss_mb": peak}


# -- orchestration ---------------------------------------------------------------------------------
def _run_worker(arguments: list[str], threads: int, python: str = sys.executable, timeout: float = 3600) -> dict | None:
    environment = dict(os.environ, **{v: str(threads) for v in THREAD_VARIABLES}, PYTHONPATH=str(ROOT))
    completed = subprocess.run([python, __file__, *arguments, "--threads", str(threads)],
                               capture_output=True, text=True, env=environment, timeout=timeout)
    if completed.returncode:
        print(f"  failed: {' '.join(arguments)}\n{completed.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(completed.stdout.strip().splitlines()[-1])


def _plot(results: dict, contexts: list[int]) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6.5, 4))
    for (runner, threads), result in sorted(results.items()):
        if result and runner != "reference":
            points = [(int(c), tps) for c, tps in result["decode_tps"].items()]
            axis.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                      linestyle="-" if runner == "runnx" else "--", label=f"{runner}, {threads} thread(s)")
    axis.set_xscale("log", base=2)
    axis.set_xticks(contexts, [str(c) for c in contexts])
    axis.set_xlabel("context length (tokens)")
    axis.set_ylabel("decode tokens/s")
    axis.set_title("SmolLM2-135M fp32 decode, greedy")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    image = ROOT / "docs" / "decode_tokens_per_second.png"
    figure.savefig(image, dpi=90)
    return image


def _llm_table(results: dict, contexts: list[int]) -> str:
    header = ["runner", "threads"] + [f"decode tok/s @{c}" for c in contexts] + \
             [f"prefill tok/s ({PREFILL_LENGTH})", "load s", "peak RSS MiB"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (runner, threads), result in sorted(results.items()):
        if not result:
            lines.append(f"| {runner} | {threads} | " + " | ".join(["failed"] * (len(header) - 2)) + " |")
            continue
        decode = [f"{result['decode_tps'][str(c)]:.1f}" if str(c) in result["decode_tps"] else "-" for c in contexts]
        prefill = f"{result['prefill_tps']:.0f}" if result["prefill_tps"] else "-"
        lines.append(f"| {runner} | {threads} | " + " | ".join(decode) +
                     f" | {prefill} | {result['load_s']:.2f} | {result['peak_rss_mb']:.0f} |")
    return "\n".join(lines)


def _ratios(results: dict, contexts: list[int]) -> str:
    lines = []
    for threads in sorted({t for _, t in results}):
        mine = results.get(("runnx", threads))
        for peer in ("onnxruntime", "onnxruntime-genai"):
            theirs = results.get((peer, threads))
            if not (mine and theirs):
                continue
            ratios = ", ".join(f"{c}: {mine['decode_tps'][str(c)] / theirs['decode_tps'][str(c)]:.2f}x"
                               for c in contexts if str(c) in mine["decode_tps"] and str(c) in theirs["decode_tps"])
            lines.append(f"- {threads} thread(s), runnx / {peer}: decode speed {ratios}; load time "
                         f"{mine['load_s'] / theirs['load_s']:.2f}x; peak memory "
                         f"{mine['peak_rss_mb'] / theirs['peak_rss_mb']:.2f}x")
    return "\n".join(lines)


def _median_result(results: list) -> dict | None:
    """Each figure's median over the rounds of one runner and thread count (None if every run failed)."""
    results = [r for r in results if r]
    if not results:
        return None

    def median(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None
    first = results[0]
    return {"load_s": median([r["load_s"] for r in results]),
            "decode_tps": {c: median([r["decode_tps"][c] for r in results]) for c in first["decode_tps"]},
            "prefill_tps": median([r["prefill_tps"] for r in results]),
            "peak_rss_mb": median([r["peak_rss_mb"] for r in results])}


def _script_output(script: str, arguments: list[str], threads: int | None) -> str:
    """Run one of the focused benchmark scripts with the thread count set (None: a script setting
    each of its workers' own); its printed table."""
    counts = {v: str(threads) for v in THREAD_VARIABLES} if threads is not None else {}
    environment = dict(os.environ, **counts, PYTHONPATH=str(ROOT))
    completed = subprocess.run([sys.executable, str(ROOT / "scripts" / script), *arguments], capture_output=True,
                               text=True, env=environment, timeout=3600)
    output = completed.stdout.strip() if completed.returncode == 0 else f"failed:\n{completed.stderr[-1500:]}"
    print(output, flush=True)
    return output


def _dispatch_table(rounds: list[dict]) -> str:
    """Each runner's median over the rounds' runs of bench_dispatch.py, every round's figure, and
    runnx's ratio to onnxruntime per chain (the median of the rounds' ratios: a round's runners
    share its machine load)."""
    lines = [f"1000-node chains of small elementwise ops, us/node of CPU time: median of {len(rounds)} rounds (each "
             "the median of 30 runs; one process a round, minutes apart)"]
    for name in rounds[0]:
        figures = [r[name] for r in rounds if name in r]
        lines.append(f"  {name:<26}{statistics.median(figures):8.2f} us/node   (rounds: "
                     f"{', '.join(f'{f:.2f}' for f in figures)})")
    ratios = []
    for chain, runnx, onnxruntime, ways in (("tiny", "runnx", "onnxruntime (1 thread)", ("compiled",)),
                                            ("bcast", "bcast: runnx", "bcast: onnxruntime", ("compiled", "interpreted")),
                                            ("comp", "comp: runnx", "comp: onnxruntime", ("compiled", "interpreted"))):
        figures = []
        for way in ways:
            name = runnx if chain == "tiny" else f"{runnx} {way}"
            each = [r[name] / r[onnxruntime] for r in rounds if name in r and r.get(onnxruntime)]
            if each:
                figures.append(f"{statistics.median(each):.1f}x {way}")
        if figures:
            ratios.append(f"{chain} {', '.join(figures)}")
    if ratios:
        lines.append(f"runnx / onnxruntime, median of the rounds' ratios: {'; '.join(ratios)}")
    return "\n".join(lines)


def main(args) -> None:
    contexts = [int(c) for c in args.contexts.split(",")]
    thread_counts = [int(t) for t in args.threads.split(",")]
    if not SMOLLM2.exists():
        sys.exit(f"{SMOLLM2} is missing: run `make models` first")
    if not args.no_write and importlib.util.find_spec("matplotlib") is None:  # before minutes of runs, not after
        sys.exit("the plot needs matplotlib: pip install -e '.[bench]' (or run with --no-write)")
    genai = GENAI_PYTHON.exists() and (GENAI_MODEL / "genai_config.json").exists()
    if not genai:
        print(f"onnxruntime-genai skipped: {GENAI_PYTHON} or {GENAI_MODEL} missing (see the top of this script)")
    runs, dispatch_rounds = {}, []
    for round_index in range(args.rounds):  # the runners alternate, so each sees the machine's slow spells
        # dispatch once a round, minutes apart: one run of a second lands wholly in a slow spell or not
        dispatch_rounds.append(json.loads(_script_output(
            "bench_dispatch.py", ["--json"] + (["--no-reference"] if round_index else []), 1).splitlines()[-1]))
        for threads in thread_counts:
            for runner in ("runnx", "onnxruntime") + (("onnxruntime-genai",) if genai else ()):
                print(f"SmolLM2 decode: {runner}, {threads} thread(s), round {round_index + 1}", flush=True)
                if runner == "onnxruntime-genai":
                    result = _run_worker(["--worker", "genai", "--contexts", args.contexts, "--steps",
                                          str(args.steps)], threads, python=str(GENAI_PYTHON))
                else:
                    result = _run_worker(["--worker", runner, "--contexts", args.contexts, "--steps",
                                          str(args.steps), "--prefill"], threads)
                runs.setdefault((runner, threads), []).append(result)
                print(f"  {result}", flush=True)
    results = {key: _median_result(values) for key, values in runs.items()}
    if args.reference:
        print("SmolLM2 decode: onnx ReferenceEvaluator, 1 thread (context 32 only)", flush=True)
        results[("reference", 1)] = _run_worker(["--worker", "reference", "--contexts", "32", "--steps", "2"], 1)
        print(f"  {results[('reference', 1)]}", flush=True)
    table, ratios = _llm_table(results, contexts), _ratios(results, contexts)
    print(table + "\n" + ratios)
    whisper = {t: _script_output("bench_whisper.py", ["--threads", str(t), "--pairs", str(WHISPER_PAIRS)], t)
               for t in thread_counts}
    dispatch = _dispatch_table(dispatch_rounds)
    print(dispatch)
    for threads in thread_counts:  # writes its own section (unless --no-write)
        _script_output("bench_pairs.py", ["--threads", str(threads), "--contexts", args.contexts]
                       + (["--no-write"] if args.no_write else []), threads)
    _script_output("bench_roofline.py", ["--threads", args.threads, "--rounds", str(args.rounds)]
                   + (["--no-write"] if args.no_write else []), None)  # (it sets each worker's threads)
    if genai:  # onnxruntime-genai's own folders (fp32, int4) in each engine's own loop; its own section
        _script_output("bench_genai.py", ["--threads", args.threads, "--contexts", args.contexts, "--rounds",
                                          str(args.rounds)] + (["--no-write"] if args.no_write else []), None)
    if args.no_write:
        return

    _plot(results, contexts)
    command = (f".venv/bin/python scripts/bench.py --threads {args.threads} --contexts {args.contexts} "
               f"--rounds {args.rounds}")
    update_section("suite-llm", f"""## SmolLM2-135M decode and prefill (`scripts/bench.py`)

runnx {git_revision()}; {machine()}; each runner in its own process with BLAS/numba/onnxruntime
threads set to the count shown. Decode: median of {args.steps} greedy steps after random past KV of
the context length (runnx gets it as `Owned` capacity buffers, onnxruntime as arrays); every figure
is the median of {args.rounds} processes, the runners alternating round by round.
Command: `{command}`.

{table}

{ratios}

![decode tokens/s vs context](decode_tokens_per_second.png)
""")
    whisper_blocks = "\n\n".join(f"```\n{text}\n```" for text in whisper.values())
    update_section("suite-whisper", f"""## Whisper tiny.en (`scripts/bench_whisper.py`, run by `scripts/bench.py`)

Encoder s/window, decoder ms/token (first window after warm-ups; steady: the same window again) and the real-time
factor of the 68.8 s `long.wav`, runnx vs onnxruntime behind the same pipeline code: medians of processes, then
{WHISPER_PAIRS} turns each in one process (`scripts/bench_whisper.py` says what a turn runs), the ratio the turns' median.
runnx {git_revision()}; {machine()}.
Command: `{command}`, which runs `.venv/bin/python scripts/bench_whisper.py --threads T --pairs {WHISPER_PAIRS}` for each T.

{whisper_blocks}
""")
    update_section("suite-dispatch", f"""## Per-node dispatch (`scripts/bench_dispatch.py`, run by `scripts/bench.py`)

Three 1000-node chains of small elementwise ops, nothing to fuse or cache (`tiny`: 4 floats; `bcast`: [1, 8, 64]
against broadcast constants and inputs; `comp`: both inputs computed; `scripts/bench_dispatch.py` says more).
Microseconds of CPU time per node: runnx's first run (planning included), compiling run, interpreted
(`compile_after=0`) and compiled runs; onnxruntime with 1 thread and its graph optimizations off. One process a round.
runnx {git_revision()}; {machine()}.
Command: `.venv/bin/python scripts/bench_dispatch.py --json` in {args.rounds} processes (`--no-reference`
after the first).

```
{dispatch}
```
""")


def _parse():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--contexts", default="32,512,2000")
    parser.add_argument("--steps", type=int, default=DECODE_STEPS)
    parser.add_argument("--rounds", type=int, default=3, help="processes per runner and thread count, alternating")
    parser.add_argument("--reference", action="store_true", help="also time onnx's ReferenceEvaluator (slow)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    parser.add_argument("--worker", choices=sorted(RUNNERS) + ["genai"], help=argparse.SUPPRESS)
    parser.add_argument("--prefill", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


if __name__ == "__main__":
    ARGS = _parse()
    if ARGS.worker == "genai":  # runs in the genai venv: neither runnx nor its dependencies there
        import numpy as np
        print(json.dumps(worker_genai(int(ARGS.threads), [int(c) for c in ARGS.contexts.split(",")], ARGS.steps)))
    elif ARGS.worker:
        import runnx

        import numpy as np
        import onnxruntime
        result = worker_llm(ARGS.worker, int(ARGS.threads), [int(c) for c in ARGS.contexts.split(",")],
                            ARGS.steps, ARGS.prefill)
        print(json.dumps(result))
    else:
        main(ARGS)
