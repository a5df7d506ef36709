"""Attention beyond softmax over a cache: LinearAttention (opset 27: a recurrent state updated per
token by one of four rules) and FlexAttention (ai.onnx.preview: softmax attention whose scores and
probabilities pass through user subgraphs). Half-precision inputs compute in float32, as both specs
ask; grouped heads: query head h reads key/value head h // (query heads / key-value heads)."""
from __future__ import annotations

import numpy as np

from runnx.capture.env import Subgraph
from runnx.errors import RunnxError
from runnx.interp.dtypes import numpy_dtype
from runnx.ops.registry import register
from runnx.ops._matmul import matmul

PREVIEW_DOMAIN = "ai.onnx.preview"
_UPDATE_RULES = ("linear", "gated", "delta", "gated_delta")


def _compute_dtype(dtype) -> np.dtype:
    """float64 stays float64; everything narrower accumulates in float32."""
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def _group_size(q_heads: int, kv_heads: int) -> int:
    if q_heads <= 0 or kv_heads <= 0 or q_heads % kv_heads:
        raise RunnxError(f"{q_heads} query heads are not a positive multiple of {kv_heads} key/value heads")
    return q_heads // kv_heads


def _heads(x, heads: int, what: str) -> np.ndarray:
    """[B, T, heads * D] -> [B, heads, T, D]."""
    if x.ndim != 3 or x.shape[2] % heads:
        raise RunnxError(f"{what} of shape {x.shape} is not [batch, time, {heads} heads * head size]")
    batch, time, width = x.shape
    return x.reshape(batch, time, heads, width // heads).transpose(0, 2, 1, 3)


def _per_token(x, kv_heads: int, allowed_widths: tuple[int, ...], what: str, dtype) -> np.ndarray:
    """A gate [B, T, width] as [B, kv_heads, T, width / kv_heads or 1], to broadcast over a head's keys."""
    if x.ndim != 3 or x.shape[2] not in allowed_widths:
        raise RunnxError(f"{what} of shape {x.shape} should be [batch, time, one of {sorted(set(allowed_widths))}]")
    if x.shape[2] == 1:
        return x[:, None, :, :].astype(dtype)
    return _heads(x, kv_heads, what).astype(dtype)


@register("LinearAttention", since=27)
def LinearAttention(query, key, value, past_state=None, decay=None, beta=None, *, q_num_heads: int,
                    kv_num_heads: int, update_rule: str = "gated_delta", scale: float = 0.0, chunk_size: int = 64):
    """Per token t: S <- exp(decay_t) * S (gated rules); v_t <- beta_t * (v_t - S^T k_t) (delta rules);
    S <- S + k_t v_t^T; output_t = scale * S^T q_t. Returns (output [B, T, Hq * Dv], final S).
    chunk_size is a blocking hint for chunked kernels; the step-by-step recurrence ignores it."""
    if update_rule not in _UPDATE_RULES:
        raise RunnxError(f"update_rule '{update_rule}' is not one of {', '.join(_UPDATE_RULES)}")
    gated, delta = update_rule in ("gated", "gated_delta"), update_rule in ("delta", "gated_delta")
    for name, given, needed in (("decay", decay, gated), ("beta", beta, delta)):
        if (given is not None) != needed:
            raise RunnxError(f"update_rule '{update_rule}' {'needs' if needed else 'takes no'} {name} input")
    group = _group_size(q_num_heads, kv_num_heads)
    dtype = _compute_dtype(query.dtype)
    q = _heads(query, q_num_heads, "query").astype(dtype)
    k = _heads(key, kv_num_heads, "key").astype(dtype)
    v = _heads(value, kv_num_heads, "value").astype(dtype)
    batch, _, time, key_size = q.shape
    if k.shape[:3] != (batch, kv_num_heads, time) or k.shape[3] != key_size or v.shape[:3] != k.shape[:3]:
        raise RunnxError(f"query {query.shape}, key {key.shape} and value {value.shape} do not match")
    value_size = v.shape[3]
    state_shape = (batch, kv_num_heads, key_size, value_size)
    if past_state is None:
        state, state_dtype = np.zeros(state_shape, dtype), query.dtype
    elif past_state.shape != state_shape:
        raise RunnxError(f"past_state has shape {past_state.shape}, expected {state_shape}")
    else:
        state, state_dtype = past_state.astype(dtype), past_state.dtype
    if gated:
        gate = np.exp(_per_token(decay, kv_num_heads, (kv_num_heads, kv_num_heads * key_size), "decay", dtype))
    if delta:
        strength = _per_token(beta, kv_num_heads, (kv_num_heads, 1), "beta", dtype)
    scale = scale or 1 / np.sqrt(key_size)

    output = np.empty((batch, q_num_heads, time, value_size), dtype)
    for t in range(time):
        key_t, value_t = k[:, :, t], v[:, :, t]
        if gated:
            state = state * gate[:, :, t, :, None]
        if delta:
            value_t = strength[:, :, t] * (value_t - np.einsum("bhkv,bhk->bhv", state, key_t))
        state = state + key_t[..., :, None] * value_t[..., None, :]
        query_t = q[:, :, t].reshape(batch, kv_num_heads, group, key_size)
        output[:, :, t] = scale * np.einsum("bhgk,bhkv->bhgv", query_t, state).reshape(batch, q_num_heads, value_size)
    output = output.transpose(0, 2, 1, 3).reshape(batch, time, q_num_heads * value_size)
    return output.astype(query.dtype), state.astype(state_dtype)


def _modified(graph: Subgraph, values: np.ndarray, what: str) -> np.ndarray:
    """values passed through a one-input, one-output modifier subgraph, kept in their dtype and shape."""
    outputs = graph(values)
    if len(outputs) != 1 or np.shape(outputs[0]) != values.shape:
        raise RunnxError(f"{what} must return one tensor of shape {values.shape}")
    return np.asarray(outputs[0], dtype=values.dtype)


@register("FlexAttention", since=1, domain=PREVIEW_DOMAIN)
def FlexAttention(q, k, v, *, scale: float | None = None, score_mod: Subgraph | None = None,
                  prob_mod: Subgraph | None = None, softmax_precision: int | None = None):
    """softmax(score_mod(scale * Q K^T)) through prob_mod, times V; Q [B, Hq, L, E], K/V [B, Hkv, S, E/Ev]."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise RunnxError(f"FlexAttention takes rank-4 Q, K, V; got {q.shape}, {k.shape}, {v.shape}")
    if k.shape[:3] != v.shape[:3] or k.shape[3] != q.shape[3] or k.shape[0] != q.shape[0]:
        raise RunnxError(f"Q {q.shape}, K {k.shape} and V {v.shape} do not match")
    group = _group_size(q.shape[1], k.shape[1])
    dtype = _compute_dtype(q.dtype) if softmax_precision is None else numpy_dtype(softmax_precision)
    scale = 1 / np.sqrt(q.shape[3]) if scale is None else scale
    keys = np.repeat(k, group, axis=1).astype(dtype)
    scores = matmul(q.astype(dtype) * np.asarray(scale, dtype), np.swapaxes(keys, -1, -2))
    if score_mod is not None:
        scores = _modified(score_mod, scores, "score_mod")
    scores = scores - scores.max(axis=-1, keepdims=True)
    probabilities = np.exp(scores)
    probabilities /= probabilities.sum(axis=-1, keepdims=True)
    if prob_mod is not None:
        probabilities = _modified(prob_mod, probabilities, "prob_mod")
    return matmul(probabilities, np.repeat(v, group, axis=1).astype(dtype)).astype(v.dtype)
