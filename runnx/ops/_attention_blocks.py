"""Attention of many query rows (a prefill, an encoder) in blocks of query positions.

Computing a prompt's whole score matrix (heads x rows x keys) streams it through memory three
times (the product, the bias and softmax, the product with the values), and a causal mask makes half
of it exponentials of -inf. Here each KV head's query rows go a block of `BLOCK` positions at a time
(the query heads sharing the KV head stacked: one BLAS product for them), each block against only
the keys its rows can see: the scores stay in the core's cache, and a causal prompt costs half the
products. Where runnx's own products run (AVX-512), the blocks are the decode pool's prompt-attention
job (`pooled_attention`, kernels in `_kernels_attention_blocks.py`), which every prompt and encoder
attention takes (this module's, `attention_in_blocks` and `causal_attention_in_blocks` of
`fused_layer_norm_blocks.py`): the pool's threads take whole blocks, where numpy's BLAS split each
small product of a block between its threads; elsewhere numpy's products compute them.

A key a row cannot see is one whose bias is at most -1e30 (-inf, or the most negative float an
exporter masks with): exp(score + bias - row maximum) is exactly 0 for it, so leaving it out does
not change what it adds. A row with a bias value between -1e30 and -1e20 (or NaN), or with no
visible key at all, keeps every key, as the whole-matrix computation has it; so does any bias that
does not tell keys apart (one column).
"""
from __future__ import annotations

import functools

import numpy as np

from runnx.ops import _kernels_gemm
from runnx.ops._kernels_attention_blocks import adds_nothing, block_positions, key_panels_into, visible_ends
from runnx.ops._matmul import matmul, rest_workers_before
from runnx.runtime import pool as decode_pool, prompt_jobs
from runnx.runtime.jobs import rows_contiguous
from runnx.runtime.rows import share_rows

BLOCK = 64  # query positions a block (numpy's products): its scores (query heads a KV head x 64 x keys) stay in L2
_NO_ENDS = np.empty((1, 1, 0), np.int64)
POOLED = _kernels_gemm.AVAILABLE  # whether blocks are the pool's job (runnx's own products: AVX-512 or AVX2)


def _visible_ends_of(bias) -> tuple:
    """(ends, zero): `visible_ends` and `adds_nothing` of every row of a 4-D bias, its rows shared
    among runnx's threads."""
    ends, zero = np.empty(bias.shape[:3], np.int64), np.empty(bias.shape[:3], np.bool_)
    share_rows(functools.partial(_visible_ends_rows, bias, ends, zero), bias.shape[2],
               bias.shape[0] * bias.shape[1] * bias.shape[3])
    return ends, zero


def _visible_ends_rows(bias, ends, zero, start: int, stop: int) -> None:
    """`visible_ends` and `adds_nothing` of the query positions start .. stop (each row alone:
    `runtime/rows.py`)."""
    visible_ends(bias[:, :, start:stop], ends[:, :, start:stop])
    adds_nothing(bias[:, :, start:stop], ends[:, :, start:stop], zero[:, :, start:stop])


def attend_blocks(scaled, key, value, bias, fill: float, ctx=None):
    """softmax(scaled @ key^T + bias) @ value, NaN rows set to `fill`, for float32 scaled (B, H, S, D)
    (the query times the scale), key (B, G, K, D), value (B, G, K, W), H a multiple of G, and a
    float32 bias broadcasting to (B, H, S, K) or None; a block of query positions at a time. With
    the run's ctx, each row's visible keys are found once for a bias every layer reads (`keep`)."""
    batch, heads, length, depth = scaled.shape
    groups, size = key.shape[1], key.shape[2]
    per = heads // groups
    given = bias
    if bias is not None and bias.ndim < 4:
        bias = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
    ends = zero = None
    if bias is not None and bias.shape[3] > 1:
        find = functools.partial(_visible_ends_of, bias)
        ends, zero = find() if ctx is None else ctx.keep(("visible ends", id(given)), (given,), find)
    out = np.empty((batch, heads, length, value.shape[3]), np.float32)
    # The job masks each row's keys from its end on itself: a bias that is 0 before every end (a
    # causal mask over a prompt with no padding) adds nothing it needs, and every query head's
    # blocks would read it again. (numpy's blocks below take a row's mask from the bias.)
    needed = bias if zero is None or not zero.all() else None
    if pooled_attention(scaled, key, value, needed, ends, fill, out):
        return out
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


def pooled_attention(scaled, key, value, bias, ends, fill: float, out) -> bool:
    """out (B, H, S, W; any layout) = softmax(scaled @ key^T + bias) @ value, NaN rows set to `fill`,
    each row's keys from its end (`ends` (B, H, S), broadcasting, or None) on masked, as the decode
    pool's prompt-attention job (`runtime/jobs.py`: its blocks shared with the pool's workers, the
    same bits on any thread count), for float32 arrays on a CPU with AVX-512 (runnx's own
    products); False, having done nothing, elsewhere or with no keys."""
    if not POOLED or not _job_takes(scaled, key, value, bias, out):
        return False
    positions = block_positions(scaled.shape[1] // key.shape[1])
    prompt_jobs.attention_blocks(scaled, _key_panels(key), _rows_contiguous(value), bias,
                                 _NO_ENDS if ends is None else ends, fill, positions, out)
    return True


def _job_takes(scaled, key, value, bias, out) -> bool:
    """Whether the job takes these: float32, of attention's shapes (`_check_attention`), a key at least."""
    arrays = (scaled, key, value, out) if bias is None else (scaled, key, value, out, bias)
    if any(a.dtype != np.float32 or a.ndim != 4 for a in arrays):
        return False
    batch, heads, length, depth = scaled.shape
    groups, size = key.shape[1], key.shape[2]
    return (size > 0 and groups > 0 and heads % groups == 0 and depth <= _kernels_gemm.KC
            and key.shape == (batch, groups, size, depth)
            and value.shape[:3] == key.shape[:3] and out.shape == (batch, heads, length, value.shape[3])
            and (bias is None or all(b in (1, s) for b, s in zip(bias.shape, (batch, heads, length, size)))))


def _key_panels(key):
    """key (B, G, K, D) as the job reads it: each KV head's keys as the panels of their columns
    (`key_panels_into`), made once a call, which every block of query positions reads in order."""
    batch, groups, size, depth = key.shape
    out = np.empty((batch, groups, -(-size // _kernels_gemm.NR) * depth, _kernels_gemm.NR), np.float32)
    key_panels_into(key, out)
    return out


def _rows_contiguous(x):
    """x (B, G, K, W) if each (b, g) is a C-contiguous (K, W) matrix (a prefix view of a cache's
    buffer is), else a copy."""
    return x if rows_contiguous(x) else np.ascontiguousarray(x)
