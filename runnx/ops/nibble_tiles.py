"""A constant 4-bit weight's tiles (`_kernels_nibble_layout`): made on its first few-row
product or ahead of it by the load's prepack (`registry`'s prepack hooks: `prepack_tiles`,
`prepack_joined_tiles`), kept while the weight lives (a `Remembered` each: one weight's, and the
joined tiles of the products of one input), and, once kept, the weight's own bytes handed back to
the file they are mapped from: its products read only the tiles from then on (few rows the tiles,
many rows panels dequantized from them, `ops/contrib_quantized.py`).

A prepack plans every weight's tiles side by side in one arena and lists them (`_tile_listing`);
one native call (`repack_listed`) makes a group of them, each part handed back as soon as it is
made, and a run reaching a weight not kept yet joins that work instead of making it again.
"""
from __future__ import annotations

import numpy as np

from runnx.errors import RunnxError
from runnx.interp.external_data import release_pages
from runnx.ops._kernels_contrib import ZERO_DEFAULT, ZERO_PACKED, ZERO_TYPED
from runnx.ops._kernels_nibble_layout import MADE, repack, repack_listed
from runnx.ops._kernels_nibble_tiles import CHUNK_BYTES, TILE
from runnx.ops._remembered import Remembered
from runnx.ops._tile_listing import Arena, buffers_key, buffers_of, listed
from runnx.ops.registry import COMPUTED

_FLOAT32 = np.dtype(np.float32)


