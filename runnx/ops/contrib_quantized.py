"""onnxruntime's contrib quantised operators: MatMulNBits (2/4/8-bit block-quantised weights),
SharedInputMatMulNBits (runnx's: the 4-bit products of one input as one job), MatMulBnb4
(bitsandbytes' FP4/NF4 codes), GatherBlockQuantized (a block-quantised embedding table),
DynamicQuantizeMatMul and MatMulIntegerToFloat. A constant 4-bit weight's tiles, and their
prepacking, are `nibble_tiles.py`'s.

MatMulNBits and MatMulBnb4 never dequantize their whole matrix: a few rows (decoding, short prompts) stream the
packed blocks through a numba kernel; many rows dequantize a panel of columns at a time into a
small buffer and multiply it with BLAS. Integer products are MatMulInteger's (int32), scaled in
float as onnxruntime scales them.
"""
from __future__ import annotations

import functools
import threading

import numpy as np

from runnx.errors import RunnxError
from runnx.ops import _native
from runnx.ops._kernels_contrib import (BNB4_TABLES, bnb4_dequantize, bnb4_rows, gather_blocks_into, lanes_order_into,
                                        nbits_dequantize, nbits_lanes, nbits_rows, nibble_lanes_panel)
from runnx.ops._kernels_nibble_layout import tile_lanes_panel
from runnx.ops._fused_common import DOMAIN as FUSED_DOMAIN
from runnx.ops.fused_layer_norm_blocks import SplitHeads
from runnx.ops.fused_norms import SiluMul
from runnx.ops.linalg_integer import MatMulInteger
from runnx.ops.nibble_tiles import (check_weight, joined_four_bit_tiles, kept_tiles, nbits_zero_points,
                                    prepack_joined_tiles, prepack_tiles, remembered_tiles)
from runnx.ops.quantization import DynamicQuantizeLinear
from runnx.ops.registry import register
from runnx.ops._matmul import matmul, own_product, rest_workers_before
from runnx.runtime import defer, opening, pool as decode_pool
from runnx.runtime.blas_split import blas_threads, split_among_threads
from runnx.runtime.jobs import post_nbits
from runnx.runtime.rows import share_rows

DOMAIN = "com.microsoft"
_FLOAT32 = np.dtype(np.float32)
_STREAMED_ROWS = 8  # up to this many rows of A stream the packed weights; more go through BLAS panels
# 4-bit float32 products read their column tiles (`_nibble_tiles`) for up to this many rows: below it
# dequantizing a panel of every weight costs more than the rows' multiply-adds (a 32-token prompt's
# products 1.8x faster, 64 rows 1.2x; 96 rows even)
TILED_ROWS = 64
# where a prompt's panels go to BLAS (no own float kernels: AVX2) and no pool worker shares the tiles'
# job, the panels win from a few dozen rows (one Zen 3 core over unpacked chunks: 24 rows' tiles
# 0.81-0.90x the panels' time, 32 even, 40 1.05x, 64 1.17x; with two threads the tiles' job is shared
# and they stay ahead up to TILED_ROWS)
ALONE_TILED_ROWS = 32
_PANEL_BYTES = 1 << 20  # a dequantized panel's size for the BLAS path
# runnx's own kernels pack the rows anew for every product: wider panels, fewer packings
_OWN_PANEL_BYTES = 1 << 22


def tiled_rows() -> int:
    """The most rows for which a 4-bit float32 product reads its column tiles (TILED_ROWS), not
    panels dequantized from them: ALONE_TILED_ROWS on one thread where the panels' products are
    BLAS's."""
    if decode_pool.pool() is None and not own_product(TILED_ROWS, True):
        return ALONE_TILED_ROWS
    return TILED_ROWS


def reads_tiles(rows: int) -> bool:
    """Whether a 4-bit float32 product of `rows` rows reads its column tiles (`tiled_rows`): a decode
    step's few rows answered without asking the pool, once a layer and token."""
    return rows <= ALONE_TILED_ROWS or rows <= tiled_rows()


