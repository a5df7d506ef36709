"""Reading a model file without copying its weights through protobuf.

`onnx.load` reads the whole file into a bytes object, then protobuf parses it, copying every
initializer's raw_data once more, and reading `raw_data` copies it a third time: for a model of
hundreds of MB, most of a load. Here the file is memory-mapped and its wire format walked just deep
enough to find the top-level graph's initializers (ModelProto field 7, GraphProto field 5): the
protobuf parsed is the file without their raw_data (field 9 of TensorProto), a few MB of nodes and
names, and each initializer's bytes are read from the file once, straight into its own aligned slice
of one anonymous map (`weight_arena`, then huge pages: `settle`; the file's map is closed after the
walk, so the arrays do not pin the file nor count its pages twice).

Anything unexpected in the wire format (a truncated field, a group, a repeated name) gives None:
the caller then parses the file the usual way and reports its errors.
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import itertools
import mmap
import threading
import time
import weakref

import numpy as np

from runnx.interp.quiet import wait_quiet

_GRAPH, _INITIALIZER, _RAW_DATA = 7, 5, 9  # ModelProto.graph, GraphProto.initializer, TensorProto.raw_data
_NAME = 8  # TensorProto.name
_LENGTH_DELIMITED = 2
_FIXED_SIZES = {1: 8, 5: 4}  # wire types fixed64, fixed32


class _Malformed(Exception):
    pass


def read_model_file(path: str, skip=frozenset()) -> tuple[bytes, dict[str, np.ndarray]] | None:
    """(the serialized model without its top-level initializers' raw_data, {initializer name: its raw
    bytes} but for the names in `skip`, replaced by the caller), or None when the file is not as
    expected."""
    with open(path, "rb") as handle:
        try:
            data = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError):  # an empty file cannot be mapped
            return None
        spans: dict[str, tuple[int, int]] = {}
        try:
            with memoryview(data) as view:
                graph = {_GRAPH: lambda start, end: _graph(view, start, end, spans)}
                stripped = _copy_fields(view, 0, len(view), graph)
        except _Malformed:
            return None
        finally:
            data.close()
        spans = {name: span for name, span in spans.items() if name not in skip}
        buffers = read_ranges(handle, list(spans.values()))
    return None if buffers is None else (stripped, dict(zip(spans, buffers)))


def read_ranges(handle, ranges: list[tuple[int, int]]) -> list[np.ndarray] | None:
    """The bytes of these (offset, length) ranges of an open file, each read once into its slice of
    one weight arena (`weight_arena`), then `settle`d into huge pages; None when the file ends
    before a range does (nothing settled)."""
    buffers, mapped = weight_arena([length for _, length in ranges])
    for (offset, length), buffer in zip(ranges, buffers):
        handle.seek(offset)
        if handle.readinto(buffer) != length:
            return None
    settle(mapped)
    return buffers


def weight_arena(lengths: list[int]) -> tuple[list[np.ndarray], np.ndarray | None]:
    """(byte buffers of these lengths, 64-byte aligned slices of one zeroed anonymous map, the map's
    bytes to `settle`, or None: nothing to settle), its pages faulted in up front (`fault_in`)."""
    starts, total = [], 0
    for length in lengths:
        starts.append(total)
        total += -(-length // 64) * 64
    arena = fresh_map(total + 64)
    mapped = fault_in(arena)
    base = -arena.ctypes.data % 64
    _ARENAS[id(arena)] = weakref.ref(arena, lambda _, key=id(arena): _ARENAS.pop(key, None))
    return [arena[base + start:base + start + length] for start, length in zip(starts, lengths)], mapped


def fresh_map(nbytes: int) -> np.ndarray:
    """The zeroed bytes of a new anonymous map, no page of it faulted in yet (`fault_in` does), or of a
    zeroed array where there are no maps. Not numpy's own: numpy advises every array of 4 MiB and more
    for huge pages, which a new process may get at the host's pace (`_fault_in_huge_pages`)."""
    try:
        return np.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), np.uint8)
    except (AttributeError, OSError, ValueError):
        return np.zeros(nbytes, np.uint8)


