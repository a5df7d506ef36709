"""One row times a weight matrix, as a decode step does it: OpenBLAS (numpy.matmul) against runnx's
numba loop (`runnx.ops._kernels_linalg.row_times_matrix`), for the weight shapes of SmolLM2-135M
and Whisper tiny.en. Weights are read from memory, not cache: each timing runs through more copies
of the matrix than the L3 cache holds.

    python scripts/bench_gemv.py [--threads 1] [--rounds 3]

Prints microseconds per product (best of rounds) and the ratio; MatMul sends one-row products to
the loop for matrices of at most 768 columns and 640 Ki elements (runnx/ops/linalg.py).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--threads", type=int, default=1)
parser.add_argument("--rounds", type=int, default=3)
ARGS = parser.parse_args()
for variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ[variable] = str(ARGS.threads)

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from runnx.ops._kernels_linalg import row_times_matrix  # noqa: E402

SHAPES = {"SmolLM2 q/o": (576, 576), "SmolLM2 k/v": (576, 192), "SmolLM2 gate/up": (576, 1536),
          "SmolLM2 down": (1536, 576), "Whisper attention": (384, 384), "Whisper fc1": (384, 1536),
          "Whisper fc2": (1536, 384)}
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
    print(f"{ARGS.threads} thread(s); microseconds per one-row product, best of {ARGS.rounds} rounds")
    print(f"{'weights':<20}{'shape':>14}{'OpenBLAS':>12}{'numba loop':>12}{'speed-up':>10}")
    for name, (depth, width) in SHAPES.items():
        copies = max(1, STREAM_BYTES // (depth * width * 4))
        matrices = [rng.standard_normal((depth, width), dtype=np.float32) for _ in range(copies)]
        row = rng.standard_normal((1, depth), dtype=np.float32)
        vector = row[0]
        row_times_matrix(vector, matrices[0])  # compile

        def blas():
            for matrix in matrices:
                np.matmul(row, matrix)

        def loop():
            for matrix in matrices:
                row_times_matrix(vector, matrix)

        blas_us = loop_us = float("inf")
        for _ in range(ARGS.rounds):  # alternate, so both see the same machine load
            blas_us = min(blas_us, best_of(blas, 1) / copies * 1e6)
            loop_us = min(loop_us, best_of(loop, 1) / copies * 1e6)
        print(f"{name:<20}{f'{depth}x{width}':>14}{blas_us:>12.0f}{loop_us:>12.0f}{blas_us / loop_us:>9.2f}x")


if __name__ == "__main__":
    main()
