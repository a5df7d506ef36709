"""Where numba caches runnx's compiled kernels, and two repairs of its on-disk cache.

Every module with `cache=True` functions imports this module before decorating them. It puts
`RunnxCacheLocator` first among numba's cache locators: the kernels of a runnx install go to
`${RUNNX_CACHE:-~/.cache/runnx}/numba/runnx-<version>-<hash of the install's path>/` (under
`$NUMBA_CACHE_DIR/runnx/` instead when the user set numba's own variable), never into the source
tree: a wheel in a site-packages nobody can write caches like an editable install, and two
installs or working copies never share a folder. A folder that cannot be written leaves the
choice to numba's own locators.

numba checks a cached function against its own source file only. A kernel compiled into a
function of another module stays there: `runtime/units.py`'s units inline `_kernels_fused.py`'s
attention, and after an edit of `_kernels_fused.py` (or a checkout that changes it) they kept
running the old attention from the cache, without a sign. So the index files older than the
newest of the cached modules' sources are removed: numba recompiles what they indexed on first
use. An install writes every file anew and the cache after them, so this only ever removes
anything in a working copy whose kernels changed.

numba also saves a new compiled signature without a lock: it reads the function's index, takes the
first data file number no entry names, writes the index, then the data. Two processes compiling
two signatures of one function at once (the test suite's two workers, a server's first requests)
both take number 1: the index ends up naming one signature and the file holding the other's code,
which a later load runs on the wrong types ("can't unbox array", seen after an edit here).
`serialize_saves` holds an exclusive lock on a file beside the index for each save.

Before each load from its cache, numba refreshes its whole compiler context: the first time in a
process that imports and registers every typing and lowering module numba has (about a quarter
of a second), which only a compile needs (numba's compiler refreshes it again itself). A cached
kernel needs numba's runtime (NRT) and nothing else, so `light_loads` initializes only that before
a load of runnx's own kernels: a first prompt pays for the kernels it loads, not for numba's
compiler. Each such request is reported to `on_cache_request` (`kernel_loads.py` records a model's, to
load them ahead in the next process).

A cached kernel is its machine code and a bitcode copy of its LLVM module, which numba parses at
every load (for the names the kernel defines, and to link it into a function compiled later that
calls it): two thirds of a load, 140 ms of a fresh process's first 4-bit prompt. `lazy_bitcode`
takes the names from the machine code's ELF symbol table instead (the same set), and parses the
bitcode only when a compile links the kernel.
"""
from __future__ import annotations

import hashlib
import os
import struct
import sys
import threading
import time
from pathlib import Path

from numba.core import caching, config

from runnx._cache_dirs import compiled_code_root

try:
    import fcntl
except ImportError:  # not on this system: saves stay unlocked, as numba makes them
    fcntl = None

_PACKAGE = Path(__file__).resolve().parents[1]
# the modules with numba functions cached on disk (`cache=True`), which call into one another
CACHED_MODULES = ("capture/capacity.py", "ops/_decode_blocks.py", "ops/_kernels_attention_blocks.py",
                  "ops/_kernels_contrib.py", "ops/_kernels_contrib_attention.py", "ops/_kernels_elementwise.py",
                  "ops/_kernels_fused.py", "ops/_kernels_gemm.py", "ops/_kernels_integer.py", "ops/_kernels_linalg.py",
                  "ops/_kernels_nibble_layout.py", "ops/_kernels_nibble_tiles.py", "ops/_kernels_nn.py",
                  "ops/_kernels_numpy_exp.py", "ops/_kernels_rows.py", "ops/_kernels_vnni.py", "runtime/arena_functions.py", "runtime/board.py",
                  "runtime/jobs.py", "runtime/mailbox.py", "runtime/units.py")
# and the modules whose constants those kernels compile in (the decode pool's job layout)
CONSTANT_MODULES = ("runtime/slots.py",)
_SOURCES = tuple(_PACKAGE / module for module in CACHED_MODULES + CONSTANT_MODULES)


def cache_folder() -> Path:
    """The folder numba caches this install's kernels in (see the module docstring)."""
    root = compiled_code_root(config.CACHE_DIR)
    from runnx import __version__
    install = hashlib.sha256(str(_PACKAGE).encode()).hexdigest()[:16]
    return root / f"runnx-{__version__}-{install}"


