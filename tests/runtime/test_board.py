"""A pool job holds the arrays its units read and write (`runtime/board.py`): every slot keeps what
it was given, an array the caller dropped lives until the job is released, and a unit's view
never reaches past the array it is taken of."""
import gc
import weakref

import numba
import numpy as np
import pytest

from runnx.ops._array_types import shaped
from runnx.ops._kernels_linalg import chunk_count
from runnx.runtime import jobs, mailbox, slots
from runnx.runtime.board import (bytes_at, floats_at, grid_at, hold_bytes, hold_floats, hold_grid, release_finished,
                                 words_of)


@numba.njit
def _hold_every_slot(job, vector, grid, raw):
    for slot in range(slots.FLOAT_SLOTS):
        hold_floats(job, slot, vector[slot:])
    for slot in range(slots.GRID_SLOTS):
        hold_grid(job, slot, grid[slot:])
    for slot in range(slots.BYTE_SLOTS):
        hold_bytes(job, slot, raw[slot:])


@numba.njit
def _firsts(job):
    """Each slot's first element and size, float slots, then grid slots, then byte slots."""
    found = []
    for slot in range(slots.FLOAT_SLOTS):
        found.append((float(floats_at(job, slot)[0]), floats_at(job, slot).size))
    for slot in range(slots.GRID_SLOTS):
        found.append((float(grid_at(job, slot)[0, 0, 0, 0]), grid_at(job, slot).shape[0]))
    for slot in range(slots.BYTE_SLOTS):
        found.append((float(bytes_at(job, slot)[0]), bytes_at(job, slot).size))
    return found


@numba.njit
def _sizes(job):
    return ([floats_at(job, slot).size for slot in range(slots.FLOAT_SLOTS)]
            + [grid_at(job, slot).size for slot in range(slots.GRID_SLOTS)]
            + [bytes_at(job, slot).size for slot in range(slots.BYTE_SLOTS)], words_of(job)[slots.FLOATS_USED])


@numba.njit
def _job(board):
    return board.job


def test_every_slot_holds_its_own_array_until_released():
    board, words = mailbox.make_board()
    job = _job(board)
    vector = np.arange(32, dtype=np.float32)
    grid = np.arange(8 * 2 * 3 * 4, dtype=np.float32).reshape(8, 2, 3, 4)[:, :, ::-1]  # strided
    raw = np.arange(16, dtype=np.uint8)
    _hold_every_slot(job, vector, grid, raw)
    expected = ([(float(slot), 32 - slot) for slot in range(slots.FLOAT_SLOTS)]
                + [(float(grid[slot, 0, 0, 0]), 8 - slot) for slot in range(slots.GRID_SLOTS)]
                + [(float(slot), 16 - slot) for slot in range(slots.BYTE_SLOTS)])
    assert _firsts(job) == expected
    assert words[slots.FLOATS_USED] == slots.FLOAT_SLOTS and words[slots.GRIDS_USED] == slots.GRID_SLOTS
    numba.njit(lambda job: release_finished(job))(job)
    sizes, used = _sizes(job)
    assert sizes == [0] * (slots.FLOAT_SLOTS + slots.GRID_SLOTS + slots.BYTE_SLOTS) and used == 0


def test_a_job_left_open_keeps_arrays_its_caller_dropped():
    """The caller drops every array but the output while the job is open: the units still read
    them (the job holds them) and they go when it is released."""
    board, _ = mailbox.make_board()
    rng = np.random.default_rng(3)
    row, matrix = rng.standard_normal(96).astype(np.float32), rng.standard_normal((96, 300)).astype(np.float32)
    expected = row @ matrix
    out = np.empty(300, np.float32)
    scratch = np.empty(chunk_count(96) * 300, np.float32)
    gone = [weakref.ref(row), weakref.ref(matrix), weakref.ref(scratch)]
    jobs.open_products(board, 0, row, (matrix,), (out,), scratch, 0.0, 1.0)  # no worker: nothing computed yet
    del row, matrix, scratch
    gc.collect()
    assert all(ref() is not None for ref in gone)  # held by the open job
    mailbox.finish_and_release(board)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-4)
    gc.collect()
    assert all(ref() is None for ref in gone)


def test_a_finished_job_holds_nothing():
    board, _ = mailbox.make_board()
    row, matrix = np.ones(8, np.float32), np.ones((8, 6), np.float32)
    gone = weakref.ref(matrix)
    out = np.empty(6, np.float32)
    jobs.post_products(board, 0, row, (matrix,), (out,), np.empty(chunk_count(8) * 6, np.float32), 0.0, 1.0)
    del matrix
    gc.collect()
    assert gone() is None and np.array_equal(out, np.full(6, 8, np.float32))


def test_a_view_never_reaches_past_its_vector():
    view = numba.njit(lambda vector, rows, columns: shaped(vector, (rows, columns), np.float32))
    vector = np.arange(12, dtype=np.float32)
    np.testing.assert_array_equal(view(vector, 3, 4), vector.reshape(3, 4))
    np.testing.assert_array_equal(view(vector, 2, 5), vector[:10].reshape(2, 5))  # a prefix
    with pytest.raises(IndexError, match="past the vector"):
        view(vector, 4, 4)
    as_words = numba.njit(lambda raw, count: shaped(raw, (count,), np.int32))
    raw = np.arange(8, dtype=np.int32).view(np.uint8)
    np.testing.assert_array_equal(as_words(raw, 8), np.arange(8, dtype=np.int32))
    with pytest.raises(IndexError):
        as_words(raw, 9)
