"""numba kernels of the fused decoder ops (`runnx/ops/fused.py`): attention over a KV cache read
in place (any strides, grouped-query heads), split over blocks of cache rows when threads help.

Dot products and sums are vectorised in any order (`_REORDER`: float rounding only); NaN and inf
keep their meaning, since masked scores are -inf and fully masked rows are found by their NaN.
float32 exp is a vectorisable polynomial within 1 ulp of the true value (`_exp32`).
"""
from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.core.imputils import impl_ret_borrowed
from numba.extending import intrinsic

_REORDER = {"reassoc", "contract", "nsz", "arcp"}
_UNROLL = 4  # cache rows per pass: fewer loads and stores of the accumulators


def _kernel(**options):
    """numba.njit as every kernel here uses it: cached, with numpy's float semantics (x / 0 is inf;
    Python's ZeroDivisionError check would also keep loops from vectorising)."""
    return numba.njit(cache=True, error_model="numpy", **options)


@intrinsic
def _typed_contiguous(typingctx, array):
    """The same array typed C-contiguous, so that loops over it vectorise (numba's 'A' layout
    indexes through the strides); the caller has checked that it is C-contiguous."""
    result = array.copy(layout="C")

    def codegen(context, builder, signature, args):
        return impl_ret_borrowed(context, builder, result, args[0])

    return result(array), codegen


@intrinsic
def _float32_from_bits(typingctx, bits):
    if bits != types.int32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


_F = np.float32
_LOG2E, _LN2_HIGH, _LN2_LOW = _F(1.44269504088896341), _F(0.693359375), _F(-2.12194440e-4)
_EXP_POLY = (_F(1.9875691500e-4), _F(1.3981999507e-3), _F(8.3334519073e-3), _F(4.1665795894e-2),
             _F(1.6666665459e-1), _F(5.0000001201e-1))
_EXP_LOWEST = _F(-87.33654)  # below it exp is subnormal, < 1.2e-38: 0 here


@_kernel(fastmath={"contract"})  # no reassociation: the ln 2 split must stay exact
def _exp32(x):
    """exp(x) for float32 x <= 0 (Cephes' expf: 2^n * polynomial of the remainder), inlined and
    vectorised by LLVM where libm's expf is a call per element."""
    clamped = max(x, _EXP_LOWEST)
    n = np.floor(clamped * _LOG2E + _F(0.5))
    r = clamped - n * _LN2_HIGH - n * _LN2_LOW
    p0, p1, p2, p3, p4, p5 = _EXP_POLY
    p = (((((p0 * r + p1) * r + p2) * r + p3) * r + p4) * r + p5) * (r * r) + r + _F(1)
    scale = _float32_from_bits(np.int32((np.int32(n) + np.int32(127)) << np.int32(23)))
    return p * scale if x >= _EXP_LOWEST else _F(0)


@_kernel()
def _rows(cache, batch, group):
    """cache[batch, group] (rows x depth) as a C-contiguous array: in place when its rows are
    contiguous and adjacent (a KV cache, even as a view of a larger capacity buffer), else a copy."""
    block = cache[batch, group]
    itemsize = block.itemsize
    if block.strides[1] == itemsize and (block.shape[0] <= 1 or block.strides[0] == block.shape[1] * itemsize):
        return _typed_contiguous(block)
    return np.ascontiguousarray(block)


@_kernel(fastmath=_REORDER)
def _scores(scaled, keys, start, scores):
    """scores[r, j] = scaled[r] . keys[start + j], `_UNROLL` key rows per pass."""
    rows, depth, count = scaled.shape[0], scaled.shape[1], scores.shape[1]
    zero = scores.dtype.type(0)
    j = 0
    while j + _UNROLL <= count:
        k0, k1, k2, k3 = keys[start + j], keys[start + j + 1], keys[start + j + 2], keys[start + j + 3]
        for r in range(rows):
            q = scaled[r]
            a0 = a1 = a2 = a3 = zero
            for d in range(depth):
                a0 += q[d] * k0[d]
                a1 += q[d] * k1[d]
                a2 += q[d] * k2[d]
                a3 += q[d] * k3[d]
            scores[r, j], scores[r, j + 1], scores[r, j + 2], scores[r, j + 3] = a0, a1, a2, a3
        j += _UNROLL
    for j in range(j, count):
        k0 = keys[start + j]
        for r in range(rows):
            a0 = zero
            for d in range(depth):
                a0 += scaled[r, d] * k0[d]
            scores[r, j] = a0


