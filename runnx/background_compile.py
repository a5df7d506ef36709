"""A command's first run does not wait for numba: numpy kernels now, the compiled ones built by a
process of its own, then used as soon as they are there.

numba compiles a kernel on its first call and caches it on disk; a decoder's fused kernels took
minutes of compiling before a first token. So the `runnx` command (`RUNNX_COMPILE`, default
`background`) keeps a marker per command and model (`stamp`: the subcommand's key, the kernels'
sources, numba's version, the thread settings) in the compiled code's folder. Without one, it
turns compiled kernels off (`runnx/ops/_native.py`: every op takes its numpy path), starts the same
command, shortened (`args.compile_argv`), in a process of its own that compiles whatever the
command calls, into numba's cache, and writes the marker when it is done; a thread of this
process then turns the kernels on, between two ops. A second command finds the marker and runs
compiled from its first op. A command ending before the compiling one leaves it running (its own
session, at a lower priority) for the next run. One compiling process per marker at a time (an
flock beside it); the others only watch for the marker.

`RUNNX_COMPILE=wait` compiles on first use, as numba does by itself, with a line on stderr per
kernel that takes long; `never` runs the numpy paths only, and compiles nothing.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from importlib.metadata import version
from pathlib import Path

try:
    import fcntl
except ImportError:  # no flock here: every first run starts its own compiling process
    fcntl = None

from runnx._cache_dirs import compiled_code_root
from runnx.errors import RunnxError
from runnx.ops import _native

MODES = ("background", "wait", "never")
_PACKAGE = Path(__file__).resolve().parent
_MARKER_VARIABLE = "RUNNX_COMPILE_MARKER"  # set for the compiling process: the marker it writes
_THREAD_VARIABLES = ("RUNNX_THREADS", "NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")
_POLL_SECONDS = 0.2
_SLOW_COMPILE = 1.0  # seconds from which a kernel numba compiles (or loads) is named on stderr


def mode() -> str:
    """RUNNX_COMPILE: background (default), wait or never."""
    value = os.environ.get("RUNNX_COMPILE", "background").strip().lower() or "background"
    if value not in MODES:
        raise RunnxError(f"RUNNX_COMPILE must be one of {', '.join(MODES)}, got '{value}'")
    return value


def folder() -> Path:
    """Where the markers go: `ready` beside numba's cache of runnx's kernels (`runnx/_cache_dirs.py`)."""
    return compiled_code_root(os.environ.get("NUMBA_CACHE_DIR")) / "ready"


def stamp(key: list) -> str:
    """The marker's name for a command's key: it changes with the kernels' sources (their newest
    time: a checkout or an edit compiles them again), numba's and Python's versions and the thread
    settings, which choose the kernels a run calls. numba's version from its metadata: a first run
    need not import numba at all."""
    sources = max(path.stat().st_mtime for pattern in ("ops/*.py", "capture/*.py", "runtime/*.py")
                  for path in _PACKAGE.glob(pattern))
    identity = [key, sources, version("numba"), sys.version, [os.environ.get(v) for v in _THREAD_VARIABLES]]
    return hashlib.sha1(json.dumps(identity, default=str).encode()).hexdigest()[:20]


def absolute(path: str) -> str:
    """A path argument as the same file from any folder (a key, or the compiling process's argv)."""
    return os.path.abspath(path)


class FirstRun:
    """The compiling process of a command and the thread that turns compiled kernels on."""

    def __init__(self, marker: Path, argv: list[str], stream=None):
        self.marker = marker
        self.stream = stream or sys.stderr
        self.started = time.perf_counter()
        self.process = None
        self.log = marker.with_suffix(".log")
        if not _locked(marker):
            env = dict(os.environ, RUNNX_COMPILE="wait", **{_MARKER_VARIABLE: str(marker)})
            with open(self.log, "w") as log:
                self.process = subprocess.Popen([sys.executable, "-m", "runnx.cli", *argv], env=env,
                                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
                                                start_new_session=True)
        _share_cores()
        who = f"pid {self.process.pid}, log {self.log}" if self.process else "another runnx process"
        self._say(f"first run: numpy kernels now, numba compiles the fast ones in the background ({who})")
        self._watcher = threading.Thread(target=self._watch, name="runnx-first-run", daemon=True)
        self._watcher.start()

    def _say(self, text: str) -> None:
        print(f"runnx: {text}", file=self.stream, flush=True)

    def _watch(self) -> None:
        while not self.marker.exists():
            if self.process is not None and self.process.poll() is not None and not self.marker.exists():
                self._say(f"compiling in the background failed (exit code {self.process.returncode}; see "
                          f"{self.log}): numpy kernels only")
                return
            time.sleep(_POLL_SECONDS)
        _native.enable()
        self._say(f"compiled kernels ready after {time.perf_counter() - self.started:.1f} s: using them from now on")

    def finish(self) -> None:
        """At the command's end: say what goes on compiling after it."""
        if not _native.enabled and self.process is not None and self.process.poll() is None:
            self._say(f"numba goes on compiling in the background (pid {self.process.pid}); the next run uses "
                      f"its kernels")


def _share_cores() -> None:
    """BLAS threads: one fewer than the cores (at least one) while a process compiles beside this
    one, unless the environment chose them: a one-row product split between two BLAS threads waits
    for the slower, and on a busy two-core machine SmolLM2's 24 numpy tokens took 50 s of wall time
    with two, 15 s with one. The process keeps it after the switch: its decode steps' products then
    go to the decode pool, not BLAS."""
    if any(os.environ.get(v) for v in _THREAD_VARIABLES):
        return
    import threadpoolctl
    threadpoolctl.threadpool_limits(limits=max(1, (os.cpu_count() or 1) - 1), user_api="blas")


def _locked(marker: Path) -> bool:
    """Whether another process is compiling for this marker now (it holds the lock beside it)."""
    if fcntl is None:
        return False
    try:
        with open(marker.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False


def start(args) -> FirstRun | None:
    """Before a command runs: what RUNNX_COMPILE asks for it (a FirstRun when it compiles in the
    background), for commands that name how (`args.compile_key`, `args.compile_argv`)."""
    if os.environ.get(_MARKER_VARIABLE):
        return _compiling_process()
    chosen = mode()
    if chosen == "wait":
        show_compiles()
        return None
    if chosen == "never":
        _native.disable()
        return None
    key_of, argv_of = getattr(args, "compile_key", None), getattr(args, "compile_argv", None)
    if key_of is None or argv_of is None or argv_of(args) is None:
        return None
    marker = folder() / stamp(key_of(args))
    if marker.exists():
        show_compiles()  # a kernel the compiling run did not call (other types) compiles on first use
        return None
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
    except OSError:  # nowhere to keep the marker: compile on first use, as numba would
        return None
    _native.disable()
    return FirstRun(marker, argv_of(args))


def _compiling_process() -> None:
    """In the compiling process: hold the marker's lock for its whole run, at a lower priority than
    the command it compiles for."""
    marker = Path(os.environ[_MARKER_VARIABLE])
    if fcntl is not None:
        global _held
        _held = open(marker.with_suffix(".lock"), "a")
        fcntl.flock(_held, fcntl.LOCK_EX)
    try:
        os.nice(10)
    except (AttributeError, OSError):
        pass
    show_compiles()


_held = None  # the compiling process's lock file, open until it exits
_showing = False  # whether `show_compiles` listens already


def finish(first_run: FirstRun | None, code: int) -> None:
    """After a command: the compiling process writes its marker when the command succeeded."""
    marker = os.environ.get(_MARKER_VARIABLE)
    if marker and code == 0:
        Path(marker).write_text(json.dumps({"argv": sys.argv[1:], "pid": os.getpid()}) + "\n")
    if first_run is not None:
        first_run.finish()


def show_compiles():
    """Lines on stderr for each kernel numba takes long to compile (or load): one when it has taken
    `_SLOW_COMPILE` seconds, one when it is done, so that a run that compiles never looks hung (once
    a process; numba compiles one kernel at a time); the numba event listener that prints them."""
    global _showing
    if _showing:
        return None
    _showing = True
    from numba.core import event

    state = {"depth": 0, "started": 0.0, "timer": None}

    def name(ev) -> str:
        return getattr(getattr(ev.data.get("dispatcher"), "py_func", None), "__name__", "a kernel")

    def announce(kernel: str) -> None:
        print(f"runnx: compiling {kernel} with numba (once: its cache keeps it)", file=sys.stderr, flush=True)

    class Listener(event.Listener):
        def on_start(self, ev):
            if state["depth"] == 0:
                state["started"] = time.perf_counter()
                state["timer"] = threading.Timer(_SLOW_COMPILE, announce, (name(ev),))
                state["timer"].daemon = True
                state["timer"].start()
            state["depth"] += 1

        def on_end(self, ev):
            state["depth"] -= 1
            if state["depth"] == 0:
                state["timer"].cancel()
                elapsed = time.perf_counter() - state["started"]
                if elapsed >= _SLOW_COMPILE:
                    print(f"runnx:   {name(ev)} ready in {elapsed:.1f} s", file=sys.stderr, flush=True)

    listener = Listener()
    event.register("numba:compile", listener)
    return listener
