"""Loading a model's recorded kernels ahead of its first run (runnx/ops/kernel_loads.py)."""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numba
from numba.core.compiler_lock import global_compiler_lock

from runnx.ops import _jit_cache, _kernels_fused, kernel_loads

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "tiny-llama"

# One process: load the folder's model, let the threads loading ahead end, then generate greedily,
# counting the requests to numba's cache for runnx's kernels that the main thread makes meanwhile.
_FIRST_GENERATION = r"""
import json, sys, threading
import runnx
from runnx.ops import _jit_cache, kernel_loads  # (which listens to _jit_cache's requests from its import)
from runnx.generate.generator import Generator

requests = []
previous = _jit_cache.on_cache_request

def note(function, signature):
    if threading.current_thread() is threading.main_thread() and isinstance(signature, tuple):
        requests.append(function.__qualname__)  # a dispatcher's load (cfuncs' signatures are not tuples)
    previous(function, signature)

_jit_cache.on_cache_request = note
generator = Generator.from_folder(sys.argv[1])
for thread in threading.enumerate():
    if thread.name in ("runnx-kernel-loads", "runnx-decode-start", "runnx-products-load"):
        thread.join()
requests.clear()
generator.start(max_new_tokens=6, stop_token_ids=())
generator.append_tokens([5, 17, 42, 7, 99, 3, 12, 64])
ids = generator.run_until_done()[0]
print(json.dumps({"requests": requests, "ids": [int(i) for i in ids]}))
"""