@_kernel(fastmath=_REORDER)
def _weighted_sum(weights, values, start, partial):
    """partial[r] = sum_j weights[r, j] * values[start + j], `_UNROLL` value rows per pass."""
    rows, width, count = partial.shape[0], partial.shape[1], weights.shape[1]
    partial[:] = 0
    j = 0
    while j + _UNROLL <= count:
        v0, v1, v2, v3 = values[start + j], values[start + j + 1], values[start + j + 2], values[start + j + 3]
        for r in range(rows):
            w0, w1, w2, w3 = weights[r, j], weights[r, j + 1], weights[r, j + 2], weights[r, j + 3]
            target = partial[r]
            for d in range(width):
                target[d] += w0 * v0[d] + w1 * v1[d] + w2 * v2[d] + w3 * v3[d]
        j += _UNROLL
    for j in range(j, count):
        v0 = values[start + j]
        for r in range(rows):
            w0 = weights[r, j]
            for d in range(width):
                partial[r, d] += w0 * v0[d]


@_kernel(fastmath=_REORDER)
def _exponentiate(scores, largest):
    """scores[j] = exp(scores[j] - largest) in place; returns their sum."""
    total = scores.dtype.type(0)
    if scores.itemsize == 4:
        for j in range(scores.shape[0]):
            e = _exp32(scores[j] - largest)
            scores[j] = e
            total += e
    else:
        for j in range(scores.shape[0]):
            e = math.exp(scores[j] - largest)
            scores[j] = e
            total += e
    return total


