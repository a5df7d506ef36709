"""A model's 4-bit weights listed for one native call (`_tile_listing`, `repack_listed`): inputs
read where they lie (a mapped data file, the load's weight arena) or staged when they lie apart,
outputs carved from one arena, and the tiles the same bits as a run's own (`repack` an item)."""
import mmap
import sys

import numpy as np
import pytest

from runnx.ops import nibble_tiles as nt
from runnx.ops._kernels_nibble_layout import FREE, MADE, repack_listed
from runnx.ops._tile_listing import Arena, _buffer_of, listed
from tests.interp.test_loader import _resident_kib

RNG = np.random.default_rng(11)
BLOCK = 32


def _weights(columns: int, depth: int, zeros: str):
    """(b, scales, zero points) of a 4-bit product; zeros: 'packed', 'typed' or 'none'."""
    blocks = -(-depth // BLOCK)
    b = RNG.integers(0, 256, (columns, blocks, BLOCK // 2), dtype=np.uint8)
    scales = (RNG.random((columns, blocks)) * 0.1 + 0.01).astype(np.float32)
    zero_points = {"packed": RNG.integers(0, 256, (columns, (blocks + 1) // 2), dtype=np.uint8),
                   "typed": (RNG.random((columns, blocks)) * 15).astype(np.float32), "none": None}[zeros]
    return b, scales, zero_points


def _in_one_buffer(arrays: list, buffer_kind: str) -> list:
    """The arrays copied side by side into one buffer, as a load keeps them: views of one uint8
    array (the weight arena) or of a read-only mapped file's memoryview (external data)."""
    present = [a for a in arrays if a is not None]
    raw = b"".join(a.tobytes() + bytes(-a.nbytes % 64) for a in present)
    if buffer_kind == "arena":
        buffer = np.frombuffer(bytearray(raw), np.uint8)
        view = lambda at, a: buffer[at:at + a.nbytes].view(a.dtype).reshape(a.shape)  # noqa: E731
    else:
        mapped = mmap.mmap(-1, len(raw))
        mapped.write(raw)
        memory = memoryview(mapped).toreadonly()
        view = lambda at, a: np.frombuffer(memory[at:at + a.nbytes], a.dtype).reshape(a.shape)  # noqa: E731
    out, at = [], 0
    for a in arrays:
        if a is None:
            out.append(None)
            continue
        placed = view(at, a)
        placed.flags.writeable = False
        out.append(placed)
        at += a.nbytes + (-a.nbytes % 64)
    return out


def _listed_tiles(weight_parts: list):
    """Each weight's tiles planned in one arena, listed, and made in one `repack_listed` call."""
    arena = Arena(Arena.sized([shape for parts in weight_parts for shape in nt._tile_shapes(parts)]))
    planned = [nt._planned_tiles(parts, arena.empty) for parts in weight_parts]
    items = [item for _, its in planned for item in its]
    sources, table = listed(items, arena)
    states = np.zeros(len(items), np.int64)
    assert repack_listed(sources, table, arena.buffer, states, 0, len(items), 1)
    assert list(states) == [1 + MADE] * len(items)
    return [result for result, _ in planned], sources


@pytest.mark.parametrize("zeros", ["packed", "typed", "none"])
@pytest.mark.parametrize("where", ["arena", "mapped", "apart"])
def test_listed_tiles_are_a_runs_own_bits(zeros, where):
    """Weights of 48/40/64 columns (a last tile padded), joined parts and a weight alone: the tiles
    of one listed call equal each weight's made alone; inputs in one buffer are read in place
    (nothing staged), others staged."""
    singles = [_weights(40, 96, zeros), _weights(64, 200, zeros)]
    joined = [_weights(48, 96, zeros), _weights(32, 96, zeros)]
    flat = [a for triple in singles + joined for a in triple]
    if where != "apart":
        flat = _in_one_buffer(flat, where)
    triples = [tuple(flat[i:i + 3]) for i in range(0, len(flat), 3)]
    weight_parts = [[triples[0]], [triples[1]], triples[2:]]
    results, sources = _listed_tiles(weight_parts)
    apart = sum(a.nbytes for a in flat[3:] if a is not None)  # all but the first weight's own buffers
    assert sources[-1].size == (apart if where == "apart" else 0)
    for parts, result in zip(weight_parts, results):
        expected = nt._made(*nt._planned_tiles(parts))
        assert len(result) == len(expected)
        for made, want in zip(result, expected):
            assert made.shape == want.shape and np.array_equal(made, want)


def test_weights_in_buffers_of_their_own_are_listed_apart_and_nothing_is_copied():
    """A prepack's weights each in files of their own (external data, a file a tensor) make a listing
    each, nothing staged; those sharing one buffer make one; the tiles are each weight's own."""
    alone = [_in_one_buffer(list(_weights(48, 96, "packed")), "mapped") for _ in range(2)]
    shared = _in_one_buffer([a for _ in range(2) for a in _weights(32, 64, "packed")], "mapped")
    triples = alone + [shared[:3], shared[3:]]
    pending = [nt.prepack_tiles((None, *t), {"K": t[0].shape[1] * BLOCK, "N": t[0].shape[0], "bits": 4,
                                              "block_size": BLOCK}) for t in triples]
    make = nt._PendingTiles.batch(pending)
    tables = {id(p.listing[1]): p.listing for p in pending}
    assert len(tables) == 3  # one a file alone, one for the two sharing a file
    assert all(listing[0][-1].size == 0 for listing in tables.values())  # nothing staged
    make()
    for t in triples:
        made = nt.remembered_tiles.known_result(((), *map(id, t)))
        assert made is not None
        for got, want in zip(made, nt._made(*nt._planned_tiles([t]))):
            assert np.array_equal(got, want)


def test_a_mapped_file_is_one_buffer():
    """Arrays from a mapped file's memoryview are found in the whole file (`_buffer_of`)."""
    first, second = _in_one_buffer([np.arange(10, dtype=np.float32), np.arange(7, dtype=np.uint8)], "mapped")
    buffer = _buffer_of(second)
    assert buffer is not None and buffer.nbytes >= first.nbytes + second.nbytes
    assert _buffer_of(first).__array_interface__["data"][0] == buffer.__array_interface__["data"][0]


def test_an_item_claimed_elsewhere_is_left_to_its_maker():
    """A call making items skips one another thread has claimed (its state not FREE) and returns
    once that one is marked made."""
    parts = [_weights(32, 64, "packed")]
    arena = Arena(Arena.sized(nt._tile_shapes(parts)))
    result, items = nt._planned_tiles(parts, arena.empty)
    sources, table = listed(items, arena)
    states = np.array([2 + MADE], np.int64)  # made by maker 2 already
    assert repack_listed(sources, table, arena.buffer, states, 0, 1, 1)
    assert states[0] == 2 + MADE  # not made again (nor claimed) by maker 1
    states[0] = FREE
    assert repack_listed(sources, table, arena.buffer, states, 0, 1, 1) and states[0] == 1 + MADE
    for made, want in zip(result, nt._made(*nt._planned_tiles(parts))):
        assert np.array_equal(made, want)


@pytest.mark.parametrize("where", ["arena", "anonymous map", "file"])
def test_only_a_files_pages_are_marked_to_go_back_and_only_for_kept_tiles(where, tmp_path):
    """An item's inputs are marked to give their pages back once it is made (HAND_BACK) when its tiles
    will be kept and they lie in a file's read-only map, whose pages the file holds: never memory
    holding the only copy (the load's arena, an anonymous map), nor a staged copy. The tiles are the
    same bits either way, and the inputs read the same after their pages went back."""
    from runnx.interp import external_data
    from runnx.ops._kernels_nibble_layout import HAND_BACK, S_BACK, W_BACK, Z_BACK

    parts = [_weights(256, 512, "packed"), _weights(128, 512, "packed")]
    flat = [a for part in parts for a in part]
    originals = [a.copy() for a in flat]
    if where == "file":
        raw = b"".join(a.tobytes() + bytes(-a.nbytes % 64) for a in flat)
        (tmp_path / "data.bin").write_bytes(raw)
        memory = memoryview(external_data._map_file(str(tmp_path / "data.bin")))
        placed, at = [], 0
        for a in flat:
            placed.append(np.frombuffer(memory[at:at + a.nbytes], a.dtype).reshape(a.shape))
            at += a.nbytes + (-a.nbytes % 64)
    else:
        placed = _in_one_buffer(flat, "arena" if where == "arena" else "mapped")
    weight_parts = [[tuple(placed[0:3])], [tuple(placed[3:6])]]
    arena = Arena(Arena.sized([shape for p in weight_parts for shape in nt._tile_shapes(p)]))
    planned = [nt._planned_tiles(p, arena.empty) for p in weight_parts]
    items = [item for _, its in planned for item in its]
    sources, table = listed(items, arena, [True, False])
    everything = W_BACK | S_BACK | Z_BACK
    assert list(table[:, HAND_BACK]) == ([everything, 0] if where == "file" else [0, 0])
    address = placed[0].__array_interface__["data"][0]
    resident = None
    if where == "file" and sys.platform.startswith("linux"):
        assert sum(int(a.sum()) for a in placed) > 0  # (their pages read in)
        resident = _resident_kib(address)
    assert repack_listed(sources, table, arena.buffer, np.zeros(2, np.int64), 0, 2, 1)
    if resident is not None:  # the first weight's bytes (64 KiB) and scales (16) went back, the second's stayed
        assert resident - 84 <= _resident_kib(address) <= resident - 72
    for (result, _), p in zip(planned, weight_parts):
        for got, expected in zip(result, nt._nibble_tiles((), *p[0])):
            np.testing.assert_array_equal(got, expected)
    for got, expected in zip(placed, originals):
        np.testing.assert_array_equal(got, expected)
