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


# how many arenas glibc's malloc has once runnx's threads (the decode pool's start, a model's kernel
# loads) and a thread of the caller's have allocated: each thread's first allocation takes an arena
# of its own by default, and what a thread frees stays in its arena
_ARENAS = """
import ctypes, os, tempfile, threading
import numpy as np
import runnx
from runnx.runtime import pool_start

runnx.set_threads(2)
runnx.runtime.start_pool_in_background()
if pool_start._starting is not None:
    pool_start._starting.join()
runnx.load(MODEL_PATH)
worker = threading.Thread(target=lambda: np.ones(1 << 20).sum())
worker.start()
worker.join()
libc = ctypes.CDLL(None)
libc.fdopen.restype = ctypes.c_void_p
libc.malloc_info.argtypes = (ctypes.c_int, ctypes.c_void_p)
libc.fclose.argtypes = (ctypes.c_void_p,)
with tempfile.TemporaryFile() as report:
    stream = libc.fdopen(os.dup(report.fileno()), b"w")
    libc.malloc_info(0, stream)
    libc.fclose(stream)
    report.seek(0)
    print(report.read().decode().count("<heap nr="))
"""


def _arenas(**environment) -> int:
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_ARENA_MAX", "RUNNX_KEEP_FREED")}
    env.update(environment)
    out = subprocess.run([sys.executable, "-c", _ARENAS.replace("MODEL_PATH", repr(str(MODEL)))], env=env,
                         capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not _glibc(), reason="glibc's malloc settings: not this C library")
def test_asked_every_thread_allocates_from_one_arena():
    assert _arenas() > 1  # glibc's default: the threads' own arenas, which the probe sees
    assert _arenas(RUNNX_KEEP_FREED="1") == 1  # asked before runnx's own threads first allocate
    assert _arenas(RUNNX_KEEP_FREED="1", MALLOC_ARENA_MAX="4") > 1  # the user's setting wins
