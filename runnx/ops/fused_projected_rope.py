"""ProjectedRopeAppend: a layer's query, key and value projections, each split into heads, their
rotary embedding and the keys' and values' growth of the caches
(`runnx/interp/fusion/products.py`'s `_rope_projected`: SharedInputMatMul feeding RopeAppend). A
decode step's row is one native call (`_decode_blocks.projected_rope_append`), and a short prompt's
one too (`_rope_rows`); anything else (a long prefill, caches not granted, biases of other shapes)
runs the kernels of the two nodes it replaced.
"""
from __future__ import annotations

import numpy as np

from runnx.ops import _native
from runnx.ops._decode_blocks import (open_projected_rope, projected_rope_append, projected_rope_append_rows,
                                     projected_rope_tail)
from runnx.ops._kernels_linalg import chunk_count
from runnx.ops._fused_common import stand_in
from runnx.ops._matmul import pooled_prompt
from runnx.ops.cache import count_appends
from runnx.ops.fused import DOMAIN
from runnx.ops.fused_layer_norm_blocks import split_shape
from runnx.ops.fused_products import _NO_BIAS, SharedInputMatMul, _split_shapes, _vector
from runnx.ops.fused_rotary import RopeAppend, appended_caches, rope_append_arguments
from runnx.ops.registry import register
from runnx.runtime import pool as decode_pool, take_leave
from runnx.runtime.rows import SHARED_FROM


@register("ProjectedRopeAppend", since=1, domain=DOMAIN, inplace=(13, 14), shape_only=(6, 9, 12), overlaps_jobs=True)
def ProjectedRopeAppend(x, query_weight, key_weight, value_weight, query_bias, query_target, query_source, key_bias,
                        key_target, key_source, value_bias, value_target, value_source, past_key, past_value,
                        query_cos, query_sin, query_start, query_end, key_cos, key_sin, key_start, key_end, *,
                        query_dims: tuple[int, ...] = (), query_axes: tuple[int, ...] = (),
                        key_dims: tuple[int, ...] = (), key_axes: tuple[int, ...] = (),
                        value_dims: tuple[int, ...] = (), value_axes: tuple[int, ...] = (), query_axis: int = -1,
                        key_axis: int = -1, key_cache_axis: int, value_cache_axis: int, overwrite=(), ctx=None):
    """RopeAppend(*SharedInputMatMul(x, query_weight, key_weight, value_weight, ...; each split into
    heads), past_key, past_value, ...): an RMSNorm layer's projections, rotary embedding and KV
    cache growth. A decode step's float32 row with both caches granted is one native call
    (`projected_rope_append`, the projections' biases added in it) writing the new rows in place.
    x may be the output of a job the previous node left open (`runtime/open_jobs.py`: a
    ResidualGatedMLP's): only the native calls read it (their post finishes that job first), other
    paths settle first."""
    leave = take_leave()  # (for its last job only: its nodes' kernels finish theirs)
    rope = (query_weight, key_weight, value_weight, query_bias, query_target, query_source, key_bias, key_target,
            key_source, value_bias, value_target, value_source, past_key, past_value, query_cos, query_sin,
            query_start, query_end, key_cos, key_sin, key_start, key_end)
    attributes = (query_dims, query_axes, key_dims, key_axes, value_dims, value_axes, query_axis, key_axis,
                  key_cache_axis, value_cache_axis)
    planned = _rope_row(x, rope, attributes, overwrite)
    if planned is None or not x.flags.c_contiguous:  # (a copy of x reads it)
        decode_pool.settle()
    if planned is None:
        prompt = _rope_rows(x, rope, attributes, overwrite)
        if prompt is None:
            return _rope_appended(False, None, None, x, rope, attributes, overwrite, ctx)
        heads, biases, unit, arguments = prompt
        done, rotated = decode_pool.shared_call(projected_rope_append_rows, x.reshape(-1, x.shape[-1]), rope[:3],
                                                biases, heads, unit, arguments)
        return _rope_appended(done, rotated, heads, x, rope, attributes, overwrite, ctx)
    heads, biases, arguments = planned
    row, rows = np.ascontiguousarray(x.reshape(-1)), tuple([h.reshape(-1) for h in heads])
    if leave:  # the products job left open, the rotation and growth after it (the next node's checks meanwhile)
        rotated = np.empty(heads[0].shape, np.float32)
        if decode_pool.open_shared_call(open_projected_rope, (row, rope[:3], rows, arguments), (row, *rope[:3], *heads),
                                        projected_rope_tail, (biases, rows, arguments, rotated),
                                        chunk_count(row.size) * sum([h.size for h in heads])):
            return _rope_appended(True, rotated, heads, x, rope, attributes, overwrite, ctx)
    done, rotated = decode_pool.shared_call(projected_rope_append, row, rope[:3], biases, rows, arguments)
    return _rope_appended(done, rotated, heads, x, rope, attributes, overwrite, ctx)


