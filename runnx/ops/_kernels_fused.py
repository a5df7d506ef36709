"""numba kernels of the fused decoder ops (`runnx/ops/fused*.py`): attention over a KV cache read
in place (any strides, grouped-query heads), RMSNorm, the SiLU gate and rotate-half.

Dot products and sums are vectorised in any order (`_REORDER`: float rounding only); NaN and inf
keep their meaning, since masked scores are -inf and fully masked rows are found by their NaN.
Attention reads four cache rows per pass (a quarter of the loads and stores of the accumulators),
a quarter of the rows apart: four long sequential streams keep more reads in flight than one,
whose hardware prefetch stops at every page (a decode step's attention over thousands of cached
positions reads tens of MB from memory). Each stream also asks for its rows `PREFETCH_ROWS` ahead
(`_prefetch`): the rows' arithmetic leaves the hardware prefetchers behind, and a layer's attention
over a long cache would wait on memory.
A long cache is cut into spans of `ATTENTION_SPAN` positions, each (batch entry, KV head, span) a
unit of work whose softmax maximum, sum and weighted values are combined after, rescaled to the
row's largest maximum (flash decoding): the decode pool's threads then share a grouped-query
decoder's few KV heads evenly over a long cache (at the price of shorter streams). Up to one span,
the combination is the plain division, exactly.
float32 exp is a vectorisable polynomial within 1 ulp of the true value (`_exp32`).
"""
from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from runnx.capture.capacity import prefix_room
from runnx.ops import _jit_cache  # noqa: F401  (numba caches this module's kernels under RUNNX_CACHE)
from runnx.ops._array_types import any_layout, typed_contiguous
from runnx.ops._kernels_numpy_exp import exp_into

_REORDER = {"reassoc", "contract", "nsz", "arcp"}


def _kernel(**options):
    """numba.njit as every kernel here uses it: cached, with numpy's float semantics (x / 0 is inf;
    Python's ZeroDivisionError check would also keep loops from vectorising)."""
    return numba.njit(cache=True, error_model="numpy", **options)


@intrinsic
def float32_from_bits(typingctx, bits):
    if bits != types.int32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


@intrinsic
def _prefetch(typingctx, rows, index, offset):
    """Ask for the cache line `offset` bytes into row `index` of a 2-D array (llvm.prefetch: a hint,
    never a fault; no code where the target has no prefetch instruction)."""
    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        row = cgutils.get_item_pointer(context, builder, signature.args[0], array,
                                       [args[1], ir.Constant(ir.IntType(64), 0)], wraparound=False)
        byte = ir.IntType(8).as_pointer()
        line = builder.gep(builder.bitcast(row, byte), [args[2]])
        hint = builder.module.declare_intrinsic(  # its name mangled as this llvmlite's pointers are
            "llvm.prefetch", [byte], ir.FunctionType(ir.VoidType(), [byte] + [ir.IntType(32)] * 3))
        builder.call(hint, [line, ir.Constant(ir.IntType(32), 0), ir.Constant(ir.IntType(32), 3),
                            ir.Constant(ir.IntType(32), 1)])  # read, keep in every level, data
        return context.get_dummy_value()

    return types.void(rows, types.intp, types.intp), codegen


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
    scale = float32_from_bits(np.int32((np.int32(n) + np.int32(127)) << np.int32(23)))
    return p * scale if x >= _EXP_LOWEST else _F(0)


@_kernel()
def _rows(cache, batch, group):
    """cache[batch, group] (rows x depth), read in place when each row is contiguous (a KV cache,
    also as a view of a larger capacity buffer or with heads interleaved), else copied; `_row`
    then types each row C-contiguous."""
    block = cache[batch, group]
    if block.strides[1] == block.itemsize or block.shape[1] <= 1:
        return block
    return np.ascontiguousarray(block)


@_kernel()
def _row(rows, j):
    return typed_contiguous(rows[j])


PREFETCH_ROWS = 16  # how far ahead of each of its four streams attention asks for cache rows


@_kernel()
def _prefetch_quarters(rows, first, quarter):
    """Ask for rows first, first + quarter, first + 2 quarter and first + 3 quarter (every line of
    each), when within the four quarters; rows are contiguous."""
    if first < quarter:
        size = rows.shape[1] * rows.itemsize
        for stream in range(4):
            for offset in range(0, size, 64):
                _prefetch(rows, first + stream * quarter, offset)


