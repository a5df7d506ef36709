"""The arena's memory functions (`arena.py`) as numba cfuncs: libc's malloc, calloc, realloc and
free, each block with a header of HEADER bytes holding its size (numpy's size at free is a hint;
the header is the truth), and freed blocks of the state's least size or more kept in its slots
while runs are under way, handed out again for a request of their exact size. Pointers are carried
as integers (uintp: the same registers as void * in the C calling convention). The state is int64
words (below)."""
from __future__ import annotations

import numba
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from runnx.ops import _jit_cache  # noqa: F401  (numba caches these under RUNNX_CACHE)
from runnx.runtime.atomics import compare_and_swap, load, pause, store

SLOTS = 64  # blocks kept at most
HEADER = 64  # bytes before each block's data: its size (64 keep the data's alignment as libc's)
# the state's words: a spin lock, the runs under way, the bytes kept, the most to keep, the least
# size to keep, whether fresh blocks of HUGE_FROM bytes ask for huge pages, the blocks handed out
# again so far, then (size, block) slots
LOCK, ACTIVE, KEPT, MOST, LEAST, HUGE_PAGES, REUSED, FIRST = 0, 1, 2, 3, 4, 5, 6, 8
WORDS = FIRST + 2 * SLOTS
HUGE_FROM = 1 << 22  # numpy's own allocator asks from here (madvise MADV_HUGEPAGE)
_MADV_HUGEPAGE, _PAGE = 14, 4096
_LARGEST = 1 << 62  # bytes: a request this large fails (NULL), as malloc's would

_libc_malloc = types.ExternalFunction("malloc", types.uintp(types.uintp))
_libc_calloc = types.ExternalFunction("calloc", types.uintp(types.uintp, types.uintp))
_libc_realloc = types.ExternalFunction("realloc", types.uintp(types.uintp, types.uintp))
_libc_free = types.ExternalFunction("free", types.void(types.uintp))
_madvise = types.ExternalFunction("madvise", types.int32(types.uintp, types.uintp, types.int32))
_STATE = types.CPointer(types.int64)
_inline = numba.njit(cache=True, nogil=True, inline="always")


@intrinsic
def _word_at(typingctx, address):
    """The int64 word at `address` (an integer), as a pointer."""
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], ir.IntType(64).as_pointer())

    return _STATE(address), codegen


@_inline
def _lock(state):
    while not compare_and_swap(state, LOCK, 0, 1):
        pause()


@_inline
def _unlock(state):
    store(state, LOCK, 0)


@_inline
def _take(state, size):
    """A kept block of exactly `size` bytes (removed from the slots), or 0."""
    found = 0
    _lock(state)
    for slot in range(FIRST, WORDS, 2):
        if state[slot] == size and state[slot + 1] != 0:
            found = state[slot + 1]
            state[slot], state[slot + 1] = 0, 0
            state[KEPT] -= size
            state[REUSED] += 1
            break
    _unlock(state)
    return found


@_inline
def _keep(state, block, size):
    """Whether the block was kept (a free slot, and room under the most to keep)."""
    kept = False
    _lock(state)
    if state[KEPT] + size <= state[MOST]:
        for slot in range(FIRST, WORDS, 2):
            if state[slot + 1] == 0:
                state[slot], state[slot + 1] = size, block
                state[KEPT] += size
                kept = True
                break
    _unlock(state)
    return kept


@_inline
def _headed(state, block, size):
    """The data of a fresh block from libc (0 stays 0), its size written in its header; a large one's
    whole pages offered huge pages as numpy's own allocator offers them."""
    if block == 0:
        return numba.uint64(0)
    numba.carray(_word_at(block), (1,))[0] = size
    data = block + HEADER
    if size >= HUGE_FROM and state[HUGE_PAGES] != 0:
        offset = _PAGE - data % _PAGE
        _madvise(numba.uint64(data + offset), numba.uint64(size - offset), _MADV_HUGEPAGE)
    return numba.uint64(data)


@numba.cfunc(types.uintp(_STATE, types.uintp), cache=True, nopython=True)
def _malloc(context, size):
    if size >= _LARGEST:
        return numba.uint64(0)
    state = numba.carray(context, (WORDS,))
    if numba.int64(size) >= state[LEAST] and load(state, ACTIVE) > 0:
        found = _take(state, numba.int64(size))
        if found != 0:
            return numba.uint64(found + HEADER)
    return _headed(state, _libc_malloc(size + HEADER), numba.int64(size))


@numba.cfunc(types.uintp(_STATE, types.uintp, types.uintp), cache=True, nopython=True)
def _calloc(context, count, size):
    if size and count > (_LARGEST - HEADER) // size:
        return numba.uint64(0)
    return _headed(numba.carray(context, (WORDS,)), _libc_calloc(1, count * size + HEADER), numba.int64(count * size))


@numba.cfunc(types.uintp(_STATE, types.uintp, types.uintp), cache=True, nopython=True)
def _realloc(context, data, size):
    if size >= _LARGEST:
        return numba.uint64(0)
    state = numba.carray(context, (WORDS,))
    if data == 0:
        return _headed(state, _libc_malloc(size + HEADER), numba.int64(size))
    return _headed(state, _libc_realloc(data - HEADER, size + HEADER), numba.int64(size))


@numba.cfunc(types.void(_STATE, types.uintp, types.uintp), cache=True, nopython=True)
def _free(context, data, hint):
    if data == 0:
        return
    block = numba.int64(data - HEADER)
    size = numba.carray(_word_at(block), (1,))[0]
    state = numba.carray(context, (WORDS,))
    if size >= state[LEAST] and load(state, ACTIVE) > 0 and _keep(state, block, size):
        return
    _libc_free(numba.uint64(block))


@numba.njit(cache=True, nogil=True)
def release(state):
    """Give every kept block back to libc (the last run has ended)."""
    _lock(state)
    for slot in range(FIRST, WORDS, 2):
        if state[slot + 1] != 0:
            _libc_free(numba.uint64(state[slot + 1]))
            state[slot], state[slot + 1] = 0, 0
    state[KEPT] = 0
    _unlock(state)


def addresses() -> tuple:
    """The cfuncs' addresses: (malloc, calloc, realloc, free)."""
    return _malloc.address, _calloc.address, _realloc.address, _free.address
