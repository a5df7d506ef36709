"""Stale compiled kernels out of numba's on-disk cache, before any kernel loads from it.

numba checks a cached function against its own source file only (its time and size). A kernel
compiled into a function of another module stays there: `_decode_mailbox.py`'s jobs inline
`_kernels_fused.py`'s attention, and after an edit of `_kernels_fused.py` (or a checkout that
changes it) they kept running the old attention from the cache, without a sign. So the index files
of the cached modules' `__pycache__` folders older than the newest of those modules' sources are
removed: numba recompiles what they indexed on first use. An install writes every file anew and
the cache after them, so this only ever removes anything in a working copy whose kernels changed.

numba also saves a new compiled signature without a lock: it reads the function's index, takes the
first data file number no entry names, writes the index, then the data. Two processes compiling
two signatures of one function at once (the test suite's two workers, a server's first requests)
both take number 1: the index ends up naming one signature and the file holding the other's code,
which a later load runs on the wrong types ("can't unbox array", seen after an edit here).
`serialize_saves` holds an exclusive lock on a file beside the index for each save.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

try:
    import fcntl
except ImportError:  # not on this system: saves stay unlocked, as numba makes them
    fcntl = None

_PACKAGE = Path(__file__).resolve().parents[1]
# the modules with numba functions cached on disk (`cache=True`), which call into one another
CACHED_MODULES = ("capture/capacity.py", "ops/_decode_blocks.py", "ops/_decode_mailbox.py",
                  "ops/_kernels_elementwise.py", "ops/_kernels_fused.py", "ops/_kernels_linalg.py",
                  "ops/_kernels_nn.py", "ops/_kernels_whisper.py")


def drop_stale(sources=tuple(_PACKAGE / module for module in CACHED_MODULES)) -> int:
    """Remove the numba index files (*.nbi) in the sources' `__pycache__` folders that are older
    than the newest source; how many. Folders numba cannot write to are left alone (it then
    caches elsewhere, under the user's cache folder, for files an install wrote at once). A source
    dated in the future (a skewed clock, a copied tree) removes nothing: every index written
    before that date would go at every start, and everything would compile again each time."""
    try:
        newest = max(os.stat(source).st_mtime for source in sources)
    except (OSError, ValueError):
        return 0
    if newest > time.time():
        return 0
    removed = 0
    for folder in {Path(source).parent / "__pycache__" for source in sources}:
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.name.endswith(".nbi") and entry.stat().st_mtime < newest:
                    os.remove(entry.path)
                    removed += 1
            except OSError:  # removed by another process starting at the same time, or read-only
                continue
    return removed


def serialize_saves() -> bool:
    """Make numba's cache saves exclusive between processes (and threads): each holds a lock on
    `<index>.lock` from reading the index to writing the data; whether saves are locked now. Only
    adds the lock: where it cannot be taken (no fcntl, a folder without write access), numba saves
    as it would."""
    try:
        from numba.core.caching import IndexDataCacheFile
    except ImportError:
        return False
    save = IndexDataCacheFile.save
    if fcntl is None or getattr(save, "locked", False):
        return getattr(save, "locked", False)

    def locked_save(self, key, data):
        try:
            lock = open(self._index_path + ".lock", "a")
        except OSError:
            return save(self, key, data)
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            return save(self, key, data)

    locked_save.locked = True
    IndexDataCacheFile.save = locked_save
    return True
