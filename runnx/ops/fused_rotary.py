"""Rotary embedding of decoders' fused patterns (`interp/fusion/rms_norm_blocks.py`): RotateHalf
(x * cos + rotate_half(x) * sin by halves) and RopeAppend (a layer's rotary embedding and KV cache
growth as one node, written into the caches' spare capacity when they are granted).

Both do the unfused arithmetic (bitwise the graph's Mul, Neg, Concat and Add). Each position is
computed alone, so a prompt's positions are shared among runnx's threads (`runtime/rows.py`) with
the same bits; a decode step's row is one numba call.
"""
from __future__ import annotations

import functools

import numpy as np

from runnx.errors import RunnxError
from runnx.ops import _native
from runnx.ops._fused_common import DOMAIN, KERNEL_DTYPES
from runnx.ops._kernels_fused import rope_append_fits, rope_append_into, rope_append_rows, rotate_half
from runnx.ops._remembered import Remembered
from runnx.ops.cache import Concat, count_appends
from runnx.ops.registry import register
from runnx.runtime.rows import SHARED_FROM, share_rows


@register("RotateHalf", since=1, domain=DOMAIN)
def RotateHalf(x, cos, sin, negated_start, kept_end, *, axis: int = -1):
    """x * cos + Concat(-x[h:], x[:h']) * sin along `axis`, for h = negated_start and h' = kept_end
    (1-element Slice starts and ends): rotary embedding by halves (the fusion checked the rest of
    the two Slices: the first to the end, the second from 0, one axis, step 1)."""
    if (_native.enabled and x.ndim == 4 and cos.ndim == 4 and sin.ndim == 4 and x.dtype in KERNEL_DTYPES
            and cos.dtype == x.dtype and sin.dtype == x.dtype and axis in (-1, 3)):
        half = _half_split(x.shape[3], negated_start, kept_end)
        if half is not None:
            try:
                return rotate_half(x, cos, sin, half)
            except ValueError:  # cos or sin broadcast beyond x: numpy's broadcasting below
                pass
    rotated = np.concatenate([np.negative(_cut(x, negated_start, None, axis)), _cut(x, None, kept_end, axis)],
                             axis=axis)
    return np.add(np.multiply(x, cos), np.multiply(rotated, sin))


def _cut(x, start, end, axis: int):
    """x[start:end] along `axis` (start and end 1-element arrays, or None), as Slice cuts it with step 1."""
    if not -x.ndim <= axis < x.ndim:
        raise RunnxError(f"RotateHalf's axis {axis} is out of range for shape {list(x.shape)}")
    for bound in (start, end):
        if bound is not None and bound.size != 1:
            raise RunnxError(f"RotateHalf's slice bounds must have one element, got shape {list(bound.shape)}")
    index = [slice(None)] * x.ndim
    index[axis] = slice(None if start is None else int(start.reshape(-1)[0]),
                        None if end is None else int(end.reshape(-1)[0]))
    return x[tuple(index)]


@register("RopeAppend", since=1, domain=DOMAIN, inplace=(3, 4))
def RopeAppend(query, key, value, past_key, past_value, query_cos, query_sin, query_start, query_end, key_cos,
               key_sin, key_start, key_end, *, query_axis: int = -1, key_axis: int = -1, key_cache_axis: int,
               value_cache_axis: int, overwrite=(), ctx=None):
    """(RotateHalf(query), Concat(past_key, RotateHalf(key)), Concat(past_value, value)): a decoder
    layer's rotary embedding and KV cache growth as one node; the cache grows as Concat grows it
    (in place into spare capacity when granted, counted under Concat's names)."""
    halves = (query_start, query_end, key_start, key_end)
    if 3 in overwrite and 4 in overwrite:
        appended = _rope_append_in_place(query, key, value, past_key, past_value, query_cos, query_sin, key_cos,
                                         key_sin, halves, query_axis, key_axis, key_cache_axis, value_cache_axis)
        if appended is not None:
            count_appends(ctx, key, value)
            return appended
    rotated_query = RotateHalf(query, query_cos, query_sin, query_start, query_end, axis=query_axis)
    rotated_key = RotateHalf(key, key_cos, key_sin, key_start, key_end, axis=key_axis)
    present_key = Concat(past_key, rotated_key, axis=key_cache_axis, overwrite=(0,) if 3 in overwrite else (), ctx=ctx)
    present_value = Concat(past_value, value, axis=value_cache_axis, overwrite=(0,) if 4 in overwrite else (),
                           ctx=ctx)
    return rotated_query, present_key, present_value


