"""Decoder blocks of several fused nodes as native calls that post the decode pool's jobs, so that a
decode step runs their products, residual adds and norms with no Python between them (each node's
Python, its checks and its hand-off to the pool cost a few percent of a decode step). A short
prompt's rows take the `*_rows` blocks, whose products are the column jobs MatMul posts for them.

A block is cut where numpy must compute: the SiLU gate's exp is numpy's (numba's differs from it
by up to 2 ulp on a third of float32 inputs), so that a block's results are bitwise those of its
nodes run one by one, but for a block that holds an attention (whose kernels are not bitwise the
nodes' anyway); LayerNorm blocks (LayerNorm, erf GELU) call what their nodes call: `layer_norm_rows`,
and ErfGelu's pool job (`post_gelu`) on a board of their own. Called through
`runtime.pool.shared_call` (the pool's workers, or alone on a board of the call: the same compiled
code, so the same results); each returns what it computed. The `*_into` ones write into arrays the
caller allocated, for a kernel that defers them (`runtime.defer`: its Python runs ahead, the calls
when the thread settles): the same jobs and kernels, so the same bits. `open_gated_down_nbits`
opens its block's last job and returns at once (`runtime.pool.open_shared_call`), what completes
the outputs from it a tail the pool runs once it is finished (`add_norm_into`).
"""
from __future__ import annotations


import numba
import numpy as np

from runnx.ops import _jit_cache  # noqa: F401  (numba caches this module's kernels under RUNNX_CACHE)
from runnx.ops._kernels_contrib import skip_norm_rows
from runnx.ops._kernels_fused import add_rms_norm_into, rope_append_into, silu_mul_into
from runnx.ops._kernels_linalg import chunk_count
from runnx.ops._kernels_nibble_tiles import CHUNK_BYTES
from runnx.ops._kernels_nn import layer_norm_rows
from runnx.ops._kernels_numpy_exp import exp_into
from runnx.ops._kernels_rows import split_heads_into
from runnx.runtime.jobs import (open_attention, open_gemms, open_nbits, post_attention, post_gelu, post_gemm,
                                post_gemms, post_nbits, post_products)
from runnx.runtime.board import own_board

_jit = numba.njit(cache=True, nogil=True, error_model="numpy")


@_jit
def _product(board, workers, row, matrix):
    """row @ matrix as one pool job."""
    out = np.empty(matrix.shape[1], np.float32)
    _product_into(board, workers, row, matrix, out)
    return out


@_jit
def _product_into(board, workers, row, matrix, out):
    """row @ matrix into out, as one pool job."""
    post_products(board, workers, row, (matrix,), (out,), np.empty(chunk_count(row.size) * out.size, np.float32), 0.0,
                  1.0)


@_jit
def _add_norm(residual, summed, epsilon, one, norm_weight, skip):
    """summed += residual (in place), then its norm (`add_norm_into`), a new array."""
    normed = np.empty(summed.shape, np.float32)
    add_norm_into(residual, summed, epsilon, one, norm_weight, skip, normed)
    return normed