def _lanes(rows, blocks: int, block_size: int, bits: int):
    """The rows of A split into the lanes of a packed byte and each block's sum (`nbits_lanes`)."""
    per_byte = 8 // bits
    lanes = np.empty((rows.shape[0], per_byte, blocks * block_size // per_byte), rows.dtype)
    sums = np.empty((rows.shape[0], blocks), rows.dtype)
    nbits_lanes(rows, block_size, lanes, sums)
    return lanes, sums


def _nibble_product(rows, b, scales, zero_points, out) -> None:
    """out = rows @ dequantized(b).T for 4-bit float32 weights in blobs of 16 bytes or more: a
    job of column tiles for the decode pool (`runtime/pool.py`), or alone on this thread."""
    decode_pool.nbits_rows(rows, *remembered_tiles((), b, scales, zero_points), out)


def _check_g_idx(g_idx, depth: int, block_size: int):
    """A g_idx that is each row's own block (k // block_size) changes nothing; any other order is refused."""
    if g_idx is None:
        return
    if g_idx.shape != (depth,) or not np.array_equal(g_idx, np.arange(depth) // block_size):
        raise RunnxError("MatMulNBits: g_idx other than k // block_size (act-order reordered groups) is not "
                         "supported; re-quantize the model without act-order")


@register("MatMulNBits", since=1, domain=DOMAIN, overlaps_jobs=True, prepack=prepack_tiles)
def MatMulNBits(a, b, scales, zero_points=None, g_idx=None, bias=None, *, K: int, N: int, bits: int = 4,
                block_size: int, accuracy_level: int = 0):
    """a (..., K) @ dequantize(b).T (+ bias): b (N, blocks, block_size * bits / 8) uint8, value i of a
    block in bits i*bits.. of its bytes, dequantized as (q - zero point) * scale per block.
    accuracy_level (onnxruntime's minimum compute precision) is accepted; runnx always computes in
    the scales' precision or wider. Given leave, a few rows' tiled product is left open for the
    decode pool's workers, or with none deferred (`runtime.defer`: the same job)."""
    if bits == 4 and a.dtype == _FLOAT32 and g_idx is None and a.shape[-1:] == (K,) and block_size >= 32:
        tiles = kept_tiles(b, scales, zero_points, K, N, block_size)
        if tiles is not None:
            rows = a.reshape(-1, K)  # B, scales and zero points checked when their tiles were made
            if reads_tiles(rows.shape[0]) and rows.flags.c_contiguous:
                out = np.empty((rows.shape[0], N), _FLOAT32)
                if bias is None:
                    if opening.allowed and decode_pool.pool() is None:  # (no workers to leave it open to)
                        defer(post_nbits, (rows, *tiles, out), job=True)
                    else:
                        decode_pool.open_nbits_rows(rows, *tiles, out)
                    return out.reshape(a.shape[:-1] + (N,))
                decode_pool.nbits_rows(rows, *tiles, out)
                return _with_bias(out, bias, _FLOAT32).reshape(a.shape[:-1] + (N,))
            if not reads_tiles(rows.shape[0]):  # a prompt's: panels of the tiles, the weight's own bytes handed back
                decode_pool.settle()  # a may be the output of a job left open
                out = np.empty((rows.shape[0], N), _FLOAT32)
                _tiled_panel_product(np.ascontiguousarray(rows), tiles, 0, out)
                return _with_bias(out, bias, _FLOAT32).reshape(a.shape[:-1] + (N,))
    decode_pool.settle()  # a may be the output of a job left open
    blocks = check_weight(b, scales, K, N, bits, block_size)
    if a.shape[-1:] != (K,):
        raise RunnxError(f"MatMulNBits: A's last dimension must be K={K}, got shape {list(a.shape)}")
    _check_g_idx(g_idx, K, block_size)
    work = np.dtype(np.float64) if a.dtype == np.float64 else np.dtype(np.float32)
    rows = np.ascontiguousarray(a.reshape(-1, K), dtype=work)
    out = np.empty((rows.shape[0], N), work)
    if reads_tiles(rows.shape[0]) and bits == 4 and block_size >= 32 and work == np.float32:
        _nibble_product(rows, b, scales, zero_points, out)  # zero points checked once
        return _with_bias(out, bias, work).reshape(a.shape[:-1] + (N,)).astype(a.dtype, copy=False)
    mode, packed, typed = nbits_zero_points(zero_points, N, blocks, bits, work)
    flat_scales = np.ascontiguousarray(scales.reshape(-1), dtype=work)
    if rows.shape[0] <= _STREAMED_ROWS:
        lanes, sums = _lanes(rows, blocks, block_size, bits)
        nbits_rows(lanes, sums, b, flat_scales, packed, typed, mode, bits, out)
    else:
        _panel_product(rows, b, flat_scales, (packed, typed, mode), bits, block_size, out)
    return _with_bias(out, bias, work).reshape(a.shape[:-1] + (N,)).astype(a.dtype, copy=False)


@register("SharedInputMatMulNBits", since=1, domain=FUSED_DOMAIN, overlaps_jobs=True, prepack=prepack_joined_tiles)
def SharedInputMatMulNBits(a, *inputs, K: int, columns: tuple, block_size: int, gated: tuple = (),
                           splits: tuple = ()):
    """(MatMulNBits(a, b, scales, zero_points, K=K, N=n, bits=4, block_size=block_size) for each
    (b, scales, zero_points) of `parts` and n of `columns`): the 4-bit products of one input (a
    layer's query, key and value projections; its gate and up projections), matched by
    `runnx/interp/fusion/nbits_products.py`. A decode step's few rows take one products job over
    the weights' tiles side by side (one hand-off to the pool, not one a product): each column is
    summed alone in its own fixed order, so the values are the separate products'. More rows take
    MatMulNBits product by product. gated (gate, up): those two come out as one, SiluMul(gate,
    up), after the others. inputs: the parts, then (bias, target, source) of SplitHeads for each
    (position, dims, axes) of `splits`: product `position` comes out with its heads split."""
    parts = inputs[:3 * len(columns)]
    rows = a.reshape(-1, K) if a.shape[-1:] == (K,) else None
    if (rows is not None and a.dtype == _FLOAT32 and reads_tiles(rows.shape[0]) and block_size >= 32
            and rows.flags.c_contiguous):
        out = np.empty((rows.shape[0], sum(columns)), _FLOAT32)
        tiles = joined_four_bit_tiles((K, block_size, columns), *parts)
        if gated or splits:  # the gate or a split reads the products
            decode_pool.nbits_rows(rows, *tiles, out)
        else:
            decode_pool.open_nbits_rows(rows, *tiles, out)
        products, start, lead = [], 0, a.shape[:-1]
        for n in columns:
            products.append(out[:, start:start + n].reshape(lead + (n,)))
            start += n
    elif (rows is not None and a.dtype == _FLOAT32 and block_size >= 32
          and (tiles := joined_four_bit_tiles.known_result(((K, block_size, columns), *map(id, parts)))) is not None):
        # a prompt's rows once the joined tiles are kept: each product over its columns of them
        decode_pool.settle()  # (a may be the output of a job left open)
        rows, products, offset = np.ascontiguousarray(rows), [], 0
        for n in columns:
            out = np.empty((rows.shape[0], n), _FLOAT32)
            _tiled_panel_product(rows, tiles, offset, out)
            products.append(out.reshape(a.shape[:-1] + (n,)))
            offset += n
    else:
        products = [MatMulNBits(a, *parts[i:i + 3], K=K, N=n, bits=4, block_size=block_size)
                    for i, n in zip(range(0, len(parts), 3), columns)]
    if gated or splits:
        decode_pool.settle()  # (MatMulNBits may have left the last product's job open)
    for n, (position, dims, axes) in enumerate(splits):
        bias, target, source = inputs[len(parts) + 3 * n:len(parts) + 3 * n + 3]
        products[position] = SplitHeads(products[position], bias, target, source, dims=dims, axes=axes)
    if gated:
        gate, up = gated
        return (*(p for i, p in enumerate(products) if i not in gated), SiluMul(products[gate], products[up]))
    return tuple(products)


def _panel_product(rows, b, scales, zero_points: tuple, bits: int, block_size: int, out) -> None:
    """out = rows @ dequantized(b).T through `matmul`, a panel of columns dequantized at a time into
    a buffer that stays in cache; 4-bit panels and the rows in lanes order (`nibble_lanes_panel`)."""
    if bits == 4:
        _panels(rows, True, out, lambda first, panel: nibble_lanes_panel(b, scales, *zero_points, block_size, first,
                                                                         panel))
        return
    _panels(rows, False, out,
            lambda first, panel: nbits_dequantize(b, scales, *zero_points, bits, block_size, first, panel))


def _tiled_panel_product(rows, tiles: tuple, offset: int, out) -> None:
    """`_panel_product` of a 4-bit weight over its kept tiles (`tile_lanes_panel`: the same panels,
    bitwise), its columns from column `offset` of the tiles on (a part of joined tiles): once a
    weight has tiles, a prompt's products read them, not the weight's own bytes, which
    `nibble_tiles._release_weights` hands back to the file they were mapped from."""
    _panels(rows, True, out, lambda first, panel: tile_lanes_panel(*tiles, offset + first, panel))


def _panels(rows, lanes: bool, out, fill) -> None:
    """out = rows @ panels.T, fill(first, panel) dequantizing columns first .. first + len(panel) into
    each panel, in lanes order when `lanes` (the rows put in it too). Where BLAS multiplies several
    panels with threads of its own, those threads would wake for every panel's product (a short
    prompt's products take hundreds): each thread takes whole panels instead, as many each,
    dequantizing its own with BLAS single-threaded meanwhile (`split_among_threads`; a prompt of
    96 rows 0.78x the time on two Zen 3 cores, 128 0.83x, 256 0.91x, 512 even). One panel, a long
    prompt's, is one product, which BLAS's threads share."""
    columns, depth = out.shape[1], rows.shape[1]
    own = own_product(rows.shape[0], True)
    panel_bytes = _OWN_PANEL_BYTES if own else _PANEL_BYTES
    # a panel holds at least the rows' bytes: each panel's product packs every row again (a
    # 2000-token prompt's 4-bit products, panels of 1 MB: a 4-bit prefill 7-10% slower)
    width = max(1, min(columns, max(panel_bytes, rows.nbytes) // (depth * rows.itemsize)))
    count = -(-columns // width)
    threads = 1 if count < 2 or own else blas_threads()
    if threads > 1:
        width = -(-columns // (-(-count // threads) * threads))
    rest_workers_before(rows.size * columns, rows.shape[0])  # BLAS's threads need the cores
    if lanes:
        rows = lanes_order(rows)
    buffers = threading.local()  # each thread's panel

    def panel_product(first: int) -> None:
        panel = getattr(buffers, "panel", None)
        if panel is None:
            panel = buffers.panel = np.empty((width, depth), rows.dtype)
        stop = min(first + width, columns)
        fill(first, panel[:stop - first])
        matmul(rows, panel[:stop - first].T, out=out[:, first:stop])

    starts = list(range(0, columns, width))
    if threads < 2 or not split_among_threads(panel_product, starts):
        for first in starts:
            panel_product(first)


def lanes_order(rows):
    """rows (M, K) in `nibble_lanes_panel`'s order: each row's even positions first, then its odd ones
    (`lanes_order_into`, a prompt's rows shared among runnx's threads)."""
    rows = np.ascontiguousarray(rows)
    out = np.empty_like(rows)
    share_rows(functools.partial(_lanes_order_range, rows, out), rows.shape[0], rows.shape[1])
    return out


def _lanes_order_range(rows, out, start: int, stop: int) -> None:
    lanes_order_into(rows[start:stop], out[start:stop])


def _with_bias(out, bias, work):
    if bias is not None:
        out += bias.astype(work, copy=False)
    return out


def _bnb4_panel_numpy(b, absmax, table, block_size: int, first: int, out) -> None:
    """`bnb4_dequantize` in numpy (the kernels not compiled yet, `_native`): columns first .. first
    + len(out) of the flattened weight, nibbles unpacked high first, times their blocks' absmax."""
    count, depth = out.shape
    start, stop = first * depth, (first + count) * depth
    chunk = b[start >> 1:(stop + 1) >> 1]
    codes = np.stack([chunk >> 4, chunk & 15], axis=-1).reshape(-1)[(start & 1):(start & 1) + stop - start]
    scales = absmax[np.arange(start, stop) // block_size]
    np.multiply(table[codes], scales, out=out.reshape(-1))


@register("MatMulBnb4", since=1, domain=DOMAIN)
def MatMulBnb4(a, b, absmax, *, K: int, N: int, block_size: int, quant_type: int, training_mode: int = 0,
               transB: int = 1):
    """a (..., K) @ W.T with W (N, K) stored flattened as 4-bit codes, two a byte (the even flat
    position in the high nibble): code q at flat position f is table[q] * absmax[f // block_size],
    the table FP4 (quant_type 0) or NF4 (1). Blocks run over the flattened W, so a block spans two
    columns when block_size does not divide K. training_mode only matters to training."""
    if quant_type not in (0, 1):
        raise RunnxError(f"MatMulBnb4: quant_type must be 0 (FP4) or 1 (NF4), got {quant_type}")
    if block_size < 16 or block_size & (block_size - 1):
        raise RunnxError(f"MatMulBnb4: block_size must be a power of 2 and at least 16, got {block_size}")
    if transB != 1:
        raise RunnxError(f"MatMulBnb4: only transB=1 (B stored as [N, K], as the quantizer writes it) is "
                         f"supported, got transB={transB}")
    total = K * N
    if b.dtype != np.uint8 or b.size != (total + 1) // 2:
        raise RunnxError(f"MatMulBnb4: B must be uint8 with {(total + 1) // 2} bytes (K={K} x N={N} codes, two a "
                         f"byte); got {b.dtype} of shape {list(b.shape)}")
    blocks = (total + block_size - 1) // block_size
    if absmax.size != blocks:
        raise RunnxError(f"MatMulBnb4: absmax has {absmax.size} values, expected {blocks} (K x N / block_size, "
                         f"rounded up)")
    if a.shape[-1:] != (K,):
        raise RunnxError(f"MatMulBnb4: A's last dimension must be K={K}, got shape {list(a.shape)}")
    work = np.dtype(np.float64) if a.dtype == np.float64 else np.dtype(np.float32)
    table = BNB4_TABLES[quant_type].astype(work)
    weights = np.ascontiguousarray(b.reshape(-1))
    scales = np.ascontiguousarray(absmax.reshape(-1), dtype=work)
    rows = np.ascontiguousarray(a.reshape(-1, K), dtype=work)
    out = np.empty((rows.shape[0], N), work)
    if _native.enabled and rows.shape[0] <= _STREAMED_ROWS:
        if K % 2 == 0:  # the values that a byte's high and low nibbles multiply
            even, odd = np.ascontiguousarray(rows[:, 0::2]), np.ascontiguousarray(rows[:, 1::2])
        else:
            even = odd = np.empty((rows.shape[0], 0), work)
        bnb4_rows(rows, even, odd, weights, scales, table, block_size.bit_length() - 1, out)
    else:
        width = max(1, min(N, _PANEL_BYTES // (K * work.itemsize)))
        panel = np.empty((width, K), work)
        for first in range(0, N, width):
            count = min(width, N - first)
            if _native.enabled:
                bnb4_dequantize(weights, scales, table, block_size.bit_length() - 1, first, panel[:count])
            else:
                _bnb4_panel_numpy(weights, scales, table, block_size, first, panel[:count])
            matmul(rows, panel[:count].T, out=out[:, first:first + count])
    return out.reshape(a.shape[:-1] + (N,)).astype(a.dtype, copy=False)


_NO_ZERO_ROWS = np.empty((1, 0), np.uint8)  # `gather_blocks_into`'s zero points when there are none


def _unpack_last_axis(data, bits: int, length: int):
    """uint8 values packed 8 // bits to a byte along the last axis (low bits first), as int32, cut to `length`."""
    per_byte = 8 // bits
    shifts = np.arange(per_byte, dtype=np.uint8) * bits
    values = (data[..., None] >> shifts) & ((1 << bits) - 1)
    return values.reshape(data.shape[:-1] + (-1,))[..., :length].astype(np.int32)


@register("GatherBlockQuantized", since=1, domain=DOMAIN)
def GatherBlockQuantized(data, indices, scales, zero_points=None, *, bits: int = 4, block_size: int = 128,
                         gather_axis: int = 0, quantize_axis: int = 1):
    """Gather(data, indices, gather_axis) dequantized in blocks of `block_size` along quantize_axis
    (the last): uint8 data packs 8 // bits values a byte (default zero point 2^(bits-1)), int4/uint4
    data holds one each (default zero point 0). Only the gathered rows are dequantized."""
    rank = data.ndim
    gather_axis, quantize_axis = gather_axis % rank, quantize_axis % rank
    if quantize_axis != rank - 1 or gather_axis == quantize_axis:
        raise RunnxError(f"GatherBlockQuantized: quantize_axis must be the last axis and differ from gather_axis "
                         f"(got gather_axis={gather_axis}, quantize_axis={quantize_axis} for rank {rank})")
    packed = data.dtype == np.uint8
    if packed and bits not in (2, 4, 8):
        raise RunnxError(f"GatherBlockQuantized: bits must be 2, 4 or 8 for uint8 data, got {bits}")
    if not packed and data.dtype.name not in ("int4", "uint4"):
        raise RunnxError(f"GatherBlockQuantized: data must be uint8, int4 or uint4, got {data.dtype}")
    width = data.shape[-1] * (8 // bits if packed else 1)
    blocks = (width + block_size - 1) // block_size
    if scales.shape != data.shape[:-1] + (blocks,):
        raise RunnxError(f"GatherBlockQuantized: scales of shape {list(scales.shape)} do not fit data of logical "
                         f"shape {list(data.shape[:-1]) + [width]} with block_size {block_size}")
    positions = np.where(indices < 0, indices + data.shape[gather_axis], indices).astype(np.intp)
    if positions.size and (positions.min() < 0 or positions.max() >= data.shape[gather_axis]):
        raise RunnxError(f"GatherBlockQuantized: indices out of range for {data.shape[gather_axis]} rows")
    if (_native.enabled and packed and rank == 2 and gather_axis == 0 and scales.dtype == _FLOAT32
            and (zero_points is None or zero_points.dtype == np.uint8
                 and zero_points.shape == (data.shape[0], -(-blocks // (8 // bits))))):
        out = np.empty((positions.size, width), _FLOAT32)
        zeros = _NO_ZERO_ROWS if zero_points is None else np.ascontiguousarray(zero_points)
        gather_blocks_into(np.ascontiguousarray(data), positions.reshape(-1), np.ascontiguousarray(scales), zeros,
                           bits, block_size, out)
        return out.reshape(positions.shape + (width,))
    gathered = np.take(data, positions, axis=gather_axis)
    values = _unpack_last_axis(gathered, bits, width) if packed else gathered.astype(np.int32)
    chosen_scales = np.take(scales, positions, axis=gather_axis)
    if zero_points is None:
        zero = np.int32(1 << (bits - 1)) if packed else np.int32(0)
    else:
        chosen = np.take(zero_points, positions, axis=gather_axis)
        zero = _unpack_last_axis(chosen, bits, blocks) if packed else chosen.astype(np.int32)
        zero = np.repeat(zero, block_size, axis=-1)[..., :width]
    work = np.float32 if scales.dtype.itemsize < 4 else scales.dtype
    expanded = np.repeat(chosen_scales.astype(work), block_size, axis=-1)[..., :width]
    return ((values - zero) * expanded).astype(scales.dtype, copy=False)


def _scaled(product, a_scale, b_scale, bias, dtype):
    """product (int32) in float times a_scale * b_scale, plus bias, as onnxruntime's output
    processor computes it and as the unfused graph does (Cast, the scales' Mul, the Mul): each step
    rounded in the work type (float32 for float16 scales), so a fused MatMulInteger -> Cast -> Mul
    (interp/fusion/integer_products.py) gives bitwise what its nodes gave."""
    work = np.dtype(np.float32) if np.dtype(dtype).itemsize < 4 else np.dtype(dtype)
    result = product.astype(work)
    result *= a_scale.astype(work, copy=False) * b_scale.astype(work, copy=False)
    if bias is not None:
        result += bias.astype(work, copy=False)
    return result.astype(dtype, copy=False)


@register("MatMulIntegerToFloat", since=1, domain=DOMAIN)
def MatMulIntegerToFloat(a, b, a_scale, b_scale, a_zero_point=None, b_zero_point=None, bias=None):
    """(a - a_zero_point) @ (b - b_zero_point) in int32 (MatMulInteger's kernel), then in float times
    a_scale * b_scale, plus bias."""
    return _scaled(MatMulInteger(a, b, a_zero_point, b_zero_point), a_scale, b_scale, bias, a_scale.dtype)


@register("DynamicQuantizeMatMul", since=1, domain=DOMAIN)
def DynamicQuantizeMatMul(a, b, b_scale, b_zero_point=None, bias=None):
    """a quantized to uint8 as DynamicQuantizeLinear does, then MatMulIntegerToFloat with b."""
    quantized, a_scale, a_zero_point = DynamicQuantizeLinear(a)
    return _scaled(MatMulInteger(quantized, b, a_zero_point, b_zero_point), a_scale, b_scale, bias, a.dtype)
