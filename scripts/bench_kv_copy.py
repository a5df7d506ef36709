"""Append-into-capacity copy: a numba kernel vs numpy slice assignment on realistic KV shapes.

runnx keeps whichever wins in runnx/capture/capacity.py (numpy slice assignment, as measured here:
numba's dispatch on non-contiguous views costs more than the copy itself).

    .venv/bin/python scripts/bench_kv_copy.py
"""
from __future__ import annotations

import time

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
def copy_rows(buffer, start, rows):
    """buffer[:, start:start+n, :] = rows for 3-D (outer, rows, inner) views."""
    outer, count, inner = rows.shape
    for o in range(outer):
        for r in range(count):
            for i in range(inner):
                buffer[o, start + r, i] = rows[o, r, i]

SHAPES = [  # (name, heads, head_dim, rows appended)
    ("SmolLM2 decode (3 kv heads x 64, 1 row)", 3, 64, 1),
    ("Whisper tiny decode (6 heads x 64, 1 row)", 6, 64, 1),
    ("SmolLM2 prefill (3 x 64, 512 rows)", 3, 64, 512),
    ("Llama-7B-like decode (32 x 128, 1 row)", 32, 128, 1),
]


def _numpy_append(buffer, start, rows):
    buffer[:, :, start:start + rows.shape[2]] = rows


def _numba_append(buffer, start, rows):
    b, h, cap, d = buffer.shape
    copy_rows(buffer.reshape(b * h, cap, d), start, rows.reshape(b * h, rows.shape[2], d))


def _time(fn, buffer, rows, repeat=2000):
    fn(buffer, 0, rows)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeat):
            fn(buffer, 7, rows)
        best = min(best, (time.perf_counter() - start) / repeat)
    return best


def main():
    print(f"{'shape':<46}{'numpy us':>10}{'numba us':>10}")
    for name, heads, dim, count in SHAPES:
        buffer = np.zeros((1, heads, 4096, dim), np.float32)
        # K arrives transposed from the attention projection: a non-contiguous view, as in the models
        rows = np.random.rand(1, count, heads, dim).astype(np.float32).transpose(0, 2, 1, 3)
        repeat = 200 if count > 1 else 5000
        print(f"{name:<46}{_time(_numpy_append, buffer, rows, repeat) * 1e6:>10.2f}"
              f"{_time(_numba_append, buffer, rows, repeat) * 1e6:>10.2f}")


if __name__ == "__main__":
    main()
