"""runnx/runtime/allocator.py: glibc keeps a run's freed temporaries mapped only when the user asks
(runnx.keep_freed(), RUNNX_KEEP_FREED=1 at load, the `runnx` command); importing runnx or loading
a model alone leaves glibc as it was."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

MODEL = Path(__file__).resolve().parents[1] / "fixtures" / "tiny-llama" / "model.onnx"
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings: Linux only")

# a run's temporaries: four 9 MiB arrays written and freed together, as an encoder window's are;
# prints whether importing runnx touched the thresholds, whether loading a model (and then `ASK`)
# set them, and the page faults of the second round
_ROUNDS = """
import resource, sys, runnx, runnx.runtime.allocator as allocator
import numpy as np
from onnx import TensorProto, helper

touched_at_import = allocator._kept is not None
graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
runnx.load(helper.make_model(graph))
runnx.runtime.arena.wait_prepared()  # (loading its functions on a thread of its own faults pages too)
ASK

def run():
    temporaries = [np.ones(9 << 18, np.float32) for _ in range(4)]
    return sum(float(t[-1]) for t in temporaries)

run()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
run()
print(touched_at_import, bool(allocator._kept), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _second_round(ask: str = "", **environment) -> tuple[bool, bool, int]:
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_",
                                                            "RUNNX_KEEP_FREED")}
    env.update(environment)
    out = subprocess.run([sys.executable, "-c", _ROUNDS.replace("ASK", ask)], env=env, capture_output=True, text=True,
                         check=True)
    touched, kept, faults = out.stdout.split()
    return touched == "True", kept == "True", int(faults)


def _glibc() -> bool:
    import ctypes
    try:
        ctypes.CDLL(None).gnu_get_libc_version
    except AttributeError:
        return False
    return True


@pytest.mark.skipif(not _glibc(), reason="glibc's malloc settings: not this C library")
def test_asked_a_second_run_reuses_the_first_runs_freed_pages():
    for asked in (_second_round("runnx.keep_freed()"), _second_round(RUNNX_KEEP_FREED="1")):
        touched, kept, faults = asked
        assert not touched and kept
        assert faults < 100  # 36 MiB written again in pages already mapped


@pytest.mark.skipif(not _glibc(), reason="glibc's malloc settings: not this C library")
def test_a_library_load_leaves_malloc_alone():
    for unasked in (_second_round(), _second_round("runnx.keep_freed()", RUNNX_KEEP_FREED="0")):
        touched, kept, faults = unasked
        assert not touched and not kept
        assert faults > 1000  # glibc's default: pages handed back and faulted in again (2,500 of the 9,216 here)


@pytest.mark.skipif(not _glibc(), reason="glibc's malloc settings: not this C library")
def test_the_command_asks_unless_told_not_to():
    probe = ("import sys, runnx.cli, runnx.runtime.allocator as allocator\n"
             "code = runnx.cli.main(['inspect', sys.argv[1]])\n"
             "print(code, bool(allocator._kept))")
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_",
                                                            "RUNNX_KEEP_FREED")}
    for environment, expected in (({}, ["0", "True"]), ({"RUNNX_KEEP_FREED": "0"}, ["0", "False"])):
        out = subprocess.run([sys.executable, "-c", probe, str(MODEL)],
                             env={**env, **environment}, capture_output=True, text=True, check=True)
        assert out.stdout.split()[-2:] == expected


def test_the_users_own_malloc_settings_win():
    assert _second_round("runnx.keep_freed()", MALLOC_TRIM_THRESHOLD_="1048576")[1] is False
    assert _second_round("runnx.keep_freed()", MALLOC_MMAP_THRESHOLD_="1048576")[1] is False
