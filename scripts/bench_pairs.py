"""SmolLM2-135M decode, runnx and onnxruntime (and onnxruntime-genai, when installed) in one
process, timed in alternating blocks of steps: the ratios without the minutes-long swings of this
kind of machine (memory bandwidth shared with other guests) that separate processes see. Writes a
section of docs/benchmarks.md.

    .venv/bin/python scripts/bench_pairs.py [--threads N] [--contexts 32,512,2000] [--blocks 8]

Per context, each runner decodes from its own random past KV of that length (runnx's as `Owned`
capacity buffers), then the runners take turns, A B B A ..., for `blocks` blocks of `steps` greedy
steps each, a short pause between blocks so that no runner's spinning threads overlap another's.
A block's figure is its median step; a ratio is the median of the blocks' ratios (each runnx block
against the other runner's block of the same turn), with their range. onnxruntime-genai runs its
own model and loop (`bench.GenAI`, its cache filled by a prefill of random tokens) when
`onnxruntime_genai` imports here (`pip install onnxruntime-genai`; its model: see bench.py).
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from report import git_revision, machine, set_threads, update_section  # noqa: E402


def _parse():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--contexts", default="32,512,2000")
    parser.add_argument("--blocks", type=int, default=8, help="blocks per runner and context")
    parser.add_argument("--steps", type=int, default=16, help="decode steps per block")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    return parser.parse_args()


ARGS = _parse()
set_threads(ARGS.threads)

import runnx  # noqa: E402

import numpy as np  # noqa: E402
import onnxruntime  # noqa: E402

import bench  # noqa: E402

bench.runnx, bench.np, bench.onnxruntime = runnx, np, onnxruntime  # bench.py imports them in its workers only
def main() -> None:
    if not bench.SMOLLM2.exists():
        sys.exit(f"{bench.SMOLLM2} is missing: run `make models` first")
    engines = {"runnx": bench._Runnx(bench.SMOLLM2, ARGS.threads),
               "onnxruntime": bench._OnnxRuntime(bench.SMOLLM2, ARGS.threads)}
    if importlib.util.find_spec("onnxruntime_genai") and (bench.GENAI_MODEL / "genai_config.json").exists():
        engines["onnxruntime-genai"] = bench.GenAI(bench.GENAI_MODEL, ARGS.threads)
    else:  # (said, so that a table without it is not taken for one that has it)
        print("onnxruntime-genai left out: it needs `onnxruntime_genai` in this environment (pip install -e "
              f"'.[bench]') and {bench.GENAI_MODEL} (make models)", file=sys.stderr, flush=True)
    peers = list(engines)[1:]
    lines = [f"SmolLM2-135M decode, {ARGS.threads} thread(s), {', '.join(engines)} in one process: "
             f"{ARGS.blocks} alternating blocks of {ARGS.steps} steps each",
             f"{'context':>8}{'runnx tok/s':>14}" + "".join(f"{peer:>19}{'ratio':>8}{'block ratios':>14}"
                                                            for peer in peers)]
    print("\n".join(lines), flush=True)
    for context in [int(c) for c in ARGS.contexts.split(",")]:
        speeds = bench.alternating_blocks(engines, context, ARGS.blocks, ARGS.steps)
        line = f"{context:>8}{statistics.median(speeds['runnx']):>14.1f}"
        for peer in peers:
            ratios = [mine / theirs for mine, theirs in zip(speeds["runnx"], speeds[peer])]
            line += (f"{statistics.median(speeds[peer]):>19.1f}{statistics.median(ratios):>7.2f}x"
                     f"{min(ratios):>8.2f}-{max(ratios):.2f}")
        lines.append(line)
        print(line, flush=True)
    if ARGS.no_write:
        return
    command = (f".venv/bin/python scripts/bench_pairs.py --threads {ARGS.threads} --contexts {ARGS.contexts} "
               f"--blocks {ARGS.blocks}")
    table = "\n".join(lines)
    title = f"SmolLM2 decode in one process, {ARGS.threads} thread(s) (`scripts/bench_pairs.py`)"
    update_section(f"pairs-{ARGS.threads}", f"""## {title}

runnx {git_revision()}; {machine()}. The runners take turns in blocks of steps (see the script),
so a slow spell of the machine falls on both. Command: `{command}`.

```
{table}
```
""")


if __name__ == "__main__":
    main()
