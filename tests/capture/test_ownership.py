"""Ownership primitives: storage keys follow views to their root buffer, the StorageTable grants
exclusivity only to owned storages held once, capacity buffers grow in place, CaptureEnv moves
owned captures once and lends the rest."""
import numpy as np
import pytest

import runnx
from runnx.capture.capacity import append_in_place, concatenate_with_headroom, spare_capacity
from runnx.capture.env import CaptureEnv
from runnx.capture.ownership import (BOOKKEEPING, StorageTable, may_write, may_write_inline, read_only_view,
                                     storage_keys, storage_root)


def test_views_share_the_storage_key_of_their_root_buffer():
    base = np.arange(24, dtype=np.float32)
    views = [base.reshape(2, 3, 4), base.reshape(2, 3, 4).transpose(2, 0, 1), base[3:9], base[None], base.view()]
    assert {storage_keys(v) for v in views} == {(id(base),)}
    assert storage_root(views[1]) is base
    assert storage_keys(base.copy()) != storage_keys(base)
    other = np.zeros(2)
    assert storage_keys([base[:2], other, None]) == (id(base), id(other))  # a sequence: one key per tensor
    assert storage_keys(None) == () and storage_keys([]) == ()


def test_storage_table_grants_exclusivity_only_to_an_owned_storage_held_once():
    table = StorageTable()
    owned = np.zeros(4)
    keys = storage_keys(owned)
    table.hold(keys, None, owned)  # a fresh writeable array: owned
    assert table.exclusive(keys) and table.is_owned(keys)
    view = owned[1:]
    table.hold(storage_keys(view), None, view)  # a live view of it
    assert not table.exclusive(keys)
    table.drop(storage_keys(view))
    assert table.exclusive(keys)
    table.hold(keys, False, owned)  # borrowed once: never owned again while live
    table.drop(keys)
    assert not table.exclusive(keys)
    table.drop(keys)
    assert keys[0] not in table.count
    frozen = np.zeros(3)
    frozen.flags.writeable = False
    table.hold(storage_keys(frozen), None, frozen)
    assert not table.exclusive(storage_keys(frozen))
    assert not table.exclusive(())


class _Context:
    """A run's context as far as `may_write` reads it: kept storages, and the writes reported."""

    def __init__(self, kept):
        self.kept_storages, self.reported = set(kept), []

    def overwriting(self, keys):
        self.reported.append(keys)


def test_may_write_and_its_inline_form_decide_as_exclusive():
    """For every table state of one or two storages (absent, held once or twice, owned or not) and
    kept storages (none, others, these): `may_write` grants exactly what `exclusive` does and reports
    a grant into kept storages; the expression generated code inlines is true exactly where
    `may_write` grants one storage with nothing kept, and falling back to `may_write` decides the rest."""
    first, second = np.zeros(2), np.zeros(3)
    inline = {}
    exec(f"def decide(table, ctx, k):\n    {BOOKKEEPING}\n    return {may_write_inline('k')}", inline)
    states = [(None, False), (1, True), (1, False), (2, True)]
    for keys in ((), storage_keys(first), storage_keys(first) + storage_keys(second)):
        for held in states:
            for other in states[:2]:
                for kept in ((), (id(np),), keys):
                    table = StorageTable()
                    for key, (count, owned) in zip(keys, (held, other)):
                        if count is not None:
                            table.count[key], table.owned[key] = count, owned
                    ctx = _Context(kept)
                    granted = may_write(table, keys, ctx)
                    assert granted == table.exclusive(keys)
                    assert ctx.reported == ([keys] if granted and kept == keys else [])
                    assert bool(inline["decide"](table, _Context(kept), keys)) == (granted and len(keys) == 1 and
                                                                                    not kept)


def test_storage_table_tracks_peak_live_bytes():
    table = StorageTable(track_bytes=True)
    a, b = np.zeros(100, np.uint8), np.zeros(50, np.uint8)
    table.hold(storage_keys(a), None, a)
    table.hold(storage_keys(a[10:]), None, a[10:])  # a view adds no bytes
    table.hold(storage_keys(b), None, b)
    table.drop(storage_keys(a))
    table.drop(storage_keys(a))
    assert table.live_bytes == 50 and table.peak_bytes == 150


def test_read_only_view_protects_the_callers_buffer():
    array = np.zeros(3)
    view = read_only_view(array)
    with pytest.raises(ValueError):
        view[0] = 1
    assert array.flags.writeable and np.shares_memory(view, array)


def test_with_capacity_hands_over_a_prefix_view_that_grows_in_place():
    past = np.arange(6, dtype=np.float32).reshape(1, 2, 3)
    owned = runnx.with_capacity(past, axis=2, capacity=5)
    assert isinstance(owned, runnx.Owned) and "Owned(shape=(1, 2, 3)" in repr(owned)
    view = owned.array
    np.testing.assert_array_equal(view, past)
    assert spare_capacity(view, 2) == 2 and spare_capacity(view, 1) == 0 and spare_capacity(past, 2) == 0
    grown = append_in_place(view, [np.full((1, 2, 2), -1, np.float32)], 2)
    assert grown.shape == (1, 2, 5) and np.shares_memory(grown, view)
    np.testing.assert_array_equal(grown[..., :3], past)
    assert append_in_place(grown, [np.zeros((1, 2, 1), np.float32)], 2) is None  # full
    with pytest.raises(ValueError, match="axis 3 out of range"):
        runnx.with_capacity(past, axis=3, capacity=5)


def test_an_empty_prefix_view_has_room_without_a_compiled_signature_of_its_own(monkeypatch):
    """A first prompt's past (no rows yet) is C-contiguous to numba, a later step's prefix view not:
    the empty one is checked in Python, so the steps share one compiled signature of prefix_room."""
    import numba
    from runnx.capture import capacity
    typed, compiled = [], capacity.prefix_room

    def spy(view, buffer, axis):
        typed.append(numba.typeof(view))
        return compiled(view, buffer, axis)

    monkeypatch.setattr(capacity, "prefix_room", spy)
    empty = capacity.allocate_prefix((1, 2, 0, 3), 2, 4, np.int16)
    assert spare_capacity(empty, 2) == 4 and typed == []
    assert spare_capacity(empty.base[:, 1:, :0], 2) == 0  # not where the buffer starts
    grown = capacity.allocate_prefix((1, 2, 1, 3), 2, 4, np.int16)
    assert spare_capacity(grown, 2) == 3 and [t.layout for t in typed] == ["A"]


def test_concatenate_with_headroom_leaves_room_for_as_many_rows_again():
    parts = [np.ones((2, 3)), np.zeros((2, 1))]
    result = concatenate_with_headroom(parts, 1)
    np.testing.assert_array_equal(result, np.concatenate(parts, 1))
    assert spare_capacity(result, 1) == 4


def test_capture_env_moves_an_owned_capture_once_and_lends_the_rest():
    a, b = np.zeros(2), np.ones(2)
    env = CaptureEnv({"a": a, "b": b}, {"a": True})
    child = env.child()
    assert child.take("a") == (a, False)  # loop iterations only borrow
    assert env.moved() == ["a"]
    value, owned = env.take("a")
    assert value is a and owned
    assert "a" not in env.values and env.moved() == []
    assert env.take("b") == (b, False) and env.take("b") == (b, False)
