"""KVCache on its own: which buffers a step is handed, what it keeps of the model's outputs, when it
regrows, whatever way the model returns its present tensors."""
import numpy as np
import pytest

from runnx import Owned
from runnx.errors import RunnxError
from runnx.generate.kv_cache import KVCache

SHAPE = (1, 2, 0, 4)


def _cache(capacity: int, zeroed: bool = False) -> KVCache:
    return KVCache.empty({"k": SHAPE, "v": SHAPE}, {"k": np.float32, "v": np.float32}, capacity, zeroed=zeroed)


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
