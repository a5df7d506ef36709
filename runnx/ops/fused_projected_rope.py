"""ProjectedRopeAppend: a layer's query, key and value projections, each split into heads, their
rotary embedding and the keys' and values' growth of the caches
(`runnx/interp/fusion/products.py`'s `_rope_projected`: SharedInputMatMul feeding RopeAppend, their
split targets and rotation bounds proven constant from the graph's dims, so they are attributes). A
decode step's row is one native call (`_decode_blocks.projected_rope_append`), and a short prompt's
one too (`_rope_rows`); anything else (a long prefill, caches not granted, biases of other shapes)
runs the kernels of the two nodes it replaced.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from runnx.ops import _native
from runnx.ops._decode_blocks import (open_projected_rows, projected_rope_append, projected_rope_append_rows,
                                     projected_rope_into, projected_rows_tail)
from runnx.ops._kernels_fused import rope_append_fits
from runnx.ops._fused_common import stand_in
from runnx.ops._matmul import pooled_prompt
from runnx.ops.cache import count_appends
from runnx.ops.fused import DOMAIN
from runnx.ops.fused_layer_norm_blocks import split_shape
from runnx.ops.fused_products import _NO_BIAS, SharedInputMatMul, _split_shapes, _vector
from runnx.ops.fused_rotary import RopeAppend, appended_caches, rope_append_arguments
from runnx.ops.registry import register
from runnx.runtime import defer, pool as decode_pool, prompt_jobs, take_leave
from runnx.runtime.rows import SHARED_FROM


@register("ProjectedRopeAppend", since=1, domain=DOMAIN, inplace=(7, 8), overlaps_jobs=True)
def ProjectedRopeAppend(x, query_weight, key_weight, value_weight, query_bias, key_bias, value_bias, past_key,
                        past_value, cos, sin, *, query_dims: tuple[int, ...], key_dims: tuple[int, ...],
                        value_dims: tuple[int, ...], query_bounds: tuple[int, ...], key_bounds: tuple[int, ...],
                        query_axis: int = -1, key_axis: int = -1, key_cache_axis: int, value_cache_axis: int,
                        overwrite=(), ctx=None):
    """RopeAppend(*SharedInputMatMul(x, query_weight, key_weight, value_weight; each plus its bias
    when given, then split into heads by Reshape to its *_dims (a 0 copies x's dim) and Transpose
    (0, 2, 1, 3)), past_key, past_value, cos, sin): an RMSNorm layer's projections, rotary embedding
    and KV cache growth. The query and the key rotate by halves with the same tables, cut at
    *_bounds (the two Slices' start and end: `fused_rotary.RotateHalf`). A decode step's float32 row
    with both caches granted is one native call (`projected_rope_append`, the biases added in it)
    writing the new rows in place. x may be the output of a job the previous node left open
    (`runtime/open_jobs.py`: a ResidualGatedMLP's): only the native calls read it (their post
    finishes that job first), other paths settle first."""
    leave = take_leave()  # (for its last job only: its nodes' kernels finish theirs)
    weights, biases = (query_weight, key_weight, value_weight), (query_bias, key_bias, value_bias)
    layer = _Layer(weights, biases, (query_dims, key_dims, value_dims), past_key, past_value, cos, sin,
                   (*_bound(*query_bounds), *_bound(*key_bounds)), (query_axis, key_axis, key_cache_axis,
                                                                    value_cache_axis))
    granted = 7 in overwrite and 8 in overwrite
    planned = _rope_row(x, layer) if granted else None
    if planned is None:
        prompt = _rope_rows(x, layer) if granted else None  # (x C-contiguous: its rows a view)
        if prompt is not None and leave and decode_pool.pool() is not None and rope_append_fits(*prompt[3][:11]):
            rotated = _open_rows(x.reshape(-1, x.shape[-1]), weights, prompt)
            if rotated is not None:
                return _rope_appended(True, rotated, prompt[0], x, layer, overwrite, ctx)
        decode_pool.settle()  # (the paths below read x)
        if prompt is None:
            return _rope_appended(False, None, None, x, layer, overwrite, ctx)
        heads, bias_rows, unit, arguments = prompt
        done, rotated = decode_pool.shared_call(projected_rope_append_rows, x.reshape(-1, x.shape[-1]), weights,
                                                bias_rows, heads, unit, arguments)
        return _rope_appended(done, rotated, heads, x, layer, overwrite, ctx)
    if not x.flags.c_contiguous:  # (a copy of x reads it)
        decode_pool.settle()
    heads, bias_rows, arguments = planned
    row, rows = np.ascontiguousarray(x.reshape(-1)), tuple([h.reshape(-1) for h in heads])
    if leave and rope_append_fits(*arguments[:11]):  # the call deferred, the next nodes' checks first
        rotated = np.empty(heads[0].shape, np.float32)
        defer(projected_rope_into, (row, weights, bias_rows, rows, arguments, rotated), job=True)
        return _rope_appended(True, rotated, heads, x, layer, overwrite, ctx)
    done, rotated = decode_pool.shared_call(projected_rope_append, row, weights, bias_rows, rows, arguments)
    return _rope_appended(done, rotated, heads, x, layer, overwrite, ctx)


def _open_rows(rows, weights: tuple, prompt: tuple):
    """A short prompt's rotated query, its products job left open to the pool's workers
    (`open_projected_rows`: the next node's Python runs while they compute it), the heads' split,
    biases, rotation and cache growth its tail; None when the pool is busy or absent (nothing
    done)."""
    heads, biases, unit, arguments = prompt
    products = tuple([np.empty((rows.shape[0], weight.shape[1]), np.float32) for weight in weights])
    rotated = np.empty(heads[0].shape, np.float32)
    if decode_pool.open_shared_call(open_projected_rows, (rows, weights, products, unit), (rows, weights, products),
                                    projected_rows_tail, (products, biases, heads, arguments, rotated)):
        return rotated
    return None


class _Layer(NamedTuple):
    """ProjectedRopeAppend's inputs and attributes past x, as its paths read them."""
    weights: tuple
    biases: tuple  # None where absent
    dims: tuple  # each product's split: Reshape target (0 copies x's dim)
    past_key: np.ndarray
    past_value: np.ndarray
    cos: np.ndarray
    sin: np.ndarray
    halves: tuple  # RotateHalf's slice bounds as 1-element arrays: query start, end, key start, end
    axes: tuple  # query_axis, key_axis, key_cache_axis, value_cache_axis


@functools.lru_cache(maxsize=64)
def _bound(start: int, end: int) -> tuple:
    """A rotation's slice bounds as read-only 1-element arrays, the same objects for the same numbers
    (what `fused_rotary` remembers its checks by)."""
    arrays = np.array([start], np.int64), np.array([end], np.int64)
    for array in arrays:
        array.flags.writeable = False
    return arrays


@functools.lru_cache(maxsize=64)
def _splits(dims: tuple) -> tuple:
    """(target, source, dims, axes) of each product's split, as `fused_products` takes them: made
    once for a model's dims (this runs a layer a step)."""
    return tuple([(None, None, split, (-1,) * len(split)) for split in dims])


def _rope_arguments(heads: tuple, layer: _Layer):
    return rope_append_arguments(*heads, layer.past_key, layer.past_value, layer.cos, layer.sin, layer.cos, layer.sin,
                                 layer.halves, *layer.axes)


def _bias_rows(layer: _Layer, shapes) -> tuple | None:
    """The projections' biases for the native calls (`_NO_BIAS`: none), or None when one is not a
    float32 vector of its product's width."""
    biases = tuple([_NO_BIAS if bias is None else bias for bias in layer.biases])
    if not all(bias is _NO_BIAS or _vector(bias, shape[1] * shape[3]) for bias, shape in zip(biases, shapes)):
        return None
    return biases


def _rope_row(x, layer: _Layer) -> tuple | None:
    """(the split heads, allocated, the projections' biases and `rope_append_into`'s arguments) when
    x is a decode step's float32 row, the biases absent or float32 vectors of their products'
    widths, the caches prefix views with room (both granted: the caller checked; x, the row, is read
    for its shape and dtype only: the call reads it); else None."""
    shapes = _split_shapes(x, layer.weights, _splits(layer.dims))
    biases = _bias_rows(layer, shapes) if shapes else None
    if biases is None:
        return None
    heads = tuple([np.empty(shape, np.float32) for shape in shapes])
    arguments = _rope_arguments(heads, layer)
    return (heads, biases, arguments) if arguments else None


def _rope_rows(x, layer: _Layer) -> tuple | None:
    """(the split heads, allocated, the projections' biases, the products job's unit and
    `rope_append_into`'s arguments) when x is a short prompt's: float32 rows (batch, length, hidden)
    of more than one position, C-contiguous, through C-contiguous float32 matrices whose products the
    own kernels share with the decode pool (`pooled_prompt`), each split into (batch, heads, length,
    depth), biases absent or vectors, and few enough positions for one thread's rotation
    (`rope_append_into`; more are shared among threads: `fused_rotary.py`); else None."""
    if not (_native.enabled and x.dtype == np.float32 and x.ndim == 3 and x.shape[1] > 1 and x.flags.c_contiguous):
        return None
    batch, length, depth = x.shape
    weights = layer.weights
    if not all(w.dtype == np.float32 and w.ndim == 2 and w.shape[0] == depth and w.flags.c_contiguous
               for w in weights) or not pooled_prompt(batch * length, depth, tuple([w.shape[1] for w in weights])):
        return None
    shapes = []
    for weight, (target, source, dims, axes) in zip(weights, _splits(layer.dims)):
        shape = split_shape(stand_in(x.dtype, (batch, length, weight.shape[1])), target, source, dims, axes)
        if len(shape) != 4 or (shape[0], shape[2], shape[1] * shape[3]) != (batch, length, weight.shape[1]):
            return None
        shapes.append(shape)
    biases = _bias_rows(layer, shapes)
    if biases is None or length * shapes[0][1] * shapes[0][3] >= SHARED_FROM:
        return None
    heads = tuple([np.empty(shape, np.float32) for shape in shapes])
    arguments = _rope_arguments(heads, layer)
    widths = tuple([w.shape[1] for w in weights])
    unit = prompt_jobs.gemm_unit(sum(widths), widths)
    return (heads, biases, unit, arguments) if arguments else None


def _rope_appended(done: bool, rotated, heads, x, layer: _Layer, overwrite, ctx) -> tuple:
    """ProjectedRopeAppend's outputs: the caches grown in place by `projected_rope_append` (done),
    or RopeAppend's kernel on the heads it computed, or (heads None) on SharedInputMatMul's of x."""
    if done:
        count_appends(ctx, heads[1], heads[2])
        return appended_caches(rotated, layer.past_key, layer.past_value, heads[1], heads[2])
    if heads is None:
        splits = tuple([(n, dims, axes) for n, (_, _, dims, axes) in enumerate(_splits(layer.dims))])
        split_inputs = [v for bias in layer.biases for v in (bias, None, None)]
        heads = SharedInputMatMul(x, *layer.weights, *split_inputs, splits=splits)
    query_axis, key_axis, key_cache_axis, value_cache_axis = layer.axes
    return RopeAppend(*heads, layer.past_key, layer.past_value, layer.cos, layer.sin, *layer.halves[:2], layer.cos,
                      layer.sin, *layer.halves[2:], query_axis=query_axis, key_axis=key_axis,
                      key_cache_axis=key_cache_axis, value_cache_axis=value_cache_axis,
                      overwrite=tuple([p - 4 for p in overwrite]), ctx=ctx)  # RopeAppend's own cache positions
