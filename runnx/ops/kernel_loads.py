"""A model's compiled kernels, loaded ahead of its first run in later processes.

A process's first run of a model loads each numba kernel it calls from numba's on-disk cache at
that kernel's first call, about 5-30 ms each: most of what a first 32-token prompt costs more than
the second. Which kernels a model calls, for which argument types, depends on the model, not on
the values. So what a model's runs ask numba's cache for is recorded (`Recorder`: kernel and
signature, as numba prints it, in a small JSON file per model file beside numba's cache), and the
next process loading the same file loads those signatures from the cache, on a thread of its own
while it reads the weights (`load_in_background`).

Only loads from numba's cache happen on that thread: a kernel the cache does not hold (the sources
changed, another numba) is left to its first call, which compiles it as before (or takes numpy's
path while a background compile runs, `ops/_native.py`). A record that cannot be read (another
runnx, a damaged file) loads nothing. Loading ahead changes no result: it is the same compiled
code, loaded earlier.
"""
from __future__ import annotations

import hashlib
import importlib
import json
import os
import threading
import time
from pathlib import Path

from numba.core.compiler_lock import global_compiler_lock

from runnx.ops import _jit_cache, _native

# modules whose functions a model's runs call but which are the process's, loaded on a thread of
# their own when wanted: the arena's allocator (runtime/arena.py; not in a process where glibc keeps
# freed memory), whose loads beside a first prompt held the GIL through it (30 ms of a first token)
_NOT_A_MODELS = ("runnx.runtime.arena_functions",)
_running = threading.local()  # .recorder: the Recorder of the run on this thread, if any
_RECORD_FORMAT = 2  # in a record's key: records written before callees were left out are not read
_KEPT_SECONDS = 30 * 24 * 3600  # a record neither loaded nor written for this long goes (its model is gone)


def record_path(model_path: str | os.PathLike) -> Path | None:
    """Where the loads of the model file at `model_path` are recorded: keyed by its real path, size
    and modification time, so a rewritten file starts a new record. None when it cannot be read."""
    try:
        real = os.path.realpath(model_path)
        status = os.stat(real)
    except (OSError, TypeError, ValueError):
        return None
    key = hashlib.sha256(f"{_RECORD_FORMAT}\0{real}\0{status.st_size}\0{status.st_mtime_ns}".encode()).hexdigest()[:32]
    return _jit_cache.cache_folder() / "loads" / f"{key}.json"