def _first_generation(folder: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", _FIRST_GENERATION, str(folder)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_the_first_ones_kernels_before_its_first_run(tmp_path):
    # numba's cache warm first (after a change to the kernels' sources it is empty): a compiling
    # run does not record what numba asks for while compiling, which its own later calls may need
    # (a later process then records them)
    shutil.copytree(FIXTURE, tmp_path / "warm-up")
    _first_generation(tmp_path / "warm-up")
    folder = tmp_path / "model"
    shutil.copytree(FIXTURE, folder)  # a new file: no record yet
    record = kernel_loads.record_path(folder / "model.onnx")
    assert record is not None and not record.exists()
    try:
        first = _first_generation(folder)
        assert first["requests"], "the first process's run should load kernels from numba's cache"
        assert record.exists()
        recorded = {qualname for _, qualname, _ in kernel_loads.read_record(record)}
        assert set(first["requests"]) <= recorded
        second = _first_generation(folder)
        assert second["requests"] == []  # every kernel its run calls was there before it started
        assert second["ids"] == first["ids"]
    finally:
        record.unlink(missing_ok=True)


def test_a_rewritten_file_starts_a_new_record(tmp_path):
    model = tmp_path / "model.onnx"
    model.write_bytes(b"one")
    first = kernel_loads.record_path(model)
    model.write_bytes(b"other")
    assert kernel_loads.record_path(model) != first
    assert kernel_loads.record_path(tmp_path / "absent.onnx") is None


def test_a_record_that_cannot_be_read_loads_nothing(tmp_path):
    path = tmp_path / "record.json"
    assert kernel_loads.read_record(path) == []
    path.write_text("not json")
    assert kernel_loads.read_record(path) == []
    path.write_text(json.dumps({"a": 1}))
    assert kernel_loads.read_record(path) == []
    path.write_text(json.dumps([["runnx.ops._kernels_fused", "rms_norm", "()"], ["bad"], 3, ["a", 1, "()"]]))
    assert kernel_loads.read_record(path) == [("runnx.ops._kernels_fused", "rms_norm", "()")]
    assert kernel_loads.load_in_background(tmp_path / "absent.json") is None


def test_only_the_recorded_signatures_in_numbas_cache_load_and_nothing_compiles(monkeypatch):
    @numba.njit(cache=False)
    def uncached(x):
        return x + 1

    signatures = kernel_loads._cached_signatures(_kernels_fused.rms_norm_into)
    assert signatures, "the suite's runs cache rms_norm_into"
    entries = [("runnx.ops._kernels_fused", "no_such_kernel", str(signatures[0])),
               ("numpy", "add", "()"),  # not runnx's: never imported
               ("runnx.ops._jit_cache", "cache_folder", "()"),  # not a dispatcher
               ("runnx.ops._kernels_fused", "rms_norm_into", "(float16, int8)")]  # a signature nothing compiled
    assert kernel_loads.load_cached(entries) == 0
    assert kernel_loads._cached_signatures(uncached) == []
    fresh = numba.njit(cache=True, error_model="numpy")(_kernels_fused.rms_norm_into.py_func)  # no overload yet
    monkeypatch.setattr(kernel_loads, "_resolve", lambda module, name: fresh)
    assert kernel_loads.load_cached([("runnx.ops._kernels_fused", "rms_norm_into", str(signatures[0]))]) == 1
    assert set(fresh.overloads) == {signatures[0]}  # that signature alone
    assert kernel_loads._load_cached(fresh, signatures[0]) == 0  # already there


def test_a_run_records_the_loads_of_its_own_thread(tmp_path):
    recorder = kernel_loads.Recorder(tmp_path / "loads" / "model.json")

    def request(name):
        kernel_loads._noted(getattr(_kernels_fused, name).py_func, (numba.float32,))

    request("rms_norm_into")  # outside any run: not the model's
    with recorder.running():
        request("add_rms_norm_into")
        other = threading.Thread(target=request, args=("rope_append_into",))  # another thread's
        other.start()
        other.join()
        with kernel_loads.Recorder(None).running():  # a nested model's run records as its own
            request("silu_mul_into")
        request("add_rms_norm_into")
    assert kernel_loads.read_record(recorder.path) == [("runnx.ops._kernels_fused", "add_rms_norm_into", "(float32,)")]
    written = recorder.path.stat().st_mtime_ns
    with recorder.running():
        request("add_rms_norm_into")
    assert recorder.path.stat().st_mtime_ns == written  # nothing new: not written again


def test_the_arenas_functions_are_never_a_models_loads(tmp_path):
    """The arena loads its allocator on a thread of its own when wanted (runtime/arena.py): neither
    recorded for a model nor read back from a record that has them (loaded beside a first prompt,
    they held the GIL through it)."""
    from runnx.runtime import arena_functions
    recorder = kernel_loads.Recorder(tmp_path / "loads" / "model.json")
    with recorder.running():
        kernel_loads._noted(arena_functions.release.py_func, (numba.int64[:],))
        kernel_loads._noted(_kernels_fused.add_rms_norm_into.py_func, (numba.float32,))
    assert kernel_loads.read_record(recorder.path) == [("runnx.ops._kernels_fused", "add_rms_norm_into", "(float32,)")]
    recorder.path.write_text('[["runnx.runtime.arena_functions", "_malloc", "(int64,)"], '
                             '["runnx.ops._kernels_fused", "silu_mul_into", "(float32,)"]]')
    assert kernel_loads.read_record(recorder.path) == [("runnx.ops._kernels_fused", "silu_mul_into", "(float32,)")]


def test_a_kernel_asked_for_while_another_compiles_is_not_recorded(tmp_path):
    # numba holds its re-entrant compiler lock once for a kernel's own compile or load, and again
    # for each kernel that compile calls: those are linked into it, and a later process loads it whole
    recorder = kernel_loads.Recorder(tmp_path / "loads" / "model.json")
    with recorder.running():
        with global_compiler_lock:  # a kernel's own load (numba's Dispatcher.compile)
            kernel_loads._noted(_kernels_fused.add_rms_norm_into.py_func, (numba.float32,))
            with global_compiler_lock:  # a kernel the one compiling calls
                kernel_loads._noted(_kernels_fused.rms_norm_into.py_func, (numba.float32,))
    assert kernel_loads.read_record(recorder.path) == [("runnx.ops._kernels_fused", "add_rms_norm_into", "(float32,)")]
    with recorder.running(), global_compiler_lock:  # a later run asking for it itself
        kernel_loads._noted(_kernels_fused.rms_norm_into.py_func, (numba.float32,))
    assert kernel_loads.read_record(recorder.path)[1:] == [("runnx.ops._kernels_fused", "rms_norm_into", "(float32,)")]


def test_records_written_before_callees_were_left_out_are_not_read(tmp_path):
    model = tmp_path / "model.onnx"
    model.write_bytes(b"one")
    status = model.stat()
    old_key = hashlib.sha256(f"{model.resolve()}\0{status.st_size}\0{status.st_mtime_ns}".encode()).hexdigest()[:32]
    assert kernel_loads.record_path(model).name != f"{old_key}.json"


def test_a_model_given_as_bytes_keeps_no_record():
    import runnx
    model = runnx.load((FIXTURE / "model.onnx").read_bytes())
    assert model._kernel_loads.path is None


def test_loading_ahead_is_off_while_the_numpy_paths_run(tmp_path, monkeypatch):
    from runnx.ops import _native
    path = tmp_path / "record.json"
    path.write_text(json.dumps([["runnx.ops._kernels_fused", "rms_norm", "()"]]))
    monkeypatch.setattr(_native, "enabled", False)
    assert kernel_loads.load_in_background(path) is None
    monkeypatch.setattr(_native, "enabled", True)
    thread = kernel_loads.load_in_background(path)
    assert thread is not None and thread.name == "runnx-kernel-loads"
    thread.join()


def test_records_unused_for_a_month_are_forgotten_when_another_is_written(tmp_path):
    import os
    import time
    folder = tmp_path / "loads"
    folder.mkdir()
    old, recent = folder / "old.json", folder / "recent.json"
    for path in (old, recent):
        path.write_text(json.dumps([["runnx.ops._kernels_fused", "rms_norm", "()"]]))
    month_ago = time.time() - 31 * 24 * 3600
    os.utime(old, (month_ago, month_ago))
    os.utime(recent, (month_ago, month_ago))
    thread = kernel_loads.load_in_background(recent)  # loading a record keeps it
    thread.join()
    recorder = kernel_loads.Recorder(folder / "new.json")
    with recorder.running():
        kernel_loads._noted(_kernels_fused.rms_norm_into.py_func, ())
    assert sorted(p.name for p in folder.iterdir()) == ["new.json", "recent.json"]


def test_a_models_first_run_waits_for_its_loads_ahead():
    model = __import__("runnx").load(str(FIXTURE / "model.onnx"))
    release, finished = threading.Event(), []

    def loading():  # a load ahead still going when the run starts
        release.wait(10)
        finished.append(True)

    ahead = threading.Thread(target=loading)
    ahead.start()
    model._kernel_loads.ahead = ahead
    threading.Timer(0.2, release.set).start()
    with model.recording_loads():  # (what a run enters first)
        assert finished == [True]  # joined before anything asked numba's cache
    assert model._kernel_loads.ahead is None and not ahead.is_alive()


def test_the_switch_interval_is_short_while_kernels_load_ahead_and_put_back_after(monkeypatch):
    before = sys.getswitchinterval()
    seen, gates = [], [threading.Event(), threading.Event()]

    def load_cached(entries):
        seen.append(sys.getswitchinterval())
        gates[entries[0]].wait(10)

    monkeypatch.setattr(kernel_loads, "load_cached", load_cached)
    first = threading.Thread(target=kernel_loads._load_switching_often, args=([0],))
    second = threading.Thread(target=kernel_loads._load_switching_often, args=([1],))
    first.start()
    second.start()
    gates[0].set()  # the first ends while the second still loads: the interval stays short
    first.join()
    short = sys.getswitchinterval()
    assert abs(short - _jit_cache.LOADING_SWITCH) < 1e-6
    gates[1].set()
    second.join()
    assert seen == [short] * 2
    assert sys.getswitchinterval() == before
