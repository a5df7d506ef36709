"""Where a SmolLM2-135M decode step's time goes in runnx: its one-row products (the weights
streamed from memory, the decode pool's jobs with two threads), its attention over the KV cache,
and everything else (the nodes' Python, the compiled plan, the shape memos), by wall clock around
the kernels' entry points, in one process. Prints only.

    .venv/bin/python scripts/bench_step_split.py [--threads 2] [--contexts 32,2000] [--steps 60]

The products count from the call into the pool (or into the one-thread loop) to its return, their
Python included; GB/s is the matrices' bytes over that time. The attention counts from the
numba kernel's entry (`_attend_kernel`) on. A step's products stream every weight once (540 MB):
when they run at the memory's speed, the rest is what a faster runtime has to cut.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from report import set_threads  # noqa: E402


def _parse():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--contexts", default="32,2000")
    parser.add_argument("--steps", type=int, default=60, help="timed decode steps per context")
    parser.add_argument("--rounds", type=int, default=3, help="timed runs of the steps per context; medians")
    return parser.parse_args()


ARGS = _parse()
set_threads(ARGS.threads)

import runnx  # noqa: E402  (first: it sets OpenBLAS's thread timeout before numpy loads OpenBLAS)

import numpy as np  # noqa: E402

import bench  # noqa: E402
from runnx.ops import _decode_pool, fused, linalg  # noqa: E402

bench.runnx, bench.np = runnx, np
SPENT = {"products": 0.0, "attention": 0.0}
PRODUCT_BYTES = [0]
INSIDE = set()  # parts being timed: a call within a call of the same part (a pool job split in two) counts once


def _timed(part: str, fn, matrices=None):
    """fn, its wall time added to SPENT[part] (and its matrices' bytes counted, `matrices` picking
    them from the arguments)."""
    def timed(*args, **kwargs):
        if part in INSIDE:
            return fn(*args, **kwargs)
        INSIDE.add(part)
        begin = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SPENT[part] += time.perf_counter() - begin
            INSIDE.discard(part)
            if matrices is not None:
                PRODUCT_BYTES[0] += sum(m.nbytes for m in matrices(args))
    return timed


def _instrument() -> None:
    _decode_pool.DecodePool.products = _timed("products", _decode_pool.DecodePool.products, lambda a: a[2])
    linalg.row_times_matrix = _timed("products", linalg.row_times_matrix, lambda a: a[1:2])
    fused._attend_kernel = _timed("attention", fused._attend_kernel)


def _split(engine, context: int) -> dict:
    """Medians over rounds of {part: ms a step} and the products' GB/s at `context`."""
    token = np.array([[42]], np.int64)
    capacity = context + (ARGS.rounds + 1) * ARGS.steps + 8
    past = engine.step(token, context, bench._random_past(engine.kv, context, np.random.default_rng(0)), capacity)
    length = context + 1
    for _ in range(ARGS.steps // 4):  # warm-up
        past = engine.step(token, length, past, 0)
        length += 1
    rounds = []
    for _ in range(ARGS.rounds):
        SPENT.update(products=0.0, attention=0.0)
        PRODUCT_BYTES[0] = 0
        begin = time.perf_counter()
        for _ in range(ARGS.steps):
            past = engine.step(token, length, past, 0)
            length += 1
        step = (time.perf_counter() - begin) / ARGS.steps
        products, attention = SPENT["products"] / ARGS.steps, SPENT["attention"] / ARGS.steps
        rounds.append({"step": step, "products": products, "attention": attention,
                       "rest": step - products - attention,
                       "GB/s": PRODUCT_BYTES[0] / ARGS.steps / products / 1e9 if products else 0.0})
    return {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}


def main() -> None:
    if not bench.SMOLLM2.exists():
        sys.exit(f"{bench.SMOLLM2} is missing: run `make models` first")
    _instrument()
    engine = bench._Runnx(bench.SMOLLM2, ARGS.threads)
    print(f"SmolLM2-135M decode step in runnx, {ARGS.threads} thread(s), medians of {ARGS.rounds} runs of "
          f"{ARGS.steps} steps (ms a step)")
    print(f"{'context':>8}{'step':>9}{'products':>10}{'GB/s':>7}{'attention':>11}{'rest':>8}")
    for context in [int(c) for c in ARGS.contexts.split(",")]:
        split = _split(engine, context)
        print(f"{context:>8}{split['step'] * 1e3:>9.2f}{split['products'] * 1e3:>10.2f}{split['GB/s']:>7.1f}"
              f"{split['attention'] * 1e3:>11.2f}{split['rest'] * 1e3:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