@_jit
def add_norm_into(residual, summed, epsilon, one, norm_weight, skip, normed):
    """summed += residual (in place), then its norm into normed (C-contiguous, summed's size):
    RMSNorm's unfused arithmetic (`add_rms_norm_into`), or with `skip` onnxruntime's
    SkipSimplifiedLayerNormalization's: its own kernel (`skip_norm_rows`: float64 statistics, no
    `one`), the sum written over `summed` (each element read before it is written)."""
    width = summed.shape[-1]
    rows = (summed.size // width, width)
    sums = summed.reshape(rows)
    if not skip:
        add_rms_norm_into(residual.reshape(rows), sums, sums, epsilon, one, norm_weight, normed.reshape(rows))
        return
    statistics = np.empty((2, rows[0]), np.float32)
    skip_norm_rows(residual.reshape(rows), sums, norm_weight[:0], norm_weight, norm_weight[:0], epsilon, True,
                   normed.reshape(rows), sums, statistics[0], statistics[1])


@_jit
def projected_gate(board, workers, x, weight, residual, epsilon, one, norm_weight, gate_weight, up_weight, skip,
                   loop):
    """(s, gate, decay, up, max(-gate)) for s = residual + x @ weight and gate, up its norm
    (`_add_norm`) @ gate_weight, @ up_weight (one job for the two), float32 rows and C-contiguous
    matrices: an attention's output projection, the residual add, the MLP's norm and its gate and up
    products. decay is numpy's exp(-gate) where `loop` is numpy's exp (`_kernels_numpy_exp.EXP`),
    else -gate, whose exp the caller takes (`_decay_into`)."""
    summed = np.empty(weight.shape[1], np.float32)
    gate, negated, up = (np.empty(gate_weight.shape[1], np.float32), np.empty(gate_weight.shape[1], np.float32),
                         np.empty(up_weight.shape[1], np.float32))
    largest = np.empty(1)
    projected_gate_into(board, workers, x, weight, residual, epsilon, one, norm_weight, gate_weight, up_weight, skip,
                        loop, summed, gate, negated, up, largest)
    return summed, gate, negated, up, largest[0]


@_jit
def projected_gate_into(board, workers, x, weight, residual, epsilon, one, norm_weight, gate_weight, up_weight, skip,
                        loop, summed, gate, negated, up, largest):
    """`projected_gate` into the caller's C-contiguous arrays (`largest` one element), for a call
    deferred with its outputs allocated before it runs (`runtime.defer`)."""
    _product_into(board, workers, x, weight, summed)
    normed = _add_norm(residual, summed, epsilon, one, norm_weight, skip)
    post_products(board, workers, normed, (gate_weight, up_weight), (gate, up),
                  np.empty(chunk_count(normed.size) * (gate.size + up.size), np.float32), 0.0, 1.0)
    largest[0] = _decay_into(loop, gate, negated)


@_jit
def _decay_into(loop, gate, decay):
    """-gate into decay (both C-contiguous), then numpy's exp of it in place where `loop` is numpy's
    exp (`_kernels_numpy_exp.EXP`; (0, 0): the caller takes it, with numpy): the SiLU's exp(-gate).
    Returns the largest element of -gate when the caller takes the exp (which silences overflow
    only when it can happen), else inf (unused). Only then is the maximum sought: its chain of
    compares, one an element, took three times as long as the exp (a 32-token prompt's 57 us a
    layer, on the calling thread alone)."""
    flat_gate, flat_decay = gate.reshape(gate.size), decay.reshape(decay.size)
    if loop[0] != 0:
        for i in range(flat_gate.size):
            flat_decay[i] = -flat_gate[i]
        exp_into(loop, flat_decay, flat_decay)
        return np.inf
    largest = -np.inf
    for i in range(flat_gate.size):
        flat_decay[i] = -flat_gate[i]
        largest = max(largest, flat_decay[i])
    return largest


@_jit
def gated_down(board, workers, gate, decay, up, weight, residual, epsilon, one, norm_weight, skip):
    """(residual + silu(gate) * up @ weight, its norm: `_add_norm`) for decay = exp(-gate) (numpy's):
    the MLP's activation, down product, residual add and the next norm."""
    summed, normed = np.empty(weight.shape[1], np.float32), np.empty(weight.shape[1], np.float32)
    gated_down_into(board, workers, gate, decay, up, weight, residual, epsilon, one, norm_weight, skip, summed, normed)
    return summed, normed


@_jit
def gated_down_into(board, workers, gate, decay, up, weight, residual, epsilon, one, norm_weight, skip, summed,
                    normed):
    """`gated_down` into the caller's arrays (`summed` the product, then the sum; `normed` its norm),
    for a deferred call as `projected_gate_into`."""
    _product_into(board, workers, silu_mul_into(gate, decay, up), weight, summed)
    add_norm_into(residual, summed, epsilon, one, norm_weight, skip, normed)


@_jit
def projected_gate_down_into(board, workers, x, weight, residual, epsilon, one, norm_weight, gate_weight, up_weight,
                             skip, loop, summed, gate, negated, up, largest, down_weight, down_epsilon, down_one,
                             down_norm_weight, down_skip, product, normed):
    """`projected_gate_into`, then `gated_down_into` on its outputs (numpy's exp of the gate taken in
    the first: `loop` numpy's), as one native call: a deferred gated MLP's two calls in one, so the
    Python between them, with its code and data evicted by the gate and up weights, is not run."""
    projected_gate_into(board, workers, x, weight, residual, epsilon, one, norm_weight, gate_weight, up_weight, skip,
                        loop, summed, gate, negated, up, largest)
    gated_down_into(board, workers, gate, negated, up, down_weight, summed, down_epsilon, down_one, down_norm_weight,
                    down_skip, product, normed)


@_jit
def normed_gate_nbits(board, workers, a, b, epsilon, one, norm_weight, skip, tiles, scales, zeros, columns, gate_at,
                      up_at, inner, loop):
    """(s, gate, decay, up, max(-gate)) for s = a + b, C-contiguous float32 rows (M, K), and gate, up
    the columns gate_at and up_at .. + inner of its norm (`_add_norm`) times the joined 4-bit tiles
    of the gate and up weights (and any others: `columns` in all), one products job
    (`post_nbits`): GatedMLPNBits' residual add and norm and its two products, the bits of the
    nodes it replaced; decay as `projected_gate`'s."""
    rows = a.shape[0]
    summed, gate, negated, up = (np.empty(a.shape, np.float32), np.empty((rows, inner), np.float32),
                                 np.empty((rows, inner), np.float32), np.empty((rows, inner), np.float32))
    largest = np.empty(1)
    normed_gate_nbits_into(board, workers, a, b, epsilon, one, norm_weight, skip, tiles, scales, zeros, columns,
                           gate_at, up_at, inner, loop, summed, gate, negated, up, largest)
    return summed, gate, negated, up, largest[0]


@_jit
def normed_gate_nbits_into(board, workers, a, b, epsilon, one, norm_weight, skip, tiles, scales, zeros, columns,
                           gate_at, up_at, inner, loop, summed, gate, negated, up, largest):
    """`normed_gate_nbits` into the caller's C-contiguous arrays (`largest` one element)."""
    summed[:] = b
    normed = _add_norm(a, summed, epsilon, one, norm_weight, skip)
    products = np.empty((normed.shape[0], columns), np.float32)
    post_nbits(board, workers, normed, tiles, scales, zeros, products)
    gate[:] = products[:, gate_at:gate_at + inner]
    up[:] = products[:, up_at:up_at + inner]
    largest[0] = _decay_into(loop, gate, negated)


@_jit
def normed_gate_down_nbits_into(board, workers, a, b, epsilon, one, norm_weight, skip, tiles, scales, zeros, columns,
                                gate_at, up_at, inner, loop, summed, gate, negated, up, largest, down_tiles,
                                down_scales, down_zeros, down_epsilon, down_one, down_norm_weight, down_skip, product,
                                normed):
    """`normed_gate_nbits_into`, then `gated_down_nbits_into` on its outputs, as one native call
    (`projected_gate_down_into`'s reason; `loop` numpy's exp)."""
    normed_gate_nbits_into(board, workers, a, b, epsilon, one, norm_weight, skip, tiles, scales, zeros, columns,
                           gate_at, up_at, inner, loop, summed, gate, negated, up, largest)
    gated_down_nbits_into(board, workers, gate, negated, up, down_tiles, down_scales, down_zeros, summed, down_epsilon,
                          down_one, down_norm_weight, down_skip, product, normed)


@_jit
def gated_down_nbits(board, workers, gate, decay, up, tiles, scales, zeros, width, residual, epsilon, one, norm_weight,
                     skip):
    """(residual + silu(gate) * up times the down weight's 4-bit tiles, its norm: `_add_norm`) for
    decay = exp(-gate) (numpy's), rows (M, inner): GatedMLPNBits' activation, down product, residual
    add and the next norm."""
    summed, normed = np.empty((gate.shape[0], width), np.float32), np.empty((gate.shape[0], width), np.float32)
    gated_down_nbits_into(board, workers, gate, decay, up, tiles, scales, zeros, residual, epsilon, one, norm_weight,
                          skip, summed, normed)
    return summed, normed


@_jit
def gated_down_nbits_into(board, workers, gate, decay, up, tiles, scales, zeros, residual, epsilon, one, norm_weight,
                          skip, summed, normed):
    """`gated_down_nbits` into the caller's C-contiguous summed and normed (rows, width)."""
    post_nbits(board, workers, silu_mul_into(gate, decay, up), tiles, scales, zeros, summed)
    add_norm_into(residual, summed, epsilon, one, norm_weight, skip, normed)


@_jit
def open_gated_down_nbits(board, workers, gate, decay, up, tiles, scales, zeros, summed, scratch):
    """`gated_down_nbits`' activation, then its down product into `summed` opened (`open_nbits`, its
    lanes and sums in `scratch`: rows x chunks x (2 CHUNK_BYTES + 1) floats), the residual add and
    norm left to `add_norm_into` after it: 1 when a worker was idle, else 0 (`DecodePool.open_call`)."""
    rows = silu_mul_into(gate, decay, up)
    height, chunks = rows.shape[0], tiles.shape[1]
    lanes = height * 2 * chunks * CHUNK_BYTES
    return 1 if open_nbits(board, workers, rows, scratch[:lanes].reshape((height, 2, chunks * CHUNK_BYTES)),
                           scratch[lanes:lanes + height * chunks].reshape((height, chunks)), tiles, scales, zeros,
                           summed) else 0


@_jit
def _gemm(board, workers, rows, matrix, unit):
    """rows @ matrix as one pool job of `unit` columns a unit (`post_gemm`): a short prompt's product,
    the bits MatMul gives it."""
    out = np.empty((rows.shape[0], matrix.shape[1]), np.float32)
    post_gemm(board, workers, rows, matrix, out, False, unit)
    return out


@_jit
def projected_gate_rows(board, workers, x, weight, residual, epsilon, one, norm_weight, gate_weight, up_weight, units,
                        skip, loop):
    """`projected_gate` for a short prompt's rows x (M, K), residual (M, N), C-contiguous float32: the
    products as pool jobs of units[0] and units[1] columns a unit (`post_gemm`, `post_gemms`: those
    of MatMul and SharedInputMatMul for such rows), the sum and norm the norm node's, so the nodes'
    bits."""
    summed = _gemm(board, workers, x, weight, units[0])
    normed = _add_norm(residual, summed, epsilon, one, norm_weight, skip)
    gate = np.empty((x.shape[0], gate_weight.shape[1]), np.float32)
    up = np.empty((x.shape[0], up_weight.shape[1]), np.float32)
    post_gemms(board, workers, normed, (gate_weight, up_weight), (gate, up), False, units[1])
    negated = np.empty_like(gate)
    return summed, gate, negated, up, _decay_into(loop, gate, negated)


@_jit
def gated_down_rows(board, workers, gate, decay, up, weight, residual, epsilon, one, norm_weight, unit, skip):
    """`gated_down` for a short prompt's rows: the down product a pool job of `unit` columns a unit."""
    summed = _gemm(board, workers, silu_mul_into(gate, decay, up), weight, unit)
    return summed, _add_norm(residual, summed, epsilon, one, norm_weight, skip)


@_jit
def open_gated_down_rows(board, workers, gate, decay, up, weight, unit, summed):
    """`gated_down_rows`' activation, then its down product into `summed` opened (`open_gemms`), the
    residual add and norm left to `add_norm_into` after it: 1 when a worker was idle, else 0
    (`DecodePool.open_call`)."""
    return 1 if open_gemms(board, workers, silu_mul_into(gate, decay, up), (weight,), (summed,), False, unit) else 0


@_jit
def projected_layer_norm(board, workers, x, weight, bias, residual, scale, norm_bias, epsilon):
    """(s, LayerNorm(s)) for s = residual + (x @ weight + bias) (bias empty: none), float32 rows and
    a C-contiguous matrix: a LayerNorm layer's output projections and second MLP product with the
    residual add and the next LayerNormalization (MatMulAddLayerNorm's nodes, the same sums)."""
    summed, normed = np.empty(weight.shape[1], np.float32), np.empty((1, weight.shape[1]), np.float32)
    projected_layer_norm_into(board, workers, x, weight, bias, residual, scale, norm_bias, epsilon, summed, normed)
    return summed, normed


@_jit
def projected_layer_norm_into(board, workers, x, weight, bias, residual, scale, norm_bias, epsilon, summed, normed):
    """`projected_layer_norm` into summed (N,) and normed (1, N), C-contiguous."""
    _product_into(board, workers, x, weight, summed)
    if bias.size:
        for i in range(summed.size):
            summed[i] += bias[i]
    for i in range(summed.size):
        summed[i] = residual[i] + summed[i]
    statistics = np.empty((2, 1), np.float32)  # mean and 1/std, unused
    layer_norm_rows(summed.reshape((1, summed.size)), scale, norm_bias, epsilon, normed, statistics[0],
                    statistics[1])


@_jit
def gelu_mlp(board, workers, x, weight, bias, residual, scale, norm_bias, epsilon, up_weight, up_bias, divisor, one,
             half, down_weight, down_bias, down_scale, down_norm_bias, down_epsilon):
    """`projected_layer_norm` (s, n), then (s2, LayerNorm(s2)) for s2 = s + (ErfGelu(n @ up_weight +
    up_bias) @ down_weight + down_bias) (empty biases: none): a LayerNorm layer from its last
    attention's output projection to the next layer's norm. The GELU is ErfGelu's job run alone on a
    mailbox of its own (as `runtime.pool.alone` runs it for ErfGelu's node)."""
    summed, normed = np.empty(down_weight.shape[1], np.float32), np.empty((1, down_weight.shape[1]), np.float32)
    gelu_mlp_into(board, workers, x, weight, bias, residual, scale, norm_bias, epsilon, up_weight, up_bias, divisor,
                  one, half, down_weight, down_bias, down_scale, down_norm_bias, down_epsilon, summed, normed)
    return summed, normed


@_jit
def gelu_mlp_into(board, workers, x, weight, bias, residual, scale, norm_bias, epsilon, up_weight, up_bias, divisor,
                  one, half, down_weight, down_bias, down_scale, down_norm_bias, down_epsilon, summed, normed):
    """`gelu_mlp` into summed (N,) and normed (1, N), C-contiguous."""
    first, first_normed = projected_layer_norm(board, workers, x, weight, bias, residual, scale, norm_bias, epsilon)
    up = _product(board, workers, first_normed[0], up_weight)
    activated = np.empty((1, up.size), np.float32)
    post_gelu(own_board(board), 0, up.reshape((1, up.size)), up_bias, divisor, one, half, activated)
    projected_layer_norm_into(board, workers, activated[0], down_weight, down_bias, first, down_scale, down_norm_bias,
                              down_epsilon, summed, normed)


@_jit
def attended_row(board, workers, x, weight, query_bias, query_scale, row, heads, key, value, bias, fill, out):
    """Attention of one query row into out (batch 1, heads, 1, width): row = x @ weight (weight
    empty: x), + query_bias, * query_scale (each empty: none), its heads `heads` (a view of row),
    then `post_attention` of the heads against key (batch, heads, length, depth) and value, scale 1:
    a decode step's HeadsAttention (with its query projection, ProjectedHeadsAttention),
    the same sums as its nodes."""
    if weight.size:
        post_products(board, workers, x, (weight,), (row,), np.empty(chunk_count(x.size) * row.size, np.float32), 0.0,
                      1.0)
    else:
        row[:] = x
    if query_bias.size:
        for i in range(row.size):
            row[i] = query_bias[i] + row[i]
    if query_scale.size:
        for i in range(row.size):
            row[i] = row[i] * query_scale[0]
    post_attention(board, workers, heads, key, value, bias, 1.0, fill, out)


@_jit
def appended_products(board, workers, x, weights, key_bias, value_bias, key_buffer, value_buffer, position):
    """x @ weights[0], with x @ weights[1] + key_bias and x @ weights[2] + value_bias (empty: none)
    split into heads and written at `position` of key_buffer and value_buffer (batch 1, heads,
    length, depth), the three products one job: a decoder layer's projections and its KV cache
    growth, the values SplitHeads and Concat give (ProjectedAppend's nodes)."""
    query = np.empty(weights[0].shape[1], np.float32)
    appended_products_into(board, workers, x, weights, key_bias, value_bias, key_buffer, value_buffer, position, query)
    return query


@_jit
def appended_products_into(board, workers, x, weights, key_bias, value_bias, key_buffer, value_buffer, position,
                           query):
    """`appended_products` with its query row written into `query`."""
    key, value = np.empty(weights[1].shape[1], np.float32), np.empty(weights[2].shape[1], np.float32)
    post_products(board, workers, x, weights, (query, key, value),
                  np.empty(chunk_count(x.size) * (query.size + key.size + value.size), np.float32), 0.0, 1.0)
    _append_row(key, key_bias, key_buffer, position)
    _append_row(value, value_bias, value_buffer, position)


@_jit
def _append_row(row, bias, buffer, position):
    """row + bias (empty: row) split into buffer's heads at `position` of each."""
    depth = buffer.shape[3]
    for h in range(buffer.shape[1]):
        for d in range(depth):
            i = h * depth + d
            buffer[0, h, position, d] = bias[i] + row[i] if bias.size else row[i]


@_jit
def projected_rope_append(board, workers, x, weights, biases, rows, rope):
    """biases[m] + x @ weights[m] into rows[m] (the query's, key's and value's heads, as views; an
    empty bias adds nothing), the products one job, then `rope_append_into(*rope)` reading them: an
    RMSNorm layer's projections, rotary embedding and KV cache growth (ProjectedRopeAppend's nodes,
    the sums SplitHeads' `_biased` makes); rope_append_into's (done, rotated query). (`rope` a
    tuple, not *rope: numba types star arguments one way from Python, another from a compiled
    caller, and compiled such a kernel twice.)"""
    size = 0
    for row in rows:
        size += row.size
    post_products(board, workers, x, weights, rows, np.empty(chunk_count(x.size) * size, np.float32), 0.0, 1.0)
    _add_biases(biases, rows)
    return rope_append_into(*rope)


@_jit
def projected_rope_into(board, workers, x, weights, biases, rows, rope, rotated):
    """`projected_rope_append` with the rotated query written into `rotated` (its jobs and kernels,
    so its bits), for a deferred call: the caller checked that `rope_append_into(*rope)` writes
    (`rope_append_fits`); ValueError if it would not."""
    size = 0
    for row in rows:
        size += row.size
    post_products(board, workers, x, weights, rows, np.empty(chunk_count(x.size) * size, np.float32), 0.0, 1.0)
    projected_rope_tail(biases, rows, rope, rotated)


@_jit
def _add_biases(biases, rows):
    """rows[m] = biases[m] + rows[m] (an empty bias: nothing): SplitHeads' `_biased` sums."""
    for m in range(len(rows)):
        bias, row = biases[m], rows[m]
        if bias.size:
            for i in range(row.size):
                row[i] = bias[i] + row[i]


@_jit
def projected_rope_tail(biases, rows, rope, rotated):
    """`projected_rope_append`'s work after its products job: the biases added, then
    `rope_append_into(*rope)` (its rotated query into `rotated`), which writes: the caller checked
    that it fits (`rope_append_fits`)."""
    _add_biases(biases, rows)
    done, query = rope_append_into(*rope)
    if not done:
        raise ValueError("a rotary embedding left open no longer fits its caches")
    rotated.reshape(rotated.size)[:] = query.reshape(query.size)


@_jit
def projected_rope_append_rows(board, workers, x, weights, biases, heads, unit, rope):
    """`projected_rope_append` for a short prompt's rows x (M, K): the three products one pool job of
    `unit` columns a unit (`post_gemms`, SharedInputMatMul's for such rows), each split into its
    heads (batch, heads, length, depth) with its bias added (`split_heads_into`, SplitHeads'), then
    `rope_append_into(*rope)` reading them: ProjectedRopeAppend's nodes, their bits."""
    products = (np.empty((x.shape[0], weights[0].shape[1]), np.float32),
                np.empty((x.shape[0], weights[1].shape[1]), np.float32),
                np.empty((x.shape[0], weights[2].shape[1]), np.float32))
    post_gemms(board, workers, x, weights, products, False, unit)
    return _split_and_rotate(products, biases, heads, rope)


@_jit
def _split_and_rotate(products, biases, heads, rope):
    """The q/k/v products each split into its heads with its bias (`_split_into`), then
    `rope_append_into(*rope)` reading them: (whether it wrote, the rotated query)."""
    _split_into(products[0], biases[0], heads[0])
    _split_into(products[1], biases[1], heads[1])
    _split_into(products[2], biases[2], heads[2])
    return rope_append_into(*rope)


@_jit
def open_projected_rows(board, workers, x, weights, products, unit):
    """`projected_rope_append_rows`' products job opened (`open_gemms`), what follows it left to
    `projected_rows_tail`: 1 when a worker was idle, else 0 (`DecodePool.open_call`)."""
    return 1 if open_gemms(board, workers, x, weights, products, False, unit) else 0


@_jit
def projected_rows_tail(products, biases, heads, rope, rotated):
    """`projected_rope_append_rows` after its products job: each split into its heads with its bias,
    then `rope_append_into(*rope)`, its rotated query into `rotated`; the caller checked that it
    writes (`rope_append_fits`): ValueError if it would not."""
    done, query = _split_and_rotate(products, biases, heads, rope)
    if not done:
        raise ValueError("a rotary embedding left open no longer fits its caches")
    rotated[...] = query


@_jit
def open_attention_call(board, workers, query, key, value, bias, scale, fill, out, partials, stats):
    """`open_attention` as `DecodePool.open_call` calls it: 1 when a worker was idle, else 0."""
    return 1 if open_attention(board, workers, query, key, value, bias, scale, fill, out, partials, stats) else 0


@_jit
def _split_into(rows, bias, heads):
    """rows (batch x length, heads x depth) split into heads (batch, heads, length, depth), plus bias."""
    batch, count, length, depth = heads.shape
    split_heads_into(rows.reshape((batch, length, count * depth)), bias, heads)