class RunnxCacheLocator(caching._SourceFileBackedLocatorMixin, caching._CacheLocator):
    """numba's cache locator for the functions of runnx's own modules: `cache_folder()`."""

    def __init__(self, py_func, py_file):
        self._py_file = py_file
        self._lineno = py_func.__code__.co_firstlineno
        self._cache_path = str(cache_folder())

    def get_cache_path(self):
        return self._cache_path

    @classmethod
    def from_function(cls, py_func, py_file):
        """A locator for a function of a runnx module whose cache folder can be written, else None
        (numba asks its next locator)."""
        if not Path(py_file).resolve().is_relative_to(_PACKAGE):
            return None
        return super().from_function(py_func, py_file)


def locate_in_cache_folder() -> None:
    """Make `RunnxCacheLocator` numba's first choice (once): before any runnx function is
    decorated, since numba picks a function's locator then."""
    locators = getattr(caching, "CacheImpl", None) or caching._CacheImpl  # `_CacheImpl` in older numba
    if RunnxCacheLocator not in locators._locator_classes:
        locators._locator_classes.insert(0, RunnxCacheLocator)


def drop_stale(sources=_SOURCES, folders=None) -> int:
    """Remove the numba index files (*.nbi) in `folders` (by default this install's cache folder
    and the sources' `__pycache__`, where an older runnx cached) that are older than the newest
    source; how many. Folders numba cannot write to are left alone. A source dated in the future
    (a skewed clock, a copied tree) removes nothing: every index written before that date would
    go at every start, and everything would compile again each time."""
    if folders is None:
        folders = {cache_folder(), *(Path(source).parent / "__pycache__" for source in sources)}
    try:
        newest = max(os.stat(source).st_mtime for source in sources)
    except (OSError, ValueError):
        return 0
    if newest > time.time():
        return 0
    return sum(remove_older(folder, ".nbi", newest) for folder in folders)


