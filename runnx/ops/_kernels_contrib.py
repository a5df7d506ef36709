"""numba kernels behind onnxruntime's contrib operators (`contrib_*.py`): the skip-add norms and the
block-quantized (MatMulNBits, MatMulBnb4) products that read packed weights directly."""
from __future__ import annotations

import math

import numba
import numpy as np

from runnx.ops import _jit_cache  # noqa: F401  (numba caches this module's kernels under RUNNX_CACHE)


@numba.njit(cache=True, nogil=True)
def skip_norm_rows(x, skip, bias, gamma, beta, epsilon, simplified, out, total, mean, inv_std):
    """Per row r: s = x[r] + skip[r % len(skip)] + bias (into total[r]), then LayerNorm (mean from
    E[s] and variance E[s^2] - E[s]^2, as onnxruntime computes it) or RMSNorm (simplified) of s,
    times gamma plus beta. bias and beta have no elements when absent. Each row alone: a prompt's
    rows may be cut into ranges computed on several threads (`runtime/rows.py`)."""
    rows, cols = x.shape
    skip_rows = skip.shape[0]
    has_bias, has_beta = bias.shape[0] > 0, beta.shape[0] > 0
    for r in range(rows):
        s = r % skip_rows if skip_rows else 0
        acc, squares = 0.0, 0.0
        for c in range(cols):
            value = x[r, c]
            if skip_rows:
                value += skip[s, c]
            if has_bias:
                value += bias[c]
            total[r, c] = value
            acc += value
            squares += value * value
        average = 0.0 if simplified else acc / cols
        variance = squares / cols - average * average
        inverse = 1.0 / math.sqrt(variance + epsilon)
        mean[r] = average
        inv_std[r] = inverse
        for c in range(cols):
            value = (total[r, c] - average) * inverse * gamma[c]
            if has_beta:
                value += beta[c]
            out[r, c] = value


_kernel = numba.njit(cache=True, nogil=True, error_model="numpy")
_summing = numba.njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc", "contract"})  # vectorised sums

# how a MatMulNBits node gives its zero points
ZERO_DEFAULT, ZERO_PACKED, ZERO_TYPED = 0, 1, 2


@_kernel
def block_zero_points(packed, typed, mode, bits, first, blocks, out):
    """out[c, block] = the zero point of block `block` of column first + c: the default 2^(bits-1),
    an unsigned integer packed 8 // bits to a byte (each column's bytes starting afresh), or a
    float of the scales' type."""
    per_byte = 8 // bits
    row_bytes = (blocks + per_byte - 1) // per_byte
    mask = (1 << bits) - 1
    for c in range(out.shape[0]):
        n = first + c
        if mode == ZERO_TYPED:
            for block in range(blocks):
                out[c, block] = typed[n * blocks + block]
        elif mode == ZERO_PACKED:
            for index in range(row_bytes):  # by byte: no division a block
                byte = np.int32(packed[n * row_bytes + index])
                for part in range(min(per_byte, blocks - index * per_byte)):
                    out[c, index * per_byte + part] = (byte >> (part * bits)) & mask
        else:
            for block in range(blocks):
                out[c, block] = 1 << (bits - 1)


