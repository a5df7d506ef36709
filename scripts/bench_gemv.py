"""One row times a weight matrix, as a decode step does it: OpenBLAS (numpy.matmul) against runnx's
numba loop on one thread (`runnx.ops._kernels_linalg.row_times_matrix`) and shared with the
decode-pool's workers (`runnx.runtime.pool`, threads - 1 of them), for the weight shapes of
SmolLM2-135M and Whisper tiny.en. Weights are read from memory, not cache: each timing runs
through more copies of the matrix than the L3 cache holds.

    python scripts/bench_gemv.py [--threads 1] [--rounds 3]

Prints microseconds per product (best of rounds) and OpenBLAS's time over runnx's (MatMul's
choice, runnx/ops/linalg.py: the pool with more than one thread, else the loop). OpenBLAS runs
last: once its
threads have run they spin between calls and take the core the decode-pool's worker needs.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from report import set_threads  # scripts/ is this script's own folder on sys.path

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--threads", type=int, default=1)
parser.add_argument("--rounds", type=int, default=3)
ARGS = parser.parse_args()
set_threads(ARGS.threads)

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from runnx.runtime import pool as decode_pool  # noqa: E402
from runnx.ops._kernels_linalg import row_times_matrix  # noqa: E402

SHAPES = {"SmolLM2 q/o": (576, 576), "SmolLM2 k/v": (576, 192), "SmolLM2 gate/up": (576, 1536),
          "SmolLM2 down": (1536, 576), "Whisper attention": (384, 384), "Whisper fc1": (384, 1536),
          "Whisper fc2": (1536, 384), "SmolLM2 head": (576, 49152), "Whisper head": (384, 51864)}
STREAM_BYTES = 96 << 20  # > the L3 cache


def best_of(function, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    rng = np.random.default_rng(0)
    decode_pool.set_workers(ARGS.threads - 1)
    pool = decode_pool.pool()
    runners = {"numba loop": row_times_matrix}
    if pool is not None:
        runners["decode pool"] = lambda row, matrix: pool.products(row, (matrix,))[0]
    print(f"{ARGS.threads} thread(s); microseconds per one-row product, best of {ARGS.rounds} rounds")
    cases = []
    for name, (depth, width) in SHAPES.items():
        copies = max(2, STREAM_BYTES // (depth * width * 4))
        matrices = [rng.standard_normal((depth, width), dtype=np.float32) for _ in range(copies)]
        cases.append((name, matrices, rng.standard_normal(depth, dtype=np.float32)))
    times = {}
    for name, matrices, row in cases:
        for runner, product in runners.items():
            product(row, matrices[0])  # compile
            times[name, runner] = min(best_of(lambda: [product(row, m) for m in matrices], 1) / len(matrices) * 1e6
                                      for _ in range(ARGS.rounds))
    for name, matrices, row in cases:
        times[name, "OpenBLAS"] = min(best_of(lambda: [np.matmul(row[None], m) for m in matrices], 1) / len(matrices)
                                      * 1e6 for _ in range(ARGS.rounds))
    columns = ["OpenBLAS", *runners]
    print(f"{'weights':<20}{'shape':>14}" + "".join(f"{c:>12}" for c in columns)
          + "".join(f"{'vs ' + r:>16}" for r in runners))
    for name, matrices, _ in cases:
        depth, width = matrices[0].shape
        print(f"{name:<20}{f'{depth}x{width}':>14}" + "".join(f"{times[name, c]:>12.0f}" for c in columns)
              + "".join(f"{times[name, 'OpenBLAS'] / times[name, r]:>15.2f}x" for r in runners))


if __name__ == "__main__":
    main()
