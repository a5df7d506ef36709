"""Fused products of one input (`runnx/interp/fusion/products.py`): SharedInputMatMul (a layer's
q/k/v or gate/up products, their heads split and the SiLU gate applied), BiasedMatMul and
ProjectedAppend (a self-attention's projections and KV cache growth). A decode step's row runs
each as one decode-pool job or native call (`_decode_blocks.py`), each product the bits of its
MatMul (`linalg.py`).
"""
from __future__ import annotations

import numpy as np

from runnx.capture.capacity import prefix_room
from runnx.ops import _native
from runnx.ops._decode_blocks import appended_products, appended_products_into
from runnx.ops._fused_common import DOMAIN, absent
from runnx.ops._matmul import shared_input_products
from runnx.ops._remembered import Remembered
from runnx.ops.cache import Concat, count_appends
from runnx.ops.fused_layer_norm_blocks import SplitHeads, split_shape
from runnx.ops.fused_norms import SiluMul
from runnx.ops.linalg import _FLOAT32, MatMul, _pooled_rows, _rows
from runnx.ops.registry import register
from runnx.runtime import defer, pool as decode_pool, take_leave

_NO_BIAS = absent((0,))  # an absent bias, as the native blocks take it


@register("SharedInputMatMul", since=1, domain=DOMAIN, overlaps_jobs=True)
def SharedInputMatMul(x, *inputs, splits: tuple = (), gated: tuple = ()):
    """(MatMul(x, w) for w in weights): the products of one input (a layer's query, key and value
    projections; its gate and up projections), matched by `runnx/interp/fusion/products.py`. A
    decode step's one-row products go to the decode pool as one job (one hand-off, not three), and
    so do a short prompt's (`shared_input_products`), each the bits of its MatMul.
    inputs: the weights, then (bias, target, source) of SplitHeads for each (position, dims, axes)
    of `splits`: product `position` comes out with its heads split. gated (gate, up): those two
    products come out as one, SiluMul(gate, up), after the others."""
    count = len(inputs) - 3 * len(splits)
    weights = inputs[:count]
    if (workers := decode_pool.pool()) is not None and x.flags.c_contiguous and _pooled_rows(x, weights):
        lead = x.shape[:-1]
        rows = workers.products(_rows(x), weights, leave_open=not (splits or gated))
        products = [product.reshape(lead + w.shape[1:]) for product, w in zip(rows, weights)]
    elif x.ndim and x.shape[-1] and (rows := shared_input_products(x.reshape(-1, x.shape[-1]), weights)) is not None:
        products = [product.reshape(x.shape[:-1] + w.shape[1:]) for product, w in zip(rows, weights)]
    else:
        products = [MatMul(x, w) for w in weights]
        decode_pool.settle()  # (MatMul may leave its job open)
    for n, (position, dims, axes) in enumerate(splits):
        bias, target, source = inputs[count + 3 * n:count + 3 * n + 3]
        products[position] = SplitHeads(products[position], bias, target, source, dims=dims, axes=axes)
    if gated:
        gate, up = gated
        return (*(p for i, p in enumerate(products) if i not in gated), SiluMul(products[gate], products[up]))
    return tuple(products)


@register("ProjectedAppend", since=1, domain=DOMAIN, inplace=(1, 2), shape_only=(8, 11), overlaps_jobs=True,
          reads_data=(7, 10))
def ProjectedAppend(x, past_key, past_value, query_weight, key_weight, value_weight, key_bias, key_target, key_source,
                    value_bias, value_target, value_source, *, key_dims: tuple[int, ...] = (),
                    key_axes: tuple[int, ...] = (), value_dims: tuple[int, ...] = (),
                    value_axes: tuple[int, ...] = (), key_axis: int, value_axis: int, overwrite=(), ctx=None):
    """(x @ query_weight, Concat(past_key, SplitHeads(x @ key_weight, key_bias, ...)),
    Concat(past_value, SplitHeads(x @ value_weight, value_bias, ...))): a decoder layer's projections
    and its KV cache growth (a self-attention's; `runnx/interp/fusion/products.py`). A decode
    step's float32 row with both caches granted and room in their buffers is one native call
    (`appended_products`) writing the new rows in place, deferred given leave (`runtime.defer`);
    anything else the nodes' kernels. The split targets are read here (`reads_data`)."""
    leave = take_leave()
    if not x.flags.c_contiguous:  # (a copy of x reads it)
        decode_pool.settle()
    if 1 in overwrite and 2 in overwrite:
        appended = append_arguments(x, past_key, past_value, query_weight, key_weight, value_weight, key_bias,
                                    key_target, key_source, value_bias, value_target, value_source, key_dims, key_axes,
                                    value_dims, value_axes, key_axis, value_axis)
        if appended is not None:
            row = np.ascontiguousarray(x.reshape(-1))
            if leave:
                query = np.empty(query_weight.shape[1], np.float32)
                defer(appended_products_into, (row, *appended, query), job=True)
            else:
                query = decode_pool.shared_call(appended_products, row, *appended)
            return appended_outputs(query, x.shape, appended, ctx)
    decode_pool.settle()  # (what follows reads the inputs' data)
    query, key, value = SharedInputMatMul(x, query_weight, key_weight, value_weight, key_bias, key_target, key_source,
                                          value_bias, value_target, value_source,
                                          splits=((1, key_dims, key_axes), (2, value_dims, value_axes)))
    return (query, Concat(past_key, key, axis=key_axis, overwrite=(0,) if 1 in overwrite else (), ctx=ctx),
            Concat(past_value, value, axis=value_axis, overwrite=(0,) if 2 in overwrite else (), ctx=ctx))


