"""Fused kernels for patterns that `runnx.interp.fusion` finds in exported decoders (private
domain `runnx.fused`; never in a model file), and `attend`, the attention kernel other fusions
call.

`attend(query, key, value, bias, scale, fill=nan) -> np.ndarray` (stable signature):
softmax((query * scale) @ key^T + bias) @ value for query (batch, heads, q_len, depth) and key,
value (batch, kv_heads, kv_len, depth / width) with heads a multiple of kv_heads (query head h
reads KV head h // (heads // kv_heads); plain multi-head attention when they are equal). key and
value are read in place whatever their strides (a KV cache is a view into its capacity buffer),
each cache row once for all the query heads of its group. bias is additive, broadcastable to
(batch, heads, q_len, kv_len), or None. A row whose softmax is NaN (every key masked) gives
fill * sum(value rows): NaN like the plain Softmax graph, 0 where the exporter replaced NaN by 0.
float32/float64 in one dtype and up to `_KERNEL_ROWS` query rows per KV head, or any number of
them over up to `_KERNEL_KEYS` keys (a short prompt's attention over itself), go to the numba
kernel (`_kernels_fused.py`; float32 shares the KV heads with the decode pool's workers); anything
else (a long prefill: BLAS products win) computes the same with numpy.

RMSNorm, the SiLU gate and rotate-half do the unfused arithmetic in its order (numpy's pairwise
summation order, numpy's exp), so their results are bitwise the unfused graph's. Attention is
within float rounding of it (rtol ~1e-5 in float32; greedy token ids unchanged): it sums in
another order, scales the query once by both factors and uses a 1-ulp float32 exp.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from runnx.errors import RunnxError
from runnx.interp.dtypes import ONNX_TO_NUMPY
from runnx.ops import _native
from runnx.ops._attention_blocks import attend_blocks
from runnx.ops._elementwise_util import binary, sigmoid
from runnx.ops._fused_common import DOMAIN, stand_in
from runnx.ops._kernels_fused import (add_rms_norm_into, attention, rms_norm_into, rope_append_fits, rope_append_into,
                                      rope_append_rows, rotate_half, silu_mul_into)
from runnx.ops._remembered import Remembered
from runnx.ops._shape_util import int_tuple
from runnx.ops.cache import Concat, count_appends
from runnx.ops.elementwise import Where
from runnx.ops.registry import register
from runnx.ops.shape import Reshape, Slice
from runnx.ops._matmul import matmul, rest_workers_before
from runnx.runtime import pool as decode_pool
from runnx.runtime.rows import SHARED_FROM, share_rows

_KERNEL_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))  # the numba kernels' (others: numpy)
_FLOAT32 = np.dtype(np.float32)


def _fits(operand, result) -> bool:
    """Whether `result op= operand` is `result op operand` (same dtype, operand broadcasts into it)."""
    return (operand.dtype == result.dtype and operand.ndim <= result.ndim
            and all(o == 1 or o == r for o, r in zip(operand.shape[::-1], result.shape[::-1])))


def _softmax_in_place(scores, axis: int):
    """Softmax-13 of a fresh array, in it: the same operations as the Softmax kernel (max-shifted
    exp, divided by its sum), without numpy's Python-level reduction wrappers."""
    if scores.size == 0:
        return scores
    np.subtract(scores, np.maximum.reduce(scores, axis=axis, keepdims=True), out=scores)
    np.exp(scores, out=scores)
    scores /= np.add.reduce(scores, axis=axis, keepdims=True)
    return scores


