"""numba kernel of GroupQueryAttention's decode step (`ops/contrib_group_query_attention.py`): the new query
and key rows turned by the rotary caches and the new key and value rows written into the KV cache,
in one pass over the step's few rows instead of a dozen numpy calls; `decode_step`, that pass
and the decode attention job in one native call; and `prompt_step`, that pass and a causal
prompt's attention job in one.

The rotation is the numpy reference's arithmetic in its order (x1 * cos - x2 * sin, x2 * cos +
x1 * sin, no fused multiply-add), so the rows are bitwise those of `contrib_attention._rotate`.
"""
from __future__ import annotations

import numba
import numpy as np

from runnx.ops import _jit_cache  # noqa: F401  (numba caches this module's kernels under RUNNX_CACHE)
from runnx.ops._kernels_attention_blocks import key_panels_into
from runnx.ops._kernels_gemm import NR
from runnx.runtime.jobs import post_attention, post_attention_blocks

_kernel = numba.njit(cache=True, nogil=True, error_model="numpy")


@_kernel
def _turn(source, target, cos, sin, half, interleaved):
    """target[:2 half] = source's first 2 half values rotated by angles (cos, sin) of `half` each:
    halves (x[i], x[half + i]) or interleaved pairs (x[2i], x[2i + 1]); the rest copied."""
    for i in range(half):
        if interleaved:
            first, second = source[2 * i], source[2 * i + 1]
            target[2 * i] = first * cos[i] - second * sin[i]
            target[2 * i + 1] = second * cos[i] + first * sin[i]
        else:
            first, second = source[i], source[half + i]
            target[i] = first * cos[i] - second * sin[i]
            target[half + i] = second * cos[i] + first * sin[i]
    for i in range(2 * half, source.shape[0]):
        target[i] = source[i]


@_kernel
def rows_fit(positions, starts, batch, steps, half, angle_rows, length):
    """Whether `rotary_append` writes its rows: each of `batch` sequences' `steps` rows from starts[b]
    on fall in [0, length), and (half: rotated) each position in [0, angle_rows), the cos/sin
    caches' rows."""
    for b in range(batch):
        if starts[b] < 0 or starts[b] + steps > length:
            return False
        for s in range(steps):
            if half and (positions[b, s] < 0 or positions[b, s] >= angle_rows):
                return False
    return True


@_kernel
def rotary_append(query, key, value, positions, cos_cache, sin_cache, half, interleaved, queries, key_cache,
                  value_cache, starts):
    """queries[b, n, s] = query head n of row (b, s) turned at positions[b, s]; key head g of row
    (b, s) turned and value head g copied into key_cache / value_cache[b, g, starts[b] + s].

    query (B, S, N, H), key and value (B, S, G, H), any strides (views into a packed QKV);
    queries (B, N, S, H); the caches (B, G, T, H). half = 0: no rotation. Returns False, having
    written nothing, when a position is outside the caches' rows [0, len(cos_cache)) or a row
    falls past T (the caller raises); True otherwise."""
    batch, steps = query.shape[0], query.shape[1]
    heads, groups = query.shape[2], key.shape[2]
    if not rows_fit(positions, starts, batch, steps, half, cos_cache.shape[0], key_cache.shape[2]):
        return False
    for b in range(batch):
        for s in range(steps):
            position = positions[b, s] if half else 0
            cos, sin = cos_cache[position], sin_cache[position]
            for n in range(heads):
                _turn(query[b, s, n], queries[b, n, s], cos, sin, half, interleaved)
            row = starts[b] + s
            for g in range(groups):
                _turn(key[b, s, g], key_cache[b, g, row], cos, sin, half, interleaved)
                value_cache[b, g, row, :] = value[b, s, g, :]
    return True


@_kernel
def decode_step(board, workers, query, key, value, positions, cos_cache, sin_cache, half, interleaved, queries,
                key_cache, value_cache, starts, begin, stop, scale, out):
    """A decode step of sequences of one length in one native call, as a decode pool job
    (`runtime.pool.shared_call`): `rotary_append` into the caches, then the decode attention job
    (`post_attention`, units per (sequence, KV head, span): the same result for any thread count)
    of queries over cache rows begin..stop into out (B, N, 1, H). False, having written nothing,
    when `rotary_append` refuses the rows."""
    if not rotary_append(query, key, value, positions, cos_cache, sin_cache, half, interleaved, queries, key_cache,
                         value_cache, starts):
        return False
    post_attention(board, workers, queries, key_cache[:, :, begin:stop], value_cache[:, :, begin:stop], None, scale,
                   0.0, out)
    return True


@_kernel
def prompt_step(board, workers, query, key, value, positions, cos_cache, sin_cache, half, interleaved, key_cache,
                value_cache, starts, scale, block, out):
    """A causal prompt of sequences that all continue their caches at starts[0] (B, S new rows), in
    one native call as a decode pool job (`runtime.pool.shared_call`): `rotary_append` into the
    caches and a scratch of turned queries, those times `scale` (float32, as numpy multiplies
    them), the caches' first starts[0] + S keys as the panels of their columns
    (`key_panels_into`), then the prompt-attention job (`post_attention_blocks`: blocks of `block`
    query positions, row s seeing the keys up to its own position) into out (B, N, S, H; any
    layout): the arrays and the job `contrib_group_query_attention._attend_rows` makes and posts from
    Python, so the same bits. False, having written nothing, when `rotary_append` refuses the
    rows."""
    batch, steps, heads, size = query.shape
    queries = np.empty((batch, heads, steps, size), np.float32)
    if not rotary_append(query, key, value, positions, cos_cache, sin_cache, half, interleaved, queries, key_cache,
                         value_cache, starts):
        return False
    turned = queries.reshape(queries.size)
    for i in range(turned.shape[0]):
        turned[i] = turned[i] * scale
    start = starts[0]
    reach = start + steps
    keys = key_cache[:, :, :reach]
    panels = np.empty((batch, keys.shape[1], (reach + NR - 1) // NR * size, NR), np.float32)
    key_panels_into(keys, panels)
    ends = np.empty((1, 1, steps), np.int64)
    for s in range(steps):
        ends[0, 0, s] = start + s + 1
    post_attention_blocks(board, workers, queries, panels, value_cache[:, :, :reach], None, ends, 0.0, block, out)
    return True