class Recorder:
    """The kernels (module, qualified name, signature as numba prints it) a model's runs asked
    numba's cache for, in the order first asked, kept in `path`. `running()` marks the calling
    thread's loads as the model's; `save()` writes the record when it grew."""

    def __init__(self, path: Path | None):
        self.path = path
        self._entries: dict[tuple, None] = dict.fromkeys(read_record(path)) if path is not None else {}
        self._saved = len(self._entries)
        self._lock = threading.Lock()
        self.ahead: threading.Thread | None = None  # `load_in_background`'s thread for this model

    def wait_ahead(self) -> None:
        """Let the loads ahead finish before this model's first run asks for kernels: beside a run,
        the loading thread and the run take the GIL and numba's compiler lock from each other, and
        the kernels the run waits for come last (a 32-token 4-bit prompt's first run took 76-98 ms
        instead of 57-60 when loads were left; joined first, what is left takes 15-25 ms)."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            ahead.join()

    def note(self, entry: tuple) -> None:
        with self._lock:
            self._entries.setdefault(entry)

    def save(self) -> None:
        """Write the record if a run added to it (best effort: a folder that cannot be written keeps
        none; a concurrent writer's file is replaced whole, never mixed)."""
        if self.path is None or len(self._entries) == self._saved:
            return
        with self._lock:
            entries, self._saved = list(self._entries), len(self._entries)
        temporary = self.path.with_name(f"{self.path.name}.{os.getpid()}.{threading.get_ident()}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            temporary.write_text(json.dumps([list(entry) for entry in entries]))
            os.replace(temporary, self.path)
        except OSError:
            try:
                temporary.unlink()
            except OSError:
                pass
        _forget_old(self.path.parent)

    def running(self) -> _Running:
        return _Running(self)


class _Running:
    __slots__ = ("before", "recorder")

    def __init__(self, recorder: Recorder):
        self.recorder = recorder

    def __enter__(self):
        if self.recorder.ahead is not None:
            self.recorder.wait_ahead()
        self.before = getattr(_running, "recorder", None)  # a nested model's run records as its own
        _running.recorder = self.recorder

    def __exit__(self, *failure):
        _running.recorder = self.before
        if self.before is None:
            self.recorder.save()


def _forget_old(folder: Path) -> None:
    """Remove the records neither loaded nor written for `_KEPT_SECONDS` (best effort): a record
    is keyed by its model file's path and date, so a deleted or rewritten model leaves one behind."""
    _jit_cache.remove_older(folder, ".json", time.time() - _KEPT_SECONDS)


def read_record(path: Path) -> list[tuple[str, str, str]]:
    """The (module, qualified name, signature) entries recorded at `path`; [] when there is none or
    it cannot be read."""
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):  # no record, or a damaged one: load nothing ahead
        return []
    if not isinstance(entries, list):
        return []
    return [tuple(entry) for entry in entries if isinstance(entry, list) and len(entry) == 3
            and all(isinstance(part, str) for part in entry) and entry[0] not in _NOT_A_MODELS]


def _noted(py_func, signature) -> None:
    """`_jit_cache`'s hook, on every request to numba's cache for one of runnx's kernels. A request
    made while another kernel compiles (a kernel it calls, whose code is linked into it) is not
    the model's: a later process loads the caller whole, and loading its callees too would cost
    a millisecond or more each, beside the first prompt, for nothing."""
    recorder = getattr(_running, "recorder", None)
    if (recorder is not None and "<locals>" not in py_func.__qualname__ and py_func.__module__ not in _NOT_A_MODELS
            and not _inside_a_compile()):
        recorder.note((py_func.__module__, py_func.__qualname__, str(signature)))


def _inside_a_compile() -> bool:
    """Whether this thread asks numba's cache from inside another kernel's compile: numba holds its
    compiler lock (re-entrant) once for a kernel's own compile or load, again for each kernel that
    compile calls. Where the lock cannot tell, every request counts (records keep callees too)."""
    depth = getattr(global_compiler_lock._lock, "_recursion_count", None)
    return depth is not None and depth() > 1


_jit_cache.on_cache_request = _noted


def load_in_background(path: Path | None) -> threading.Thread | None:
    """Load the kernels recorded at `path` from numba's cache on a thread of its own (returned, or
    None when there is nothing to load). Not a daemon thread: a process ending while numba loads
    aborts inside LLVM, so the interpreter waits for it at exit."""
    if path is None or not _native.enabled:
        return None
    entries = read_record(path)
    if not entries:
        return None
    try:
        os.utime(path)  # in use: kept (`_forget_old`)
    except OSError:
        pass
    thread = threading.Thread(target=_load_switching_often, args=(entries,), name="runnx-kernel-loads")
    thread.start()
    return thread


def _load_switching_often(entries: list[tuple[str, str, str]]) -> None:
    """`load_cached` with the GIL changing hands often (`_jit_cache.switching_often`): beside a
    loading model's Python (imports, the graph's rewrites, a tokenizer's load) a 4-bit SmolLM2's
    loads were otherwise still going when its load ended (15-25 ms of them left, taken by its first
    prompt: 75-95 ms instead of 57-60)."""
    with _jit_cache.switching_often():
        load_cached(entries)


def load_cached(entries: list[tuple[str, str, str]]) -> int:
    """Load each (module, qualified name, signature) from numba's cache where it holds it; how many
    were loaded. Nothing compiles: a missing function or signature is skipped."""
    wanted: dict[tuple[str, str], set[str]] = {}
    for module_name, qualname, signature in entries:
        wanted.setdefault((module_name, qualname), set()).add(signature)
    loaded = 0
    for (module_name, qualname), signatures in wanted.items():
        try:
            dispatcher = _resolve(module_name, qualname)
            for signature in _cached_signatures(dispatcher):
                if str(signature) in signatures:
                    loaded += _load_cached(dispatcher, signature)
        except Exception:  # a renamed kernel, an index of another numba: its first call decides
            continue
    return loaded


def _resolve(module_name: str, qualname: str):
    if not module_name.startswith("runnx."):
        raise LookupError(module_name)
    target = importlib.import_module(module_name)
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def _cached_signatures(dispatcher) -> list[tuple]:
    """The signatures in the dispatcher's cache index (numba's pickled index, read by numba itself)
    for this machine's code generator; [] for anything but a cached dispatcher (a cfunc, an
    intrinsic: its first use loads it)."""
    cache, overloads = getattr(dispatcher, "_cache", None), getattr(dispatcher, "overloads", None)
    cache_file = getattr(cache, "_cache_file", None)
    if cache_file is None or overloads is None:
        return []
    machine = dispatcher.targetctx.codegen().magic_tuple()
    return [key[0] for key in cache_file._load_index() if key[1] == machine and isinstance(key[0], tuple)]


def _load_cached(dispatcher, signature: tuple) -> int:
    """What numba's Dispatcher.compile does on a cache hit, and nothing on a miss; 1 if loaded."""
    with global_compiler_lock:
        if signature in dispatcher.overloads:
            return 0
        compiled = dispatcher._cache.load_overload(signature, dispatcher.targetctx)
        if compiled is None:
            return 0
        if not compiled.objectmode:
            dispatcher.targetctx.insert_user_function(compiled.entry_point, compiled.fndesc, [compiled.library])
        dispatcher.add_overload(compiled)
    return 1