@_kernel(fastmath=_REORDER)
def _scores(scaled, keys, scores):
    """scores[r, j] = scaled[r] . keys[j], four key rows a quarter of the keys apart per pass."""
    rows, depth, count = scaled.shape[0], scaled.shape[1], scores.shape[1]
    zero = scores.dtype.type(0)
    quarter = count // 4
    for j in range(quarter):
        _prefetch_quarters(keys, j + PREFETCH_ROWS, quarter)
        j1, j2, j3 = j + quarter, j + 2 * quarter, j + 3 * quarter
        k0, k1, k2, k3 = _row(keys, j), _row(keys, j1), _row(keys, j2), _row(keys, j3)
        for r in range(rows):
            q = scaled[r]
            a0 = a1 = a2 = a3 = zero
            for d in range(depth):
                a0 += q[d] * k0[d]
                a1 += q[d] * k1[d]
                a2 += q[d] * k2[d]
                a3 += q[d] * k3[d]
            scores[r, j], scores[r, j1], scores[r, j2], scores[r, j3] = a0, a1, a2, a3
    for j in range(4 * quarter, count):
        k0 = _row(keys, j)
        for r in range(rows):
            a0 = zero
            for d in range(depth):
                a0 += scaled[r, d] * k0[d]
            scores[r, j] = a0


@_kernel(fastmath=_REORDER)
def _weighted_sum(weights, values, partial):
    """partial[r] = sum_j weights[r, j] * values[j], four value rows a quarter apart per pass."""
    rows, width, count = partial.shape[0], partial.shape[1], weights.shape[1]
    partial[:] = 0
    quarter = count // 4
    for j in range(quarter):
        _prefetch_quarters(values, j + PREFETCH_ROWS, quarter)
        j1, j2, j3 = j + quarter, j + 2 * quarter, j + 3 * quarter
        v0, v1, v2, v3 = _row(values, j), _row(values, j1), _row(values, j2), _row(values, j3)
        for r in range(rows):
            w0, w1, w2, w3 = weights[r, j], weights[r, j1], weights[r, j2], weights[r, j3]
            target = partial[r]
            for d in range(width):
                target[d] += w0 * v0[d] + w1 * v1[d] + w2 * v2[d] + w3 * v3[d]
    for j in range(4 * quarter, count):
        v0 = _row(values, j)
        for r in range(rows):
            w0 = weights[r, j]
            for d in range(width):
                partial[r, d] += w0 * v0[d]


ATTENTION_SPAN = 512  # cache positions per unit of work: a long cache is shared between threads in spans