def fault_in(arena: np.ndarray) -> np.ndarray | None:
    """Fault a `fresh_map`'s pages in at once: in huge pages where the kernel has free ones enough
    (`_free_huge_pages`) while they come fast (`_fault_in_huge_pages`), else in 4 KiB pages; returns
    the bytes left in 4 KiB pages, to `settle` into huge pages by a collapse while the models are
    quiet (a huge page at fault time may wait for the kernel to compact memory, or for a virtual
    machine's host, up to seconds), or None."""
    if not isinstance(getattr(arena.base, "obj", None), mmap.mmap):
        return None  # (a plain array: numpy's pages, faulted in already)
    total = arena.size
    if (total >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE") and _free_huge_pages() * HUGE_PAGE >= 2 * total
            and _advise(arena, mmap.MADV_HUGEPAGE)):
        return _fault_in_huge_pages(arena)  # None: in huge pages from the start
    _advise(arena, _MADV_POPULATE_WRITE)
    return arena


_ARENAS: dict[int, weakref.ref] = {}  # id -> the weight arenas made here, while they live


def owned_bytes(array: np.ndarray) -> np.ndarray | None:
    """A writable uint8 view of a C-contiguous array's bytes when they lie in a weight arena made
    here (memory of runnx's own, read from a file: no caller holds it), else None. A load-time pass
    that no longer needs a weight may lay what replaces it there (`fusion/split_products.py`)."""
    root = owning_array(array)
    known = _ARENAS.get(id(root))
    if known is None or known() is not root or not root.flags.writeable or not array.flags.c_contiguous:
        return None
    offset = array.ctypes.data - root.ctypes.data
    return root[offset:offset + array.nbytes] if 0 <= offset and offset + array.nbytes <= root.nbytes else None


def owning_array(array: np.ndarray) -> np.ndarray:
    """The last array in `array`'s chain of bases: the one whose memory it views (a map's bytes, an
    arena), `array` itself when its base is no array."""
    root = array
    while isinstance(root.base, np.ndarray):
        root = root.base
    return root


_MADV_POPULATE_WRITE, _MADV_COLLAPSE = 23, 25  # Linux 5.14 and 6.1 (Python 3.11's mmap names neither)
HUGE_PAGE = 2 << 20
_HUGE_ORDER = 9  # a 2 MiB page is 2**9 of 4 KiB
_CHUNK = 16 << 20  # bytes of a map faulted in huge pages at a time, each timed
_FAST = 1 << 30  # bytes/s at least, while the kernel hands out huge pages of its own


def _fault_in_huge_pages(arena: np.ndarray) -> np.ndarray | None:
    """Fault a map advised MADV_HUGEPAGE in, a chunk at a time, while each chunk comes fast. Free
    2 MiB blocks may be ones a virtual machine reported free to its host (virtio's free page
    reporting), which the host must back again: 0.1-0.3 GB/s against 7 (a 540 MB model's load took
    4-5 s after another process's exit). So after a slow chunk the rest comes in 4 KiB pages (0.14 s),
    advised for huge pages and returned for `settle` to collapse while the models are quiet; None
    when every chunk came in huge pages. The first chunk is one huge page and each next one twice
    the last, up to `_CHUNK`: a slow chunk of 16 MiB waits 0.05-0.16 s, a huge page 2.5-20 ms."""
    start, size = 0, HUGE_PAGE
    while start < arena.size:
        chunk = arena[start:start + size]
        began = time.perf_counter()
        _advise(chunk, _MADV_POPULATE_WRITE)
        start += chunk.size
        if (time.perf_counter() - began) * _FAST > chunk.size:
            rest = arena[start:]
            if not rest.size:
                return None
            small = _advise(rest, mmap.MADV_NOHUGEPAGE)
            _advise(rest, _MADV_POPULATE_WRITE)
            if small:
                _advise(rest, mmap.MADV_HUGEPAGE)
            return rest
        size = min(2 * size, _CHUNK)
    return None


def in_small_pages(array: np.ndarray) -> None:
    """Advise the whole pages of a new array's memory, not yet touched, to come in 4 KiB pages as
    they are first written (MADV_NOHUGEPAGE; nothing where madvise is missing): for a buffer written
    a little at a time over a long while, a KV cache's capacity (`capture/capacity.py`), which numpy
    advises for huge pages from 4 MiB on. A huge page comes at the host's pace on a virtual machine
    that reported it free (5-12 ms each here): a first prompt into SmolLM2's KV cache of 8,192 rows
    a layer took 0.76-0.79 s against 0.07 in 4 KiB pages, each of its 60 buffers faulting a huge page
    a head for the prompt's first row."""
    if not hasattr(mmap, "MADV_NOHUGEPAGE") or array.nbytes < HUGE_PAGE:
        return
    first = -array.ctypes.data % mmap.PAGESIZE
    whole = (array.nbytes - first) // mmap.PAGESIZE * mmap.PAGESIZE
    if whole > 0:
        _advise(array.reshape(-1).view(np.uint8)[first:first + whole], mmap.MADV_NOHUGEPAGE)


