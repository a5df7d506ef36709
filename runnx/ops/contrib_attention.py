"""onnxruntime's contrib attention: RotaryEmbedding, MultiHeadAttention and Attention
(com.microsoft), and the numpy rotation and attention GroupQueryAttention
(`contrib_group_query_attention.py`) shares with them. A self-attention's past is grown in place
when granted (`runnx/capture/capacity.py`); many unmasked float32 query rows go in blocks
(`attention_in_blocks`); softcap, smooth softmax and sinks take a numpy path.
"""
from __future__ import annotations

import math

import numpy as np

from runnx.capture.capacity import append_in_place, concatenate_with_headroom
from runnx.errors import RunnxError
from runnx.ops import _native
from runnx.ops.fused import attend
from runnx.ops.fused_layer_norm_blocks import attention_in_blocks
from runnx.ops.registry import register
from runnx.ops._matmul import matmul

_BLOCKED_ROWS = 48  # query rows a head from which attention goes in blocks of BLAS products

DOMAIN = "com.microsoft"


def _rotate(x, positions, cos_cache, sin_cache, interleaved: bool, rotary_dim: int):
    """Rotary embedding of x (B, S, N, H) at integer positions (B, S), into a new array: the first
    rotary_dim values of each head turned by the cached angles, the rest passed through. Halves
    (x1 = first half, x2 = second) or interleaved pairs (x[2i], x[2i+1])."""
    if positions.size and (positions.min() < 0 or positions.max() >= cos_cache.shape[0]):
        raise RunnxError(f"rotary position ids must be in [0, {cos_cache.shape[0]}) (the cos/sin cache's rows); "
                         f"got {int(positions.min())}..{int(positions.max())}")
    half = rotary_dim // 2
    if cos_cache.shape[-1] < half:
        raise RunnxError(f"rotary cos/sin caches have {cos_cache.shape[-1]} columns, need rotary_dim / 2 = {half}")
    cos = cos_cache[positions, :half][:, :, None, :].astype(x.dtype, copy=False)  # (B, S, 1, half)
    sin = sin_cache[positions, :half][:, :, None, :].astype(x.dtype, copy=False)
    out = np.array(x, copy=True)
    if interleaved:
        first, second = x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]
        out[..., 0:rotary_dim:2] = first * cos - second * sin
        out[..., 1:rotary_dim:2] = second * cos + first * sin
    else:
        first, second = x[..., :half], x[..., half:rotary_dim]
        out[..., :half] = first * cos - second * sin
        out[..., half:rotary_dim] = second * cos + first * sin
    return out


