"""Fuzz runnx for longer than CI does: mutated seed models (and the small committed fixtures)
with random feeds, until a case count or a time budget is reached. Any exception other than a
runnx error is a bug: the case's bytes are saved for replay and counted.

    .venv/bin/python scripts/fuzz.py --cases 200000            # or --seconds 600, --seed N, --fixtures
    .venv/bin/python scripts/fuzz.py --replay fuzz-failures/case-123.onnx
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "reliability")]
from corpus import fixture_models, mutated, run_case, seed_models  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=100_000)
    parser.add_argument("--seconds", type=float, default=None, help="stop after this long, whatever the count")
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: from the clock)")
    parser.add_argument("--out", type=Path, default=Path("fuzz-failures"), help="where failing cases are saved")
    parser.add_argument("--fixtures", action="store_true", help="also mutate the committed fixture models (slower)")
    parser.add_argument("--replay", type=Path, help="run one saved case and show its traceback")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    if args.replay:
        print(run_case(args.replay.read_bytes(), np.random.default_rng(0)))
        return 0
    seed = args.seed if args.seed is not None else time.time_ns() % 2**32
    rng = np.random.default_rng(seed)
    seeds = {**seed_models(), **(fixture_models() if args.fixtures else {})}
    names = sorted(seeds)
    outcomes, failures = Counter(), 0
    start = time.perf_counter()
    print(f"fuzzing {len(names)} seed models ({', '.join(names)}) with seed {seed}")
    for count in range(1, args.cases + 1):
        data = mutated(seeds[names[int(rng.integers(len(names)))]], rng, int(rng.integers(1, 4)))
        try:
            outcomes[run_case(data, rng)] += 1
        except Exception:  # anything but a RunnxError (and not KeyboardInterrupt) is a bug
            failures += 1
            args.out.mkdir(exist_ok=True)
            path = args.out / f"case-{seed}-{count}.onnx"
            path.write_bytes(data)
            print(f"FAILURE saved to {path}:\n{traceback.format_exc(limit=-3)}", file=sys.stderr)
        if count % 10_000 == 0:
            print(f"{count} cases, {time.perf_counter() - start:.0f} s, {failures} failures")
        if args.seconds is not None and time.perf_counter() - start > args.seconds:
            break
    total = sum(outcomes.values()) + failures
    print(f"{total} cases in {time.perf_counter() - start:.1f} s: {failures} failures; outcomes {dict(outcomes.most_common())}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
