"""A decode step's attention over a KV cache, as SmolLM2-135M's layers run it: runnx's numba kernel on
one thread (`runnx.ops._kernels_fused.attention`) and shared with the decode pool's workers
(`DecodePool.attention`, threads - 1 of them), in microseconds a layer and GB/s of cache read. The
caches are read from memory, not cache: each timing runs through more layers' caches than the L3
cache holds. Compare with a layer's products in scripts/bench_gemv.py: where attention's GB/s is
below theirs, its arithmetic, not memory, bounds it.

    python scripts/bench_attention.py [--threads 1] [--contexts 512,2000,4000] [--rounds 5]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from report import set_threads  # scripts/ is this script's own folder on sys.path

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--threads", type=int, default=1)
parser.add_argument("--contexts", default="512,2000,4000")
parser.add_argument("--rounds", type=int, default=5)
ARGS = parser.parse_args()
set_threads(ARGS.threads)

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from runnx.runtime import pool as decode_pool  # noqa: E402
from runnx.ops._kernels_fused import attention  # noqa: E402

HEADS, KV_HEADS, DEPTH = 9, 3, 64  # SmolLM2-135M's
STREAM_BYTES = 96 << 20  # > the L3 cache


def main() -> None:
    rng = np.random.default_rng(0)
    decode_pool.set_workers(ARGS.threads - 1)
    pool = decode_pool.pool()
    run = attention if pool is None else pool.attention
    print(f"{ARGS.threads} thread(s); SmolLM2-135M's attention of one query row (9 heads over 3 KV heads of 64), "
          f"best of {ARGS.rounds} rounds")
    print(f"{'context':>8}{'us a layer':>12}{'GB/s':>7}")
    query = rng.standard_normal((1, HEADS, 1, DEPTH), dtype=np.float32)
    for context in [int(c) for c in ARGS.contexts.split(",")]:
        cache_bytes = 2 * KV_HEADS * context * DEPTH * 4
        layers = max(2, STREAM_BYTES // cache_bytes)
        shape = (1, KV_HEADS, context + 64, DEPTH)  # views of buffers with room, as runnx's caches are
        caches = [(rng.standard_normal(shape, dtype=np.float32)[:, :, :context],
                   rng.standard_normal(shape, dtype=np.float32)[:, :, :context]) for _ in range(layers)]
        bias = np.zeros((1, 1, 1, context), np.float32)
        best = float("inf")
        for _ in range(ARGS.rounds + 1):  # the first compiles
            begin = time.perf_counter()
            for key, value in caches:
                run(query, key, value, bias, 0.125, 0.0)
            best = min(best, (time.perf_counter() - begin) / layers)
        print(f"{context:>8}{best * 1e6:>12.0f}{cache_bytes / best / 1e9:>7.1f}")


if __name__ == "__main__":
    main()
