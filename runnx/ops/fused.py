"""Fused attention for patterns that `runnx.interp.fusion` finds in exported decoders (private
domain `runnx.fused`; never in a model file): RepeatedKVAttention (an attention over a KV cache
whose heads the exporter repeats for grouped queries) and LastPosition, and `attend`, the attention
kernel other fusions call. The norms and the SiLU gate are `fused_norms.py`'s, the rotary
embedding `fused_rotary.py`'s.

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

Attention is within float rounding of the unfused graph (rtol ~1e-5 in float32; greedy token ids
unchanged): it sums in another order, scales the query once by both factors and uses a 1-ulp
float32 exp.
"""
from __future__ import annotations

import math

import numpy as np

from runnx.errors import RunnxError
from runnx.ops import _native
from runnx.ops._attention_blocks import attend_blocks
from runnx.ops._fused_common import DOMAIN, KERNEL_DTYPES, fits, stand_in
from runnx.ops._decode_blocks import open_attention_call
from runnx.ops._kernels_fused import attention, attention_scratch
from runnx.ops.registry import register
from runnx.ops.shape import Reshape
from runnx.ops._matmul import matmul, rest_workers_before
from runnx.runtime import defer, pool as decode_pool, take_leave
from runnx.runtime.jobs import post_attention

_FLOAT32 = np.dtype(np.float32)


def _softmax_in_place(scores, axis: int):
    """Softmax-13 of a fresh array, in it: the same operations as the Softmax kernel (max-shifted
    exp, divided by its sum), without numpy's Python-level reduction wrappers."""
    if scores.size == 0:
        return scores
    np.subtract(scores, np.maximum.reduce(scores, axis=axis, keepdims=True), out=scores)
    np.exp(scores, out=scores)
    scores /= np.add.reduce(scores, axis=axis, keepdims=True)
    return scores


@register("LastPosition", since=1, domain=DOMAIN, overlaps_jobs=True)
def LastPosition(x):
    """x[..., -1:, :], as Slice(x, -1, end, axis -2) would take it: an LM head's input for the next
    token's logits only (`runnx/interp/last_position.py`). A decode step's one position is x itself,
    with none of a Slice's parsing of starts, ends and axes. A view, its data never read here: x may
    be the output of calls still pending (`overlaps_jobs`), so a decode step's LM head joins the
    layers' deferred calls instead of waiting for them behind a settle (`runtime/open_jobs.py`)."""
    if x.ndim < 2:
        raise RunnxError(f"LastPosition needs a rank of at least 2 (positions, features), got shape {list(x.shape)}")
    return x if x.shape[-2] == 1 else x[..., -1:, :]


def repeated_heads(kv, repeat: int) -> np.ndarray:
    """kv (batch, heads, length, depth) with each head repeated `repeat` times in place: what
    Reshape(Expand(Unsqueeze(kv, 2), ...), ...) gives for a head repeat the graph proves
    (`runnx/interp/fusion/matcher.py`), for the paths that need the repeated cache itself."""
    if repeat == 1:
        return kv
    batch, heads, length, depth = kv.shape
    return np.broadcast_to(kv[:, :, None], (batch, heads, repeat, length, depth)).reshape(
        batch, heads * repeat, length, depth)


@register("RepeatedKVShape", since=1, domain=DOMAIN, shape_only=(0,))
def RepeatedKVShape(kv, *, repeat: int):
    """A stand-in with the shape of the repeated cache, for nodes that only read its shape."""
    if kv.ndim != 4:
        raise RunnxError(f"a KV cache whose heads repeat must be (batch, heads, length, depth), got {list(kv.shape)}")
    return stand_in(kv.dtype, (kv.shape[0], kv.shape[1] * repeat, *kv.shape[2:]))


@register("RepeatedKVAttention", since=1, domain=DOMAIN, overlaps_jobs=True, reads_data=(5, 6))
def RepeatedKVAttention(query, key, value, bias=None, merged_target=None, mask=None, mask_end=None, *,
                        repeat: int = 1, query_scale, key_scale, nan_fill, axis: int = -1, mask_axis: int = -1,
                        masked_then=None, masked_else=None, ctx=None):
    """Softmax((query * query_scale) @ (repeat(key)^T * key_scale) + bias) with NaN -> nan_fill, @
    repeat(value), where repeat repeats each KV head `repeat` times (grouped-query attention; the
    kernels read each cache head for its group of query heads instead, in place: the cache is a
    view into its capacity buffer). The scales and the fill are numpy scalars of the constants'
    dtypes. With merged_target: Reshape(Transpose(that, (0, 2, 1, 3)), merged_target), the heads
    merged back. With mask (bias absent): bias = Where(mask cut to [0, mask_end) on mask_axis,
    masked_then, masked_else), mask_end the key's length when absent. query, key and value may be
    the outputs of calls still pending (a ProjectedRopeAppend's deferred ones,
    `runtime/open_jobs.py`): the attention's own post, or its deferred call, runs after them; every
    other path settles before it reads them. Given leave, a decode row's attention is deferred
    (`runtime.defer`: its merged heads a view of its output, written when the thread settles), and
    with pool workers and merged_target a short prompt's job is left open, written into its heads
    merged. The mask is read here (the plan settles first when a deferred call may still write it)."""
    leave = take_leave()
    if mask is not None:
        end = key.shape[2] if mask_end is None else _one_number(mask_end)
        bias = _mask_bias(mask, end, mask_axis, masked_then, masked_else, ctx)
    heads = _repeated_kv_attention(query, key, value, bias, query_scale, key_scale, nan_fill, repeat, axis, ctx, leave,
                                   merged_target is not None)
    if merged_target is None:
        return heads
    merged = heads.transpose(0, 2, 1, 3)
    if not merged.flags.c_contiguous:  # (Reshape copies it: reads it)
        decode_pool.settle()
    return Reshape(merged, merged_target)