def remove_older(folder, suffix: str, before: float) -> int:
    """Remove the files of `folder` named *suffix last modified before `before` (a time); how many.
    Best effort: a folder or file that cannot be read or removed is left alone."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return 0
    removed = 0
    for entry in entries:
        try:
            if entry.name.endswith(suffix) and entry.stat().st_mtime < before:
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
    from numba.core.caching import IndexDataCacheFile
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


on_cache_request = None  # called with (function, signature) before each load of a runnx kernel: kernel_loads.py


def light_loads() -> bool:
    """Load runnx's cached kernels with numba's runtime initialized instead of its whole compiler
    context refreshed (see the module docstring); whether that is in place. Other packages' numba
    caches load as numba does."""
    load = caching.Cache.load_overload
    if getattr(load, "light", False):
        return True
    from numba.core.runtime import nrt

    def light_load(self, sig, target_context):
        if not isinstance(self._impl.locator, RunnxCacheLocator):
            return load(self, sig, target_context)
        if on_cache_request is not None:
            on_cache_request(self._py_func, sig)
        nrt.rtsys.initialize(target_context)  # once per process: what compiled code calls into
        outer, _loading.runnx = getattr(_loading, "runnx", False), True
        try:
            return self._load_overload(sig, target_context)
        finally:
            _loading.runnx = outer

    light_load.light = True
    caching.Cache.load_overload = light_load
    return True


_loading = threading.local()  # runnx: this thread is loading one of runnx's kernels (`light_loads`)


LOADING_SWITCH = 0.0002  # seconds: the interpreter's switch interval while `switching_often`
_switching = [0, 0.005, 0.0]  # threads inside; the interval the first of them found; as set (rounded)
_switch_lock = threading.Lock()


class switching_often:
    """A context for a thread loading kernels in the background: the interpreter's switch interval
    LOADING_SWITCH instead of 5 ms meanwhile. Why: numba's load makes hundreds of LLVM calls through
    ctypes, each releasing the GIL and then waiting to take it back, which beside another thread's
    Python lasts the interval. The interval is the process's: the first thread in sets it, the last
    out puts back what the first found (unless someone changed it since)."""

    __slots__ = ()

    def __enter__(self):
        with _switch_lock:
            if _switching[0] == 0:
                _switching[1] = sys.getswitchinterval()
                sys.setswitchinterval(LOADING_SWITCH)
                _switching[2] = sys.getswitchinterval()
            _switching[0] += 1
        return self

    def __exit__(self, *failure):
        with _switch_lock:
            _switching[0] -= 1
            if _switching[0] == 0 and sys.getswitchinterval() == _switching[2]:
                sys.setswitchinterval(_switching[1])
        return False


def lazy_bitcode() -> bool:
    """Load runnx's cached kernels with the names they define read from their machine code, their
    bitcode parsed only when a compile links them (see the module docstring); whether that is in
    place. Other packages' kernels, and machine code that is not 64-bit little-endian ELF, load as
    numba loads them."""
    from numba.core import codegen
    library = codegen.CPUCodeLibrary
    unserialize, for_linking = getattr(library, "_unserialize", None), getattr(library, "_get_module_for_linking", None)
    if getattr(unserialize, "lazy", False):
        return True
    if unserialize is None or for_linking is None or not hasattr(library, "_finalize_final_module"):
        return False  # (another numba: its loads as they are)

    def lazy_unserialize(cls, codegen_, state):
        name, kind, data = state
        lazy = (kind == "object" and getattr(_loading, "runnx", False)
                and hasattr(getattr(codegen_, "_engine", None), "_defined_symbols"))
        names = elf_defined_symbols(data[0]) if lazy else None
        if names is None:
            return unserialize.__func__(cls, codegen_, state)
        # numba's own steps for kind "object" (codegen.CPUCodeLibrary._unserialize), the bitcode kept
        self = codegen_.create_library(name)
        self.enable_object_caching()
        self._set_compiled_object(data[0])
        self._runnx_bitcode = data[1]
        self._finalize_final_module()
        codegen_._engine._defined_symbols |= names
        return self

    def module_for_linking(self):
        bitcode = self.__dict__.pop("_runnx_bitcode", None)
        if bitcode is not None:  # as numba's load would have made it
            from llvmlite import binding
            self._shared_module = binding.parse_bitcode(bitcode)
            self._codegen._engine._load_defined_symbols(self._shared_module)
        return for_linking(self)

    lazy_unserialize.lazy = True
    library._unserialize = classmethod(lazy_unserialize)
    library._get_module_for_linking = module_for_linking
    return True


_SYMTAB, _UNDEFINED, _SECTION_OR_FILE = 2, 0, (3, 4)  # ELF's SHT_SYMTAB, SHN_UNDEF, STT_SECTION and STT_FILE


def elf_defined_symbols(code: bytes) -> set[str] | None:
    """The names of the symbols a 64-bit little-endian ELF object file defines (numba's machine code
    for a kernel on Linux), or None when `code` is not one or defines none."""
    if len(code) < 64 or code[:4] != b"\x7fELF" or code[4] != 2 or code[5] != 1:
        return None
    try:
        (sections_at,), (entry_size, count) = struct.unpack_from("<Q", code, 0x28), struct.unpack_from("<HH", code, 0x3A)
        sections = [struct.unpack_from("<IIQQQQIIQQ", code, sections_at + i * entry_size) for i in range(count)]
        names = set()
        for section in sections:
            if section[1] != _SYMTAB or section[9] == 0:
                continue
            strings = sections[section[6]][4]
            for at in range(section[4], section[4] + section[5], section[9]):
                name, info, _, index = struct.unpack_from("<IBBH", code, at)
                if name and index != _UNDEFINED and info & 0xF not in _SECTION_OR_FILE:
                    names.add(code[strings + name:code.index(b"\0", strings + name)].decode())
        return names or None  # (none found: numba's own load reads them)
    except (struct.error, IndexError, ValueError, UnicodeDecodeError):
        return None


locate_in_cache_folder()
light_loads()  # before any kernel loads from numba's cache
lazy_bitcode()  # before any kernel loads from numba's cache
drop_stale()  # before any kernel loads from numba's cache
serialize_saves()  # before any kernel compiles