@register("RMSNorm", since=1, domain=DOMAIN)
def RMSNorm(x, epsilon, one, weight, *, axis: int = -1, to: int = 0):
    """weight * Cast(x * (one / sqrt(ReduceMean(x * x, axis) + epsilon)), to) (to=0: no Cast)."""
    if _norm_kernel_applies(x, epsilon, one, weight, axis, to):
        out = np.empty_like(x)
        rows = _rows_of(x)
        share_rows(functools.partial(_rms_norm_rows, x.reshape(rows), epsilon.item(), one.item(), weight,
                                     out.reshape(rows)), *rows)
        return out
    squares = np.square(x)
    mean = np.add.reduce(squares, axis=axis, keepdims=True, dtype=squares.dtype)  # np.sum without its wrapper
    mean = np.true_divide(mean, x.shape[axis], out=mean, casting="unsafe")
    np.add(mean, epsilon, out=mean, casting="unsafe")
    np.sqrt(mean, out=mean)
    normed = np.multiply(x, np.divide(one, mean))
    if to:
        normed = normed.astype(ONNX_TO_NUMPY[to], copy=False)
    return np.multiply(weight, normed)


def _norm_kernel_applies(x, epsilon, one, weight, axis: int, to: int) -> bool:
    """Whether RMSNorm of x is the numba kernel's: a C-contiguous float32/64 x normed over its last
    axis by scalars and a vector weight of its dtype (and no Cast to another)."""
    return (_native.enabled and x.flags.c_contiguous
            and norm_fits(x.dtype, x.ndim, x.shape[-1:], epsilon, one, weight, axis, to, 0))


def rms_norm_applies(x, epsilon, one, weight, axis: int, to: int, cast: int) -> bool:
    """Whether AddRMSNorm's sum x (Cast to `cast`, 0: none) is normed by the numba kernel."""
    return (_native.enabled and x.flags.c_contiguous
            and norm_fits(x.dtype, x.ndim, x.shape[-1:], epsilon, one, weight, axis, to, cast))


def norm_fits(dtype, ndim: int, width: tuple, epsilon, one, weight, axis: int, to: int, cast: int) -> bool:
    """`rms_norm_applies` for a C-contiguous x of this dtype, rank and last dimension (a tuple: () at rank 0)."""
    return bool(dtype in _KERNEL_DTYPES and ndim and axis in (-1, ndim - 1) and epsilon.dtype == dtype
                and one.dtype == dtype and weight.dtype == dtype and weight.shape == width and epsilon.size == 1
                and one.size == 1 and epsilon.ndim <= ndim and one.ndim <= ndim and _casts_to_itself(to, dtype)
                and _casts_to_itself(cast, dtype))


def _casts_to_itself(to: int, dtype) -> bool:
    """Whether Cast(to) (0: no Cast) leaves a `dtype` value as it is (float32 exports may cast
    float32 to float32)."""
    return to == 0 or ONNX_TO_NUMPY.get(to) == dtype


@register("AddRMSNorm", since=1, domain=DOMAIN, inplace=(0, 1))
def AddRMSNorm(a, b, epsilon, one, weight, *, axis: int = -1, to: int = 0, cast: int = 0, overwrite=()):
    """(s, RMSNorm(s)) with s = Cast(a + b, cast) (cast=0: no Cast): a residual add, kept for the
    next one, and the norm reading it (onnxruntime's SkipSimplifiedLayerNormalization). Equal
    shapes and dtypes, both C-contiguous, no Cast to another dtype: one numba call (the sum into a
    or b when granted)."""
    if (a.shape == b.shape and a.dtype == b.dtype and b.flags.c_contiguous
            and rms_norm_applies(a, epsilon, one, weight, axis, to, cast)):
        residual = a if 0 in overwrite else b if 1 in overwrite else np.empty_like(a)
        out = np.empty_like(a)
        rows = _rows_of(a)
        share_rows(functools.partial(_add_rms_norm_rows, a.reshape(rows), b.reshape(rows), residual.reshape(rows),
                                     epsilon.item(), one.item(), weight, out.reshape(rows)), *rows)
        return residual, out
    residual = binary(np.add, a, b, overwrite)
    if cast:
        residual = residual.astype(ONNX_TO_NUMPY[cast], copy=False)
    return residual, RMSNorm(residual, epsilon, one, weight, axis=axis, to=to)