@_kernel()
def attention_spans(count):
    """How many spans a cache of `count` positions is cut into (at least one)."""
    return max(1, (count + ATTENTION_SPAN - 1) // ATTENTION_SPAN)


@_kernel(fastmath=_REORDER)
def _span_numerators(scores):
    """scores = exp(scores - m) in place for m = max(scores), returning (m, their sum); m is NaN
    when a score is NaN or +inf (the row's softmax is NaN) and -inf when every score is -inf (the
    span adds nothing): the scores are then zeros."""
    largest, unordered = scores.dtype.type(-np.inf), False
    for j in range(scores.shape[0]):
        s = scores[j]
        unordered |= s != s
        if s > largest:
            largest = s
    total = scores.dtype.type(0)
    if unordered or largest == np.inf:
        scores[:] = 0
        return scores.dtype.type(np.nan), total
    if largest == -np.inf:
        scores[:] = 0
        return largest, total
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
    return largest, total


@_kernel(fastmath=_REORDER)
def _add_offsets(scores, offsets, start):
    """scores += offsets[start:start + len(scores)] (one offset: broadcast), contiguous offsets
    typed so that the sum vectorises."""
    if offsets.shape[0] == 1:
        offset = offsets[0]
        for j in range(scores.shape[0]):
            scores[j] += offset
    elif offsets.strides[0] == offsets.itemsize:
        contiguous = typed_contiguous(offsets[start:start + scores.shape[0]])
        for j in range(scores.shape[0]):
            scores[j] += contiguous[j]
    else:
        for j in range(scores.shape[0]):
            scores[j] += offsets[start + j]


@_kernel(fastmath=_REORDER)
def attention_span(query, key, value, bias, scale, partials, stats, b, g, span):
    """The query rows of KV head g of batch entry b (its heads x query positions) against span
    `span` of the cache: each row's softmax numerators' maximum and sum into stats[b * G + g,
    span, row] and their weighted sum of the span's values into partials[b * G + g, span, row]
    (C-contiguous arrays): the unit `runtime/pool.py` shares between threads."""
    heads, length, depth = query.shape[1], query.shape[2], query.shape[3]
    groups, count = key.shape[1], key.shape[2]
    repeat = heads // groups
    rows = repeat * length
    spans = partials.shape[1]
    start, stop = count * span // spans, count * (span + 1) // spans
    scaled = np.empty((rows, depth), partials.dtype)
    scores = np.empty((rows, stop - start), partials.dtype)
    for r in range(rows):
        for d in range(depth):
            scaled[r, d] = query[b, g * repeat + r // length, r % length, d] * scale
    _scores(scaled, _rows(key, b, g)[start:stop], scores)
    if bias is not None:
        for r in range(rows):
            head, position = g * repeat + r // length, r % length
            _add_offsets(scores[r], bias[b if bias.shape[0] != 1 else 0, head if bias.shape[1] != 1 else 0,
                                         position if bias.shape[2] != 1 else 0], start)
    unit = b * groups + g
    for r in range(rows):
        stats[unit, span, r, 0], stats[unit, span, r, 1] = _span_numerators(scores[r])
    # typed C-contiguous (the pool posts partials with runtime strides): the sums vectorise
    _weighted_sum(scores, _rows(value, b, g)[start:stop], typed_contiguous(partials[unit, span]))


@_kernel(fastmath=_REORDER)
def attention_combine(value, partials, stats, fill, out, b, g):
    """out's rows of KV head g of batch entry b from its spans' results: the weighted sums
    rescaled to the largest maximum and divided by the rescaled sums, in span order (one span:
    partial / sum, the rescaling exactly 1). A row whose softmax is NaN (a NaN or +inf score,
    every score -inf) gives fill * sum(values): what Where(IsNaN(p), fill, p) @ V gives."""
    heads, length, width = out.shape[1], out.shape[2], out.shape[3]
    groups, spans = value.shape[1], partials.shape[1]
    repeat = heads // groups
    unit = b * groups + g
    for r in range(repeat * length):
        target = out[b, g * repeat + r // length, r % length]
        largest, unordered = out.dtype.type(-np.inf), False
        for span in range(spans):
            m = stats[unit, span, r, 0]
            unordered |= m != m
            if m > largest:
                largest = m
        target[:] = 0
        if unordered or largest == -np.inf:
            values = _rows(value, b, g)
            for j in range(values.shape[0]):
                row = _row(values, j)
                for d in range(width):
                    target[d] += fill * row[d]
            continue
        total = out.dtype.type(0)
        for span in range(spans):
            m = stats[unit, span, r, 0]
            if m == -np.inf:
                continue
            factor = _exp32(m - largest) if out.itemsize == 4 else math.exp(m - largest)
            total += stats[unit, span, r, 1] * factor
            partial = partials[unit, span, r]
            for d in range(width):
                target[d] += partial[d] * factor
        for d in range(width):
            target[d] = target[d] / total


@_kernel()
def attention_scratch(query, key, value):
    """(partials, stats) for `attention_span` of these arrays."""
    rows = query.shape[1] // key.shape[1] * query.shape[2]
    units = key.shape[0] * key.shape[1]
    spans = attention_spans(key.shape[2])
    return (np.empty((units, spans, rows, value.shape[3]), query.dtype),
            np.empty((units, spans, rows, 2), query.dtype))


@_kernel(fastmath=_REORDER)
def attention(query, key, value, bias, scale, fill):
    """softmax((query * scale) @ key^T + bias) @ value, NaN softmax rows -> fill, for query
    (B, H, Q, D), key (B, G, K, D), value (B, G, K, W) with H a multiple of G, bias broadcastable
    to (B, H, Q, K) in 4 dimensions or None (the caller checks the shapes). Each KV head's cache
    rows are read once, for the query rows of all its heads together, in spans of
    `ATTENTION_SPAN` positions whose results are combined as flash decoding does."""
    out = np.empty(query.shape[:3] + value.shape[3:], query.dtype)
    partials, stats = attention_scratch(query, key, value)
    for b in range(query.shape[0]):
        for g in range(key.shape[1]):
            for span in range(partials.shape[1]):
                attention_span(query, key, value, bias, scale, partials, stats, b, g, span)
            attention_combine(value, partials, stats, fill, out, b, g)
    return out


@intrinsic
def _lane_squares(typingctx, row, start, stop):
    """Numpy's eight running sums of squares over row[start:stop] (a C-contiguous float32 or float64
    row; stop - start a positive multiple of 8), combined as numpy combines them: lane l sums
    x * x of elements start + l, start + 8 + l, ... in order, one vector multiply and add a step
    (never fused: numpy squares, rounds, then adds). Written as vector instructions because
    LLVM leaves eight scalar chains scalar: 0.38 ns an element, a short prompt's RMS norms 2x."""
    if not (isinstance(row, types.Array) and row.ndim == 1 and row.layout == "C"
            and row.dtype in (types.float32, types.float64)):
        return None
    signature = row.dtype(row, start, stop)

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        element = context.get_data_type(sig.args[0].dtype)
        lanes = ir.VectorType(element, 8)
        i64 = ir.IntType(64)
        first, stop_at = (context.cast(builder, value, kind, types.int64)
                          for value, kind in zip(args[1:], sig.args[1:]))

        def squares(index):
            values = builder.load(builder.bitcast(builder.gep(data, [index]), lanes.as_pointer()), align=1)
            return builder.fmul(values, values)

        sums = cgutils.alloca_once_value(builder, squares(first))
        with cgutils.for_range_slice(builder, builder.add(first, ir.Constant(i64, 8)), stop_at,
                                     ir.Constant(i64, 8)) as (index, _):
            builder.store(builder.fadd(builder.load(sums), squares(index)), sums)
        total = builder.load(sums)
        lane = [builder.extract_element(total, ir.Constant(ir.IntType(32), i)) for i in range(8)]
        pairs = [builder.fadd(lane[i], lane[i + 1]) for i in range(0, 8, 2)]
        return builder.fadd(builder.fadd(pairs[0], pairs[1]), builder.fadd(pairs[2], pairs[3]))
    return signature, codegen


@_kernel()
def _block_squares(row, start, count):
    """sum(row[start:start+count] ** 2) for count <= 128 in numpy's order: 8 running sums
    (`_lane_squares`), then the rest one by one."""
    total = row.dtype.type(0)
    if count < 8:
        for i in range(start, start + count):
            total += row[i] * row[i]
        return total
    end = start + count - count % 8
    total = _lane_squares(row, start, end)
    for i in range(end, start + count):
        total += row[i] * row[i]
    return total


@_kernel()
def _pairwise_scratch(zero):
    """`_pairwise_squares`' stack of (start, count) pairs (count -1: add the last two sums) and its
    sums of `zero`'s type: deep enough for any row (each level halves it)."""
    return np.empty(128, np.int64), np.empty(128, np.int64), np.empty(64, type(zero))


@_kernel()
def _pairwise_squares(row, starts, counts, sums):
    """sum(row ** 2) in numpy's pairwise order (blocks of <= 128, halves above, split at multiples
    of 8), so that RMSNorm's mean is bitwise np.add.reduce(np.square(x)). The recursion runs on an
    explicit stack (scratch from `_pairwise_scratch`): numba's cache cannot reload recursive
    functions."""
    if row.shape[0] <= 128:
        return _block_squares(row, 0, row.shape[0])
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


@_kernel(nogil=True)
def rms_norm_into(rows, epsilon, one, weight, out):
    """weight * (x * (one / sqrt(mean(x * x) + epsilon))) of each row x of rows (rows, width) into
    out, both C-contiguous, the unfused graph's operations in its order (bitwise equal to it); every
    row alone, so that a prompt's rows may be cut into ranges computed on several threads
    (`runtime/rows.py`)."""
    width = rows.shape[1]
    count, epsilon, unit = rows.dtype.type(width), rows.dtype.type(epsilon), rows.dtype.type(one)
    starts, counts, sums = _pairwise_scratch(rows.dtype.type(0))
    for r in range(rows.shape[0]):
        row = rows[r]
        mean = _pairwise_squares(row, starts, counts, sums) / count + epsilon
        scale = unit / np.sqrt(mean)
        for i in range(width):
            out[r, i] = weight[i] * (row[i] * scale)


@_kernel(nogil=True)
def add_rms_norm_into(a, b, residual, epsilon, one, weight, out):
    """The RMS norm of residual (`rms_norm_into`) into out after residual = a + b (residual may be a or
    b; the sum numpy's, elementwise): rows (rows, width), C-contiguous, every row alone."""
    for r in range(a.shape[0]):
        for i in range(a.shape[1]):
            residual[r, i] = a[r, i] + b[r, i]
    rms_norm_into(residual, epsilon, one, weight, out)


@_kernel(nogil=True)
def silu_mul_into(gate, decay, up):
    """decay = gate * (1 / (1 + decay)) * up for decay = exp(-gate) (numpy's, so that the result
    is bitwise the unfused Sigmoid and Muls): C-contiguous arrays of one shape."""
    flat_gate, flat_decay, flat_up = gate.reshape(gate.size), decay.reshape(decay.size), up.reshape(up.size)
    one = gate.dtype.type(1)
    for i in range(flat_decay.size):
        flat_decay[i] = flat_gate[i] * (one / (one + flat_decay[i])) * flat_up[i]
    return decay


@_kernel(nogil=True)
def silu_mul_blocks(loop, gate, up, decay, block):
    """decay = gate * Sigmoid(gate) * up (`silu_mul_into` after numpy's exp of -gate, called
    through `loop`: `_kernels_numpy_exp.EXP`) for C-contiguous float32 rows (rows, columns) of one
    shape, whole rows of about `block` elements at a time: the three passes over a block read it
    from cache, and no pass takes the GIL. Elementwise: the bits of the unfused nodes."""
    step = max(1, block // max(1, gate.shape[1]))
    for first in range(0, gate.shape[0], step):
        last = min(gate.shape[0], first + step)
        negated, gated = decay[first:last].reshape(-1), gate[first:last].reshape(-1)
        for i in range(negated.size):
            negated[i] = -gated[i]
        exp_into(loop, negated, negated)
        silu_mul_into(gate[first:last], decay[first:last], up[first:last])


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
    if not (_broadcasts_into(cos, x) and _broadcasts_into(sin, x)):
        raise ValueError("cos/sin do not broadcast into x")
    out = np.empty(x.shape, x.dtype)
    _rotate_rows(x, cos, sin, half, out, 0)
    return out


@_kernel()
def _rotate_rows(x, cos, sin, half, out, start):
    """out[b, h, start + q] = rotate_half's row (b, h, q) of x."""
    batch, heads, length, width = x.shape
    tail = width - half
    for b in range(batch):
        for h in range(heads):
            for q in range(length):
                row = x[b, h, q]
                c = cos[b if cos.shape[0] != 1 else 0, h if cos.shape[1] != 1 else 0, q if cos.shape[2] != 1 else 0]
                s = sin[b if sin.shape[0] != 1 else 0, h if sin.shape[1] != 1 else 0, q if sin.shape[2] != 1 else 0]
                target = out[b, h, start + q]
                if c.shape[0] == width and s.shape[0] == width:  # (no index to choose: loops that vectorise)
                    for i in range(tail):
                        target[i] = row[i] * c[i] + -row[half + i] * s[i]
                    for i in range(tail, width):
                        target[i] = row[i] * c[i] + row[i - tail] * s[i]
                    continue
                for i in range(tail):
                    target[i] = row[i] * c[i if c.shape[0] != 1 else 0] + -row[half + i] * s[i if s.shape[0] != 1 else 0]
                for i in range(tail, width):
                    target[i] = row[i] * c[i if c.shape[0] != 1 else 0] + row[i - tail] * s[i if s.shape[0] != 1 else 0]


@_kernel()
def rope_append_into(query, key, value, past_key, key_buffer, past_value, value_buffer, query_cos, query_sin,
                     key_cos, key_sin, query_half, key_half):
    """A decoder layer's rotary embedding and cache growth in one call: (True, rotate_half(query))
    with rotate_half(key) written after past_key inside key_buffer and value after past_value inside
    value_buffer, or (False, an empty array) having written nothing when the caches are not prefix
    views with room, the new rows do not match them or cos/sin do not broadcast. The caches and
    tables of any layout to the body (`_array_types.py`): a prompt's empty caches and transposed
    tables and a decode step's prefix views and rows take one compiled body (its arithmetic plain
    multiplies and adds, never contracted or reassociated: the same bits in any layout)."""
    return _rope_append_into(any_layout(query), any_layout(key), any_layout(value), any_layout(past_key), key_buffer,
                             any_layout(past_value), value_buffer, any_layout(query_cos), any_layout(query_sin),
                             any_layout(key_cos), any_layout(key_sin), query_half, key_half)


@_kernel()
def _rope_append_into(query, key, value, past_key, key_buffer, past_value, value_buffer, query_cos, query_sin,
                      key_cos, key_sin, query_half, key_half):
    if not rope_append_fits(query, key, value, past_key, key_buffer, past_value, value_buffer, query_cos, query_sin,
                            key_cos, key_sin):
        return False, np.empty((0, 0, 0, 0), query.dtype)
    rotated = np.empty(query.shape, query.dtype)
    rope_append_rows(query, key, value, key_buffer, value_buffer, query_cos, query_sin, key_cos, key_sin, query_half,
                     key_half, rotated, past_key.shape[2], past_value.shape[2])
    return True, rotated


@_kernel(nogil=True)
def rope_append_fits(query, key, value, past_key, key_buffer, past_value, value_buffer, query_cos, query_sin,
                     key_cos, key_sin):
    """Whether `rope_append_into` writes: cos/sin broadcast into the rows, the new rows match the
    caches, which are prefix views of their buffers with room for them. (Spelled out, not looped
    over tuples: the arrays may differ in layout, a split-heads query a transposed view.)"""
    return (_broadcasts_into(query_cos, query) and _broadcasts_into(query_sin, query)
            and _broadcasts_into(key_cos, key) and _broadcasts_into(key_sin, key)
            and _grows_into(key, past_key, key_buffer) and _grows_into(value, past_value, value_buffer))


@_kernel()
def _grows_into(new, past, buffer):
    """Whether the rows `new` match the cache `past`, a prefix view of `buffer` with room for them."""
    return (new.shape[0] == past.shape[0] and new.shape[1] == past.shape[1] and new.shape[3] == past.shape[3]
            and prefix_room(past, buffer, 2) >= new.shape[2])


@_kernel(nogil=True)
def rope_append_rows(query, key, value, key_buffer, value_buffer, query_cos, query_sin, key_cos, key_sin, query_half,
                     key_half, rotated, key_start, value_start):
    """`rope_append_into`'s writes once it fits: rotated = rotate_half(query), rotate_half(key) at
    row key_start of key_buffer and value at row value_start of value_buffer (along axis 2). Every
    position alone: a prompt's positions may be cut into ranges, each its views of the rows and
    cos/sin rows (`runtime/rows.py`). Its arrays of any layout to the body, as `rope_append_into`'s."""
    _rope_append_rows(any_layout(query), any_layout(key), any_layout(value), key_buffer, value_buffer,
                      any_layout(query_cos), any_layout(query_sin), any_layout(key_cos), any_layout(key_sin), query_half,
                      key_half, any_layout(rotated), key_start, value_start)


@_kernel()
def _rope_append_rows(query, key, value, key_buffer, value_buffer, query_cos, query_sin, key_cos, key_sin, query_half,
                      key_half, rotated, key_start, value_start):
    _rotate_rows(query, query_cos, query_sin, query_half, rotated, np.int64(0))  # (not a literal: one compile)
    _rotate_rows(key, key_cos, key_sin, key_half, any_layout(key_buffer), key_start)
    for b in range(value.shape[0]):
        for h in range(value.shape[1]):
            for q in range(value.shape[2]):
                row, target = value[b, h, q], value_buffer[b, h, value_start + q]
                for i in range(row.shape[0]):  # (an element loop: a row's slice assignment costs more)
                    target[i] = row[i]
