"""KVCache on its own: which buffers a step is handed, what it keeps of the model's outputs, when it
regrows, whatever way the model returns its present tensors."""
import mmap
import resource
import sys
import weakref

import numpy as np
import pytest

from runnx import Owned
from runnx.errors import RunnxError
from runnx.generate import kv_cache
from runnx.generate.kv_cache import KVCache, SpareBuffers
from runnx.interp import model_file

SHAPE = (1, 2, 0, 4)


def _cache(capacity: int, zeroed: bool = False, spare: SpareBuffers | None = None) -> KVCache:
    return KVCache.empty({"k": SHAPE, "v": SHAPE}, {"k": np.float32, "v": np.float32}, capacity, zeroed=zeroed,
                         spare=spare)


def _append(view: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """What a model's in-place Concat returns: the longer prefix view of the same buffer."""
    longer = view.base[:, :, :view.shape[2] + rows.shape[2]]
    longer[:, :, view.shape[2]:] = rows
    return longer


def _rows(value: float, count: int = 1) -> np.ndarray:
    return np.full((1, 2, count, 4), value, np.float32)


def test_whole_buffers_are_handed_over_as_the_same_objects_every_step():
    cache = _cache(8, zeroed=True)
    buffers = {name: feed.array for name, feed in cache.handover(1, whole=True).items()}
    assert all(b.shape == (1, 2, 8, 4) for b in buffers.values())
    for step in range(5):
        for b in buffers.values():
            b[:, :, step] = step + 1  # a shared-buffer model writes the new row at the length
        cache.accept(dict(buffers), length=step + 1)
        assert cache.appended_in_place and cache.length == step + 1
        if step < 4:
            fed = cache.handover(1, whole=True)
            assert all(fed[name].array is buffers[name] for name in buffers)  # no copy, no new view
    assert cache.regrowths == 0
    np.testing.assert_array_equal(cache.arrays["k"][0, 0, :, 0], [1, 2, 3, 4, 5])


def test_prefix_views_grow_in_their_buffer_then_regrow_to_double_with_their_rows():
    cache = _cache(2)
    for step in range(5):
        fed = cache.handover(1)
        cache.accept({name: _append(feed.array, _rows(step)) for name, feed in fed.items()})
        assert cache.appended_in_place
    assert cache.regrowths == 2 * 2  # each tensor: 2 -> 4 -> 8 rows
    assert cache.capacity == 8
    np.testing.assert_array_equal(cache.arrays["v"][0, 1, :, 3], [0, 1, 2, 3, 4])
    handed = cache.handover(1, whole=True)
    assert all(feed.array.shape == (1, 2, 8, 4) for feed in handed.values())


def test_fresh_arrays_from_the_model_are_kept_and_not_regrown():
    cache = _cache(4)
    fed = cache.handover(2)
    cache.accept({name: np.concatenate([feed.array, _rows(7, 2)], axis=2) for name, feed in fed.items()})
    assert not cache.appended_in_place  # the model copied: giving it room would waste a copy a step
    assert cache.capacity == 2
    fed = cache.handover(1)
    assert cache.regrowths == 0 and all(feed.array.shape[2] == 2 for feed in fed.values())
    cache.accept({name: _append(feed.array, _rows(1)) if feed.array.base is not None
                  else np.concatenate([feed.array, _rows(1)], axis=2) for name, feed in fed.items()})
    assert cache.length == 3


def test_a_full_restored_cache_regrows_on_the_next_step_and_accept_checks_names():
    arrays = {"k": _rows(1, 3), "v": _rows(2, 3)}
    cache = KVCache.with_capacity(arrays, 3)
    assert cache.capacity == 3
    fed = cache.handover(1, whole=True)
    assert cache.regrowths == 2 and all(feed.array.shape[2] == 6 for feed in fed.values())
    np.testing.assert_array_equal(fed["v"].array[:, :, :3], arrays["v"])
    with pytest.raises(RunnxError, match="already handed over"):
        cache.handover(1)
    with pytest.raises(RunnxError, match="do not match"):
        cache.accept({"k": fed["k"].array})
    cache.accept({name: feed.array for name, feed in fed.items()}, length=4)
    assert cache.length == 4 and isinstance(Owned(cache.arrays["k"]), Owned)


def _filled(capacity: int, rows: int, zeroed: bool = False) -> KVCache:
    cache = _cache(capacity, zeroed)
    fed = cache.handover(rows)
    cache.accept({name: _append(feed.array, _rows(3.5, rows)) for name, feed in fed.items()})
    return cache


def test_a_spent_caches_buffers_are_the_next_prefills():
    old = _filled(8, 3)
    buffers = {name: weakref.ref(buffer) for name, buffer in old._buffers.items()}  # (a reference would hold them)
    spare = old.spare()
    assert old.arrays == {}  # the spent cache lets go of its views
    cache = _cache(8, spare=spare)
    assert spare.taken == 2 and all(cache._buffers[name] is buffers[name]() for name in buffers)
    assert cache.length == 0 and cache.capacity == 8


def test_a_spare_buffer_still_viewed_elsewhere_is_never_written_again():
    old = _filled(8, 3)
    held = old.arrays["k"]  # a caller still holds a view of the key buffer
    held_values = held.copy()
    spare = old.spare()
    cache = _cache(8, spare=spare)
    fed = cache.handover(3)
    cache.accept({name: _append(feed.array, _rows(-1.0, 3)) for name, feed in fed.items()})
    assert spare.taken == 1 and cache._buffers["k"] is not held.base  # the value buffer only
    np.testing.assert_array_equal(held, held_values)


def test_a_spare_of_another_shape_capacity_or_dtype_is_not_taken():
    for capacity, shapes, dtype in ((16, SHAPE, np.float32), (8, (2, 2, 0, 4), np.float32), (8, SHAPE, np.float16)):
        spare = _filled(8, 3).spare()
        cache = KVCache.empty({"k": shapes, "v": shapes}, {"k": dtype, "v": dtype}, capacity, spare=spare)
        assert spare.taken == 0 and cache.capacity == capacity and cache.arrays["k"].dtype == dtype


def test_zeroed_spare_buffers_are_zero_again_and_uninitialised_ones_never_serve_a_zeroed_cache():
    old = _cache(8, zeroed=True)
    buffers = {name: feed.array for name, feed in old.handover(5, whole=True).items()}
    for b in buffers.values():
        b[:, :, :5] = 7.0  # a shared-buffer model wrote five rows
    old.accept(dict(buffers), length=5)
    old.handover(1, whole=True)
    old.accept(dict(buffers), length=2)  # (the cache kept fewer rows than were written)
    del buffers, b  # (the test's references would hold them)
    spare = old.spare()
    cache = _cache(8, zeroed=True, spare=spare)
    assert spare.taken == 2
    assert all(not b.any() for b in cache._buffers.values())  # every row written is zero again
    spare = _filled(8, 3).spare()
    cache = _cache(8, zeroed=True, spare=spare)
    assert spare.taken == 0 and all(not b.any() for b in cache._buffers.values())


def test_buffers_made_ahead_are_what_a_prefill_would_allocate():
    for zeroed in (False, True):
        spare = SpareBuffers.made({"k": SHAPE, "v": SHAPE}, {"k": np.float32, "v": np.float32}, 8, zeroed)
        cache = _cache(8, zeroed, spare=spare)
        assert spare.taken == 2 and cache.capacity == 8 and cache.arrays["k"].shape == SHAPE
        assert not zeroed or all(not b.any() for b in cache._buffers.values())
        restored = KVCache.with_capacity({"k": _rows(1.0, 2), "v": _rows(2.0, 2)}, 8, zeroed=zeroed,
                                         spare=SpareBuffers.made({"k": SHAPE, "v": SHAPE},
                                                                 {"k": np.float32, "v": np.float32}, 8, zeroed))
        np.testing.assert_array_equal(restored.arrays["v"], _rows(2.0, 2))
        assert restored.capacity == 8


def _faults_writing(array: np.ndarray) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    array[...] = 1
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")
def test_faulted_in_memory_is_written_without_a_fault():
    pages = 64
    fresh = model_file.fresh_map(pages * mmap.PAGESIZE)  # (an anonymous map: none of its pages touched yet)
    assert _faults_writing(fresh) >= pages // 2
    made = model_file.faulted_in(model_file.fresh_map(pages * mmap.PAGESIZE)[100:-100])  # (rounded out)
    assert _faults_writing(made) == 0


def test_buffers_made_ahead_have_each_heads_first_rows_faulted_in(monkeypatch):
    faulted = []
    monkeypatch.setattr(kv_cache, "faulted_in", faulted.append)
    shapes, dtypes = {"k": (2, 3, 0, 64), "v": (2, 3, 0, 64)}, {"k": np.float32, "v": np.float32}
    spare = SpareBuffers.made(shapes, dtypes, 4096, False)
    assert len(faulted) == 2 * 2 * 3  # each (batch entry, head) of both buffers
    assert all(rows.shape == (kv_cache.FAULTED_ROWS, 64) and rows.flags.c_contiguous for rows in faulted)
    assert {id(rows.base) for rows in faulted} == {id(buffer) for buffer in spare._buffers.values()}
