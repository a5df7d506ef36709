"""What a SmolLM2-135M decoder layer's Python costs between its native calls, warm and cold. Prints only.

    .venv/bin/python scripts/bench_checks.py [--threads 2] [--context 32] [--rounds 20]

The inputs of one decode step's fused layer nodes are captured (ProjectedRopeAppend's and
ResidualGatedMLP's decode-row checks, `runnx/ops/fused_projected_rope.py`, `fused_residual_blocks.py`),
then each layer's checks, and numba's unboxing of the MLP's first native call's arguments (a no-op
numba function taking them), are timed:
- warm: one layer again and again;
- data cold: every layer once, in a row, after streaming 96 MB (more than the L3 cache): the code is
  warm after the first layer, each layer's own objects are not (a step whose Python ran together);
- cold: each layer after streaming 96 MB: code and data out of the caches, harsher than a decode
  step, where a layer's 14 MB of weights stream between two layers' Python (L3: 32 MiB here).
Medians over layers and rounds, microseconds a layer.
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

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--threads", type=int, default=2)
parser.add_argument("--context", type=int, default=32)
parser.add_argument("--rounds", type=int, default=20)
ARGS = parser.parse_args()
set_threads(ARGS.threads)

import runnx  # noqa: E402

import numba  # noqa: E402
import numpy as np  # noqa: E402

import bench  # noqa: E402
from runnx.ops import fused_projected_rope, fused_residual_blocks  # noqa: E402

bench.runnx, bench.np = runnx, np
EVICTING = np.ones(96 << 18, np.float32)  # 96 MB


@numba.njit(nogil=True)
def _unboxed(*arguments):
    """Nothing: what a native call costs before its first instruction (numba's typing and unboxing)."""
    return len(arguments)


def _captured_step(engine) -> dict:
    """{check name: [(function, arguments) of each layer]} from one decode step."""
    captured = {"ProjectedRopeAppend's checks": [], "ResidualGatedMLP's checks": []}
    originals = fused_projected_rope._rope_row, fused_residual_blocks._gated_mlp_row

    def capturing(name, function):
        def capture(*arguments):
            captured[name].append((function, arguments))
            return function(*arguments)
        return capture

    fused_projected_rope._rope_row = capturing("ProjectedRopeAppend's checks", originals[0])
    fused_residual_blocks._gated_mlp_row = capturing("ResidualGatedMLP's checks", originals[1])
    token = np.array([[42]], np.int64)
    try:
        past = engine.step(token, ARGS.context, bench._random_past(engine.kv, ARGS.context, np.random.default_rng(0)),
                           ARGS.context + 8)
        for name in captured:
            captured[name].clear()
        engine.step(token, ARGS.context + 1, past, 0)
    finally:
        fused_projected_rope._rope_row, fused_residual_blocks._gated_mlp_row = originals
    mlp = captured["ResidualGatedMLP's checks"]
    captured["ResidualGatedMLP's native call, unboxing"] = [(_unboxed, function(*arguments)[0])
                                                           for function, arguments in mlp]
    return captured


def _timed(calls: list, evict_each: bool, evict_first: bool) -> list[float]:
    times = []
    if evict_first:
        EVICTING.sum()
    for function, arguments in calls:
        if evict_each:
            EVICTING.sum()
        begin = time.perf_counter()
        function(*arguments)
        times.append(time.perf_counter() - begin)
    return times


def main() -> None:
    if not bench.SMOLLM2.exists():
        sys.exit(f"{bench.SMOLLM2} is missing: run `make models` first")
    captured = _captured_step(bench._Runnx(bench.SMOLLM2, ARGS.threads))
    print(f"SmolLM2-135M, context {ARGS.context}, {ARGS.threads} thread(s): a layer's Python, us (medians of "
          f"{ARGS.rounds} rounds over its layers)")
    print(f"{'':<44}{'warm':>8}{'data cold':>11}{'cold':>8}")
    for name, calls in captured.items():
        layer = calls[len(calls) // 2]
        warm = [t for _ in range(ARGS.rounds) for t in _timed([layer] * 10, False, False)]
        data_cold = [t for _ in range(ARGS.rounds) for t in _timed(calls, False, True)[1:]]  # code warm from layer 1
        cold = [t for _ in range(ARGS.rounds) for t in _timed(calls, True, False)]
        print(f"{name:<44}" + "".join(f"{statistics.median(times) * 1e6:>{width}.1f}"
                                      for times, width in ((warm, 8), (data_cold, 11), (cold, 8))))


if __name__ == "__main__":
    main()
