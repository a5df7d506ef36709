"""Prove in-place execution safe over the ONNX backend suite: every case runs with its inputs handed
over as `runnx.Owned` copies (so single-node cases run in place too), in checking mode (each
in-place step recomputed out of place and compared), and its outputs are compared bitwise with
copy mode (inplace=False). Cases runnx cannot load or run are counted, not judged here: the
backend suite (tests/test_backend.py) judges correctness.

    .venv/bin/python scripts/check_inplace.py [--include REGEX] [--kind node --kind simple ...]
"""
from __future__ import annotations

import argparse
import re
import sys
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnx.backend.test.loader
import onnx.numpy_helper

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "reliability")]
import runnx  # noqa: E402
from corpus import bits  # noqa: E402
from runnx.interp.folding import NONDETERMINISTIC  # noqa: E402
from runnx.errors import InPlaceMismatchError  # noqa: E402


def _owned(value):
    return runnx.Owned(value.copy()) if isinstance(value, np.ndarray) else value


def _from_folder(folder: Path):
    """(model path, [input lists]) of a backend case stored as files (the non-node kinds)."""
    data_sets = []
    for data_set in sorted(folder.glob("test_data_set_*")):
        inputs = []
        for path in sorted(data_set.glob("input_*.pb"), key=lambda p: int(p.stem.split("_")[1])):
            tensor = onnx.TensorProto()
            tensor.ParseFromString(path.read_bytes())
            inputs.append(onnx.numpy_helper.to_array(tensor))
        data_sets.append(inputs)
    return folder / "model.onnx", data_sets


def check_case(case) -> str:
    """'in place ok', 'no in place', 'not runnable', 'nondeterministic', or a failure description."""
    if case.model is not None:
        model, data_sets = case.model, [inputs for inputs, _ in case.data_sets]
    else:
        model, data_sets = _from_folder(Path(case.model_dir))
    try:
        checked = runnx.load(model, check_inplace=True)
        copied = runnx.load(model, inplace=False)
    except runnx.RunnxError:
        return "not runnable"
    names = checked.input_names
    verdict = "no in place"
    for inputs in data_sets:
        feeds = dict(zip(names, inputs))
        try:
            fast, profile = checked.run({n: _owned(v) for n, v in feeds.items()}, profile=True)
        except InPlaceMismatchError as error:
            return f"MISMATCH {error}"
        except runnx.RunnxError:
            return "not runnable"
        slow = copied.run({n: _owned(v) for n, v in feeds.items()})
        if {n: bits(v) for n, v in fast.items()} != {n: bits(v) for n, v in slow.items()}:
            if any(node.op_type in NONDETERMINISTIC for _, node in checked.graph.walk()):
                return "nondeterministic"  # random ops (Bernoulli, ...) differ from run to run
            return "DIFFERS from copy mode"
        if profile.inplace_total or profile.moves:
            verdict = "in place ok"
    return verdict


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--include", default="", help="only cases whose name matches this regex")
    parser.add_argument("--kind", action="append", help="backend test kind (default: all but 'real', "
                                                        "whose models are downloaded)")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    outcomes, failures = Counter(), []
    kinds = args.kind or ["node", "simple", "light", "pytorch-converted", "pytorch-operator"]
    cases = [case for kind in kinds for case in onnx.backend.test.loader.load_model_tests(kind=kind)]
    for case in cases:
        if not re.search(args.include, case.name):
            continue
        verdict = check_case(case)
        if verdict.startswith(("MISMATCH", "DIFFERS")):
            failures.append(f"{case.name}: {verdict}")
            print(failures[-1], file=sys.stderr)
            verdict = "failed"
        outcomes[verdict] += 1
    print(f"{sum(outcomes.values())} backend cases with Owned inputs: {dict(outcomes)}; {len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
