"""Attention of many query rows (a prefill, an encoder) in blocks of query positions.

Computing a prompt's whole score matrix (heads x rows x keys) streams it through memory three
times (the product, the bias and softmax, the product with the values), and a causal mask makes half
of it exponentials of -inf. Here each KV head's query rows go a block of `BLOCK` positions at a time
(the query heads sharing the KV head stacked: one BLAS product for them), each block against only
the keys its rows can see: the scores stay in the core's cache, and a causal prompt costs half the
products.

A key a row cannot see is one whose bias is at most -1e30 (-inf, or the most negative float an
exporter masks with): exp(score + bias - row maximum) is exactly 0 for it, so leaving it out does
not change what it adds. A row with a bias value between -1e30 and -1e20 (or NaN), or with no
visible key at all, keeps every key, as the whole-matrix computation has it; so does any bias that
does not tell keys apart (one column).
"""
from __future__ import annotations

import numba
import numpy as np

from runnx.ops import _jit_cache  # noqa: F401  (numba caches this module's kernels under RUNNX_CACHE)
from runnx.ops._matmul import matmul, rest_workers_before
from runnx.runtime import pool as decode_pool

BLOCK = 64  # query positions a block: a block's scores (query heads a KV head x 64 x keys) stay in L2
_MASKED, _VISIBLE = -1e30, -1e20


@numba.njit(cache=True, nogil=True, error_model="numpy")
def visible_ends(bias, ends):
    """ends[b, h, r] = one past the last key of bias[b, h, r] (4-D, any layout) a row can see, or the
    key count for a row that must keep them all (see the module docstring)."""
    size = bias.shape[3]
    for b in range(bias.shape[0]):
        for h in range(bias.shape[1]):
            for r in range(bias.shape[2]):
                end = size
                for j in range(size - 1, -1, -1):
                    value = bias[b, h, r, j]
                    if value <= _MASKED:
                        continue
                    if value > _VISIBLE:
                        end = j + 1
                    break
                ends[b, h, r] = end


def attend_blocks(scaled, key, value, bias, fill: float):
    """softmax(scaled @ key^T + bias) @ value, NaN rows set to `fill`, for float32 scaled (B, H, S, D)
    (the query times the scale), key (B, G, K, D), value (B, G, K, W), H a multiple of G, and a
    float32 bias broadcasting to (B, H, S, K) or None; a block of query positions at a time."""
    batch, heads, length, depth = scaled.shape
    groups, size = key.shape[1], key.shape[2]
    per = heads // groups
    if bias is not None and bias.ndim < 4:
        bias = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
    ends = None
    if bias is not None and bias.shape[3] > 1:
        ends = np.empty(bias.shape[:3], np.int64)
        visible_ends(bias, ends)
    out = np.empty((batch, heads, length, value.shape[3]), np.float32)
    rest_workers_before(batch * heads * length * size * depth)
    for b in range(batch):
        bias_b = None if bias is None else bias[b if bias.shape[0] > 1 else 0]
        ends_b = None if ends is None else ends[b if ends.shape[0] > 1 else 0]
        for g in range(groups):
            heads_g = slice(g * per, (g + 1) * per)
            bias_g = None if bias_b is None else bias_b[heads_g] if bias_b.shape[0] > 1 else bias_b
            ends_g = None if ends_b is None else ends_b[heads_g] if ends_b.shape[0] > 1 else ends_b
            for first in range(0, length, BLOCK):
                stop = min(first + BLOCK, length)
                count = stop - first
                end = size if ends_g is None else int(ends_g[:, first:stop].max()) if ends_g.shape[1] > 1 \
                    else int(ends_g[:, 0].max())
                rows = np.ascontiguousarray(scaled[b, heads_g, first:stop]).reshape(per * count, depth)
                scores = matmul(rows, key[b, g, :end].T)
                if bias_g is not None:
                    block = bias_g[:, first:stop] if bias_g.shape[1] > 1 else bias_g
                    block = block[..., :end] if block.shape[2] > 1 else block
                    scores3 = scores.reshape(per, count, end)
                    np.add(scores3, block, out=scores3)
                decode_pool.softmax_rows(scores, fill)
                out[b, heads_g, first:stop] = matmul(scores, value[b, g, :end]).reshape(per, count, value.shape[3])
    return out