def nbits_zero_points(zero_points, columns: int, blocks: int, bits: int, work):
    """(mode, packed uint8, typed floats) for the kernel, after checking the zero points' size."""
    empty_packed, empty_typed = np.empty(0, np.uint8), np.empty(0, work)
    if zero_points is None:
        return ZERO_DEFAULT, empty_packed, empty_typed
    if zero_points.dtype == np.uint8:
        per_byte = 8 // bits
        expected = columns * ((blocks + per_byte - 1) // per_byte)
        if zero_points.size != expected:
            raise RunnxError(f"MatMulNBits: packed zero points have {zero_points.size} bytes, expected {expected} "
                             f"({columns} columns x {blocks} blocks at {bits} bits)")
        return ZERO_PACKED, np.ascontiguousarray(zero_points.reshape(-1)), empty_typed
    if zero_points.size != columns * blocks:
        raise RunnxError(f"MatMulNBits: zero points of type {zero_points.dtype} have {zero_points.size} values, "
                         f"expected {columns * blocks} (one per block)")
    return ZERO_TYPED, empty_packed, np.ascontiguousarray(zero_points.reshape(-1), dtype=work)


def check_weight(b, scales, K: int, N: int, bits: int, block_size: int) -> int:
    """The blocks of a MatMulNBits weight of K rows and N columns, whose B and scales are checked."""
    if bits not in (2, 4, 8):
        raise RunnxError(f"MatMulNBits: bits must be 2, 4 or 8, got {bits}")
    if block_size < 16 or block_size & (block_size - 1):
        raise RunnxError(f"MatMulNBits: block_size must be a power of 2 and at least 16, got {block_size}")
    blocks = (K + block_size - 1) // block_size
    blob = block_size * bits // 8
    if b.dtype != np.uint8 or b.shape != (N, blocks, blob):
        raise RunnxError(f"MatMulNBits: B must be uint8 of shape [{N}, {blocks}, {blob}] for K={K}, N={N}, "
                         f"bits={bits}, block_size={block_size}; got {b.dtype} {list(b.shape)}")
    if scales.size != N * blocks:
        raise RunnxError(f"MatMulNBits: scales have {scales.size} values, expected {N * blocks} (N x blocks)")
    return blocks


def _nibble_tiles(_, weights, scales, zero_points):
    """4-bit weights with blobs of 16 bytes or more repacked in tiles of 16 columns, with a scale
    and a zero point for each 32 values (`_kernels_nibble_layout`: uint8 zero points, float32 ones
    of the scales' type, or one shared row of the default), read-only."""
    return _made(*_planned_tiles([(weights, scales, zero_points)]))


def _tile_shapes(parts: list) -> list:
    """(shape, dtype) of each array `_planned_tiles(parts, empty)` asks `empty` for, in order."""
    chunks = parts[0][0].shape[1] * parts[0][0].shape[2] // CHUNK_BYTES
    count = sum(b.shape[0] for b, _, _ in parts[:-1]) // TILE + -(-parts[-1][0].shape[0] // TILE)
    shapes = [((count, chunks, CHUNK_BYTES, TILE), np.uint8), ((count, chunks, TILE), _FLOAT32)]
    zero_points = parts[0][2]
    if zero_points is not None:
        shapes.append(((count, chunks, TILE), np.uint8 if zero_points.dtype == np.uint8 else _FLOAT32))
    return shapes


def _planned_tiles(parts: list, empty=np.empty) -> tuple[tuple, list]:
    """((tiles, scales, zeros), items): buffers from `empty` for the tiles of the 4-bit weights of
    parts ((b, scales, zero points) triples, zero points all absent or all of one type) side by
    side, and the `repack` arguments that fill them, one item a part, each into its share: every
    part but the last has whole tiles (its columns a multiple of 16)."""
    (tiles_shape, _), (scales_shape, _), *zeros_shape = _tile_shapes(parts)
    tiles = empty(tiles_shape, np.uint8)  # (`repack` writes every element)
    tile_scales = empty(scales_shape, _FLOAT32)
    tile_zeros, items, first = None, [], 0
    for weights, scales, zero_points in parts:
        columns, blocks, _ = weights.shape
        mode, packed, typed = nbits_zero_points(zero_points, columns, blocks, 4, _FLOAT32)
        own = slice(first, first + -(-columns // TILE))
        if mode == ZERO_DEFAULT:
            tile_zeros = np.full((1, 1, TILE), 8, np.uint8)  # 4 bits' default, one row for every column
        elif tile_zeros is None:
            tile_zeros = empty(*zeros_shape[0])
        byte_zeros = tile_zeros[own] if mode == ZERO_PACKED else _NO_BYTE_ZEROS
        float_zeros = tile_zeros[own] if mode == ZERO_TYPED else _NO_FLOAT_ZEROS
        items.append((_read_only(np.ascontiguousarray(weights)),
                      _read_only(np.ascontiguousarray(scales.reshape(-1), dtype=_FLOAT32)), _read_only(packed),
                      _read_only(typed), mode, tiles[own], tile_scales[own], byte_zeros, float_zeros))
        first = own.stop
    return (tiles, tile_scales, tile_zeros), items


def _made(result: tuple, items: list) -> tuple:
    """The planned tiles (`_planned_tiles`), filled and read-only."""
    for item in items:
        repack(*item)
    return _sealed(result)


def _sealed(result: tuple) -> tuple:
    for array in result:
        array.flags.writeable = False
    return result


def _read_only(array: np.ndarray) -> np.ndarray:
    if array.flags.writeable:
        array = array.view()
        array.flags.writeable = False
    return array


_NO_BYTE_ZEROS, _NO_FLOAT_ZEROS = np.empty((0, 1, TILE), np.uint8), np.empty((0, 1, TILE), _FLOAT32)
PREPACK, RUN = 1, 2  # makers of an item (`repack_listed`'s states)


class _PendingTiles:
    """Tiles a prepack planned (`registry`'s pending work): the parts of their weights, the
    `Remembered` that keeps them for these values and arrays once they are made, and, once `batch`
    has listed them, their buffers and `repack` items and where they are in its table."""

    __slots__ = ("remembered", "values", "arrays", "parts", "result", "items", "listing", "first")

    def __init__(self, remembered: Remembered, values, arrays: tuple, parts: list):
        self.remembered, self.values, self.arrays, self.parts = remembered, values, arrays, parts

    @staticmethod
    def batch(pending: list):
        """Plan the tiles of every weight side by side in one arena and list them (`_tile_listing`),
        weights lying in the same buffers together (one group for a model whose weights share a
        data file or the load's arena; a file a tensor, a group a weight: nothing copied); returns
        the function making each group in one native call (`repack_listed`), then keeping each
        weight. Every weight is promised to its `Remembered` first: a run reaching one not kept yet
        makes the items of it that the prepacking thread has not started, and waits for the others
        (`join`): no tiles made twice, and the run waits for at most the items being made."""
        pending = [p for p in pending if not p.known()]  # (a run may have made some since)
        arena = Arena(Arena.sized([shape for p in pending for shape in _tile_shapes(p.parts)]))  # (faulted in now)
        groups: dict = {}
        for p in pending:
            p.result, p.items = _planned_tiles(p.parts, arena.empty)
            groups.setdefault(buffers_key(buffers_of(p.items[0])), []).append(p)
        listings = []
        for group in groups.values():
            sources, table = listed([item for p in group for item in p.items], arena,
                                    [p.keeps() for p in group for _ in p.items])
            states, first = np.zeros(len(table), np.int64), 0
            for p in group:
                p.listing, p.first = (sources, table, arena.buffer, states), first
                first += len(p.items)
                p.remembered.promise(p.values, p.arrays, p.join)
            listings.append((p.listing, group))
        if listings:  # loaded now (from numba's cache, on a process's first call: Python holding the
            # GIL for milliseconds), so that the calls `make` begins with are native at once
            repack_listed(*listings[0][0], 0, 0, PREPACK)

        def make() -> None:
            for listing, group in listings:
                states = listing[3]
                repack_listed(*listing, 0, len(states), PREPACK)
                for p in group:
                    if not np.all(states[p.first:p.first + len(p.items)] & MADE):
                        p.remembered.withdraw(p.values, p.arrays)  # a run reaching it makes it alone, and raises
                    elif not p.known():  # (else a run's `join` kept it)
                        p.keep()
        return make

    def join(self) -> tuple | None:
        """These tiles, made by this thread and the prepacking one together (`batch`), sealed; None
        when a repack refused them (the run's own making raises it)."""
        if repack_listed(*self.listing, self.first, len(self.items), RUN):
            return _sealed(self.result)
        return None

    def keeps(self) -> bool:
        """Whether these tiles will be kept once made: their weight's own bytes are then read no more
        (`_release_weights`)."""
        return self.remembered.keeps(self.arrays)

    def known(self) -> bool:
        """Whether these tiles are made already (a run got to them first)."""
        return self.remembered.knows(self.values, self.arrays)

    def keep(self) -> bool:
        """Keep the made tiles for their values and arrays, as a run's `lookup` would; False when a
        run kept its own first (those stay)."""
        made = _sealed(self.result)
        return self.remembered.keep(self.values, self.arrays, made) is made


def _pending(remembered: Remembered, values, arrays: tuple, parts) -> _PendingTiles | None:
    """The tiles of these weight parts for these values and arrays, to be made by
    `_PendingTiles.batch`; None when they are made already (a run got to them first). parts: a
    function giving them checked (it raises what a run would)."""
    if remembered.knows(values, arrays):
        return None
    return _PendingTiles(remembered, values, arrays, parts())


def _release_weights(_, *arrays) -> None:
    """Once a weight's tiles are kept, its own bytes (weights, scales, zero points) are read no more
    (few rows read the tiles, more rows their panels: `_tiled_panel_product`): those mapped from a
    data file hand their pages back (`external_data.release_pages`), as onnxruntime's prepacking
    frees the initializers it packed. A 4-bit model's weights then take memory once, not twice."""
    for array in arrays:
        if array is not None:
            release_pages(array)


# a constant weight's tiles are made on its first product (or ahead, by the load's prepack) and kept
# while it lives, its own bytes handed back when a file holds them (`_release_weights`)
remembered_tiles = Remembered(_nibble_tiles, kept=_release_weights)


def kept_tiles(b, scales, zero_points, K: int, N: int, block_size: int) -> tuple | None:
    """The tiles kept for this 4-bit weight (`remembered_tiles`), made and checked already, or None."""
    tiles = remembered_tiles.known_result(((), id(b), id(scales), id(zero_points)))
    return tiles if tiles is not None and b.shape == (N, (K + block_size - 1) // block_size, block_size // 2) else None


def four_bit_tiles(b, scales, zero_points, K: int, N: int, block_size: int) -> tuple:
    """The tiles of a constant 4-bit weight (block_size 32 or more) that its few-row products read,
    made on first use and kept (`remembered_tiles`), checked as MatMulNBits checks it first (its
    zero points when they are made)."""
    tiles = kept_tiles(b, scales, zero_points, K, N, block_size)
    if tiles is not None:
        return tiles
    check_weight(b, scales, K, N, 4, block_size)
    return remembered_tiles((), b, scales, zero_points)


def prepack_tiles(inputs: tuple, attrs: dict) -> _PendingTiles | None:
    """MatMulNBits' tiles planned ahead (`registry`'s prepack): a constant 4-bit weight that its few-row
    products read as tiles (`_nibble_product`), checked as MatMulNBits checks it first."""
    b, scales, zero_points, g_idx = (inputs[1:] + (None, None, None))[:4]
    K, N, block_size = attrs.get("K"), attrs.get("N"), attrs.get("block_size")
    if (any(x is COMPUTED for x in (b, scales, zero_points)) or b is None or scales is None or g_idx is not None
            or attrs.get("bits") != 4 or not isinstance(block_size, int) or block_size < 32
            or block_size & (block_size - 1) or not isinstance(K, int) or not isinstance(N, int)):
        return None
    blocks = (K + block_size - 1) // block_size
    if b.dtype == np.uint8 and b.shape == (N, blocks, block_size // 2) and scales.size == N * blocks:
        return _pending(remembered_tiles, (), (b, scales, zero_points), lambda: [(b, scales, zero_points)])
    return None


def _joined_tiles(shape: tuple, *parts):
    """The tiles of the 4-bit weights of `parts` (flat (b, scales, zero points) triples) side by
    side, columns of the first part first, each part checked as MatMulNBits checks it; shape:
    (K, block_size, columns of each part)."""
    return _made(*_planned_tiles(_joined_parts(shape, *parts)))


def _joined_parts(shape: tuple, *parts) -> list:
    """`_joined_tiles`' parts as `_planned_tiles` takes them, checked: each part into its share when
    the parts before the last have whole tiles, else the parts joined."""
    depth, block_size, columns = shape
    blocks = (depth + block_size - 1) // block_size
    triples = [parts[i:i + 3] for i in range(0, len(parts), 3)]
    for (b, scales, zero_points), n in zip(triples, columns):
        if b.dtype != np.uint8 or b.shape != (n, blocks, block_size // 2):
            raise RunnxError(f"SharedInputMatMulNBits: B must be uint8 of shape [{n}, {blocks}, {block_size // 2}], "
                             f"got {b.dtype} {list(b.shape)}")
        if scales.size != n * blocks:
            raise RunnxError(f"SharedInputMatMulNBits: scales have {scales.size} values, expected {n * blocks}")
        nbits_zero_points(zero_points, n, blocks, 4, _FLOAT32)
    if any((zero_points is None) != (triples[0][2] is None) or zero_points is not None
           and zero_points.dtype != triples[0][2].dtype for _, _, zero_points in triples):
        raise RunnxError("SharedInputMatMulNBits: every product needs zero points of one type, or none")
    if all(b.shape[0] % TILE == 0 for b, _, _ in triples[:-1]):  # each part into its own tiles
        return triples
    weights = np.concatenate([b for b, _, _ in triples])
    scales = np.concatenate([s.reshape(-1) for _, s, _ in triples])
    zero_points = None if triples[0][2] is None else np.concatenate([z.reshape(-1) for _, _, z in triples])
    return [(weights, scales, zero_points)]


# made on the first few-row product, kept while the weights live (`remembered_tiles`):
# joined_four_bit_tiles((K, block_size, columns), *parts), the parts checked when they are made
joined_four_bit_tiles = Remembered(_joined_tiles, kept=_release_weights)


def prepack_joined_tiles(inputs: tuple, attrs: dict) -> _PendingTiles | None:
    """SharedInputMatMulNBits' joined tiles planned ahead (`registry`'s prepack), checked as they are
    when a few-row product makes them (`_joined_tiles`)."""
    parts = inputs[1:1 + 3 * len(attrs.get("columns", ()))]  # (then SplitHeads' inputs)
    if not parts or any(x is COMPUTED for x in parts) or attrs.get("block_size", 0) < 32:
        return None
    shape = (attrs["K"], attrs["block_size"], tuple(attrs["columns"]))
    return _pending(joined_four_bit_tiles, shape, parts, lambda: _joined_parts(shape, *parts))
