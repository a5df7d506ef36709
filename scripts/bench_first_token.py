"""Time to first token in a fresh process: runnx, onnxruntime-genai and onnxruntime side by side.

    .venv/bin/python scripts/bench_first_token.py [--threads 1,2] [--processes 5] [--prompt-tokens 32]
                                                  [--weights fp32,int4] [--pause 0] [--tree PATH] [--write] [--profile]

Each engine runs greedily from the same prompt ids in processes of its own (import, load, then the
clock; a load is the model's and its tokenizer's, as a generation needs both): the first token of
the process's first generation (prefill of the prompt and the choice of one token; compiled code
already cached on disk, as after any earlier run), then the same prompt's
first token again in that process (steady). The figures are medians over `--processes` processes
per engine and thread count, the engines taking turns. runnx: `Generator.from_folder` on Optimum's
SmolLM2-135M export; onnxruntime-genai: its own generator on its fp32 build of the same weights (its
venv, `make models` target smollm2-genai); onnxruntime: one session run on Optimum's model.onnx.
--weights int4: runnx and onnxruntime-genai both on onnxruntime-genai's int4 folder (MatMulNBits).
--pause S: each process waits S seconds between its load and its first token, as a chat's first prompt
comes some seconds after the load (runnx settles its weights into huge pages in such a pause:
`interp/model_file.py`'s `settle`); its table goes to a section of its own.
--profile prints a cProfile of runnx's first token (one process) instead; --tree runs another
checkout's runnx (its numba cache warmed by a run of its own first). --write puts the table into
docs/benchmarks.md.
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

CACHE = Path(os.environ.get("RUNNX_CACHE") or Path.home() / ".cache" / "runnx").expanduser()
SMOLLM2 = CACHE / "models" / "smollm2-135m"
GENAI_PYTHON = CACHE / "genai-venv" / "bin" / "python"
GENAI_MODEL = CACHE / "models" / "smollm2-135m-genai-fp32"
GENAI_INT4 = CACHE / "models" / "smollm2-135m-genai-int4"
MODEL_FOLDERS = {"fp32": SMOLLM2, "int4": GENAI_INT4}
GENAI_FOLDERS = {"fp32": GENAI_MODEL, "int4": GENAI_INT4}
ROOT = Path(__file__).resolve().parents[1]
THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")
TEXT = ("Once upon a time, in a small village at the edge of a great forest, there lived an old woodcutter "
        "and his three children, who loved to explore the hills and the rivers beyond the old stone bridge.")
ENGINES = ("runnx", "onnxruntime-genai", "onnxruntime")


# -- workers: one engine, one process; each prints one JSON line ---------------------------------------
def worker_runnx(ids: list[int], threads: int, profile: bool, weights: str) -> dict:
    started = time.perf_counter()
    import runnx  # noqa: F401
    from runnx.generate.generator import Generator
    imported = time.perf_counter()
    generator = Generator.from_folder(MODEL_FOLDERS[weights])
    loaded = time.perf_counter()
    loads = _count_numba_loads()
    first_loads = []

    def first_token():
        begin = time.perf_counter()
        generator.start(max_new_tokens=1, stop_token_ids=())
        generator.append_tokens(ids)
        token = int(generator.generate_next_token()[0])
        seconds = time.perf_counter() - begin
        first_loads.append(list(loads))
        return seconds, token

    if profile:
        import cProfile
        import pstats
        profiler = cProfile.Profile()
        profiler.enable()
        first_token()
        profiler.disable()
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("cumulative").print_stats(60)
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(40)
    figures = _figures(started, imported, loaded, first_token)
    return {**figures, "numba_loads": first_loads[0][0], "numba_load_s": first_loads[0][1]}


def _count_numba_loads() -> list:
    """[count, seconds] so far of the compiled functions numba loads from its cache (or compiles) from
    now on, in any thread: a part of a first token that the second does not pay."""
    from numba.core.ccallback import CFunc
    from numba.core.dispatcher import Dispatcher
    tally = [0, 0.0]

    def counted(method):
        def wrapper(*args, **kwargs):
            begin = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                tally[0] += 1
                tally[1] += time.perf_counter() - begin
        return wrapper

    Dispatcher.compile, CFunc.compile = counted(Dispatcher.compile), counted(CFunc.compile)
    return tally


def worker_genai(ids: list[int], threads: int, weights: str) -> dict:
    started = time.perf_counter()
    import numpy as np
    import onnxruntime_genai as og
    imported = time.perf_counter()
    config = og.Config(str(GENAI_FOLDERS[weights]))
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
    model = og.Model(config)
    og.Tokenizer(model)  # (a generation needs it: runnx's Generator loads its own)
    loaded = time.perf_counter()
    prompt = np.array(ids, np.int32)

    def first_token():
        begin = time.perf_counter()
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(ids) + 1, do_sample=False)
        generator = og.Generator(model, params)
        generator.append_tokens(prompt)
        generator.generate_next_token()
        token = int(generator.get_next_tokens()[0])
        return time.perf_counter() - begin, token

    return _figures(started, imported, loaded, first_token)


def worker_onnxruntime(ids: list[int], threads: int) -> dict:
    started = time.perf_counter()
    import numpy as np
    import onnxruntime
    from tokenizers import Tokenizer
    imported = time.perf_counter()
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    session = onnxruntime.InferenceSession(str(SMOLLM2 / "model.onnx"), options, providers=["CPUExecutionProvider"])
    Tokenizer.from_file(str(SMOLLM2 / "tokenizer.json"))  # (the tokenizer a generation needs)
    loaded = time.perf_counter()
    past = [i for i in session.get_inputs() if i.name.startswith("past_key_values.")]

    def first_token():
        begin = time.perf_counter()
        feeds = {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, len(ids)), np.int64),
                 "position_ids": np.arange(len(ids), dtype=np.int64)[None],
                 **{i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32) for i in past}}
        logits = session.run(["logits"], feeds)[0]
        token = int(logits[0, -1].argmax())
        return time.perf_counter() - begin, token

    return _figures(started, imported, loaded, first_token)


def _figures(started, imported, loaded, first_token) -> dict:
    time.sleep(PAUSE)  # (`--pause`: a chat's first prompt comes a while after the load)
    first, token = first_token()
    steady, again = first_token()
    return {"import_s": imported - started, "load_s": loaded - imported, "first_s": first, "steady_s": steady,
            "token": token, "same_token_again": token == again}


# -- orchestration -----------------------------------------------------------------------------------
def prompt_ids(count: int) -> list[int]:
    sys.path.insert(0, str(ROOT))
    from runnx.generate.tokenizer import Tokenizer
    ids = Tokenizer.from_folder(SMOLLM2).encode(TEXT)[:count]
    if len(ids) != count:
        sys.exit(f"the benchmark text has only {len(ids)} tokens")
    return ids


def run_worker(engine: str, ids: list[int], threads: int, profile: bool = False, tree: Path = ROOT,
               weights: str = "fp32") -> dict | None:
    python = str(GENAI_PYTHON) if engine == "onnxruntime-genai" else sys.executable
    environment = dict(os.environ, **{v: str(threads) for v in THREAD_VARIABLES}, PYTHONPATH=str(tree.resolve()))
    command = [python, __file__, "--worker", engine, "--ids", json.dumps(ids), "--threads", str(threads),
               "--weights", weights, "--pause", str(PAUSE)]
    completed = subprocess.run(command + (["--profile"] if profile else []), capture_output=True, text=True,
                               env=environment, timeout=1800)
    if profile:
        print(completed.stderr)
    if completed.returncode:
        print(f"  {engine} failed:\n{completed.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(completed.stdout.strip().splitlines()[-1])


def table(results: dict, threads_list: list[int], weights_list: list[str]) -> str:
    header = ["threads", "weights", "engine", "first token ms", "steady ms", "numba loads in the first", "load s", "import s",
              "token"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for threads in threads_list:
        for weights, engine in ((w, e) for w in weights_list for e in ENGINES):
            runs = [r for r in results.get((engine, threads, weights), []) if r]
            if not runs:
                continue
            median = {k: statistics.median(r[k] for r in runs) for k in ("first_s", "steady_s", "load_s", "import_s")}
            firsts = ", ".join(f"{r['first_s'] * 1e3:.0f}" for r in runs)
            tokens = sorted({r["token"] for r in runs})
            loads = (f"{statistics.median(r['numba_loads'] for r in runs):.0f}: "
                     f"{statistics.median(r['numba_load_s'] for r in runs) * 1e3:.0f} ms") if "numba_loads" in runs[0] else "-"
            lines.append(f"| {threads} | {weights} | {engine} | {median['first_s'] * 1e3:.0f} ({firsts}) | "
                         f"{median['steady_s'] * 1e3:.0f} | {loads} | {median['load_s']:.2f} | {median['import_s']:.2f} | "
                         f"{', '.join(map(str, tokens))} |")
    return "\n".join(lines)


def main(args) -> int:
    threads_list = [int(t) for t in args.threads.split(",")]
    weights_list = [w for w in args.weights.split(",") if (MODEL_FOLDERS[w] / "model.onnx").exists()]
    ids = prompt_ids(args.prompt_tokens)
    if args.profile:
        run_worker("runnx", ids, threads_list[0], profile=True, tree=args.tree, weights=weights_list[0])
        return 0
    runs = [(e, w) for w in weights_list for e in ENGINES if e in args.engines.split(",")
            and (e != "onnxruntime-genai" or (GENAI_PYTHON.exists() and (GENAI_FOLDERS[w] / "genai_config.json").exists()))
            and (e != "onnxruntime" or w == "fp32")]  # (onnxruntime: Optimum's fp32 model.onnx)
    results = {}
    for round_index in range(args.processes):
        for threads in threads_list:
            for engine, weights in runs if round_index % 2 == 0 else runs[::-1]:  # turns: each sees the slow spells
                result = run_worker(engine, ids, threads, tree=args.tree, weights=weights)
                results.setdefault((engine, threads, weights), []).append(result)
                print(f"{engine} {weights}, {threads} thread(s): {result}", file=sys.stderr, flush=True)
    text = table(results, threads_list, weights_list)
    print(text)
    if args.write:
        sys.path.insert(0, str(ROOT / "scripts"))
        from report import git_revision, machine, update_section
        paused = f" --pause {args.pause:g}" if args.pause else ""
        command = (f".venv/bin/python scripts/bench_first_token.py --threads {args.threads} "
                   f"--processes {args.processes} --prompt-tokens {args.prompt_tokens} --weights {args.weights}"
                   f"{paused} --write")
        title = f", {args.pause:g} s after the load" if args.pause else ""
        pause = f" a pause of {args.pause:g} s," if args.pause else ""
        update_section("first-token" + ("-after-pause" if args.pause else ""),
                       f"""## Time to first token in a fresh process{title} (`scripts/bench_first_token.py`)