def append_arguments(x, past_key, past_value, query_weight, key_weight, value_weight, key_bias, key_target,
                     key_source, value_bias, value_target, value_source, key_dims, key_axes, value_dims, value_axes,
                     key_axis, value_axis) -> tuple | None:
    """`appended_products`' arguments after the mailbox, workers and row in ProjectedAppend's decode
    case: one float32 row of batch 1 (x, read for its shape and dtype only), C-contiguous float32
    matrices, caches of 4 float32 dimensions growing along axis 2, prefix views of buffers with room
    for the row, whose heads split as the caches hold them. None when any of that does not hold."""
    if (not _native.enabled or key_axis not in (2, -2) or value_axis not in (2, -2)
            or past_key.base is past_value.base):
        return None
    shapes = _split_shapes(x, (key_weight, value_weight), ((key_target, key_source, key_dims, key_axes),
                                                           (value_target, value_source, value_dims, value_axes)))
    if shapes is None or not _query_and_biases_fit((x.size, *shapes), query_weight, key_bias, value_bias):
        return None
    position = append_position(past_key, past_value, shapes)
    if position < 0:
        return None
    return ((query_weight, key_weight, value_weight), _NO_BIAS if key_bias is None else key_bias,
            _NO_BIAS if value_bias is None else value_bias, past_key.base, past_value.base, position)


def append_position(past_key, past_value, shapes: tuple) -> int:
    """Where `appended_products` writes a step's key and value rows: the caches' length, when both
    are float32 prefix views of 4 dimensions of float32 buffers with room for a row, their heads
    split as `shapes` (the key's and the value's products, (1, heads, 1, depth)); else -1."""
    position = past_key.shape[2] if past_key.ndim == 4 else -1
    for past, shape in zip((past_key, past_value), shapes):
        buffer = past.base
        if (past.dtype != _FLOAT32 or past.ndim != 4 or type(buffer) is not np.ndarray or buffer.dtype != _FLOAT32
                or buffer.ndim != 4 or past.shape[2] != position or prefix_room(past, buffer, 2) < 1
                or shape != (1, past.shape[1], 1, past.shape[3])):
            return -1
    return position


def appended_outputs(query, shape: tuple, arguments: tuple, ctx) -> tuple:
    """ProjectedAppend's outputs after `appended_products` with `arguments` gave the query row: the
    query shaped as an x of `shape`, the caches grown by a row (views of their buffers), the new
    rows counted in a profile."""
    key_buffer, value_buffer, position = arguments[3:]
    key, value = key_buffer[:, :, :position + 1], value_buffer[:, :, :position + 1]
    if ctx is not None and ctx.profile is not None:  # the new rows' views only for the counters
        count_appends(ctx, key[:, :, -1:], value[:, :, -1:])
    return query.reshape(shape[:-1] + query.shape), key, value


@Remembered
def _query_and_biases_fit(shapes: tuple, query_weight, key_bias, value_bias) -> bool:
    """Whether ProjectedAppend's query matrix (a row's depth, then the key's and the value's split
    shapes) is C-contiguous float32 and its biases absent or float32 vectors of the splits' widths."""
    depth, key_shape, value_shape = shapes
    return (_matrix(query_weight, depth, query_weight.shape[-1])
            and all(bias is None or _vector(bias, shape[1] * shape[3])
                    for bias, shape in ((key_bias, key_shape), (value_bias, value_shape))))


def _split_shapes(x, weights, splits) -> tuple | None:
    """The (1, heads, 1, depth) shapes of x @ weight split into heads, for each weight and (target,
    source, dims, axes) of its split, when x is one float32 row of batch 1 and the matrices
    C-contiguous float32; else None."""
    if x.dtype != _FLOAT32 or x.ndim != 3 or x.size != x.shape[-1]:
        return None
    return _heads_shapes((x.size, tuple([split[2:] for split in splits])), *weights,
                         *[array for split in splits for array in split[:2]])


@Remembered
def _heads_shapes(values: tuple, *arrays) -> tuple | None:
    """`_split_shapes` for a row of this depth: values (depth, (dims, axes) of each split), arrays
    the weights, then each split's target and source."""
    depth, attributes = values
    count = len(attributes)
    shapes = []
    for n, weight in enumerate(arrays[:count]):
        if not _matrix(weight, depth, weight.shape[-1]):
            return None
        target, source = arrays[count + 2 * n:count + 2 * n + 2]
        shape = split_shape(np.empty((1, 1, weight.shape[1]), np.float32), target, source, *attributes[n])
        if len(shape) != 4 or shape[0] != 1 or shape[2] != 1:
            return None
        shapes.append(shape)
    return tuple(shapes)


@register("BiasedMatMul", since=1, domain=DOMAIN)
def BiasedMatMul(x, weight, bias):
    """Add(MatMul(x, weight), bias) for a constant 1-D bias (`runnx/interp/fusion/products.py`): the
    sum written into the fresh product (the same additions as the Add node's)."""
    product = MatMul(x, weight)
    if bias.dtype == product.dtype and product.ndim and bias.shape[0] in (1, product.shape[-1]):
        return np.add(product, bias, out=product)
    return np.add(product, bias)


def _matrix(w, depth: int, width: int) -> bool:
    return w.dtype == _FLOAT32 and w.shape == (depth, width) and w.flags.c_contiguous


def _vector(v, width: int) -> bool:
    return v is not None and v.dtype == _FLOAT32 and v.shape == (width,) and v.flags.c_contiguous


def _product(x, weight, bias):
    return MatMul(x, weight) if bias is None else BiasedMatMul(x, weight, bias)
