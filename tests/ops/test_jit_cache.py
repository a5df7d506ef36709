"""numba caches runnx's kernels in runnx's cache folder, never beside the sources; stale indexes
are removed before kernels load (a kernel inlined into another module's cached function must not
outlive an edit of its own file); saves are locked; loads parse no bitcode until a compile needs it."""
import importlib
import inspect
import os
import time
from pathlib import Path

import numpy as np
from numba.core.caching import FunctionCache
from numba.core.registry import CPUDispatcher

from runnx.ops import _jit_cache


def test_the_cached_modules_are_every_module_caching_numba_functions():
    package = Path(_jit_cache.__file__).resolve().parents[1]
    caching = {str(path.relative_to(package)) for path in package.rglob("*.py")
               if "cache=True" in path.read_text() and path.name != "_jit_cache.py"}
    assert caching == set(_jit_cache.CACHED_MODULES)


def test_every_cached_kernel_caches_into_the_cache_folder_of_this_install():
    """Each cached module imports `_jit_cache` before decorating its kernels (numba picks a
    function's cache folder then): the folder is under RUNNX_CACHE, keyed by this install."""
    folder = _jit_cache.cache_folder()
    assert folder.name.startswith("runnx-") and _jit_cache._PACKAGE not in folder.parents
    kernels = 0
    for module in _jit_cache.CACHED_MODULES:
        namespace = vars(importlib.import_module("runnx." + module.removesuffix(".py").replace("/", ".")))
        for value in namespace.values():
            if isinstance(value, CPUDispatcher) and isinstance(value._cache, FunctionCache):
                assert isinstance(value._cache._impl.locator, _jit_cache.RunnxCacheLocator), value
                assert Path(value._cache.cache_path) == folder
                kernels += 1
    assert kernels >= len(_jit_cache.CACHED_MODULES)


def test_no_compiled_kernel_has_a_default_argument():
    """A call from Python that omits a numba function's default argument does not take numba's fast
    dispatch: it resolved the `omitted` type in Python, tens of microseconds a call, and a decode
    pool's float products (`post_products` with its zero point and scale left out) paid it on every
    node of a decode step. So compiled kernels take every argument."""
    with_defaults = []
    for module in _jit_cache.CACHED_MODULES:
        namespace = vars(importlib.import_module("runnx." + module.removesuffix(".py").replace("/", ".")))
        for name, value in namespace.items():
            if isinstance(value, CPUDispatcher):
                parameters = inspect.signature(value.py_func).parameters.values()
                if any(p.default is not inspect.Parameter.empty for p in parameters):
                    with_defaults.append(f"{module}: {name}")
    assert with_defaults == []


def test_the_folder_follows_runnx_cache_and_numba_cache_dir(tmp_path, monkeypatch):
    from numba.core import config
    monkeypatch.setenv("RUNNX_CACHE", str(tmp_path / "runnx"))
    monkeypatch.setattr(config, "CACHE_DIR", "")
    assert _jit_cache.cache_folder().parent == tmp_path / "runnx" / "numba"
    monkeypatch.setattr(config, "CACHE_DIR", str(tmp_path / "numba"))  # the user's NUMBA_CACHE_DIR wins
    assert _jit_cache.cache_folder().parent == tmp_path / "numba" / "runnx"


def test_indexes_older_than_the_newest_source_are_removed(tmp_path):
    sources = [tmp_path / "a.py", tmp_path / "b.py"]
    cache = tmp_path / "__pycache__"
    cache.mkdir()
    files = {name: cache / name for name in ("a.f-1.py311.nbi", "b.g-2.py311.nbi", "a.f-1.py311.1.nbc")}
    for path in [*sources, *files.values()]:
        path.write_text("")
    # b.py edited after a's function was cached (and its data), before b's was
    for path, when in ((sources[0], 100), (files["a.f-1.py311.nbi"], 200), (files["a.f-1.py311.1.nbc"], 200),
                       (sources[1], 300), (files["b.g-2.py311.nbi"], 400)):
        os.utime(path, (when, when))
    assert _jit_cache.drop_stale(sources, [cache]) == 1
    assert sorted(p.name for p in cache.iterdir()) == ["a.f-1.py311.1.nbc", "b.g-2.py311.nbi"]
    assert _jit_cache.drop_stale(sources, [cache]) == 0


def test_missing_sources_or_folders_remove_nothing(tmp_path):
    assert _jit_cache.drop_stale([tmp_path / "gone.py"], [tmp_path / "cache"]) == 0
    (tmp_path / "a.py").write_text("")
    assert _jit_cache.drop_stale([tmp_path / "a.py"], [tmp_path / "cache"]) == 0


def test_a_source_dated_in_the_future_removes_nothing(tmp_path):
    """Else every index written before that date would go at each start: a compile every run."""
    source, index = tmp_path / "a.py", tmp_path / "__pycache__" / "a.f-1.py311.nbi"
    index.parent.mkdir()
    source.write_text("")
    index.write_text("")
    later = time.time() + 3600
    os.utime(source, (later, later))
    assert _jit_cache.drop_stale([source], [index.parent]) == 0 and index.exists()