A {args.prompt_tokens}-token prompt, SmolLM2-135M: fp32 (runnx on Optimum's export, genai on its fp32 build, onnxruntime on model.onnx)
and int4 (runnx and genai on genai's int4 folder). Each engine in its own processes: import, load (model and tokenizer),{pause}
the first token (numba's cache warm), then again (steady); medians of {args.processes} processes, each process's first in
brackets; runnx's and onnxruntime's loads copy the weights into fresh memory (slow on this guest), genai maps its file.
runnx {git_revision()}; {machine()}; load average {os.getloadavg()[0]:.1f} at the end.
Command: `{command}`.

{text}
""")
    return 0


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--processes", type=int, default=5, help="fresh processes per engine and thread count")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"among {', '.join(ENGINES)}")
    parser.add_argument("--weights", default="fp32,int4", help="fp32 and/or int4 (onnxruntime-genai's int4 folder)")
    parser.add_argument("--pause", type=float, default=0.0, help="seconds between each process's load and its first token")
    parser.add_argument("--profile", action="store_true", help="cProfile of runnx's first token (one process)")
    parser.add_argument("--tree", type=Path, default=ROOT, help="the runnx checkout to run (default: this one)")
    parser.add_argument("--write", action="store_true", help="write the table into docs/benchmarks.md")
    parser.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--ids", help=argparse.SUPPRESS)
    return parser.parse_args()


if __name__ == "__main__":
    ARGS = parse_args()
    PAUSE = ARGS.pause
    if ARGS.worker:
        IDS, THREADS = json.loads(ARGS.ids), int(ARGS.threads)
        if ARGS.worker == "runnx":
            print(json.dumps(worker_runnx(IDS, THREADS, ARGS.profile, ARGS.weights)))
        elif ARGS.worker == "onnxruntime-genai":
            print(json.dumps(worker_genai(IDS, THREADS, ARGS.weights)))
        else:
            print(json.dumps(worker_onnxruntime(IDS, THREADS)))
    else:
        sys.exit(main(ARGS))
