"""Decode speed over a chat's turns: the weights that a load left in 4 KiB pages settle into huge pages in
the pauses between turns (`runnx/interp/model_file.py`'s `settle`, while the models are quiet).

    .venv/bin/python scripts/bench_turns.py [--folder NAME] [--threads 2] [--turns 3] [--tokens 64]
        [--pause 4] [--processes 3] [--gap 5] [--no-write]

Each process loads the folder (`DecoderStep.from_folder`, ${RUNNX_CACHE:-~/.cache/runnx}/models/NAME), runs a
32-token prompt, then `--turns` turns of `--tokens` greedy steps with `--pause` seconds between them; a turn's
figure is its median step, and the weights' share in huge pages (AnonHugePages of the process) after it.
Processes alternate between runnx as it is ("settling") and runnx with `settle` doing nothing ("4 KiB
kept": the weights stay as the load left them, as before settling waited for quiet moments); the table gives
the median over each's processes. A load takes huge pages at once while they come fast: right after another
process freed memory, which a virtual machine reporting free memory to its host (as these guests do) hands
back a few seconds later; each process waits `--gap` seconds first, so that it meets memory as a first run
after a while does (--gap 0: right after the last, often all of it in huge pages from the start, both kinds
then alike). Writes its section of docs/benchmarks.md unless --no-write.
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

from report import THREAD_VARIABLES, git_revision, huge_pages_mb, machine, update_section  # scripts/: this script's folder

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("RUNNX_CACHE") or Path.home() / ".cache" / "runnx").expanduser()
KINDS = ("settling", "4 KiB kept")


def worker(folder: Path, kind: str, turns: int, tokens: int, pause: float) -> dict:
    sys.path.insert(0, str(ROOT))
    import numpy as np

    from runnx.generate.decoder import DecoderStep
    from runnx.interp import folding, model_file

    if kind == KINDS[1]:
        model_file.settle = folding.settle = lambda mapped: None
    decoder = DecoderStep.from_folder(folder, capacity=32 + turns * tokens + 8)
    decoder.wait_prepared()
    loaded = huge_pages_mb()
    prompt = np.random.default_rng(0).integers(3, 40000, size=(1, 32)).astype(np.int64)
    token = decoder.step(prompt)[:, -1:].argmax(-1).astype(np.int64)
    steps, huge = [], []
    for turn in range(turns):
        if turn:
            time.sleep(pause)
        times = []
        for _ in range(tokens):
            begin = time.perf_counter()
            token = decoder.step(token)[:, -1:].argmax(-1).astype(np.int64)
            times.append(time.perf_counter() - begin)
        steps.append(statistics.median(times) * 1e3)
        huge.append(huge_pages_mb())
    return {"loaded_huge_mb": loaded, "step_ms": steps, "huge_mb": huge}


def _run(folder: Path, kind: str, args) -> dict | None:
    environment = dict(os.environ, **{v: str(args.threads) for v in THREAD_VARIABLES}, PYTHONPATH=str(ROOT))
    completed = subprocess.run([sys.executable, __file__, "--worker", kind, "--folder", args.folder, "--turns",
                                str(args.turns), "--tokens", str(args.tokens), "--pause", str(args.pause)],
                               capture_output=True, text=True, env=environment, timeout=1800, check=False)
    if completed.returncode:
        print(f"  failed: {kind}\n{completed.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(completed.stdout.strip().splitlines()[-1])


def main(args) -> None:
    folder = CACHE / "models" / args.folder
    if not folder.exists():
        sys.exit(f"missing: {folder} (run `make models`)")
    runs = {kind: [] for kind in KINDS}
    for index in range(args.processes):
        for kind in KINDS if index % 2 == 0 else KINDS[::-1]:
            time.sleep(args.gap)
            result = _run(folder, kind, args)
            print(f"{kind}, process {index + 1}: {result}", flush=True)
            if result:
                runs[kind].append(result)
    header = (["runnx", "huge pages after the load MB"] + [f"turn {t + 1} ms a step (huge MB)" for t in range(args.turns)]
              + [f"turn {args.turns} / turn 1"])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for kind, results in runs.items():
        if not results:
            lines.append(f"| {kind} | " + " | ".join(["failed"] * (len(header) - 1)) + " |")
            continue
        steps = [statistics.median(r["step_ms"][t] for r in results) for t in range(args.turns)]
        huge = [statistics.median(r["huge_mb"][t] for r in results) for t in range(args.turns)]
        loaded = statistics.median(r["loaded_huge_mb"] for r in results)
        cells = [f"{s:.1f} ({h:.0f})" for s, h in zip(steps, huge)]
        lines.append(f"| {kind} | {loaded:.0f} | " + " | ".join(cells) + f" | {steps[-1] / steps[0]:.2f} |")
    table = "\n".join(lines)
    print(table)
    if args.no_write:
        return
    command = (f".venv/bin/python scripts/bench_turns.py --folder {args.folder} --threads {args.threads} "
               f"--turns {args.turns} --tokens {args.tokens} --pause {args.pause} --processes {args.processes} --gap {args.gap}")
    update_section("turns", f"""## Decode over a chat's turns (`scripts/bench_turns.py`)

{args.folder}, {args.threads} thread(s): a 32-token prompt, then {args.turns} turns of {args.tokens} greedy steps,
{args.pause} s apart; each turn's median step and the process's huge pages after it, medians of {args.processes}
processes per kind, alternating, each started {args.gap} s after the last ended. "4 KiB kept": `settle` off, the
weights as the load left them. runnx {git_revision()};
{machine()}. Command: `{command}`.

{table}
""")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", default="smollm2-135m-genai-fp32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--pause", type=float, default=4.0)
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--gap", type=float, default=5.0, help="seconds before each process (memory handed back)")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--worker", choices=KINDS, help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.worker:
        print(json.dumps(worker(CACHE / "models" / arguments.folder, arguments.worker, arguments.turns,
                                arguments.tokens, arguments.pause)))
    else:
        main(arguments)