def test_two_saves_at_once_keep_each_signatures_own_code(tmp_path, monkeypatch):
    """Two writers of one function's cache, each saving a new signature: both read the index before
    either writes it, and the first one's data lands last. Unlocked, both take data file 1 and the
    index names the second signature while the file holds the first's code; with the lock each
    signature loads its own."""
    import threading
    from numba.core.caching import IndexDataCacheFile

    assert _jit_cache.serialize_saves()
    index_read = threading.Barrier(2, timeout=1)
    load_index, save_data = IndexDataCacheFile._load_index, IndexDataCacheFile._save_data

    def racing_load_index(self):
        overloads = load_index(self)
        try:
            index_read.wait()  # both read the empty index first, unless a lock keeps one out
        except threading.BrokenBarrierError:
            pass
        return overloads

    def late_first_data(self, name, data):
        if data == "first":
            time.sleep(0.2)
        save_data(self, name, data)

    monkeypatch.setattr(IndexDataCacheFile, "_load_index", racing_load_index)
    monkeypatch.setattr(IndexDataCacheFile, "_save_data", late_first_data)
    files = [IndexDataCacheFile(str(tmp_path), "f-1.py311", "stamp") for _ in range(2)]
    writers = [threading.Thread(target=f.save, args=(key, key)) for f, key in zip(files, ("first", "second"))]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    monkeypatch.undo()
    reader = IndexDataCacheFile(str(tmp_path), "f-1.py311", "stamp")
    assert reader.load("first") == "first" and reader.load("second") == "second"


_LOAD_ONE_KERNEL = """
import sys
import numpy as np
from runnx.capture.capacity import allocate_prefix, prefix_room
view = allocate_prefix((1, 2, 3, 4), 2, 10, np.float32)
print(prefix_room(view, view.base, 2), prefix_room.stats.cache_hits.get(prefix_room.signatures[0], 0),
      "numba.np.polynomial.polynomial_core" in sys.modules)
"""


def test_a_cached_kernel_loads_without_refreshing_numbas_compiler(tmp_path):
    """The first process compiles the kernel (numba's compiler context and all its modules); the
    second loads it from the cache with only numba's runtime initialized: a right result from the
    cache, and numba's compiler modules never imported."""
    import subprocess
    import sys
    environment = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path), PYTHONPATH=str(_jit_cache._PACKAGE.parent))
    runs = [subprocess.run([sys.executable, "-c", _LOAD_ONE_KERNEL], capture_output=True, text=True,
                           env=environment, check=True).stdout.split() for _ in range(2)]
    assert runs[0] == ["7", "0", "True"]  # compiled: the compiler's modules are loaded
    assert runs[1] == ["7", "1", "False"]  # loaded from the cache, the compiler left alone


_LINK_A_LOADED_KERNEL = """
import numba
import numpy as np
from llvmlite import binding
from runnx.capture.capacity import allocate_prefix, prefix_room
parsed = []
parse = binding.parse_bitcode
binding.parse_bitcode = lambda data: parsed.append(len(data)) or parse(data)
view = allocate_prefix((1, 2, 3, 4), 2, 10, np.float32)
room = prefix_room(view, view.base, 2)
loaded_parsing = len(parsed)


@numba.njit
def twice(view, base):
    return 2 * prefix_room(view, base, 2)


print(room, prefix_room.stats.cache_hits.get(prefix_room.signatures[0], 0), loaded_parsing, twice(view, view.base),
      len(parsed) > loaded_parsing)
"""


def test_a_cached_kernel_loads_without_its_bitcode_until_a_compile_links_it(tmp_path):
    """The second process loads the kernel from the cache without parsing its bitcode (the names it
    defines come from its machine code), and a function compiled after that calls it links it: the
    bitcode parsed then, the call right."""
    import subprocess
    import sys
    environment = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path), PYTHONPATH=str(_jit_cache._PACKAGE.parent))
    runs = [subprocess.run([sys.executable, "-c", _LINK_A_LOADED_KERNEL], capture_output=True, text=True,
                           env=environment, check=True).stdout.split() for _ in range(2)]
    assert runs[0][0] == "7" and runs[0][1] == "0" and runs[0][3] == "14"  # compiled
    assert runs[1] == ["7", "1", "0", "14", "True"]  # loaded unparsed, then linked


def test_the_names_a_kernel_defines_come_from_its_machine_code_as_from_its_bitcode():
    """`elf_defined_symbols` of a compiled kernel's machine code is the set of names numba reads
    from its bitcode (every defined function and global); anything but ELF gives None."""
    import numba
    from llvmlite import binding

    @numba.njit
    def summed(x):
        return np.sin(x).sum()

    summed(np.ones(3))
    name, kind, (code, bitcode) = summed.overloads[summed.signatures[0]].library.serialize_using_object_code()
    module = binding.parse_bitcode(bitcode)
    defined = {value.name for values in (module.functions, module.global_variables) for value in values
               if not value.is_declaration}
    assert kind == "object" and len(defined) > 1
    assert _jit_cache.elf_defined_symbols(code) == defined
    assert _jit_cache.elf_defined_symbols(b"\xcf\xfa\xed\xfe" + code[4:]) is None  # a Mach-O header
    assert _jit_cache.elf_defined_symbols(code[:40]) is None