def _one_number(end) -> int:
    if end.size != 1:
        raise RunnxError(f"the attention mask's end must have one element, got shape {list(end.shape)}")
    return int(end.reshape(-1)[0])


def _mask_bias(mask, end: int, axis: int, then, otherwise, ctx=None):
    """RepeatedKVAttention's additive mask, made once a run (with ctx) for the same mask array and
    numbers: every layer of a decode step reads the same (np.where once a layer a step was a
    measurable part of it)."""
    def made():
        if not -mask.ndim <= axis < mask.ndim:
            raise RunnxError(f"the attention mask of shape {list(mask.shape)} cannot be cut on axis {axis}")
        index = [slice(None)] * mask.ndim
        index[axis] = slice(0, end)  # (Slice with step 1 clamps as a Python slice does)
        return np.where(mask[tuple(index)], then, otherwise)
    if ctx is None:
        return made()
    return ctx.keep(("mask bias", id(mask), end, axis, then, otherwise), (mask,), made)


def _repeated_kv_attention(query, key, value, bias, query_scale, key_scale, nan_fill, repeat: int, axis: int,
                           ctx=None, leave: bool = False, merged: bool = False):
    """The attention's heads (B, H, Q, W). Given leave, a decode row's kernel call is deferred, and a
    prompt's job whose heads are then `merged` left open, written merged (merging copies nothing)."""
    if axis % 4 != 3 or not _grouped(query, key, value) or query.shape[1] != key.shape[1] * repeat:
        _settled()  # (the product's broadcasting decides what that computes, or raises)
        scores = matmul(np.multiply(query, query_scale),
                        np.multiply(np.swapaxes(repeated_heads(key, repeat), -1, -2), key_scale))
        return matmul(_probabilities(scores, bias, nan_fill, axis), repeated_heads(value, repeat))
    dtype = query.dtype
    if (query_scale.dtype == dtype and key_scale.dtype == dtype and nan_fill.dtype == dtype
            and (bias is None or bias.dtype == dtype)):
        result = _attend_kernel(query, key, value, bias, query_scale.item() * key_scale.item(), nan_fill.item(),
                                leave and query.shape[2] == 1, leave and merged)
        if result is not None:
            return result
    _settled()
    scaled = np.multiply(query, query_scale)
    np.multiply(scaled, key_scale, out=scaled, casting="unsafe")
    return _attend_numpy(scaled, key, value, bias, nan_fill, ctx)


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


def _settled() -> None:
    """Before a path that reads the inputs otherwise than through a pool post: the deferred calls
    run, the job left open finished."""
    decode_pool.settle()


def _attend_kernel(query, key, value, bias, scale: float, fill: float, defer_it: bool = False,
                   open_merged: bool = False):
    """The numba attention for float32/float64 in one dtype, or None (then numpy computes it):
    another dtype, a bias that does not broadcast into the scores, or a long query. defer_it: a
    float32 attention is deferred (`runtime.defer`), for a kernel given leave; open_merged: its job
    is left open to the pool's workers (`DecodePool.open_call`), written into heads merged ((B, Q, H,
    W) storage), for a kernel given leave that merges them."""
    dtype = query.dtype
    if not _native.enabled or dtype not in KERNEL_DTYPES or key.dtype != dtype or value.dtype != dtype:
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
        if defer_it:
            out = np.empty(query.shape[:3] + value.shape[3:], np.float32)
            defer(post_attention, (query, key, value, bias, scale, fill, out), job=True)
            return out
        workers = decode_pool.pool()
        if workers is not None and batch * groups > 1:
            if open_merged:
                out = np.empty((batch, length, heads, value.shape[3]), np.float32).transpose(0, 2, 1, 3)
                partials, stats = attention_scratch(query, key, value)
                if workers.open_call(open_attention_call, (query, key, value, bias, scale, fill, out, partials, stats),
                                     (query, key, value, bias, out, partials, stats), None, ()):
                    return out
            return workers.attention(query, key, value, bias, scale, fill)
        return decode_pool.attention_job(query, key, value, bias, scale, fill)
    _settled()
    return attention(query, key, value, bias, scale, fill)


def _attend_numpy(scaled, key, value, bias, fill, ctx=None):
    """The grouped attention with numpy's matrix products: each KV head's query rows as one
    matrix, so the cache is not repeated (`attend_blocks`, with the run's ctx: what it derives from
    the bias is made once a run)."""
    if (_native.enabled and scaled.dtype == np.float32 and key.dtype == np.float32 and value.dtype == np.float32
            and (bias is None or (bias.dtype == np.float32 and bias.ndim <= 4)) and np.size(fill) == 1):
        return attend_blocks(scaled, key, value, bias, float(np.asarray(fill).reshape(-1)[0]), ctx)
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
        scores = np.add(scores, bias, out=scores if fits(bias, scores) else None)
    decode_pool.softmax_rows(scores.reshape(-1, scores.shape[-1]), fill)
    return scores


def _probabilities(scores, bias, fill, axis: int):
    """Where(IsNaN(Softmax(scores + bias, axis)), fill, .), in scores when the shapes allow."""
    if bias is not None:
        if fits(bias, scores):
            np.add(scores, bias, out=scores)
        else:
            scores = np.add(scores, bias)
    probabilities = _softmax_in_place(scores, axis)
    missing = np.isnan(probabilities)
    if missing.any():
        return np.where(missing, fill, probabilities)
    return probabilities.astype(np.result_type(fill, probabilities), copy=False)
