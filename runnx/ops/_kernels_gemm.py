"""float32 matrix products at the CPU's full vector width (AVX-512, or AVX2 with FMA), for when BLAS runs
narrower or a product's shape suits them better.

numpy's OpenBLAS picks its kernels by the CPU it detects, and OPENBLAS_CORETYPE overrides that:
some machines pin it to the AVX2 kernels (older OpenBLAS builds miscomputed on their CPUs), which
halves a prompt's or an encoder's products on a CPU with AVX-512. onnxruntime's own kernels do
not follow that setting; these do not either. `_matmul.py` decides when they run.

The product is blocked as Goto's and BLIS's are: a block of MC rows of a, for KC of its columns,
is packed into panels of MR rows (`_pack_a`, k-major: one panel row a step of k; a product of at
most ROWS_IN_PLACE columns reads a's rows in place instead, `_tile_of_rows`); `_tile`
multiplies such a panel by KC x NR of b, read in place (a panel of NR columns is two vectors a row;
only the last columns short of NR are packed; a b given by its columns, b.T C-contiguous, has a
block's columns packed, `_pack_columns`), in MR x 2 vector registers (AVX-512: 12 rows x 2 vectors of 16),
one fused multiply-add per register a step of k, and adds the tile to c (stores it, for the first
block of k). Reading b in place, not packing it, is 3x faster for a prompt's first few dozen rows;
from PACKED_FROM rows of a on, each block of b is packed into panels once for all of them (a tile
then reads its panel in order, where b in place steps across b's rows, a page a row or more: 1,500-
and 2,000-row products up to 1.16x faster, a 512-row prompt's LM head 1.5-1.9x). b's columns go in blocks of
BLOCK_COLUMNS, whose KC rows stay
in cache while every row of a passes, and each tile prefetches the next panel's rows (a wide b, an
LM head's, has each of its rows a page or more apart: the hardware's prefetcher follows none). The
tiles of a block's first MC rows also fetch the next block of b into L2, each tile a share of its
rows (`gemm_columns`): a short prompt's weights come cold from memory, and only a few dozen rows
pass each block, so without it the first tiles waited for each block as long as all of them
computed it. Each element of c is thus the sum over its k in
blocks of KC, in order, each block summed in order by fused multiply-adds: the same for any
shape of the rest of the product, any split of its columns among threads and any position of
the element, so results never depend on the thread count. A short prompt's product by a weight
(`product_columns`) runs the same chains over slices of b's rows read across whole rows
(`gemm_streamed`): a weight cold from memory then streams at memory's pace.
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import literally, types
from numba.core import cgutils
from numba.extending import intrinsic

from runnx.ops import _jit_cache  # noqa: F401  (numba caches this module's kernels under RUNNX_CACHE)
from runnx.ops._array_types import any_layout, read_only
from runnx.ops._vector_width import compiles_for


WIDE = compiles_for("avx512f")  # 512-bit registers, 32 of them
AVAILABLE = WIDE or compiles_for("avx2", "fma")  # 256-bit registers, 16 of them: half the tile

# The tiles fill the registers the CPU has (AVX-512: 24 sums of 32; AVX2: 12 of 16, beside the b
# vectors and a's broadcast value). Each element's arithmetic is the same chain at either width,
# so the two give the same bits.
LANES = 16 if WIDE else 8  # float32 lanes of a register
MR, NR = (12, 32) if WIDE else (6, 16)  # a tile: rows of a x columns of b, two vectors of b a row
KC, MC = 256, 120  # blocks of k (a panel of b: 32 KiB) and of a's rows (a's packed block: 120 KiB)
BLOCK_COLUMNS = 512  # b's columns a block: KC rows of them (512 KiB) stay in cache for every row of a
ROWS_IN_PLACE = 2 * NR  # products of at most this many columns read a's rows in place
SLICE_ROWS, STREAMED_COLUMNS = 32, 2016  # `gemm_streamed`: b's rows a slice and columns a pass
# a product of at most STREAMED_ROWS rows, over a range of at least STREAMED_FROM columns, is streamed
STREAMED_ROWS, STREAMED_FROM = 48, 4 * NR  # (a few dozen rows, whatever the tile; four panels)
SHORT_MR, SHORT_NR = (8, 48) if WIDE else (4, 24)  # `gemm_streamed`'s tile for more than MR rows: as many sums
STREAMED_SPAN = 96  # `gemm_streamed`'s passes are a multiple of this many columns (of NR and SHORT_NR)
PACKED_FROM = MC  # `gemm_columns` packs b's blocks into panels for products of this many rows of a or more

_kernel = numba.njit(cache=True, nogil=True, error_model="numpy")


def _tile_codegen(a_in_place: bool, resumable: bool = False, rows: int = MR, columns: int = NR):
    """The code of a tile (`_tile`, `_tile_of_rows`, `_tile_resumed`): a's values from a packed panel
    (element i of step k at a_at + k * rows + i) or from a's rows in place (at a_at + i * a_step + k);
    its sums from zero, or (resumable, when `resume`) from the float32 sums a tile stored before;
    `rows` x `columns` sums (MR x NR but for `_tile_short`)."""

    def codegen(context, builder, sig, args):
        a_arr, b_arr, c_arr, ahead_arr = (context.make_array(sig.args[i])(context, builder, args[i])
                                          for i in (0, 3, 7, 11))
        a_at, a_step, b_at, b_step, depth, row, column, first = (args[i] for i in (1, 2, 4, 5, 6, 8, 9, 10))
        ahead_at, ahead_step, ahead_rows = args[12], args[13], args[14]
        i32, i64 = ir.IntType(32), ir.IntType(64)
        vector = ir.VectorType(ir.FloatType(), LANES)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vector, [vector] * 3), f"llvm.fma.v{LANES}f32")
        i8_pointer = ir.IntType(8).as_pointer()
        prefetch = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8_pointer, i32, i32, i32]),
                                                  "llvm.prefetch.p0i8")
        zeros = ir.Constant(vector, [0.0] * LANES)
        sums = [[cgutils.alloca_once_value(builder, zeros) for _ in range(columns // LANES)] for _ in range(rows)]
        undefined, broadcast = ir.Constant(vector, ir.Undefined), ir.Constant(ir.VectorType(i32, LANES), [0] * LANES)

        def at(base, offset):
            return builder.add(base, ir.Constant(i64, offset))

        if resumable:  # the chains go on from the sums stored at init_at (rows init_step apart)
            init_arr = context.make_array(sig.args[15])(context, builder, args[15])
            init_at, init_step, resume = args[16], args[17], args[18]
            with builder.if_then(builder.icmp_unsigned("!=", resume, ir.Constant(resume.type, 0))):
                for i in range(rows):
                    start = builder.add(init_at, builder.mul(ir.Constant(i64, i), init_step))
                    for j in range(columns // LANES):
                        pointer = builder.bitcast(builder.gep(init_arr.data, [at(start, LANES * j)]),
                                                  vector.as_pointer())
                        builder.store(builder.load(pointer, align=4), sums[i][j])

        a_rows = [builder.add(a_at, builder.mul(a_step, ir.Constant(i64, i))) for i in range(rows)]

        def step(k):  # one step of k: each sum's next fused multiply-add
            b_row = builder.add(b_at, builder.mul(k, b_step))
            b_vectors = [builder.load(builder.bitcast(builder.gep(b_arr.data, [at(b_row, LANES * j)]),
                                                      vector.as_pointer()), align=4) for j in range(columns // LANES)]
            for j in range(0, columns, 16):  # the next panel's row, read in place: its own stream for the prefetcher
                builder.call(prefetch, [builder.bitcast(builder.gep(b_arr.data, [at(b_row, columns + j)]), i8_pointer),
                                        ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
            with builder.if_then(builder.icmp_signed("<", k, ahead_rows)):
                ahead_row = builder.add(ahead_at, builder.mul(k, ahead_step))
                for j in range(0, columns, 16):  # a row of the next block's panel (`gemm_columns`), a line at a time
                    builder.call(prefetch, [builder.bitcast(builder.gep(ahead_arr.data, [at(ahead_row, j)]), i8_pointer),
                                            ir.Constant(i32, 0), ir.Constant(i32, 2), ir.Constant(i32, 1)])
            if a_in_place:
                a_places = [builder.add(start, k) for start in a_rows]
            else:
                a_column = builder.add(a_at, builder.mul(k, ir.Constant(i64, rows)))
                a_places = [at(a_column, i) for i in range(rows)]
            for i in range(rows):
                value = builder.load(builder.gep(a_arr.data, [a_places[i]]))
                a_vector = builder.shuffle_vector(builder.insert_element(undefined, value, ir.Constant(i32, 0)),
                                                  undefined, broadcast)
                for j, b_vector in enumerate(b_vectors):
                    builder.store(builder.call(fma, [a_vector, b_vector, builder.load(sums[i][j])]), sums[i][j])

        if WIDE:
            with cgutils.for_range(builder, depth) as loop:
                step(loop.index)
        else:  # two steps a pass, then the odd last one, each sum's chain in k's order: AVX2's tiles have
            # half the sums of AVX-512's to spread the loop's own instructions over (a 512-row
            # product 53 -> 65-79 GFLOP/s on a Zen 3 core)
            pairs = builder.and_(depth, ir.Constant(i64, -2))
            with cgutils.for_range_slice(builder, ir.Constant(i64, 0), pairs, ir.Constant(i64, 2)) as (k, _):
                step(k)
                step(builder.add(k, ir.Constant(i64, 1)))
            with builder.if_then(builder.icmp_signed("<", pairs, depth)):
                step(pairs)
        stored = builder.icmp_unsigned("!=", first, ir.Constant(first.type, 0))
        row_step = builder.sdiv(builder.extract_value(c_arr.strides, 0), ir.Constant(i64, 4))
        corner = builder.add(builder.mul(row, row_step), column)
        for i in range(rows):
            start = builder.add(corner, builder.mul(ir.Constant(i64, i), row_step))
            for j in range(columns // LANES):
                pointer = builder.bitcast(builder.gep(c_arr.data, [at(start, LANES * j)]), vector.as_pointer())
                total = builder.load(sums[i][j])
                builder.store(builder.select(stored, total, builder.fadd(builder.load(pointer, align=4), total)),
                              pointer, align=4)
        return context.get_dummy_value()

    return codegen


@intrinsic
def _tile(typingctx, a_panel, a_at, a_step, b_panel, b_at, b_step, depth, c, row, column, first, ahead, ahead_at,
          ahead_step, ahead_rows):
    """c[row:row + MR, column:column + NR] (+)= the a panel at a_at (depth x MR, k-major; a_step
    unused) times the b panel at b_at (depth rows of NR, b_step apart): stored when `first`, added
    otherwise. c's rows are contiguous. Its first `ahead_rows` steps of k also prefetch NR floats of
    `ahead` into L2, ahead_step apart from ahead_at (nothing read: addresses past an array are
    harmless)."""
    return (types.void(a_panel, a_at, a_step, b_panel, b_at, b_step, depth, c, row, column, first, ahead, ahead_at,
                       ahead_step, ahead_rows), _tile_codegen(False))


@intrinsic
def _tile_of_rows(typingctx, a, a_at, a_step, b_panel, b_at, b_step, depth, c, row, column, first, ahead, ahead_at,
                  ahead_step, ahead_rows):
    """`_tile` reading a's MR rows in place: row i's values at a_at + i * a_step, one a step of k."""
    return (types.void(a, a_at, a_step, b_panel, b_at, b_step, depth, c, row, column, first, ahead, ahead_at,
                       ahead_step, ahead_rows), _tile_codegen(True))


@intrinsic
def _tile_resumed(typingctx, a_panel, a_at, a_step, b_panel, b_at, b_step, depth, c, row, column, first, ahead,
                  ahead_at, ahead_step, ahead_rows, init, init_at, init_step, resume):
    """`_tile` whose chains start, when `resume`, from the sums at init_at of init (MR rows of NR,
    init_step apart) rather than from zero: a float32 sum stored and loaded back is the same value,
    so a chain cut into steps of k is the chain uncut."""
    return (types.void(a_panel, a_at, a_step, b_panel, b_at, b_step, depth, c, row, column, first, ahead, ahead_at,
                       ahead_step, ahead_rows, init, init_at, init_step, resume), _tile_codegen(False, True))


@intrinsic
def _tile_short(typingctx, a_panel, a_at, a_step, b_panel, b_at, b_step, depth, c, row, column, first, ahead,
                ahead_at, ahead_step, ahead_rows, init, init_at, init_step, resume):
    """`_tile_resumed` of SHORT_MR rows by SHORT_NR columns (`gemm_streamed`'s for more than MR rows)."""
    return (types.void(a_panel, a_at, a_step, b_panel, b_at, b_step, depth, c, row, column, first, ahead, ahead_at,
                       ahead_step, ahead_rows, init, init_at, init_step, resume),
            _tile_codegen(False, True, SHORT_MR, SHORT_NR))


@_kernel
def _pack_b(b, first_k, depth, first_column, width, panels):
    """b[first_k:first_k + depth, first_column:first_column + width] as panels of depth rows of NR
    (panel p at p * depth * NR), the last one zero-filled (a block's last columns short of NR)."""
    _pack_b_columns(b, first_k, depth, first_column, width, panels, NR)


@_kernel
def _pack_columns(columns, first_k, depth, first_column, width, panels):
    """`_pack_b` of b given as its columns (b.T, C-contiguous: a column is a row of `columns`): b's
    rows first_k.. of columns first_column.. as panels of depth rows of NR, the last zero-filled."""
    for start in range(0, width, NR):
        at = start * depth
        count = min(NR, width - start)
        for j in range(NR):
            if j < count:
                column = columns[first_column + start + j]
                for k in range(depth):
                    panels[at + k * NR + j] = column[first_k + k]
            else:
                for k in range(depth):
                    panels[at + k * NR + j] = 0.0


@_kernel
def _pack_a_rows(a, first_row, height, first_k, depth, panels, mr):
    """a[first_row:first_row + height, first_k:first_k + depth] into panels of mr rows, k-major
    (panel i: depth columns of mr at i * depth * mr), the last one zero-filled; mr compiled in
    (`literally`: a constant inner loop, as a tile's rows are)."""
    mr = literally(mr)
    for start in range(0, height, mr):
        at = start * depth
        count = min(mr, height - start)
        for k in range(depth):
            for i in range(mr):
                panels[at + k * mr + i] = a[first_row + start + i, first_k + k] if i < count else 0.0


@_kernel
def _pack_b_columns(b, first_k, depth, first_column, width, panels, nr):
    """b[first_k:first_k + depth, first_column:first_column + width] as panels of depth rows of nr
    (panel p at p * depth * nr), the last one zero-filled; nr compiled in (`literally`)."""
    nr = literally(nr)
    for k in range(depth):
        row = b[first_k + k]
        for start in range(0, width, nr):
            at = start * depth + k * nr
            count = min(nr, width - start)
            for j in range(nr):
                panels[at + j] = row[first_column + start + j] if j < count else 0.0


@_kernel
def _pack_a(a, first_row, height, first_k, depth, panels):
    """a[first_row:first_row + height, first_k:first_k + depth] into panels of MR rows, k-major
    (panel i: depth columns of MR at i * depth * MR), the last one zero-filled."""
    _pack_a_rows(a, first_row, height, first_k, depth, panels, MR)


@_kernel
def copy_block(source, source_row, source_column, target, target_row, target_column, rows, columns):
    """target[target_row:+rows, target_column:+columns] = the same block of source, element by element:
    numba's 2-d slice assignment costs seconds of compiling for each kernel that has one."""
    for i in range(rows):
        for j in range(columns):
            target[target_row + i, target_column + j] = source[source_row + i, source_column + j]


@_kernel
def gemm_columns(a, b, c, first_column, stop_column, a_panels, b_panel, edge, columns_given, b_block):
    """c[:, first_column:stop_column] = a @ b[:, first_column:stop_column] for C-contiguous float32
    a and b (c's rows contiguous), in blocks of BLOCK_COLUMNS columns. b is read in place, its last
    columns short of a panel packed into b_panel (KC * NR), or, for PACKED_FROM rows of a or more
    given room for a block in b_block, each block packed into b_block's panels (as `columns_given`
    below; the same tiles, so the same bits); a is packed into a_panels (MC * KC) but
    for products of at most ROWS_IN_PLACE columns, where packing would cost as much as the tiles
    (an attention's values product): whole tiles read a's rows in place. Scratch: edge (MR, NR).
    When `columns_given`, b holds b's columns as its rows (b.T: a dequantized weight's panel, a
    transposed operand) and each block of them is packed into b_block (KC * BLOCK_COLUMNS) while
    every row of a passes: the tiles' arithmetic, hence every element, is the same either way.
    Meanwhile the first row block's tiles prefetch the next block of b (after the range's last, the
    block past stop_column: a pool job's next unit), tile i of n its rows i, i + n, ... (`_tile`'s
    `ahead`: rows of b in place, so not when `columns_given`)."""
    rows, depth = a.shape
    a_flat, b_flat = a.reshape(-1), b.reshape(-1)
    b_step = b.shape[1]
    rows_in_place = stop_column - first_column <= ROWS_IN_PLACE
    packed = columns_given or (rows >= PACKED_FROM and not rows_in_place
                               and b_block.size >= KC * min(BLOCK_COLUMNS, -(-(stop_column - first_column) // NR) * NR))
    ahead_tiles = -(-min(MC, rows) // MR)  # the first row block's tiles, which share the next block's rows
    ahead_step = ahead_tiles * b_step
    for column_block in range(first_column, stop_column, BLOCK_COLUMNS):
        block_stop = min(column_block + BLOCK_COLUMNS, stop_column)
        whole = column_block if packed else column_block + (block_stop - column_block) // NR * NR
        for k_block in range(0, depth, KC):
            k_count = min(KC, depth - k_block)
            first = k_block == 0
            if columns_given:
                _pack_columns(b, k_block, k_count, column_block, block_stop - column_block, b_block)
            elif packed:
                _pack_b(b, k_block, k_count, column_block, block_stop - column_block, b_block)
            else:
                _pack_b(b, k_block, k_count, whole, block_stop - whole, b_panel)
            next_k, next_column = k_block + KC, column_block
            if next_k >= depth:  # (after the last block: the columns after stop_column, a pool job's next unit)
                next_k, next_column = 0, min(column_block + BLOCK_COLUMNS, stop_column)
            ahead_rows = 0 if columns_given or next_column >= b_step else min(KC, depth - next_k)
            ahead_shift = next_k * b_step + next_column - column_block
            for row_block in range(0, rows, MC):
                height = min(MC, rows - row_block)
                if rows_in_place:
                    _pack_a(a, row_block + height // MR * MR, height % MR, k_block, k_count, a_panels)
                else:
                    _pack_a(a, row_block, height, k_block, k_count, a_panels)
                for i in range(0, height, MR):
                    tile_rows, row = min(MR, height - i), row_block + i
                    in_place = rows_in_place and tile_rows == MR
                    a_at = row * depth + k_block if in_place else (0 if rows_in_place else i * k_count)
                    tile_index = i // MR
                    ahead_count = 0 if row_block or tile_index >= ahead_rows else (
                        -(-(ahead_rows - tile_index) // ahead_tiles))
                    for column in range(column_block, block_stop, NR):
                        ahead_at = ahead_shift + column + tile_index * b_step
                        if packed:
                            b_source, b_at, b_from = b_block, (column - column_block) * k_count, NR
                            tile_columns = min(NR, block_stop - column)
                        elif column < whole:
                            b_source, b_at, b_from, tile_columns = b_flat, k_block * b_step + column, b_step, NR
                        else:
                            b_source, b_at, b_from, tile_columns = b_panel, 0, NR, block_stop - whole
                        if tile_rows == MR and tile_columns == NR:
                            if in_place:
                                _tile_of_rows(a_flat, a_at, depth, b_source, b_at, b_from, k_count, c, row, column,
                                              first, b_flat, ahead_at, ahead_step, ahead_count)
                            else:
                                _tile(a_panels, a_at, 0, b_source, b_at, b_from, k_count, c, row, column, first,
                                      b_flat, ahead_at, ahead_step, ahead_count)
                            continue
                        if not first:
                            copy_block(c, row, column, edge, 0, 0, tile_rows, tile_columns)
                        if in_place:
                            _tile_of_rows(a_flat, a_at, depth, b_source, b_at, b_from, k_count, edge, 0, 0, first,
                                          b_flat, ahead_at, ahead_step, ahead_count)
                        else:
                            _tile(a_panels, a_at, 0, b_source, b_at, b_from, k_count, edge, 0, 0, first, b_flat,
                                  ahead_at, ahead_step, ahead_count)
                        copy_block(edge, 0, 0, c, row, column, tile_rows, tile_columns)


@_kernel
def _streamed_tile(short, a_panels, a_at, b_source, b_at, b_from, steps, c, row, column, first, b_flat, sums,
                   init_at, sums_step, resume, ahead_at, ahead_step, ahead_rows):
    """One tile of `gemm_streamed`: SHORT_MR x SHORT_NR when `short`, else MR x NR; its first
    `ahead_rows` steps fetch a row each of b's (its tile's columns, ahead_step apart from ahead_at)
    into L2."""
    if short:
        _tile_short(a_panels, a_at, 0, b_source, b_at, b_from, steps, c, row, column, first, b_flat, ahead_at,
                    ahead_step, ahead_rows, sums, init_at, sums_step, resume)
    else:
        _tile_resumed(a_panels, a_at, 0, b_source, b_at, b_from, steps, c, row, column, first, b_flat, ahead_at,
                      ahead_step, ahead_rows, sums, init_at, sums_step, resume)


@_kernel
def panels_product(a, panels, c, a_panels, edge):
    """c (M, N) = a (M, K) @ b for C-contiguous float32 a, K at most KC, and b (K, N) given as its
    panels: `panels` (P * K, NR), C-contiguous, panel p (b's columns p NR .. p NR + NR, zero past
    N, P NR >= N) at rows p K .. p K + K, k-major as `_pack_b` packs them. The bits of
    `gemm_columns(a, b, c, 0, N, ...)`: the same tiles over the same chains. Made once for many
    products (a KV head's keys, which every block of query positions multiplies), panels are read
    in order, two pages each, where b's columns read in place step across its rows, a page a row
    (the scores product of a prompt's attention 12-22% faster)."""
    rows, depth = a.shape
    columns = c.shape[1]
    whole = columns // NR * NR
    flat = panels.reshape(-1)
    for row_block in range(0, rows, MC):
        height = min(MC, rows - row_block)
        _pack_a(a, row_block, height, 0, depth, a_panels)
        for column in range(0, columns, NR):
            for i in range(0, height, MR):
                tile_rows, row = min(MR, height - i), row_block + i
                if tile_rows == MR and column < whole:
                    _tile(a_panels, i * depth, 0, flat, column * depth, NR, depth, c, row, column, True, flat, 0, 0, 0)
                    continue
                _tile(a_panels, i * depth, 0, flat, column * depth, NR, depth, edge, 0, 0, True, flat, 0, 0, 0)
                count = min(NR, columns - column)
                copy_block(edge, 0, 0, c, row, column, tile_rows, count)


@_kernel
def gemm_streamed(a, b, c, first_column, stop_column, sums):
    """`gemm_columns` (columns not given, its bits) for a few rows of a (at most MC) whose b comes
    cold from memory: b is read SLICE_ROWS rows at a time across as many columns as sums has (a
    multiple of STREAMED_SPAN; STREAMED_COLUMNS where a range is that wide), panel by panel, so
    each of those rows' lines is asked for in order and the hardware's streamer fetches ahead of
    them (a KC-row block of 512 columns, read down each panel, touches two lines of a page and
    leaves it: the core's fill buffers then bound the stream, a third of memory's pace), and the
    tiles of each slice fetch the next slice's rows into L2, a share each, while they compute (a
    slice's first tile would otherwise wait for it from memory: 32-row products 12-30% slower,
    their weights' time and their multiply-adds' adding up instead of overlapping). Each
    tile's chains run a slice of k and are stored into sums (float32, `streamed_rows` rows), the
    next slice's tile resuming them; the block's last slice adds them to c as `gemm_columns` does,
    so every element is the same chain of fused multiply-adds over its KC block. Tiles of MR x NR
    for at most MR rows, else of SHORT_MR x SHORT_NR: a prompt of a few dozen rows fills tiles of
    8 rows, where tiles of 12 leave up to two thirds of the last one empty."""
    rows, depth = a.shape
    short = rows > MR
    mr, nr = (SHORT_MR, SHORT_NR) if short else (MR, NR)
    b_flat, b_step = b.reshape(-1), b.shape[1]
    sums_step = span = sums.shape[1]
    tiles = -(-rows // mr)
    a_panels = np.empty(tiles * mr * KC, np.float32)
    b_panel, edge = np.empty(KC * nr, np.float32), np.empty((mr, nr), np.float32)
    for chunk in range(first_column, stop_column, span):
        chunk_stop = min(chunk + span, stop_column)
        whole = chunk + (chunk_stop - chunk) // nr * nr
        for k_block in range(0, depth, KC):
            k_count = min(KC, depth - k_block)
            first = k_block == 0
            if short:  # (constant panel sizes: `literally`)
                _pack_a_rows(a, 0, rows, k_block, k_count, a_panels, SHORT_MR)
                _pack_b_columns(b, k_block, k_count, whole, chunk_stop - whole, b_panel, SHORT_NR)
            else:
                _pack_a(a, 0, rows, k_block, k_count, a_panels)
                _pack_b(b, k_block, k_count, whole, chunk_stop - whole, b_panel)
            for k_slice in range(0, k_count, SLICE_ROWS):
                steps = min(SLICE_ROWS, k_count - k_slice)
                resume, last = k_slice > 0, k_slice + SLICE_ROWS >= k_count
                # the next slice's rows (the next pass's first, after the last) go to L2 meanwhile,
                # a share of them with each tile over its columns: b then arrives while the
                # tiles compute, not while the first waits for it
                ahead_row, ahead_chunk = k_block + k_slice + steps, chunk
                if ahead_row >= depth:
                    ahead_row, ahead_chunk = 0, chunk + span
                ahead_count = 0 if ahead_chunk >= stop_column else min(SLICE_ROWS, depth - ahead_row)
                share = -(-ahead_count // tiles)
                for tile in range(tiles):
                    row = tile * mr
                    tile_rows = min(mr, rows - row)
                    a_at = row * k_count + k_slice * mr
                    ahead_first = tile * share
                    ahead_rows = max(0, min(share, ahead_count - ahead_first))
                    for column in range(chunk, chunk_stop, nr):
                        init_at = row * sums_step + column - chunk
                        ahead_at = (ahead_row + ahead_first) * b_step + ahead_chunk + column - chunk
                        if column < whole:
                            b_at = (k_block + k_slice) * b_step + column
                            b_source, b_from, tile_columns = b_flat, b_step, nr
                        else:
                            b_at = k_slice * nr
                            b_source, b_from, tile_columns = b_panel, nr, chunk_stop - whole
                        if not last:
                            _streamed_tile(short, a_panels, a_at, b_source, b_at, b_from, steps, sums, row,
                                           column - chunk, True, b_flat, sums, init_at, sums_step, resume, ahead_at,
                                           b_step, ahead_rows)
                        elif tile_rows == mr and tile_columns == nr:
                            _streamed_tile(short, a_panels, a_at, b_source, b_at, b_from, steps, c, row, column,
                                           first, b_flat, sums, init_at, sums_step, resume, ahead_at, b_step,
                                           ahead_rows)
                        else:
                            if not first:
                                copy_block(c, row, column, edge, 0, 0, tile_rows, tile_columns)
                            _streamed_tile(short, a_panels, a_at, b_source, b_at, b_from, steps, edge, 0, 0, first,
                                           b_flat, sums, init_at, sums_step, resume, ahead_at, b_step, ahead_rows)
                            copy_block(edge, 0, 0, c, row, column, tile_rows, tile_columns)


@_kernel
def streamed_rows(rows):
    """The rows of `gemm_streamed`'s sums for a of `rows` rows (its tiles')."""
    return MR if rows <= MR else -(-rows // SHORT_MR) * SHORT_MR


@_kernel
def streams(rows, columns, columns_given):
    """Whether `product_columns` streams a product of `rows` rows over `columns` columns of b."""
    return not columns_given and rows <= STREAMED_ROWS and columns >= STREAMED_FROM


@_kernel
def product_columns(a, b, c, first_column, stop_column, a_panels, b_panel, edge, columns_given, b_block, sums):
    """c[:, first_column:stop_column] = a @ b[:, ...] as `gemm_columns` (its arguments, the same bits),
    streamed (`gemm_streamed`, into sums of `streamed_rows` rows) when a has at most
    STREAMED_ROWS rows, b is given by its rows and the range has STREAMED_FROM columns or more: a
    short prompt's product by a weight, which comes from memory at the pace of its multiply-adds.
    (Narrower ranges have rows too short for the streamer to pay for the slices' stored sums; from
    a few dozen rows the weights' time is the smaller part, and whole KC chains compute faster.)
    a and b read-only and c of any layout to the product (`_array_types.py`): one compiled product
    for weights and computed values, whole and strided outputs."""
    _columns_product(read_only(a), read_only(b), any_layout(c), first_column, stop_column, a_panels, b_panel, edge,
                     columns_given, b_block, sums)


@_kernel
def _columns_product(a, b, c, first_column, stop_column, a_panels, b_panel, edge, columns_given, b_block, sums):
    rows = a.shape[0]
    if (streams(rows, stop_column - first_column, columns_given) and sums.shape[0] >= streamed_rows(rows)
            and sums.shape[1] >= STREAMED_SPAN and sums.shape[1] % STREAMED_SPAN == 0):
        gemm_streamed(a, b, c, first_column, stop_column, sums)
    else:
        gemm_columns(a, b, c, first_column, stop_column, a_panels, b_panel, edge, columns_given, b_block)


@intrinsic
def _fma(typingctx, x, y, z):
    """x * y + z rounded once (llvm.fma.f32): the tiles' arithmetic, one element at a time."""
    def codegen(context, builder, sig, args):
        function = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.FloatType(), [ir.FloatType()] * 3),
                                                  "llvm.fma.f32")
        return builder.call(function, args)

    return types.float32(types.float32, types.float32, types.float32), codegen


@intrinsic
def _strip(typingctx, row, columns, first, k_start, k_stop, sums):
    """sums[first:first + LANES] = the chains of fused multiply-adds, from zero, of row[k] times
    columns[first + lane, k] for k in k_start .. k_stop (columns: C-contiguous (N, K), a b given
    by its columns), LANES columns in one register: each lane's chain in order, as a tile sums it."""
    def codegen(context, builder, sig, args):
        row_a, columns_a, sums_a = (context.make_array(sig.args[i])(context, builder, args[i]) for i in (0, 1, 5))
        first, k_start, k_stop = args[2], args[3], args[4]
        i32, i64 = ir.IntType(32), ir.IntType(64)
        vector = ir.VectorType(ir.FloatType(), LANES)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vector, [vector] * 3), f"llvm.fma.v{LANES}f32")
        depth = builder.extract_value(columns_a.shape, 1)
        total = cgutils.alloca_once_value(builder, ir.Constant(vector, [0.0] * LANES))
        undefined, broadcast = ir.Constant(vector, ir.Undefined), ir.Constant(ir.VectorType(i32, LANES), [0] * LANES)
        starts = [builder.mul(builder.add(first, ir.Constant(i64, lane)), depth) for lane in range(LANES)]
        with cgutils.for_range_slice(builder, k_start, k_stop, ir.Constant(i64, 1)) as (k, _):
            value = builder.load(builder.gep(row_a.data, [k]))
            x = builder.shuffle_vector(builder.insert_element(undefined, value, ir.Constant(i32, 0)), undefined,
                                       broadcast)
            column = undefined
            for lane in range(LANES):
                entry = builder.load(builder.gep(columns_a.data, [builder.add(starts[lane], k)]))
                column = builder.insert_element(column, entry, ir.Constant(i32, lane))
            builder.store(builder.call(fma, [x, column, builder.load(total)]), total)
        pointer = builder.bitcast(builder.gep(sums_a.data, [first]), vector.as_pointer())
        builder.store(builder.load(total), pointer, align=4)
        return context.get_dummy_value()

    return types.void(row, columns, types.int64, types.int64, types.int64, sums), codegen


@_kernel
def few_rows(a, b, c, columns_given, sums):
    """c = a @ b for a few rows (a decode step's one, stacks of them: an attention's heads), the
    tiles' arithmetic without packing anything: each element the sum over its k in blocks of KC, in
    order, each block a chain of fused multiply-adds from zero, so the same bits as `gemm_columns`
    (which packs b's panels, a's rows and, when `columns_given`, b's columns: more work than one
    row's multiply-adds). a (M, K), b (K, N) or, columns given, (N, K), C-contiguous; c (M, N);
    sums: N float32."""
    if not b.flags.c_contiguous:
        raise ValueError("few_rows reads b (or its columns) as a C-contiguous matrix")
    rows, depth = a.shape
    columns = c.shape[1]
    for i in range(rows):
        for k_block in range(0, depth, KC):
            sums[:columns] = 0
            stop = min(k_block + KC, depth)
            if columns_given:  # LANES columns at a time in one register, each lane its own chain
                whole = columns // LANES * LANES
                for first in range(0, whole, LANES):
                    _strip(a[i], b, first, k_block, stop, sums)
                for j in range(whole, columns):
                    for k in range(k_block, stop):
                        sums[j] = _fma(a[i, k], b[j, k], sums[j])
            else:
                for k in range(k_block, stop):
                    x = a[i, k]
                    for j in range(columns):
                        sums[j] = _fma(x, b[k, j], sums[j])
            if k_block == 0:
                c[i, :] = sums[:columns]
            else:
                for j in range(columns):
                    c[i, j] = c[i, j] + sums[j]


@_kernel
def few_rows_stack(a, b, c, columns_given, sums):
    """`few_rows` for each matrix of the stacks a (S, M, K), b (S, K, N) or (S, N, K), c (S, M, N)."""
    for s in range(a.shape[0]):
        few_rows(a[s], b[s], c[s], columns_given, sums)