@_kernel(fastmath=_REORDER)
def _attend_block(query, key, value, bias, scale, batch, group, start, stop, peak, total, partial):
    """One block of key rows [start, stop) of KV head `group` of `batch`, for all the query rows
    of that group (its query heads x query length, in that order): each row's largest score goes
    to peak, sum(exp(score - peak)) to total (0 when the block is masked for the row, NaN when
    the row's softmax is NaN: a NaN or +inf score), and sum(exp(score - peak) * value row) to
    partial."""
    heads, length, depth = query.shape[1], query.shape[2], query.shape[3]
    repeat = heads // key.shape[1]
    rows, count = repeat * length, stop - start
    zero, lowest = query.dtype.type(0), query.dtype.type(-np.inf)
    scaled = np.empty((rows, depth), query.dtype)
    for r in range(rows):
        for d in range(depth):
            scaled[r, d] = query[batch, group * repeat + r // length, r % length, d] * scale
    scores = np.empty((rows, count), query.dtype)
    _scores(scaled, _rows(key, batch, group), start, scores)
    if bias is not None:
        bias_batch = batch if bias.shape[0] != 1 else 0
        for r in range(rows):
            head, position = group * repeat + r // length, r % length
            bias_row = bias[bias_batch, head if bias.shape[1] != 1 else 0, position if bias.shape[2] != 1 else 0]
            if bias.shape[3] == 1:
                for j in range(count):
                    scores[r, j] += bias_row[0]
            else:
                for j in range(count):
                    scores[r, j] += bias_row[start + j]
    for r in range(rows):
        row = scores[r]
        largest, unordered = lowest, False
        for j in range(count):
            s = row[j]
            unordered |= s != s
            if s > largest:
                largest = s
        peak[r] = largest
        if unordered or largest == np.inf or largest == lowest:
            total[r] = np.nan if largest != lowest or unordered else zero
            row[:] = zero  # left out by _combine
        else:
            total[r] = _exponentiate(row, largest)
    _weighted_sum(scores, _rows(value, batch, group), start, partial)


@_kernel(fastmath=_REORDER)
def _combine(query, value, fill, batch, group, peak, total, partial, out):
    """out rows of one KV group from its blocks' (peak, total, partial): the softmax-weighted sum;
    a row whose softmax is NaN (every score masked, or a NaN/+inf score) gets fill * sum(values),
    which is what Where(IsNaN(p), fill, p) @ V gives."""
    heads, length = query.shape[1], query.shape[2]
    repeat = heads // value.shape[1]
    blocks, rows, width = partial.shape[0], partial.shape[1], partial.shape[2]
    for r in range(rows):
        target = out[batch, group * repeat + r // length, r % length]
        largest, missing = -np.inf, False
        for k in range(blocks):
            missing |= total[k, r] != total[k, r]
            if total[k, r] > 0 and peak[k, r] > largest:
                largest = peak[k, r]
        target[:] = 0
        if missing or largest == -np.inf:
            for j in range(value.shape[2]):
                row = value[batch, group, j]
                for d in range(width):
                    target[d] += fill * row[d]
            continue
        norm = 0.0
        for k in range(blocks):
            if total[k, r] > 0:
                weight = math.exp(peak[k, r] - largest)
                norm += weight * total[k, r]
                for d in range(width):
                    target[d] += weight * partial[k, r, d]
        for d in range(width):
            target[d] /= norm


@_kernel(fastmath=_REORDER)
def attention_serial(query, key, value, bias, scale, fill):
    """Softmax((query * scale) @ key^T + bias) @ value per KV group, one thread: see attention."""
    batch, heads, length = query.shape[0], query.shape[1], query.shape[2]
    groups, rows = key.shape[1], (heads // key.shape[1]) * length
    out = np.empty((batch, heads, length, value.shape[3]), query.dtype)
    peak = np.empty((1, rows), query.dtype)
    total = np.empty((1, rows), query.dtype)
    partial = np.empty((1, rows, value.shape[3]), query.dtype)
    for b in range(batch):
        for g in range(groups):
            _attend_block(query, key, value, bias, scale, b, g, 0, key.shape[2], peak[0], total[0], partial[0])
            _combine(query, value, fill, b, g, peak, total, partial, out)
    return out


@_kernel(fastmath=_REORDER, parallel=True)
def attention_parallel(query, key, value, bias, scale, fill, blocks):
    """attention_serial with each KV group's rows split into `blocks` blocks, in parallel."""
    batch, heads, length = query.shape[0], query.shape[1], query.shape[2]
    groups, rows, size = key.shape[1], (heads // key.shape[1]) * length, key.shape[2]
    out = np.empty((batch, heads, length, value.shape[3]), query.dtype)
    units = batch * groups
    peak = np.empty((units, blocks, rows), query.dtype)
    total = np.empty((units, blocks, rows), query.dtype)
    partial = np.empty((units, blocks, rows, value.shape[3]), query.dtype)
    step = (size + blocks - 1) // blocks
    for task in numba.prange(units * blocks):
        unit, block = task // blocks, task % blocks
        start = min(block * step, size)
        _attend_block(query, key, value, bias, scale, unit // groups, unit % groups, start, min(start + step, size),
                      peak[unit, block], total[unit, block], partial[unit, block])
    for unit in range(units):
        _combine(query, value, fill, unit // groups, unit % groups, peak[unit], total[unit], partial[unit], out)
    return out


@_kernel()
def _block_squares(row, start, count):
    """sum(row[start:start+count] ** 2) for count <= 128 in numpy's order: 8 running sums."""
    total = row.dtype.type(0)
    if count < 8:
        for i in range(start, start + count):
            total += row[i] * row[i]
        return total
    r0, r1, r2, r3 = row[start] * row[start], row[start + 1] * row[start + 1], \
        row[start + 2] * row[start + 2], row[start + 3] * row[start + 3]
    r4, r5, r6, r7 = row[start + 4] * row[start + 4], row[start + 5] * row[start + 5], \
        row[start + 6] * row[start + 6], row[start + 7] * row[start + 7]
    end = start + count - count % 8
    for i in range(start + 8, end, 8):
        r0 += row[i] * row[i]
        r1 += row[i + 1] * row[i + 1]
        r2 += row[i + 2] * row[i + 2]
        r3 += row[i + 3] * row[i + 3]
        r4 += row[i + 4] * row[i + 4]
        r5 += row[i + 5] * row[i + 5]
        r6 += row[i + 6] * row[i + 6]
        r7 += row[i + 7] * row[i + 7]
    total = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    for i in range(end, start + count):
        total += row[i] * row[i]
    return total


@_kernel()
def _pairwise_squares(row):
    """sum(row ** 2) in numpy's pairwise order (blocks of <= 128, halves above, split at multiples
    of 8), so that RMSNorm's mean is bitwise np.add.reduce(np.square(x)). The recursion runs on an
    explicit stack: numba's cache cannot reload recursive functions."""
    if row.shape[0] <= 128:
        return _block_squares(row, 0, row.shape[0])
    starts, counts = np.empty(128, np.int64), np.empty(128, np.int64)  # count -1: add the last two sums
    sums = np.empty(64, row.dtype)
    starts[0], counts[0], pending, done = 0, row.shape[0], 1, 0
    while pending:
        pending -= 1
        start, count = starts[pending], counts[pending]
        if count < 0:
            done -= 1
            sums[done - 1] += sums[done]
        elif count <= 128:
            sums[done] = _block_squares(row, start, count)
            done += 1
        else:
            half = count // 2
            half -= half % 8
            starts[pending], counts[pending] = 0, -1
            starts[pending + 1], counts[pending + 1] = start + half, count - half
            starts[pending + 2], counts[pending + 2] = start, half
            pending += 3
    return sums[0]


@_kernel()
def rms_norm(x, epsilon, one, weight):
    """weight * (x * (one / sqrt(mean(x * x) + epsilon))) over the last axis of a C-contiguous x,
    the unfused graph's operations in its order (bitwise equal to it)."""
    width = x.shape[-1]
    rows = x.reshape(x.size // width, width)
    out = np.empty_like(x)
    result = out.reshape(rows.shape)
    count, epsilon, unit = x.dtype.type(width), x.dtype.type(epsilon), x.dtype.type(one)
    for r in range(rows.shape[0]):
        row = rows[r]
        mean = _pairwise_squares(row) / count + epsilon
        scale = unit / np.sqrt(mean)
        for i in range(width):
            result[r, i] = weight[i] * (row[i] * scale)
    return out


@_kernel()
def silu_mul_into(gate, decay, up):
    """decay = gate * (1 / (1 + decay)) * up for decay = exp(-gate) (numpy's, so that the result
    is bitwise the unfused Sigmoid and Muls): C-contiguous arrays of one shape."""
    flat_gate, flat_decay, flat_up = gate.reshape(gate.size), decay.reshape(decay.size), up.reshape(up.size)
    one = gate.dtype.type(1)
    for i in range(flat_decay.size):
        flat_decay[i] = flat_gate[i] * (one / (one + flat_decay[i])) * flat_up[i]
    return decay


@_kernel()
def _broadcasts_into(operand, result):
    for axis in range(result.ndim):
        if operand.shape[axis] != 1 and operand.shape[axis] != result.shape[axis]:
            return False
    return True


@_kernel()
def rotate_half(x, cos, sin, half):
    """x * cos + concat(-x[..., half:], x[..., :half]) * sin over the last axis of 4-D arrays,
    cos and sin broadcasting into x (ValueError otherwise); bitwise the unfused arithmetic."""
    batch, heads, length, width = x.shape
    if not (_broadcasts_into(cos, x) and _broadcasts_into(sin, x)):
        raise ValueError("cos/sin do not broadcast into x")
    out = np.empty(x.shape, x.dtype)
    tail = width - half
    for b in range(batch):
        for h in range(heads):
            for q in range(length):
                row = x[b, h, q]
                c = cos[b if cos.shape[0] != 1 else 0, h if cos.shape[1] != 1 else 0, q if cos.shape[2] != 1 else 0]
                s = sin[b if sin.shape[0] != 1 else 0, h if sin.shape[1] != 1 else 0, q if sin.shape[2] != 1 else 0]
                target = out[b, h, q]
                for i in range(tail):
                    target[i] = row[i] * c[i if c.shape[0] != 1 else 0] + -row[half + i] * s[i if s.shape[0] != 1 else 0]
                for i in range(tail, width):
                    target[i] = row[i] * c[i if c.shape[0] != 1 else 0] + row[i - tail] * s[i if s.shape[0] != 1 else 0]
    return out
