"""The CLI's first runs (`runnx/background_compile.py`): numpy kernels until the compiling process
writes its marker, then compiled ones; a marker found at start runs compiled from the first op."""
from __future__ import annotations

import argparse
import io
import os
import time
from pathlib import Path

import pytest

from runnx import background_compile
from runnx.errors import RunnxError
from runnx.ops import _native

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "tiny-llama" / "model.onnx"
SHARE_CORES = background_compile._share_cores  # the fixture below stands it in for every other test


@pytest.fixture(autouse=True)
def compiled_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "numba"))
    monkeypatch.setenv("RUNNX_COMPILE", "background")
    monkeypatch.delenv("RUNNX_COMPILE_MARKER", raising=False)
    monkeypatch.setattr(background_compile, "_share_cores", lambda: None)  # the test process keeps its BLAS threads
    yield
    _native.enable()


def _args(argv: list[str]) -> argparse.Namespace:
    """A command whose compiling process runs `runnx argv` (`inspect` compiles nothing: quick)."""
    return argparse.Namespace(compile_key=lambda args: ["test", argv], compile_argv=lambda args: argv)


def _until(condition, seconds: float = 60.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def test_numpy_kernels_until_the_compiling_process_is_done(capsys):
    first_run = background_compile.start(_args(["inspect", str(FIXTURE)]))
    assert first_run is not None and first_run.process is not None
    assert not _native.enabled  # until the marker is there
    assert _until(lambda: _native.enabled), first_run.log.read_text()
    assert first_run.process.wait() == 0 and first_run.marker.exists()
    messages = capsys.readouterr().err
    assert "first run: numpy kernels now" in messages and "compiled kernels ready" in messages
    # the next command finds the marker: compiled from its first op, no process started
    assert background_compile.start(_args(["inspect", str(FIXTURE)])) is None and _native.enabled


def test_a_failed_compiling_process_leaves_numpy_kernels(capsys):
    first_run = background_compile.start(_args(["run", "no-such-model.onnx"]))
    assert first_run.process.wait() != 0
    seen = []
    assert _until(lambda: seen.append(capsys.readouterr().err) or "in the background failed" in "".join(seen), 10)
    assert not _native.enabled and not first_run.marker.exists()


def test_one_compiling_process_per_marker(tmp_path):
    import fcntl
    marker = background_compile.folder() / "held"
    marker.parent.mkdir(parents=True)
    with open(marker.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process compiling for this marker
        _native.disable()
        first_run = background_compile.FirstRun(marker, ["inspect", str(FIXTURE)], stream=io.StringIO())
        assert first_run.process is None and "another runnx process" in first_run.stream.getvalue()
        time.sleep(0.3)
        assert not _native.enabled
        marker.write_text("{}")  # what that process writes when it is done
        assert _until(lambda: _native.enabled, 10)


def test_the_compiling_process_writes_its_marker_only_on_success(tmp_path, monkeypatch):
    marker = tmp_path / "marker"
    monkeypatch.setenv("RUNNX_COMPILE_MARKER", str(marker))
    background_compile.finish(None, 1)
    assert not marker.exists()
    background_compile.finish(None, 0)
    assert marker.exists()


def test_modes(monkeypatch):
    monkeypatch.setenv("RUNNX_COMPILE", "never")
    assert background_compile.start(_args(["inspect", str(FIXTURE)])) is None and not _native.enabled
    _native.enable()
    monkeypatch.setenv("RUNNX_COMPILE", "wait")
    assert background_compile.start(_args(["inspect", str(FIXTURE)])) is None and _native.enabled
    monkeypatch.setenv("RUNNX_COMPILE", "later")
    with pytest.raises(RunnxError, match="RUNNX_COMPILE must be one of background, wait, never"):
        background_compile.mode()


def test_markers_differ_by_command_and_threads(monkeypatch):
    generate = background_compile.stamp(["generate", "/models/a", False])
    assert generate == background_compile.stamp(["generate", "/models/a", False])
    assert generate != background_compile.stamp(["generate", "/models/b", False])
    monkeypatch.setenv("RUNNX_THREADS", "1")
    assert generate != background_compile.stamp(["generate", "/models/a", False])


def test_wait_mode_names_each_kernel_it_compiles(capsys, monkeypatch):
    import numba
    monkeypatch.setattr(background_compile, "_SLOW_COMPILE", 0.0)
    monkeypatch.setattr(background_compile, "_showing", False)  # a listener of this test's own
    listener = background_compile.show_compiles()

    @numba.njit
    def doubled(x):
        return 2 * x

    try:
        assert doubled(21) == 42
    finally:
        numba.core.event.unregister("numba:compile", listener)
    lines = capsys.readouterr().err.splitlines()
    assert any(line.startswith("runnx:   doubled ready in ") for line in lines)


def test_blas_leaves_a_core_to_the_compiling_process(monkeypatch):
    import threadpoolctl
    limits = []
    monkeypatch.setattr(threadpoolctl, "threadpool_limits", lambda **kwargs: limits.append(kwargs))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    for variable in ("RUNNX_THREADS", "NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        monkeypatch.delenv(variable, raising=False)
    SHARE_CORES()
    assert limits == [{"limits": 1, "user_api": "blas"}]
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")  # the user's choice stands
    SHARE_CORES()
    assert len(limits) == 1
