"""runnx's own float32 products (`runnx/ops/_kernels_gemm.py`) beside numpy's BLAS, in one process,
the two taking turns, at the shapes of a prompt (SmolLM2-135M's projections at 32 and 2000 rows),
a Whisper tiny encoder window (1500 rows) and a prompt's attention block, for each thread count.

    .venv/bin/python scripts/bench_gemm.py [--threads 1,2] [--rounds 7] [--no-write]

Both results are checked against float64 arithmetic. Writes its section of docs/benchmarks.md
unless --no-write.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from report import git_revision, machine, update_section  # noqa: E402  (scripts/: this script's folder; before numpy)

import numpy as np  # noqa: E402

import runnx  # noqa: E402
from runnx.ops import _matmul  # noqa: E402

SHAPES = (("prompt of 32, q/k/v and gate/up", 32, 576, 1536), ("prompt of 32, down", 32, 1536, 576),
          ("prompt of 2000, gate/up", 2000, 576, 1536), ("prompt of 2000, down", 2000, 1536, 576),
          ("encoder window, MLP up", 1500, 384, 1536), ("attention block, scores", 256, 64, 2000),
          ("attention block, values", 256, 2000, 64), ("LM head of a prompt of 512", 512, 576, 49152))


def _seconds(product, budget: float = 0.05) -> float:
    """Median seconds of one call, over calls filling about `budget` seconds."""
    product()
    begin = time.perf_counter()
    product()
    calls = max(3, int(budget / max(time.perf_counter() - begin, 1e-6)))
    times = []
    for _ in range(calls):
        begin = time.perf_counter()
        product()
        times.append(time.perf_counter() - begin)
    return statistics.median(times)


def measure(threads: int, rounds: int) -> list[tuple]:
    runnx.set_threads(threads)
    rng = np.random.default_rng(0)
    rows = []
    for name, m, k, n in SHAPES:
        a, b = rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((k, n), dtype=np.float32)
        out = np.empty((m, n), np.float32)
        exact = a.astype(np.float64) @ b.astype(np.float64)
        bound = 1e-5 * np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64)
        for engine in (lambda: _matmul.matmul(a, b, out=out), lambda: np.matmul(a, b, out=out)):
            engine()
            if not np.all(np.abs(out - exact) <= bound):
                raise SystemExit(f"{name}: a product is off float64 arithmetic")
        own, blas = [], []
        for _ in range(rounds):
            own.append(_seconds(lambda: _matmul.matmul(a, b, out=out)))
            blas.append(_seconds(lambda: np.matmul(a, b, out=out)))
        flop = 2 * m * k * n
        rows.append((name, f"{m} x {k} x {n}", threads, flop / statistics.median(own) / 1e9,
                     flop / statistics.median(blas) / 1e9,
                     statistics.median(b_ / o for o, b_ in zip(own, blas))))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = parser.parse_args()
    forced = "" if _matmul.own_kernels() else (
        " runnx's own products are not the default here (no AVX-512, or numpy's BLAS is as wide) but for a short"
        " prompt's (fewer than 240 rows): these rows have them forced on.")
    if forced:
        print(forced.strip())
    _matmul.set_own_kernels(True)
    counts = [int(t) for t in args.threads.split(",")]
    results = [measure(threads, args.rounds) for threads in counts]
    lines = ["| product | m x k x n | " + " | ".join(f"{t} thread(s): runnx / BLAS GFLOP/s | ratio" for t in counts) + " |",
             "|---|---|" + "---|---|" * len(counts)]
    for index, (name, shape) in enumerate((row[0], row[1]) for row in results[0]):
        cells = [f"{rows[index][3]:.0f} / {rows[index][4]:.0f} | {rows[index][5]:.2f}x" for rows in results]
        lines.append(f"| {name} | {shape} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    if args.no_write:
        return
    update_section("gemm", f"""## float32 products (`scripts/bench_gemm.py`)

runnx's own products beside numpy's BLAS in one process, taking turns (ratio: the median of the rounds' time ratios); runnx {git_revision()}; {machine()}. Command: `.venv/bin/python scripts/bench_gemm.py --threads {args.threads} --rounds {args.rounds}`.{forced}

{table}
""")


if __name__ == "__main__":
    main()
