"""One 4-bit MatMulNBits product alone (1 row, block 32, packed zero points): median microseconds and
G weights/s, warm (the same matrix every call) and cold (64 matrices in turn, ~30 MB, as a decode
step streams its weights).

    .venv/bin/python scripts/bench_matmul_nbits.py [--calls 400]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from runnx.ops.contrib_quantized import MatMulNBits  # noqa: E402

SHAPES = ((576, 1536), (1536, 576))  # a decoder's gate/up and down products (K x N)
BLOCK = 32


def median_us(call, calls: int) -> float:
    for _ in range(20):
        call()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=400)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    for k, n in SHAPES:
        row = rng.standard_normal((1, 1, k)).astype(np.float32)
        matrices = [(rng.integers(0, 256, (n, k // BLOCK, BLOCK // 2), dtype=np.uint8),
                     (rng.random((n, k // BLOCK)) * 0.02).astype(np.float32),
                     rng.integers(0, 256, (n, k // (2 * BLOCK)), dtype=np.uint8)) for _ in range(64)]
        warm = median_us(lambda: MatMulNBits(row, *matrices[0], K=k, N=n, block_size=BLOCK), args.calls)
        turn = iter(range(10 ** 9))
        cold = median_us(lambda: MatMulNBits(row, *matrices[next(turn) % 64], K=k, N=n, block_size=BLOCK), args.calls)
        print(f"{k} x {n}: warm {warm:.0f} us ({k * n / warm / 1e3:.2f} G weights/s), "
              f"cold {cold:.0f} us ({k * n / cold / 1e3:.2f} G weights/s)")


if __name__ == "__main__":
    main()