@register("SiluMul", since=1, domain=DOMAIN)
def SiluMul(gate, up):
    """gate * Sigmoid(gate) * up: the SiLU-gated MLP's activation."""
    if (_native.enabled and gate.ndim and gate.dtype in _KERNEL_DTYPES and up.dtype == gate.dtype
            and up.shape == gate.shape and gate.flags.c_contiguous and up.flags.c_contiguous):
        decay = np.empty_like(gate)
        rows = _rows_of(gate)
        share_rows(functools.partial(_silu_mul_rows, gate.reshape(rows), up.reshape(rows), decay.reshape(rows)), *rows)
        return decay
    activated = sigmoid(gate)
    np.multiply(gate, activated, out=activated)
    if _fits(up, activated):
        return np.multiply(activated, up, out=activated)
    return np.multiply(activated, up)


def _rows_of(x) -> tuple[int, int]:
    """(rows, columns) of a C-contiguous x of rank 1 or more, rows over its last axis."""
    columns = x.shape[-1]
    return (x.size // columns if columns else math.prod(x.shape[:-1])), columns


def _rms_norm_rows(x, epsilon: float, one: float, weight, out, start: int, stop: int) -> None:
    rms_norm_into(x[start:stop], epsilon, one, weight, out[start:stop])


def _add_rms_norm_rows(a, b, residual, epsilon: float, one: float, weight, out, start: int, stop: int) -> None:
    add_rms_norm_into(a[start:stop], b[start:stop], residual[start:stop], epsilon, one, weight, out[start:stop])


def _silu_mul_rows(gate, up, decay, start: int, stop: int) -> None:
    """decay[start:stop] = SiLU(gate) * up of those rows: exp(-gate) by numpy (the unfused Sigmoid's
    exp), then `silu_mul_into`, which divides by it."""
    part = np.negative(gate[start:stop], out=decay[start:stop])
    silu_mul_into(gate[start:stop], exp_in_place(part, math.inf), up[start:stop])


_EXP_FINITE = 88.0  # float32 exp overflows from 88.72 on


def exp_in_place(x, largest: float):
    """np.exp(x) into x, whose largest element is `largest` (or more: inf when unknown), with
    numpy's overflow warning silenced (an exp(-gate) of inf is a sigmoid of 0) only when it can
    overflow: numpy's errstate costs a few microseconds."""
    if largest < _EXP_FINITE:
        return np.exp(x, out=x)
    with np.errstate(over="ignore"):
        return np.exp(x, out=x)


@register("LastPosition", since=1, domain=DOMAIN)
def LastPosition(x):
    """x[..., -1:, :], as Slice(x, -1, end, axis -2) would take it: an LM head's input for the next
    token's logits only (`runnx/interp/last_position.py`). A decode step's one position is x itself,
    with none of a Slice's parsing of starts, ends and axes."""
    if x.ndim < 2:
        raise RunnxError(f"LastPosition needs a rank of at least 2 (positions, features), got shape {list(x.shape)}")
    return x if x.shape[-2] == 1 else x[..., -1:, :]


@register("RotateHalf", since=1, domain=DOMAIN)
def RotateHalf(x, cos, sin, negated_start, kept_end, *, axis: int = -1):
    """x * cos + Concat(-x[h:], x[:h']) * sin along `axis`, for h = negated_start and h' = kept_end
    (1-element Slice starts and ends): rotary embedding by halves (the fusion checked the rest of
    the two Slices: the first to the end, the second from 0, one axis, step 1)."""
    if (_native.enabled and x.ndim == 4 and cos.ndim == 4 and sin.ndim == 4 and x.dtype in _KERNEL_DTYPES
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
    if not (_native.enabled and dtype in _KERNEL_DTYPES and query_axis in (-1, 3) and key_axis in (-1, 3)
            and key_cache_axis in (-2, 2) and value_cache_axis in (-2, 2) and type(key_buffer) is np.ndarray
            and type(value_buffer) is np.ndarray
            and key_buffer is not value_buffer and key.dtype == dtype and value.dtype == dtype
            and key_buffer.dtype == dtype and value_buffer.dtype == dtype and query.ndim == 4 and key.ndim == 4
            and value.ndim == 4 and key_buffer.ndim == 4 and value_buffer.ndim == 4
            and rope_cache_fits(dtype, past_key, past_value, query_cos, query_sin, key_cos, key_sin)):
        return None
    split = _remembered_halves((query.shape[3], key.shape[3]), *halves)
    if split is None:
        return None
    return (query, key, value, past_key, key_buffer, past_value, value_buffer, query_cos, query_sin, key_cos, key_sin,
            *split)


def rope_cache_fits(dtype, past_key, past_value, query_cos, query_sin, key_cos, key_sin) -> bool:
    """Whether a decode step's caches and rotary tables are of `dtype` (the heads') and 4 dimensions:
    `rope_append_arguments`' checks of what a step changes."""
    return (past_key.dtype == dtype and past_value.dtype == dtype and query_cos.dtype == dtype
            and query_sin.dtype == dtype and key_cos.dtype == dtype and key_sin.dtype == dtype and past_key.ndim == 4
            and past_value.ndim == 4 and query_cos.ndim == 4 and query_sin.ndim == 4 and key_cos.ndim == 4
            and key_sin.ndim == 4)


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


def _slice(x, starts, ends, axes, steps):
    """ONNX Slice; one axis with step 1 clamps exactly like a Python slice, so it is one."""
    if axes is not None and starts.size == 1 and ends.size == 1 and axes.size == 1 and (
            steps is None or (steps.size == 1 and int(steps.reshape(-1)[0]) == 1)):
        axis = int(axes.reshape(-1)[0])
        if -x.ndim <= axis < x.ndim:
            index = [slice(None)] * x.ndim
            index[axis] = slice(int(starts.reshape(-1)[0]), int(ends.reshape(-1)[0]))
            return x[tuple(index)]
    return Slice(x, starts, ends, axes, steps)


def _resolve_reshape(shape: tuple, target: tuple) -> tuple | None:
    """Reshape's output shape (allowzero=0: a 0 copies the input's dimension), None if invalid."""
    dims = [shape[i] if d == 0 and i < len(shape) else d for i, d in enumerate(target)]
    total = math.prod(shape)
    if dims.count(-1) == 1:
        known = math.prod(d for d in dims if d != -1)
        if known == 0 or total % known:
            return None
        dims[dims.index(-1)] = total // known
    if any(d < 0 for d in dims) or math.prod(dims) != total:
        return None
    return tuple(dims)


def _unsqueezed_shape(shape: tuple, axes: tuple) -> tuple:
    """Shape of Unsqueeze (axes count in the output's rank; negative from its end)."""
    rank = len(shape) + len(axes)
    result = list(shape)
    for a in sorted(a % rank for a in axes):
        result.insert(a, 1)
    return tuple(result)


@functools.lru_cache(maxsize=256)
def _repeat_shapes(shape: tuple, axes: tuple, expand: tuple, target: tuple) -> tuple:
    """(unsqueezed, expanded, reshaped) shapes of Reshape(Expand(Unsqueeze(kv, axes), expand),
    target) for a kv of `shape`, and r when that repeats each of kv's heads r times in place
    (grouped-query attention), else None."""
    unsqueezed = _unsqueezed_shape(shape, axes)
    try:
        expanded = np.broadcast_shapes(unsqueezed, expand)
    except ValueError:
        raise RunnxError(f"cannot expand shape {list(unsqueezed)} to {list(expand)}") from None
    reshaped = _resolve_reshape(expanded, target)
    if reshaped is None:
        raise RunnxError(f"cannot reshape {list(expanded)} to {list(target)}")
    repeat = None
    if len(shape) == 4 and [a % 5 for a in axes] == [2] and expanded[:2] == shape[:2] and expanded[3:] == shape[2:]:
        if reshaped == (shape[0], shape[1] * expanded[2], shape[2], shape[3]):
            repeat = expanded[2]
    return unsqueezed, expanded, reshaped, repeat


def head_repeat(kv, axes, expand, target) -> tuple:
    """`_repeat_shapes` for the array kv and the repeat's inputs."""
    return _repeat_shapes(kv.shape, int_tuple(axes), int_tuple(expand), int_tuple(target))


def materialised_repeat(kv, shapes):
    """The unfused computation of the repeated cache, for shapes that are not a plain head repeat."""
    unsqueezed, expanded, reshaped, _ = shapes
    return np.broadcast_to(kv.reshape(unsqueezed), expanded).reshape(reshaped)


@register("RepeatedKVShape", since=1, domain=DOMAIN, shape_only=(0,))
def RepeatedKVShape(kv, axes, expand, target):
    """A stand-in with the shape of the repeated cache, for nodes that only read its shape."""
    return stand_in(kv.dtype, head_repeat(kv, axes, expand, target)[2])


@register("RMSNormShape", since=1, domain=DOMAIN, shape_only=(0, 3))
def RMSNormShape(x, epsilon, one, weight, *, axis: int = -1, to: int = 0, cast: int = 0):
    """A stand-in with the shape and dtype of AddRMSNorm's norm of sums shaped as x, for nodes that
    only read its shape: a fused node's norm computed inside it (AttentionGatedMLPRopeAppend's).
    Both come from AddRMSNorm itself, on ones of x's shape and dtype (numpy's promotion rules)."""
    ones = np.ones(x.shape, x.dtype)
    normed = AddRMSNorm(ones, ones, epsilon, one, weight, axis=axis, to=to, cast=cast)[1]
    return stand_in(normed.dtype, normed.shape)


@register("RepeatedKVAttention", since=1, domain=DOMAIN)
def RepeatedKVAttention(query, key, value, bias, query_scale, key_scale, nan_fill, key_axes, key_expand, key_target,
                        value_axes, value_expand, value_target, merged_target=None, mask=None, mask_starts=None,
                        mask_ends=None, mask_axes=None, mask_steps=None, masked_then=None, masked_else=None, *,
                        axis: int = -1, ctx=None):
    """Softmax((query * qs) @ (repeat(key)^T * ks) + bias) with NaN -> nan_fill, @ repeat(value),
    where repeat is the exporter's Unsqueeze/Expand/Reshape head repeat. Query heads are grouped
    per KV head instead, so the cache (a view into its capacity buffer) is read in place. With
    merged_target: Reshape(Transpose(that, (0, 2, 1, 3)), merged_target), the heads merged back.
    With mask (bias absent): bias = Where(Slice(mask, starts, ends, axes, steps), then, else)."""
    if mask is not None:
        bias = _mask_bias(mask, mask_starts, mask_ends, mask_axes, mask_steps, masked_then, masked_else, ctx)
    heads = _repeated_kv_attention(query, key, value, bias, query_scale, key_scale, nan_fill, key_axes, key_expand,
                                   key_target, value_axes, value_expand, value_target, axis)
    if merged_target is None:
        return heads
    return Reshape(heads.transpose(0, 2, 1, 3), merged_target)


def _mask_bias(mask, starts, ends, axes, steps, then, otherwise, ctx=None):
    """RepeatedKVAttention's additive mask from its Slice/Where inputs, made once a run (with ctx) for
    the same input arrays: every layer of a decode step reads the same (np.where once a layer a
    step was a measurable part of it). Known by identity, not by the slice's and scalars' values
    (reading them a layer between kernels streaming weights costs cache misses)."""
    if ctx is None or then.size > 1 or otherwise.size > 1:
        return Where(_slice(mask, starts, ends, axes, steps), then, otherwise)
    arrays = (mask, starts, ends, axes, steps, then, otherwise)  # the same objects: the same bias
    return ctx.keep(("mask bias", *map(id, arrays)), arrays,
                    lambda: Where(_slice(mask, starts, ends, axes, steps), then, otherwise))


def repeated_kv_row(query, key, value, bias, query_scale, key_scale, nan_fill, key_axes, key_expand, key_target,
                    value_axes, value_expand, value_target, merged_target=None, mask=None, mask_starts=None,
                    mask_ends=None, mask_axes=None, mask_steps=None, masked_then=None, masked_else=None, *,
                    axis: int = -1, ctx=None) -> tuple | None:
    """(the arguments of `runtime.jobs.post_attention` after the mailbox and workers, RepeatedKVAttention's
    merged output: a C-contiguous view of the buffer that call fills) when RepeatedKVAttention is a
    decode row (batch 1, one position) of float32 heads over a plain head repeat, merged back;
    else None."""
    if (not _native.enabled or merged_target is None or query.dtype != _FLOAT32 or query.ndim != 4
            or query.shape[0] != 1 or query.shape[2] != 1 or axis % 4 != 3):
        return None
    cache = repeated_kv_cache(query, key, value, bias, key_axes, key_expand, key_target, value_axes, value_expand,
                              value_target, mask, mask_starts, mask_ends, mask_axes, mask_steps, masked_then,
                              masked_else, ctx)
    numbers = cache and _scale_and_fill((), query_scale, key_scale, nan_fill)
    if numbers is None:
        return None
    heads = query.shape[:3] + value.shape[3:]
    merged_shape = _merged_shape(heads, merged_target)  # one query row: the transposed heads stay contiguous
    if merged_shape is None:
        return None
    out = np.empty(heads, np.float32)
    return (query, key, value, *cache, *numbers, out), out.reshape(merged_shape)


def repeated_kv_cache(query, key, value, bias, key_axes, key_expand, key_target, value_axes, value_expand,
                      value_target, mask, mask_starts, mask_ends, mask_axes, mask_steps, masked_then, masked_else,
                      ctx) -> tuple | None:
    """(the bias in 4 dimensions, or None,) when a query row's heads (batch 1, one position, float32)
    attend to float32 caches repeated plainly into its heads, with a bias (or the mask's) broadcasting
    into its scores; else None: what `repeated_kv_row` makes of a decode step's caches and mask
    (the rest comes from constants and the query's shape)."""
    if mask is not None:
        bias = _mask_bias(mask, mask_starts, mask_ends, mask_axes, mask_steps, masked_then, masked_else, ctx)
    repeat = head_repeat(key, key_axes, key_expand, key_target)[3]
    if (repeat is None or repeat != head_repeat(value, value_axes, value_expand, value_target)[3]
            or not _grouped(query, key, value) or key.dtype != _FLOAT32 or value.dtype != _FLOAT32
            or query.shape[1] // key.shape[1] > _KERNEL_ROWS):
        return None
    if bias is not None:
        if bias.dtype != _FLOAT32 or bias.ndim > 4:
            return None
        bias = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
        if not (bias.shape[0] == 1 and bias.shape[1] in (1, query.shape[1]) and bias.shape[2] == 1
                and bias.shape[3] in (1, key.shape[2])):
            return None
    return (bias,)


@Remembered
def _scale_and_fill(_, query_scale, key_scale, nan_fill) -> tuple | None:
    """(query_scale * key_scale, nan_fill) as numbers when they are float32 scalars, else None."""
    if not (query_scale.dtype == _FLOAT32 and key_scale.dtype == _FLOAT32 and nan_fill.dtype == _FLOAT32
            and query_scale.size == 1 and key_scale.size == 1 and nan_fill.size == 1 and nan_fill.ndim <= 4):
        return None
    return query_scale.item() * key_scale.item(), nan_fill.item()


@Remembered
def _merged_shape(heads: tuple, target) -> tuple | None:
    """The shape Reshape(heads transposed (0, 2, 1, 3), target) gives one query row's heads, else None."""
    return _resolve_reshape((heads[0], heads[2], heads[1], heads[3]), int_tuple(target))


def _repeated_kv_attention(query, key, value, bias, query_scale, key_scale, nan_fill, key_axes, key_expand,
                           key_target, value_axes, value_expand, value_target, axis):
    key_shapes = head_repeat(key, key_axes, key_expand, key_target)
    value_shapes = head_repeat(value, value_axes, value_expand, value_target)
    repeat = key_shapes[3]
    if repeat is None or repeat != value_shapes[3] or axis % 4 != 3 or not _grouped(query, key, value):
        keys = materialised_repeat(key, key_shapes)
        values = materialised_repeat(value, value_shapes)
        scores = matmul(np.multiply(query, query_scale), np.multiply(np.swapaxes(keys, -1, -2), key_scale))
        return matmul(_probabilities(scores, bias, nan_fill, axis), values)
    dtype = query.dtype
    if (query_scale.dtype == dtype and key_scale.dtype == dtype and nan_fill.dtype == dtype and bias.dtype == dtype
            and query_scale.size == 1 and key_scale.size == 1 and nan_fill.size == 1 and nan_fill.ndim <= 4):
        result = _attend_kernel(query, key, value, bias, query_scale.item() * key_scale.item(), nan_fill.item())
        if result is not None:
            return result
    scaled = np.multiply(query, query_scale)
    np.multiply(scaled, key_scale, out=scaled, casting="unsafe")
    return _attend_numpy(scaled, key, value, bias, nan_fill)


def attend(query, key, value, bias, scale, fill: float = math.nan) -> np.ndarray:
    """softmax((query * scale) @ key^T + bias) @ value with grouped-query heads (scale and fill:
    numbers): see the module docstring. RunnxError when the shapes are not those of attention."""
    if not _grouped(query, key, value):
        raise RunnxError(f"attention needs query (batch, heads, q_len, depth) and key/value (batch, kv_heads, "
                         f"kv_len, depth/width) with heads a multiple of kv_heads; got {list(query.shape)}, "
                         f"{list(key.shape)}, {list(value.shape)}")
    result = _attend_kernel(query, key, value, bias, float(scale), float(fill))
    if result is not None:
        return result
    scores_shape = query.shape[:3] + key.shape[2:3]
    if bias is not None and not (bias.ndim <= 4 and all(b == 1 or b == s for b, s in zip(bias.shape[::-1],
                                                                                        scores_shape[::-1]))):
        raise RunnxError(f"attention bias of shape {list(bias.shape)} does not broadcast to the scores' "
                         f"{list(scores_shape)}")
    return _attend_numpy(np.multiply(query, scale), key, value, bias, query.dtype.type(fill))


def _grouped(query, key, value) -> bool:
    """Whether query (B, H, Q, D), key (B, G, K, D) and value (B, G, K, W) make grouped-query
    attention (H a multiple of G)."""
    if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
        return False
    batch, heads, _, depth = query.shape
    groups = key.shape[1]
    return (key.shape[0] == batch and key.shape[3] == depth and value.shape[:3] == key.shape[:3] and groups > 0
            and heads % groups == 0)


# query rows per KV head up to which the kernel beats numpy's BLAS products (a decode step, over any
# number of keys); over at most _KERNEL_KEYS keys it does for any number of rows (a prompt of a few
# dozen tokens over itself, each layer's attention starting with its code and data evicted by the
# weights streamed since: one native call touches less than a dozen BLAS calls do)
_KERNEL_ROWS, _KERNEL_KEYS = 48, 64


def _attend_kernel(query, key, value, bias, scale: float, fill: float):
    """The numba attention for float32/float64 in one dtype, or None (then numpy computes it):
    another dtype, a bias that does not broadcast into the scores, or a long query."""
    dtype = query.dtype
    if not _native.enabled or dtype not in _KERNEL_DTYPES or key.dtype != dtype or value.dtype != dtype:
        return None
    batch, heads, length, depth = query.shape
    groups, size = key.shape[1], key.shape[2]
    rows = heads // groups * length
    if rows > _KERNEL_ROWS and size > _KERNEL_KEYS:
        return None
    if bias is not None:
        if bias.dtype != dtype or bias.ndim > 4:
            return None
        if bias.ndim < 4:
            bias = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
        shape = bias.shape
        if not ((shape[0] == 1 or shape[0] == batch) and (shape[1] == 1 or shape[1] == heads)
                and (shape[2] == 1 or shape[2] == length) and (shape[3] == 1 or shape[3] == size)):
            return None
    if dtype == np.float32:  # the decode pool's workers take KV heads: same results with or without them
        workers = decode_pool.pool()
        run = workers.attention if workers is not None and batch * groups > 1 else decode_pool.attention_job
        return run(query, key, value, bias, scale, fill)
    return attention(query, key, value, bias, scale, fill)


def _attend_numpy(scaled, key, value, bias, fill):
    """The grouped attention with numpy's matrix products: each KV head's query rows as one
    matrix, so the cache is not repeated."""
    if (_native.enabled and scaled.dtype == np.float32 and key.dtype == np.float32 and value.dtype == np.float32
            and (bias is None or (bias.dtype == np.float32 and bias.ndim <= 4)) and np.size(fill) == 1):
        return attend_blocks(scaled, key, value, bias, float(np.asarray(fill).reshape(-1)[0]))
    batch, heads, length, depth = scaled.shape
    groups, size = key.shape[1], key.shape[2]
    grouped = scaled.reshape(batch, groups, heads // groups * length, depth)
    rest_workers_before(grouped.size * size)
    scores = matmul(grouped, np.swapaxes(key, -1, -2)).reshape(batch, heads, length, size)
    if (_native.enabled and scores.dtype == np.float32 and scores.flags.c_contiguous
            and (bias is None or bias.dtype == np.float32)
            and np.size(fill) == 1):
        probabilities = _row_probabilities(scores, bias, float(np.asarray(fill).reshape(-1)[0]))
    else:
        probabilities = _probabilities(scores, bias, fill, -1)
    grouped = probabilities.reshape(batch, groups, heads // groups * length, size)
    return matmul(grouped, value).reshape(batch, heads, length, value.shape[3])


def _row_probabilities(scores, bias, fill: float):
    """`_probabilities` over the last axis of float32 scores from a product (C-contiguous, fresh):
    the bias added in place, then the decode pool's row softmax, one pass per row for maximum,
    exponentials, sum and division, shared with its workers (numpy's took five passes over a
    prefill's scores, on one thread); a row whose softmax is NaN becomes the fill, as Where(IsNaN)
    gives it."""
    if bias is not None:
        scores = np.add(scores, bias, out=scores if _fits(bias, scores) else None)
    decode_pool.softmax_rows(scores.reshape(-1, scores.shape[-1]), fill)
    return scores


def _probabilities(scores, bias, fill, axis: int):
    """Where(IsNaN(Softmax(scores + bias, axis)), fill, .), in scores when the shapes allow."""
    if bias is not None:
        if _fits(bias, scores):
            np.add(scores, bias, out=scores)
        else:
            scores = np.add(scores, bias)
    probabilities = _softmax_in_place(scores, axis)
    missing = np.isnan(probabilities)
    if missing.any():
        return np.where(missing, fill, probabilities)
    return probabilities.astype(np.result_type(fill, probabilities), copy=False)