def _rope_append_in_place(query, key, value, past_key, past_value, query_cos, query_sin, key_cos, key_sin, halves,
                          query_axis, key_axis, key_cache_axis, value_cache_axis):
    """RopeAppend's decode case as one numba call (`rope_append_into`): both caches granted, prefix
    views of their buffers with room, every array 4-D of one float dtype, rotation over the last
    axis and growth along axis 2. None when any of that does not hold (nothing is written)."""
    arguments = rope_append_arguments(query, key, value, past_key, past_value, query_cos, query_sin, key_cos, key_sin,
                                      halves, query_axis, key_axis, key_cache_axis, value_cache_axis)
    if arguments is None:
        return None
    positions, per_position = query.shape[2], query.shape[1] * query.shape[3]
    if positions * per_position < SHARED_FROM or key.shape[2] != positions or value.shape[2] != positions:
        done, rotated = rope_append_into(*arguments)  # (a decode step's row: one call)
        return appended_caches(rotated, past_key, past_value, key, value) if done else None
    if not rope_append_fits(*arguments[:11]):
        return None
    rotated = np.empty(query.shape, query.dtype)
    share_rows(functools.partial(_rope_append_positions, arguments, rotated), positions, per_position)
    return appended_caches(rotated, past_key, past_value, key, value)


def _rope_append_positions(arguments: tuple, rotated, start: int, stop: int) -> None:
    """`rope_append_rows` of a prompt's positions start .. stop (`rope_append_arguments`' arguments)."""
    query, key, value, past_key, key_buffer, past_value, value_buffer, query_cos, query_sin, key_cos, key_sin, \
        query_half, key_half = arguments
    at = slice(start, stop)
    rope_append_rows(query[:, :, at], key[:, :, at], value[:, :, at], key_buffer, value_buffer,
                     *[table if table.shape[2] == 1 else table[:, :, at]
                       for table in (query_cos, query_sin, key_cos, key_sin)],
                     query_half, key_half, rotated[:, :, at], past_key.shape[2] + start, past_value.shape[2] + start)


def appended_caches(rotated, past_key, past_value, key, value) -> tuple:
    """RopeAppend's outputs once `rope_append_into` has written key and value after the caches."""
    return (rotated, past_key.base[:, :, :past_key.shape[2] + key.shape[2]],
            past_value.base[:, :, :past_value.shape[2] + value.shape[2]])


def rope_append_arguments(query, key, value, past_key, past_value, query_cos, query_sin, key_cos, key_sin, halves,
                          query_axis, key_axis, key_cache_axis, value_cache_axis) -> tuple | None:
    """`rope_append_into`'s arguments for `_rope_append_in_place`'s case (query, key and value only
    read for their shapes and dtypes here), else None."""
    dtype = query.dtype
    key_buffer, value_buffer = past_key.base, past_value.base
    # spelled out: a generator over the arrays costs ~2 us a call, a fifth of the whole fast path
    if not (_native.enabled and dtype in KERNEL_DTYPES and query_axis in (-1, 3) and key_axis in (-1, 3)
            and key_cache_axis in (-2, 2) and value_cache_axis in (-2, 2) and type(key_buffer) is np.ndarray
            and type(value_buffer) is np.ndarray
            and key_buffer is not value_buffer and key.dtype == dtype and value.dtype == dtype
            and key_buffer.dtype == dtype and value_buffer.dtype == dtype and query.ndim == 4 and key.ndim == 4
            and value.ndim == 4 and key_buffer.ndim == 4 and value_buffer.ndim == 4
            and past_key.dtype == dtype and past_value.dtype == dtype and query_cos.dtype == dtype
            and query_sin.dtype == dtype and key_cos.dtype == dtype and key_sin.dtype == dtype and past_key.ndim == 4
            and past_value.ndim == 4 and query_cos.ndim == 4 and query_sin.ndim == 4 and key_cos.ndim == 4
            and key_sin.ndim == 4):
        return None
    split = _remembered_halves((query.shape[3], key.shape[3]), *halves)
    if split is None:
        return None
    return (query, key, value, past_key, key_buffer, past_value, value_buffer, query_cos, query_sin, key_cos, key_sin,
            *split)


@Remembered
def _remembered_halves(widths: tuple, query_start, query_end, key_start, key_end) -> tuple | None:
    """(query half, key half) by `_half_split` for the query's and the key's widths, or None;
    remembered for bounds that cannot change."""
    halves = (_half_split(widths[0], query_start, query_end), _half_split(widths[1], key_start, key_end))
    return None if None in halves else halves


def _half_split(width: int, negated_start, kept_end) -> int | None:
    """h when x[negated_start:] and x[:kept_end] of a last axis of `width` are x[h:] and x[:h],
    else None."""
    if negated_start.size != 1 or kept_end.size != 1:
        return None
    half, _, _ = slice(int(negated_start.reshape(-1)[0]), None).indices(width)
    _, stop, _ = slice(None, int(kept_end.reshape(-1)[0])).indices(width)
    return half if stop == half else None
