"""The ONNX Attention op (opsets 23-25): scaled dot-product attention with an optional KV cache.

With past_key/past_value granted (owned, dead, unaliased), present_key/present_value are the past
buffers extended in place into their spare capacity, so a decode step costs O(new tokens).
Numerics follow the ONNX reference (sqrt(scale) applied to Q and K, masked rows give zeros).
"""
from __future__ import annotations

import numpy as np

from runnx.capture.capacity import append_in_place, concatenate_with_headroom
from runnx.errors import RunnxError
from runnx.interp.dtypes import ONNX_TO_NUMPY
from runnx.ops.registry import register
from runnx.ops._matmul import matmul


def _split_heads(x, heads: int | None, what: str):
    """(B, S, H*D) -> (B, H, S, D); 4-D inputs pass through."""
    if x.ndim == 4:
        return x
    if x.ndim != 3 or not heads:
        raise RunnxError(f"Attention {what} must be 4-D, or 3-D with q_num_heads/kv_num_heads set; "
                         f"got shape {list(x.shape)}")
    batch, length, hidden = x.shape
    if hidden % heads:
        raise RunnxError(f"Attention {what} hidden size {hidden} is not divisible by {heads} heads")
    return x.reshape(batch, length, heads, hidden // heads).transpose(0, 2, 1, 3)


def _extend(past, new, granted: bool, ctx, name: str):
    """present = concat(past, new) along the sequence axis, in place when granted and possible."""
    if past is None:
        return new
    if granted:
        grown = append_in_place(past, [new], 2)
        if grown is not None:
            ctx.count("Attention.appends_in_place")
            ctx.count("Attention.bytes_copied", new.nbytes)
            return grown
        ctx.count("Attention.bytes_copied", past.nbytes + new.nbytes)
        return concatenate_with_headroom([past, new], 2)
    ctx.count("Attention.bytes_copied", past.nbytes + new.nbytes)
    return np.concatenate([past, new], axis=2)


def _bias(q_len, kv_len, dtype, attn_mask, is_causal, offset, window, nonpad_kv_seqlen, batch):
    """Additive attention bias (0 attend / -inf masked), broadcastable to (B, H, q, kv)."""
    bias = np.zeros((q_len, kv_len), dtype=dtype)
    if attn_mask is not None:
        missing = kv_len - attn_mask.shape[-1]
        if missing > 0:
            fill = False if attn_mask.dtype == np.bool_ else -np.inf
            attn_mask = np.pad(attn_mask, [(0, 0)] * (attn_mask.ndim - 1) + [(0, missing)], constant_values=fill)
        if attn_mask.dtype == np.bool_:
            attn_mask = np.where(attn_mask, dtype.type(0), dtype.type(-np.inf))
        bias = bias + attn_mask.astype(dtype, copy=False)
    query = np.arange(q_len).reshape(q_len, 1)
    key = np.arange(kv_len).reshape(1, kv_len)
    per_batch = np.ndim(offset) > 0
    position = query + (np.reshape(offset, (-1, 1, 1)) if per_batch else int(offset))
    allowed = None
    if is_causal:
        allowed = key <= position
    left, right = window
    if left >= 0 or right >= 0:
        inside = np.ones(np.broadcast_shapes(position.shape, key.shape), dtype=bool)
        if left >= 0:
            inside &= position - key <= left
        if right >= 0:
            inside &= key - position <= right
        allowed = inside if allowed is None else allowed & inside
    if allowed is not None:
        masked = np.where(allowed, dtype.type(0), dtype.type(-np.inf))
        bias = bias + (masked.reshape(batch, 1, q_len, kv_len) if per_batch else masked)
    if nonpad_kv_seqlen is not None:
        padding = np.arange(kv_len) < np.asarray(nonpad_kv_seqlen).reshape(-1, 1)
        bias = bias + np.where(padding, 0, -np.inf).astype(dtype).reshape(batch, 1, 1, kv_len)
    return bias


def _softmax(scores):
    top = np.max(scores, axis=-1, keepdims=True)
    top = np.where(np.isneginf(top), 0, top).astype(scores.dtype)
    exp = np.exp(scores - top)
    total = np.sum(exp, axis=-1, keepdims=True)
    return exp / np.where(total == 0, 1, total).astype(scores.dtype)


def _attention(q, k, v, attn_mask, past_key, past_value, nonpad_kv_seqlen, *, scale, is_causal, q_num_heads,
               kv_num_heads, softmax_precision, softcap, qk_matmul_output_mode, window, overwrite, ctx):
    if (past_key is None) != (past_value is None):
        raise RunnxError("Attention needs past_key and past_value together")
    if nonpad_kv_seqlen is not None and past_key is not None:
        raise RunnxError("Attention: nonpad_kv_seqlen cannot be combined with past_key/past_value")
    three_d = q.ndim == 3
    q = _split_heads(q, q_num_heads, "Q")
    k = _split_heads(k, kv_num_heads, "K")
    v = _split_heads(v, kv_num_heads, "V")
    dtype = q.dtype
    root_scale = dtype.type(np.sqrt(scale if scale is not None else 1 / np.sqrt(q.shape[3])))
    past_length = past_key.shape[2] if past_key is not None else 0
    present_key = _extend(past_key, k, 4 in overwrite, ctx, "key")
    present_value = _extend(past_value, v, 5 in overwrite, ctx, "value")
    batch, heads, q_len = q.shape[0], q.shape[1], q.shape[2]
    kv_len = present_key.shape[2]
    if nonpad_kv_seqlen is not None and past_key is None:
        offset = np.asarray(nonpad_kv_seqlen).reshape(-1) - q_len
    else:
        offset = past_length
    bias = _bias(q_len, kv_len, dtype, attn_mask, is_causal, offset, window, nonpad_kv_seqlen, batch)
    keys, values = present_key, present_value
    if heads != keys.shape[1]:
        if heads % keys.shape[1]:
            raise RunnxError(f"Attention: {heads} query heads are not a multiple of {keys.shape[1]} kv heads")
        keys = np.repeat(keys, heads // keys.shape[1], axis=1)
        values = np.repeat(values, heads // values.shape[1], axis=1)
    scores = matmul(q * root_scale, np.swapaxes(keys, 2, 3) * root_scale).astype(dtype, copy=False)
    if softcap:
        scores = np.tanh(scores / dtype.type(softcap)) * dtype.type(softcap)
    qk_output = scores
    with_bias = scores + bias
    if qk_matmul_output_mode == 2:
        qk_output = with_bias.copy()
    if softmax_precision is not None:
        with_bias = with_bias.astype(ONNX_TO_NUMPY[softmax_precision])
    probabilities = _softmax(with_bias)
    fully_masked = np.isneginf(np.max(np.broadcast_to(bias, with_bias.shape[:-2] + bias.shape[-2:]), axis=-1,
                                      keepdims=True))
    probabilities = np.where(fully_masked, 0, probabilities).astype(dtype)
    if qk_matmul_output_mode == 3:
        qk_output = probabilities
    output = matmul(probabilities, values).astype(dtype, copy=False)  # ml_dtypes matmul widens
    if three_d:
        output = output.transpose(0, 2, 1, 3).reshape(batch, q_len, -1)
    return output, present_key, present_value, qk_output.astype(dtype, copy=False)


@register("Attention", since=23, inplace=(4, 5))
def Attention(q, k, v, attn_mask=None, past_key=None, past_value=None, nonpad_kv_seqlen=None, *,
              is_causal: int = 0, kv_num_heads: int | None = None, q_num_heads: int | None = None,
              qk_matmul_output_mode: int = 0, scale: float | None = None, softcap: float = 0.0,
              softmax_precision: int | None = None, overwrite=(), ctx=None):
    return _attention(q, k, v, attn_mask, past_key, past_value, nonpad_kv_seqlen, scale=scale, is_causal=is_causal,
                      q_num_heads=q_num_heads, kv_num_heads=kv_num_heads, softmax_precision=softmax_precision,
                      softcap=softcap, qk_matmul_output_mode=qk_matmul_output_mode, window=(-1, -1),
                      overwrite=overwrite, ctx=ctx)


@register("Attention", since=25, inplace=(4, 5))
def Attention_25(q, k, v, attn_mask=None, past_key=None, past_value=None, nonpad_kv_seqlen=None, *,
                 is_causal: int = 0, kv_num_heads: int | None = None, q_num_heads: int | None = None,
                 qk_matmul_output_mode: int = 0, scale: float | None = None, softcap: float = 0.0,
                 softmax_precision: int | None = None, left_window_size: int = -1, right_window_size: int = -1,
                 overwrite=(), ctx=None):
    """Opset 25 adds sliding windows and forbids head counts with 4-D inputs."""
    if q.ndim == 4 and (q_num_heads is not None or kv_num_heads is not None):
        raise RunnxError("Attention: q_num_heads and kv_num_heads must not be set for 4-D inputs")
    return _attention(q, k, v, attn_mask, past_key, past_value, nonpad_kv_seqlen, scale=scale, is_causal=is_causal,
                      q_num_heads=q_num_heads, kv_num_heads=kv_num_heads, softmax_precision=softmax_precision,
                      softcap=softcap, qk_matmul_output_mode=qk_matmul_output_mode,
                      window=(left_window_size, right_window_size), overwrite=overwrite, ctx=ctx)