def faulted_in(array: np.ndarray) -> np.ndarray:
    """`array` with the pages of its memory faulted in now, in one call (MADV_POPULATE_WRITE, which
    writes nothing; nothing where it is missing), not one fault at a time as it is first written: a
    buffer a timed run will write, made beforehand (a decoder's KV cache at its load:
    `generate/decoder.py`); a C-contiguous array (another is returned as it is). Its first and last
    pages are whole pages of its map, so they are faulted in too."""
    madvise = _madvise()
    if madvise is not None and array.flags.c_contiguous and array.nbytes:
        start = array.ctypes.data // mmap.PAGESIZE * mmap.PAGESIZE
        stop = -(-(array.ctypes.data + array.nbytes) // mmap.PAGESIZE) * mmap.PAGESIZE
        madvise(start, stop - start, _MADV_POPULATE_WRITE)
    return array


def _free_huge_pages() -> int:
    """How many 2 MiB pages the kernel could hand out now without compacting memory: the free blocks
    of 2 MiB and more in /proc/buddyinfo (0 where it cannot tell, or THP is off)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as mode:
            if "[never]" in mode.read():
                return 0
        with open("/proc/buddyinfo") as info:
            lines = info.read().splitlines()
    except OSError:
        return 0
    free = 0
    for line in lines:  # "Node 0, zone   Normal  <free blocks of order 0> <order 1> ..."
        counts = line.split()[4:]
        for order, count in enumerate(counts[_HUGE_ORDER:], _HUGE_ORDER):
            if count.isdigit():
                free += int(count) << (order - _HUGE_ORDER)
    return free


def _advise(mapped: np.ndarray, advice: int) -> bool:
    """madvise(2) over a map's bytes; False where it failed or there is none. MADV_POPULATE_WRITE
    faults a new map's pages in one call: written one 4 KiB fault at a time (`readinto`), a small LM's
    weights came in at about 1 GB/s, half of its load."""
    madvise = _madvise()
    return madvise is not None and madvise(mapped.ctypes.data, mapped.size, advice) == 0


@functools.cache
def _madvise():
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (AttributeError, OSError):
        return None
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return madvise


_held = threading.local()  # this thread's maps whose settling waits (`settles_held`)
_queued: collections.deque = collections.deque()  # maps waiting for the collapsing thread, in order
_queue_lock = threading.Lock()
_collapsing: threading.Thread | None = None
QUIET = 0.5  # seconds the models are quiet before each huge page of a settling map collapses


def settle(mapped: np.ndarray | None) -> None:
    """Move the read weights (`mapped`: bytes of an anonymous map in 4 KiB pages) into transparent
    huge pages (where THP is `madvise`, as on these machines): a decode step then streams them
    through 2 MiB pages, fewer TLB misses (a 135M-parameter decoder's two-thread step 7-8% faster,
    its one-row products 13-26%). The kernel's collapse copies them into new huge pages, which
    may come at a virtual machine's host's pace (12 ms each: seconds of a core for a small LM,
    which made a first prompt beside it twice as slow and a decode step 12% slower). So a thread
    of its own collapses them a huge page at a time, one map after another, each only once the
    models have been quiet for `QUIET` seconds (`quiet.BUSY`: no run, load or prepack): a server's
    idle time or a chat's turns, never a decode loop. ctypes' call leaves the GIL, readers see the
    same bytes throughout. Inside `settles_held` on this thread, the map waits for `settle_held`.
    Best effort: older kernels and other systems keep 4 KiB pages (as does a process that is never
    quiet, but for the kernel's khugepaged, at its own pace)."""
    global _collapsing
    if mapped is None or not hasattr(mmap, "MADV_HUGEPAGE"):
        return
    held = getattr(_held, "maps", None)
    if held is not None:
        held.append(mapped)
        return
    if not _advise(mapped, mmap.MADV_HUGEPAGE):
        return
    root = owning_array(mapped)
    offset = mapped.ctypes.data - root.ctypes.data
    with _queue_lock:  # (held weakly: a model dropped meanwhile takes its weights with it)
        _queued.append((weakref.ref(root), offset, offset + mapped.size))
        if _collapsing is None:
            _collapsing = threading.Thread(target=_collapse_queued, daemon=True, name="runnx-huge-pages")
            _collapsing.start()


def _collapse_queued() -> None:
    global _collapsing
    while True:
        with _queue_lock:
            if not _queued:
                _collapsing = None
                return
            held, start, stop = _queued.popleft()
        root = held()
        pieces = [] if root is None or not root.flags.c_contiguous else _huge_page_pieces(root.ctypes.data, start,
                                                                                          stop)
        del root
        for first, last in pieces:
            wait_quiet(QUIET)
            root = held()
            if root is None:
                break
            _advise(root.reshape(-1).view(np.uint8)[first:last], _MADV_COLLAPSE)  # (byte offsets, any dtype)
            del root


def _huge_page_pieces(address: int, start: int, stop: int) -> list[tuple[int, int]]:
    """Bytes start .. stop of the memory at address, cut at each 2 MiB boundary of the address space:
    a huge page a piece (the ends may be parts of one, which a collapse leaves)."""
    first = start + -(address + start) % HUGE_PAGE
    cuts = [start, *range(first if first > start else first + HUGE_PAGE, stop, HUGE_PAGE), stop]
    return [(a, b) for a, b in itertools.pairwise(cuts) if b > a]


@contextlib.contextmanager
def settles_held():
    """A block in which this thread's `settle` calls wait for `settle_held` (or the block's end): a
    load reads its weights, then folds constants from them (a tied LM head's transposed copy), which
    a collapse under way beside it made several times slower (0.08 -> 0.5 s for a 135M-parameter
    decoder's)."""
    outer = getattr(_held, "maps", None)
    _held.maps = []
    try:
        yield
    finally:
        settle_held()
        _held.maps = outer


def settle_held() -> None:
    """Settle the maps this thread's `settles_held` block holds, from now on (none outside one)."""
    held = getattr(_held, "maps", None)
    if held:
        _held.maps = None  # settled now, in the order they came
        try:
            for mapped in held:
                settle(mapped)
        finally:
            _held.maps = []


def _graph(view, start: int, end: int, spans: dict) -> bytes:
    return _copy_fields(view, start, end, {_INITIALIZER: lambda s, e: _initializer(view, s, e, spans)})


def _initializer(view, start: int, end: int, spans: dict) -> bytes:
    """The TensorProto without raw_data; where its bytes lie goes to spans[name]."""
    found: list = []
    name: list = []

    def keep_raw(s, e):
        found[:] = [(s, e - s)]
        return None

    def read_name(s, e):
        name[:] = [bytes(view[s:e])]
        return name[0]

    tensor = _copy_fields(view, start, end, {_RAW_DATA: keep_raw, _NAME: read_name})
    if found:
        key = name[0].decode("utf-8", "surrogateescape") if name else ""
        if key in spans:  # a name twice: let the usual parse report it
            raise _Malformed
        spans[key] = found[0]
    return tensor


def _copy_fields(view, start: int, end: int, rewrite: dict) -> bytes:
    """The message in view[start:end] re-serialized: length-delimited fields named in `rewrite` by
    what their function returns for (payload start, payload end) (None: the field is dropped),
    every other field as it is."""
    out = bytearray()
    position = start
    while position < end:
        field_start = position
        key, position = _varint(view, position, end)
        field, wire = key >> 3, key & 7
        if wire == 0:
            _, position = _varint(view, position, end)
        elif wire in _FIXED_SIZES:
            position += _FIXED_SIZES[wire]
        elif wire == _LENGTH_DELIMITED:
            length, position = _varint(view, position, end)
            payload, position = position, position + length
            if position > end:
                raise _Malformed
            if field in rewrite:
                replaced = rewrite[field](payload, position)
                if replaced is not None:
                    out += _encoded_varint(key) + _encoded_varint(len(replaced)) + replaced
                continue
        else:  # groups (deprecated) or garbage
            raise _Malformed
        if position > end:
            raise _Malformed
        out += view[field_start:position]
    return bytes(out)


def _varint(view, position: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if position >= end or shift > 63:
            raise _Malformed
        byte = view[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position
        shift += 7


def _encoded_varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