@register("RotaryEmbedding", since=1, domain=DOMAIN)
def RotaryEmbedding(x, position_ids, cos_cache, sin_cache, *, interleaved: int = 0, is_packed_batching: int = 0,
                    num_heads: int = 0, rotary_embedding_dim: int = 0, scale: float = 1.0):
    """x (B, S, hidden) or (B, N, S, H) rotated at position_ids (B, S), or at offset + s when
    position_ids holds one offset."""
    if is_packed_batching:
        raise RunnxError("RotaryEmbedding: is_packed_batching=1 (variable-length packed batches) is not supported")
    if x.ndim == 4:
        heads = x.transpose(0, 2, 1, 3)
    elif x.ndim == 3:
        head_size = (x.shape[2] // num_heads if num_heads else 2 * cos_cache.shape[-1])
        if not head_size or x.shape[2] % head_size:
            raise RunnxError(f"RotaryEmbedding: hidden size {x.shape[2]} is not a whole number of heads "
                             f"(num_heads={num_heads}, head size {head_size})")
        heads = x.reshape(x.shape[0], x.shape[1], -1, head_size)
    else:
        raise RunnxError(f"RotaryEmbedding: input must be 3-D (B, S, hidden) or 4-D (B, N, S, H), got "
                         f"{list(x.shape)}")
    batch, length = heads.shape[:2]
    if position_ids.size == 1:
        positions = np.broadcast_to(int(position_ids.reshape(-1)[0]) + np.arange(length), (batch, length))
    elif position_ids.shape == (batch, length):
        positions = position_ids
    else:
        raise RunnxError(f"RotaryEmbedding: position_ids must be (batch, sequence) = {[batch, length]} or one "
                         f"offset, got {list(position_ids.shape)}")
    rotary_dim = rotary_embedding_dim or heads.shape[3]
    rotated = _rotate(heads, positions.astype(np.intp), cos_cache, sin_cache, bool(interleaved), rotary_dim)
    return rotated.transpose(0, 2, 1, 3) if x.ndim == 4 else rotated.reshape(x.shape)


def _probabilities(scores, bias, softcap: float, smooth: bool, sink):
    """softmax of capped scores plus bias over the last axis; smooth softmax (or per-head sinks)
    adds one more logit (0, or the sink) to the denominator."""
    if softcap:
        scores = np.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = scores + bias
    top = np.max(scores, axis=-1, keepdims=True)
    extra = None
    if sink is not None:
        extra = sink.reshape(1, -1, 1, 1).astype(scores.dtype)
    elif smooth:
        extra = np.zeros_like(top)
    if extra is not None:
        top = np.maximum(top, extra)
    exp = np.exp(scores - top)
    total = np.sum(exp, axis=-1, keepdims=True)
    if extra is not None:
        total = total + np.exp(extra - top)
    return exp / total


def _attention(query, key, value, bias, scale, softcap=0.0, smooth=False, sink=None):
    """softmax(scale q k^T (capped) + bias) v for query (B, N, S, H), key/value (B, G, T, H). Many
    unmasked float32 query rows of one KV head each (an encoder's self-attention) go in blocks of
    rows that stay in cache (`attention_in_blocks`), never the whole score matrix (measured: a
    masked prompt's blocks, each adding its mask's rows, were slower than one masked product)."""
    if not softcap and not smooth and sink is None:
        if (_native.enabled and bias is None and query.dtype == np.float32 and key.dtype == np.float32
                and value.dtype == np.float32 and query.shape[2] > _BLOCKED_ROWS and key.shape[1] == query.shape[1]):
            scaled = np.multiply(query, np.float32(scale))
            return attention_in_blocks(scaled, key.swapaxes(2, 3), value, None, 0.0).transpose(0, 2, 1, 3)
        return attend(query, key, value, bias, scale, fill=0.0)
    group = query.shape[1] // key.shape[1]
    keys = np.repeat(key, group, axis=1) if group > 1 else key
    values = np.repeat(value, group, axis=1) if group > 1 else value
    work = np.dtype(np.float32) if query.dtype.itemsize < 4 else query.dtype
    scores = matmul(query.astype(work), np.swapaxes(keys, 2, 3).astype(work)) * work.type(scale)
    probabilities = _probabilities(scores, None if bias is None else bias.astype(work), softcap, smooth, sink)
    return matmul(probabilities, values.astype(work)).astype(query.dtype, copy=False)


def _heads(x, heads: int):
    """(B, S, N*H) -> (B, N, S, H)."""
    batch, length, width = x.shape
    if width % heads:
        raise RunnxError(f"hidden size {width} is not divisible by {heads} heads")
    return x.reshape(batch, length, heads, width // heads).transpose(0, 2, 1, 3)


def _merged(x):
    """(B, N, S, H) -> (B, S, N*H)."""
    batch, heads, length, size = x.shape
    return x.transpose(0, 2, 1, 3).reshape(batch, length, heads * size)


def _key_mask(mask, batch: int, queries: int, keys: int, op: str):
    """Which keys each query may see (broadcastable to (B, 1, S, T)) by a key padding mask: key
    lengths (B,), or a 0/1 mask (B, T), or (B, S, T) for Attention (MultiHeadAttention's spec has
    no per-query mask)."""
    if mask.ndim == 1 and mask.shape[0] == batch:
        return (np.arange(keys)[None, :] < mask.reshape(-1, 1))[:, None, None, :]
    if mask.ndim == 2 and mask.shape == (batch, keys):
        return (mask != 0)[:, None, None, :]
    per_query = op == "Attention"
    if per_query and mask.ndim == 3 and mask.shape == (batch, queries, keys):
        return (mask != 0)[:, None]
    raise RunnxError(f"{op}: mask of shape {list(mask.shape)} is not supported (expected key lengths "
                     f"[{batch}] or a 0/1 mask [{batch}, {keys}]" + (f" or [{batch}, {queries}, {keys}])"
                                                                       if per_query else ")"))


def _masks(batch, queries, keys, past, dtype, key_mask, attention_bias, unidirectional, filter_value, op):
    """The attention's additive bias (broadcastable to (B, N, S, T)), as onnxruntime's CPU kernels
    build it: mask_filter_value where a key is padding, -inf where (unidirectional) it is in the
    future of the query (query i is at position past + i; a query whose keys are all padding
    then attends to its past ones), plus the given attention bias. None when that bias is all
    zeros (no mask, no bias, no key in any query's future: an encoder's, a decode step's), which
    leaves every score as it is, so the attention need not read it."""
    future = unidirectional and keys > past + 1  # query 0 sees keys 0 .. past
    if key_mask is None and attention_bias is None and not future:
        return None
    visible = np.ones((1, 1, queries, keys), bool)
    if key_mask is not None:
        visible = visible & _key_mask(key_mask, batch, queries, keys, op)
    bias = np.where(visible, dtype.type(0), dtype.type(filter_value))
    if unidirectional:
        future = np.arange(keys)[None, :] > past + np.arange(queries)[:, None]
        bias = np.where(future, dtype.type(-np.inf), bias)
    if attention_bias is not None:
        bias = bias + attention_bias.astype(dtype, copy=False)
    return bias


def _concatenated(past, new, granted: bool = False, ctx=None, op: str = ""):
    """past (B, N, P, H) then new (B, N, S, H) along the sequence: grown in place into past's spare
    capacity when past is granted (Concat's rule: a decode step's cost is its new rows), else a copy."""
    if past is None:
        return new
    if granted:
        grown = append_in_place(past, [new], 2)
        if grown is not None:
            if ctx is not None:
                ctx.count(f"{op}.appends_in_place")
            return grown
        return concatenate_with_headroom([past, new], 2)
    return np.concatenate([past, new], axis=2)


@register("MultiHeadAttention", since=1, domain=DOMAIN, inplace=(6, 7))
def MultiHeadAttention(query, key=None, value=None, bias=None, key_padding_mask=None, attention_bias=None,
                       past_key=None, past_value=None, past_sequence_length=None, cache_indirection=None, *,
                       num_heads: int, mask_filter_value: float = -10000.0, scale: float = 0.0,
                       unidirectional: int = 0, overwrite=(), ctx=None, output_count):
    """Multi-head attention of query (B, S, D) over key/value (B, L, D) (biased by `bias` when
    given), or over key/value already split into heads (B, N, L, H); packed QKV (B, S, N, 3, H) and
    packed KV (B, L, N, 2, H) too. past_key/past_value (B, N, P, H) come before the new keys: the
    presents grow in place into a granted past's spare capacity."""
    if cache_indirection is not None or past_sequence_length is not None:
        raise RunnxError("MultiHeadAttention: past_sequence_length and cache_indirection (beam search buffers) "
                         "are not supported")
    if query.ndim == 5:  # packed QKV
        q, k, v = (query[:, :, :, i].transpose(0, 2, 1, 3) for i in range(3))
    else:
        width = query.shape[2]
        q = _heads(query + bias[:width] if bias is not None else query, num_heads)
        if key is not None and key.ndim == 5:  # packed KV
            k, v = key[:, :, :, 0].transpose(0, 2, 1, 3), key[:, :, :, 1].transpose(0, 2, 1, 3)
        elif key is not None and key.ndim == 4:  # cross attention, keys already in heads
            k, v = key, value
        elif key is not None and value is not None:
            key_width = key.shape[2]
            k = _heads(key + bias[width:width + key_width] if bias is not None else key, num_heads)
            v = _heads(value + bias[width + key_width:] if bias is not None else value, num_heads)
        else:
            raise RunnxError("MultiHeadAttention needs key and value, packed KV in key, or packed QKV in query")
    k = _concatenated(past_key, k, 6 in overwrite, ctx, "MultiHeadAttention")
    v = _concatenated(past_value, v, 7 in overwrite, ctx, "MultiHeadAttention")
    batch, _, queries, size = q.shape
    past = 0 if past_key is None else past_key.shape[2]
    dtype = np.dtype(np.float32) if q.dtype.itemsize < 4 else q.dtype
    masks = _masks(batch, queries, k.shape[2], past, dtype, key_padding_mask, attention_bias, unidirectional,
                   mask_filter_value, "MultiHeadAttention")
    output = _attention(np.ascontiguousarray(q), k, v, masks, scale or 1 / math.sqrt(size))
    results = (_merged(output), k, v)
    return results[:output_count] if output_count > 1 else results[0]


@register("Attention", since=1, domain=DOMAIN)
def Attention(x, weights, bias=None, mask_index=None, past=None, attention_bias=None, past_sequence_length=None, *,
              do_rotary: int = 0, mask_filter_value: float = -10000.0, num_heads: int,
              past_present_share_buffer: int = 0, qkv_hidden_sizes: tuple[int, ...] | None = None,
              rotary_embedding_dim: int = 0, scale: float = 0.0, unidirectional: int = 0, output_count):
    """Self-attention with its own QKV projection: x (B, S, D_in) @ weights (+ bias) split into
    Q, K, V (qkv_hidden_sizes, equal thirds by default); past (2, B, N, P, H) before the new keys,
    present (2, B, N, P + S, H)."""
    if do_rotary or past_present_share_buffer or past_sequence_length is not None:
        raise RunnxError("Attention (com.microsoft): do_rotary, past_present_share_buffer and "
                         "past_sequence_length are not supported")
    sizes = tuple(qkv_hidden_sizes) if qkv_hidden_sizes else (weights.shape[1] // 3,) * 3
    if len(sizes) != 3 or sum(sizes) != weights.shape[1] or sizes[0] != sizes[1]:
        raise RunnxError(f"Attention: qkv_hidden_sizes {list(sizes)} do not split the weights' "
                         f"{weights.shape[1]} columns into Q, K (equal) and V")
    projected = matmul(x, weights)
    if bias is not None:
        projected = projected + bias
    q, k, v = (_heads(part, num_heads) for part in np.split(projected, [sizes[0], sizes[0] + sizes[1]], axis=2))
    past_length = 0
    if past is not None:
        k, v = _concatenated(past[0], k), _concatenated(past[1], v)
        past_length = past.shape[3]
    dtype = np.dtype(np.float32) if q.dtype.itemsize < 4 else q.dtype
    masks = _masks(x.shape[0], x.shape[1], k.shape[2], past_length, dtype, mask_index, attention_bias,
                   unidirectional, mask_filter_value, "Attention")
    output = _merged(_attention(np.ascontiguousarray(q), k, v, masks, scale or 1 / math.sqrt(q.shape[3])))
    if output_count > 1:
        return output, np.stack([k, v])
    return output