@_summing
def zero_scales_of(packed_zeros, typed_zeros, zero_mode, bits, blocks, scales, out):
    """out[n * blocks + block] = zero point * scale of each block (`out` as long as `scales`): the
    zero points' share of a column is then a short dot with the row's block sums (`nbits_rows`).
    4-bit zero points of an even number of blocks are contiguous nibbles: one flat loop."""
    if zero_mode == ZERO_TYPED:
        for i in range(out.shape[0]):
            out[i] = typed_zeros[i] * scales[i]
    elif zero_mode == ZERO_DEFAULT:
        middle = np.float32(1 << (bits - 1))
        for i in range(out.shape[0]):
            out[i] = middle * scales[i]
    elif bits == 4 and blocks % 2 == 0:
        low_bits = np.int32(15)
        for i in range(out.shape[0]):
            byte = np.int32(packed_zeros[i >> 1])
            out[i] = np.float32(np.int32((byte >> np.int32((i & 1) * 4)) & low_bits)) * scales[i]
    else:
        per_byte = 8 // bits
        row_bytes = (blocks + per_byte - 1) // per_byte
        mask = np.int32((1 << bits) - 1)
        for n in range(out.shape[0] // blocks):
            for block in range(blocks):
                byte = np.int32(packed_zeros[n * row_bytes + block // per_byte])
                zero = (byte >> np.int32((block % per_byte) * bits)) & mask
                out[n * blocks + block] = np.float32(np.int32(zero)) * scales[n * blocks + block]


@_summing
def _short_dot(x, y, acc):
    """acc + x . y, for the few blocks of a column (`acc` a zero of the sums' type)."""
    for i in range(x.shape[0]):
        acc += x[i] * y[i]
    return acc


@_kernel
def _unpack_block(blob, bits, count, zero, scale, out):
    """out[:count] = (q_i - zero) * scale for the first `count` values of one block's packed bytes
    (low bits first in each byte)."""
    if bits == 4:
        for j in range(count // 2):
            byte = blob[j]
            out[2 * j] = ((byte & 15) - zero) * scale
            out[2 * j + 1] = ((byte >> 4) - zero) * scale
        if count % 2:
            out[count - 1] = ((blob[count // 2] & 15) - zero) * scale
    elif bits == 8:
        for i in range(count):
            out[i] = (blob[i] - zero) * scale
    else:
        per_byte = 8 // bits
        mask = (1 << bits) - 1
        for i in range(count):
            out[i] = (((blob[i // per_byte] >> ((i % per_byte) * bits)) & mask) - zero) * scale


@_kernel
def nbits_lanes(rows, block_size, lanes, sums):
    """The rows of A as `nbits_rows` reads them: lanes (M, 8 // bits, blocks * blob), lane l the
    values at positions l, l + 8 // bits, ... (zero past K, so a last block's tail adds nothing),
    and sums (M, blocks), each block's sum in order from rows[m, 0] * 0.0 (a float64 chain), stored
    in the sums' type. Each lane is one strided pass over the row, and the blocks' chains run side
    by side (a step of each block in turn), each the same adds in k's order: one chain at a time
    waited for every add, and a 4-bit job's posting thread makes its rows while the workers wait
    (`runtime/jobs.py`)."""
    count, depth = rows.shape
    per_byte = lanes.shape[1]
    length = lanes.shape[2]
    blocks = sums.shape[1]
    whole = min(length, depth // per_byte)  # (positions whose lanes all fall before K)
    full = min(blocks, depth // block_size)
    totals = np.empty(blocks)  # (float64: each row's chains start from row[0] * 0.0)
    for m in range(count):
        row = rows[m]
        for lane in range(per_byte):
            target = lanes[m, lane]
            for i in range(whole):
                target[i] = row[i * per_byte + lane]
            for i in range(whole, length):
                k = i * per_byte + lane
                target[i] = row[k] if k < depth else 0.0
        start = row[0] * 0.0 if depth else 0.0
        for block in range(blocks):
            totals[block] = start
        for j in range(block_size):
            for block in range(full):
                totals[block] += row[block * block_size + j]
        for block in range(full, blocks):
            for k in range(block * block_size, min(depth, (block + 1) * block_size)):
                totals[block] += row[k]
        for block in range(blocks):
            sums[m, block] = totals[block]


@_summing
def nbits_rows(lanes, sums, weights, scales, packed_zeros, typed_zeros, zero_mode, bits, out):
    """out (M, N) = a @ dequantized(weights).T, streaming the packed weights (N, blocks, blob) once.

    a comes as `lanes` (M, 8 // bits, blocks * blob): lane l holds the values that a byte's bits
    l*bits.. multiply (a zero-padded to whole blocks, so a last block's tail adds nothing), and
    `sums` (M, blocks), each block's sum of a. Column n is then
    sum_i q_i a_i scale_block(i) - sum_blocks zero * scale * sum(a over the block) (`zero_scales_of`):
    one loop over the column's bytes, unpacked in 32-bit integer registers (64-bit ones halve the
    vector lanes), each lane a contiguous load of a and the scale gathered by the byte's index
    (a loop per block of 16-byte blobs is too short to vectorise). For the one-row products of
    decoding and the few-row ones of short prompts that float32 4-bit weights in blobs of 16 bytes
    or more do not take (`_kernels_nibble_tiles.py`)."""
    rows = lanes.shape[0]
    columns, blocks, blob = weights.shape
    shift = 0
    while (1 << shift) < blob:
        shift += 1
    zero_scales = np.empty(columns * blocks, out.dtype)
    zero_scales_of(packed_zeros, typed_zeros, zero_mode, bits, blocks, scales, zero_scales)
    flat = weights.reshape(-1)
    length = blocks * blob
    nought = np.zeros(1, out.dtype)[0]
    mask = np.int32((1 << bits) - 1)
    for n in range(columns):
        column = flat[n * length:(n + 1) * length]
        column_scales = scales[n * blocks:(n + 1) * blocks]
        column_zeros = zero_scales[n * blocks:(n + 1) * blocks]
        for m in range(rows):
            acc = nought
            for lane in range(8 // bits):
                values = lanes[m, lane]
                lane_shift = np.int32(lane * bits)
                for i in range(length):
                    quantized = np.int32((np.int32(column[i]) >> lane_shift) & mask)
                    acc += np.float32(quantized) * values[i] * column_scales[i >> shift]
            out[m, n] = acc - _short_dot(column_zeros, sums[m], nought)


@_kernel
def nbits_dequantize(weights, scales, packed_zeros, typed_zeros, zero_mode, bits, block_size, first, out):
    """out (P, K) = the dequantized columns first .. first + P of the packed weights: a panel for a
    BLAS product of many rows, in natural order (4-bit products use `nibble_lanes_panel`)."""
    depth = out.shape[1]
    blocks = weights.shape[1]
    zeros = np.empty((out.shape[0], blocks), out.dtype)
    block_zero_points(packed_zeros, typed_zeros, zero_mode, bits, first, blocks, zeros)
    for p in range(out.shape[0]):
        n = first + p
        for block in range(blocks):
            start = block * block_size
            count = min(block_size, depth - start)
            _unpack_block(weights[n, block], bits, count, zeros[p, block], scales[n * blocks + block], out[p, start:])


@_kernel
def lanes_order_into(rows, out):
    """out[r] = row r of rows (M, K) in `nibble_lanes_panel`'s order: its even positions, then its
    odd ones (both C-contiguous). One pass a row, where numpy's two strided slices joined took
    three (a 2000-token prompt's rows: 1.4 ms a 4-bit product)."""
    depth = rows.shape[1]
    evens = (depth + 1) // 2
    for r in range(rows.shape[0]):
        row, target = rows[r], out[r]
        for j in range(evens):
            target[j] = row[2 * j]
        for j in range(depth // 2):
            target[evens + j] = row[2 * j + 1]


@_kernel
def nibble_lanes_panel(weights, scales, packed_zeros, typed_zeros, zero_mode, block_size, first, out):
    """out (P, K) = the dequantized 4-bit columns first .. first + P in lanes order: a column's low
    nibbles (its even positions k) first, then its high ones (odd k), so that each block unpacks in
    two contiguous, vectorised stores (the natural order interleaves them, 4x slower). Rows
    multiplied with the panel come in the same order (`contrib_quantized.lanes_order`). Each value is
    (q - zero) * scale rounded once: in the output's type, exact as float64's when the zero points
    are integers, in float64 when they are floats (q - zero would round first). The bytes of a
    block are counted from `block_size`: LLVM vectorises the loop 3-5x less well when they are the
    weights' last dimension."""
    depth = out.shape[1]
    blocks, half = weights.shape[1], block_size >> 1
    pairs, odd = depth >> 1, depth & 1
    whole = pairs // half  # blocks whose every byte holds two values
    zeros = np.empty((out.shape[0], blocks), out.dtype)
    block_zero_points(packed_zeros, typed_zeros, zero_mode, 4, first, blocks, zeros)
    if zero_mode == ZERO_TYPED:
        _lanes_panel_wide(weights, scales, zeros, first, out)
        return
    for p in range(out.shape[0]):
        n = first + p
        row, zero = out[p], zeros[p]
        low, high = row[:pairs + odd], row[pairs + odd:]
        scale = scales[n * blocks:(n + 1) * blocks]
        for block in range(whole):
            blob = weights[n, block]
            z, s = zero[block], scale[block]
            start = block * half
            for j in range(half):
                byte = np.int32(blob[j])
                low[start + j] = (np.float32(byte & np.int32(15)) - z) * s
                high[start + j] = (np.float32(byte >> np.int32(4)) - z) * s
        for j in range(whole * half, pairs + odd):  # the last block's part
            byte = np.int32(weights[n, whole, j - whole * half])
            low[j] = (np.float32(byte & np.int32(15)) - zero[whole]) * scale[whole]
            if j < pairs:
                high[j] = (np.float32(byte >> np.int32(4)) - zero[whole]) * scale[whole]


@_kernel
def _lanes_panel_wide(weights, scales, zeros, first, out):
    """`nibble_lanes_panel` for float zero points: (q - zero) * scale in float64, rounded once."""
    depth = out.shape[1]
    blocks, half = weights.shape[1], weights.shape[2]
    pairs, odd = depth >> 1, depth & 1
    for p in range(out.shape[0]):
        n = first + p
        row = out[p]
        for j in range(pairs + odd):
            block = j // half
            byte = np.int32(weights[n, block, j - block * half])
            z, s = np.float64(zeros[p, block]), np.float64(scales[n * blocks + block])
            row[j] = (np.float64(byte & np.int32(15)) - z) * s
            if j < pairs:
                row[pairs + odd + j] = (np.float64(byte >> np.int32(4)) - z) * s


# MatMulBnb4's 4-bit codes (bitsandbytes' FP4 with a bias of 3, and NormalFloat4), as onnxruntime's
# blockwise_quant_block_bnb4.h tabulates them, indexed by quant_type
BNB4_TABLES = np.array([
    [0.0, 5.208333333e-03, 0.66666667, 1.0, 0.33333333, 0.5, 0.16666667, 0.25,
     -0.0, -5.208333333e-03, -0.66666667, -1.0, -0.33333333, -0.5, -0.16666667, -0.25],
    [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
     -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
     0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
     0.7229568362236023, 1.0]], dtype=np.float32)


@_summing
def bnb4_rows(rows, high, low, weights, absmax, table, log_block, out):
    """out (M, N) = rows @ dequantized(weights).T, streaming the packed weights once.

    The weight is (N, K) flattened, two codes a byte: flat position f is byte f >> 1, its high
    nibble when f is even, scaled by absmax[f >> log_block]. For an even K column n is the bytes
    n*K/2 .. (n+1)*K/2, whose high nibbles multiply `high` (a's even positions) and low ones `low`
    (the odd ones): one row looks its codes up as it sums (gathers from the 16-entry table), more
    rows dequantize the column once into two small buffers and sum each row against them. An odd
    K reads nibble by nibble from `rows`."""
    count, depth = rows.shape
    columns = out.shape[1]
    nought = np.zeros(1, out.dtype)[0]  # the sums' type: out's, not float64
    if depth % 2 == 0:
        half = depth // 2
        shift = log_block - 1  # bytes to blocks
        even_values = np.empty(half, out.dtype)
        odd_values = np.empty(half, out.dtype)
        for n in range(columns):
            start = n * half
            column = weights[start:start + half]
            if count == 1:
                even, odd = high[0], low[0]
                acc = nought
                for i in range(half):
                    byte = np.int32(column[i])
                    acc += (table[byte >> 4] * even[i] + table[byte & 15] * odd[i]) * absmax[(start + i) >> shift]
                out[0, n] = acc
                continue
            for i in range(half):
                byte = np.int32(column[i])
                scale = absmax[(start + i) >> shift]
                even_values[i] = table[byte >> 4] * scale
                odd_values[i] = table[byte & 15] * scale
            for m in range(count):
                even, odd = high[m], low[m]
                acc = nought
                for i in range(half):
                    acc += even_values[i] * even[i] + odd_values[i] * odd[i]
                out[m, n] = acc
        return
    for n in range(columns):
        base = n * depth
        for m in range(count):
            acc = nought
            for k in range(depth):
                f = base + k
                byte = np.int32(weights[f >> 1])
                code = byte & 15 if f & 1 else byte >> 4
                acc += table[code] * absmax[f >> log_block] * rows[m, k]
            out[m, n] = acc


@_kernel
def bnb4_dequantize(weights, absmax, table, log_block, first, out):
    """out (P, K) = the dequantized columns first .. first + P of the packed weights (`bnb4_rows`'
    layout): a panel for a BLAS product of many rows. An even K goes byte by byte."""
    depth = out.shape[1]
    if depth % 2 == 0:
        half = depth // 2
        shift = log_block - 1
        for p in range(out.shape[0]):
            start = (first + p) * half
            row = out[p]
            for i in range(half):
                byte = np.int32(weights[start + i])
                scale = absmax[(start + i) >> shift]
                row[2 * i] = table[byte >> 4] * scale
                row[2 * i + 1] = table[byte & 15] * scale
        return
    for p in range(out.shape[0]):
        base = (first + p) * depth
        for k in range(depth):
            f = base + k
            byte = np.int32(weights[f >> 1])
            code = byte & 15 if f & 1 else byte >> 4
            out[p, k] = table[code] * absmax[f >> log_block]


@_kernel
def gather_blocks_into(data, positions, scales, zero_points, bits, block_size, out):
    """out[r] = row positions[r] of uint8 data (N, bytes), its values packed 8 // bits a byte (low bits
    first), dequantized as float32(float64(q - zero) * scale) per block of `block_size` (scales (N,
    blocks)), zero points packed alike in each row of zero_points (N, bytes), or 2^(bits-1) for an
    empty one: numpy's arithmetic of `GatherBlockQuantized` (int32 differences times the scales
    in float64, rounded once), over the gathered rows only, for an embedding table's prompt of
    thousands of rows (numpy's unpacking took 0.15 s for 2,000)."""
    per_byte, mask = 8 // bits, (1 << bits) - 1
    width, blocks = out.shape[1], scales.shape[1]
    default = np.int32(1 << (bits - 1))
    for r in range(positions.size):
        p = positions[r]
        row, target = data[p], out[r]
        for block in range(blocks):
            zero = default
            if zero_points.shape[1]:
                byte = np.int32(zero_points[p, block // per_byte])
                zero = (byte >> np.int32((block % per_byte) * bits)) & np.int32(mask)
            scale = np.float64(scales[p, block])
            for c in range(block * block_size, min(width, (block + 1) * block_size)):
                byte = np.int32(row[c // per_byte])
                q = (byte >> np.int32((c % per_byte) * bits)) & np.int32(mask)
                target[c] = np.float64(q - zero) * scale