def _rope_row(x, rope: tuple, attributes: tuple, overwrite) -> tuple | None:
    """(the split heads, allocated, the projections' biases (`_NO_BIAS`: none) and
    `rope_append_into`'s arguments) when ProjectedRopeAppend(x, *rope) is a decode step's float32
    row, its biases absent or float32 vectors of their products' widths, both caches granted, prefix
    views with room (x, the row, is read for its shape and dtype only: the call reads it); else None."""
    if not (13 in overwrite and 14 in overwrite):
        return None
    query_dims, query_axes, key_dims, key_axes, value_dims, value_axes = attributes[:6]
    shapes = _split_shapes(x, rope[:3], ((rope[4], rope[5], query_dims, query_axes),
                                         (rope[7], rope[8], key_dims, key_axes),
                                         (rope[10], rope[11], value_dims, value_axes)))
    if not shapes:
        return None
    biases = tuple([_NO_BIAS if bias is None else bias for bias in rope[3:12:3]])
    if not all(bias is _NO_BIAS or _vector(bias, shape[1] * shape[3]) for bias, shape in zip(biases, shapes)):
        return None
    heads = tuple([np.empty(shape, np.float32) for shape in shapes])
    past_key, past_value, query_cos, query_sin = rope[12:16]
    arguments = rope_append_arguments(*heads, past_key, past_value, query_cos, query_sin, rope[18], rope[19],
                                      rope[16:18] + rope[20:22], *attributes[6:])
    return (heads, biases, arguments) if arguments else None


def _rope_rows(x, rope: tuple, attributes: tuple, overwrite) -> tuple | None:
    """(the split heads, allocated, the projections' biases, the products job's unit and
    `rope_append_into`'s arguments) when ProjectedRopeAppend(x, *rope) is a short prompt's: float32
    rows (batch, length, hidden) of more than one position, C-contiguous, through C-contiguous float32
    matrices whose products the own kernels share with the decode pool (`pooled_prompt`), each split
    into (batch, heads, length, depth), biases absent or vectors, both caches granted, and few enough
    positions for one thread's rotation (`rope_append_into`; more are shared among threads:
    `fused_rotary.py`); else None."""
    if not (13 in overwrite and 14 in overwrite and _native.enabled and x.dtype == np.float32 and x.ndim == 3
            and x.shape[1] > 1 and x.flags.c_contiguous):
        return None
    batch, length, depth = x.shape
    weights = rope[:3]
    if not all(w.dtype == np.float32 and w.ndim == 2 and w.shape[0] == depth and w.flags.c_contiguous
               for w in weights) or not pooled_prompt(batch * length, depth, tuple([w.shape[1] for w in weights])):
        return None
    shapes = []
    for weight, (target, source), dims, axes in zip(weights, (rope[4:6], rope[7:9], rope[10:12]), attributes[0:6:2],
                                                    attributes[1:6:2]):
        shape = split_shape(stand_in(x.dtype, (batch, length, weight.shape[1])), target, source, dims, axes)
        if len(shape) != 4 or (shape[0], shape[2], shape[1] * shape[3]) != (batch, length, weight.shape[1]):
            return None
        shapes.append(shape)
    biases = tuple([_NO_BIAS if bias is None else bias for bias in rope[3:12:3]])
    if (not all(bias is _NO_BIAS or _vector(bias, shape[1] * shape[3]) for bias, shape in zip(biases, shapes))
            or length * shapes[0][1] * shapes[0][3] >= SHARED_FROM):
        return None
    heads = tuple([np.empty(shape, np.float32) for shape in shapes])
    arguments = rope_append_arguments(*heads, *rope[12:16], rope[18], rope[19], rope[16:18] + rope[20:22],
                                      *attributes[6:])
    unit = decode_pool.gemm_unit(sum(w.shape[1] for w in weights))
    return (heads, biases, unit, arguments) if arguments else None


def _rope_appended(done: bool, rotated, heads, x, rope: tuple, attributes: tuple, overwrite, ctx) -> tuple:
    """ProjectedRopeAppend's outputs: the caches grown in place by `projected_rope_append` (done),
    or RopeAppend's kernel on the heads it computed, or (heads None) on SharedInputMatMul's of x."""
    past_key, past_value = rope[12:14]
    if done:
        count_appends(ctx, heads[1], heads[2])
        return appended_caches(rotated, past_key, past_value, heads[1], heads[2])
    query_dims, query_axes, key_dims, key_axes, value_dims, value_axes, query_axis, key_axis, key_cache_axis, \
        value_cache_axis = attributes
    if heads is None:
        heads = SharedInputMatMul(x, *rope[:12], splits=((0, query_dims, query_axes), (1, key_dims, key_axes),
                                                         (2, value_dims, value_axes)))
    return RopeAppend(*heads, *rope[12:], query_axis=query_axis, key_axis=key_axis, key_cache_axis=key_cache_axis,
                      value_cache_axis=value_cache_axis, overwrite=tuple([p - 10 for p in overwrite]),
                      ctx=ctx)  # RopeAppend's own cache positions
