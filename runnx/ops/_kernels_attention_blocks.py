"""numba kernels of a prompt's attention in blocks of query positions (`_attention_blocks.py`): which
keys each query row can see, and one block's attention on runnx's own products (`_kernels_gemm.py`),
which the decode pool's prompt-attention job (`runtime/jobs.py`) computes a block a unit.

A block is the query rows of one KV head's query heads at a few positions (`block_positions`),
stacked, against the keys its rows can see: its scores stay in the core's cache, and a causal prompt
costs half the products. A block is computed whole by one thread, its products summing every element
alike whatever else the product holds (`gemm_columns`) and its softmax the row kernel the other
attention paths share: a result never depends on the thread count or on which thread took a block.
"""
from __future__ import annotations

import numba
import numpy as np

from runnx.ops import _jit_cache  # noqa: F401  (numba caches this module's kernels under RUNNX_CACHE)
from runnx.ops._array_types import any_layout, read_only
from runnx.ops._kernels_gemm import KC, MC, MR, NR, gemm_columns, panels_product
from runnx.ops._kernels_rows import softmax_rows_float32

_MASKED, _VISIBLE = -1e30, -1e20
BLOCK_ROWS = 192  # query rows a block stacks (positions: this over the query heads a KV head)

_jit = numba.njit(cache=True, nogil=True, error_model="numpy")


@_jit
def visible_ends(bias, ends):
    """ends[b, h, r] = one past the last key of bias[b, h, r] (4-D, any layout) a row can see, or the
    key count for a row that must keep them all (see `_attention_blocks.py`'s docstring)."""
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


@_jit
def adds_nothing(bias, ends, out):
    """out[b, h, r] = whether every value of bias[b, h, r] (4-D, any layout) before the row's end
    (`visible_ends`) is 0: adding such a row to a score changes no softmax weight (x + 0.0 is x but
    for -0.0, whose exponential is the same), and the keys from the end on are masked apart."""
    for b in range(bias.shape[0]):
        for h in range(bias.shape[1]):
            for r in range(bias.shape[2]):
                row = bias[b, h, r]
                others = 0
                for j in range(ends[b, h, r]):
                    others += row[j] != 0  # NaN too
                out[b, h, r] = others == 0


@_jit
def key_panels_into(key, out):
    """out[b, g] = the panels of key[b, g].T for key (B, G, K, D) of any layout and out (B, G, P D, NR),
    P = ceil(K / NR): panel p, rows p D .. p D + D, holds keys p NR .. p NR + NR by their columns
    (element [d, j] is key j's d), zero past K, as `panels_product` reads a b. A panel is written
    row by row, its NR keys' rows staying in L1 meanwhile (written a key's column at a time, an
    encoder's 6 heads x 1500 keys took 1.8x as long)."""
    size, depth = key.shape[2], key.shape[3]
    for b in range(key.shape[0]):
        for g in range(key.shape[1]):
            rows, panels = key[b, g], out[b, g]
            for p in range(panels.shape[0] // depth):
                panel = panels[p * depth:(p + 1) * depth]
                count = min(NR, size - p * NR)
                block = rows[p * NR:p * NR + count]
                for d in range(depth):
                    target = panel[d]
                    for j in range(count):
                        target[j] = block[j, d]
                    for j in range(count, NR):
                        target[j] = 0.0


def block_positions(per: int) -> int:
    """Query positions a block takes when `per` query heads share a KV head."""
    return max(MR, BLOCK_ROWS // max(per, 1))


@_jit
def block_limit(ends, per, g, b, first, stop, size):
    """The keys a block of (b, KV head g, positions first..stop) attends: one past the last any of
    its rows can see (ends, `visible_ends`'s or a causal prompt's, broadcasting to (B, H, Q); with no
    positions: every key); each end at least 1 (`post_attention_blocks` checks)."""
    if ends.shape[2] == 0:
        return size
    end = 0
    eb = b if ends.shape[0] > 1 else 0
    for h in range(g * per, (g + 1) * per):
        eh = h if ends.shape[1] > 1 else 0
        if ends.shape[2] == 1:
            end = max(end, np.int64(ends[eb, eh, 0]))
            continue
        for r in range(first, stop):
            end = max(end, np.int64(ends[eb, eh, r]))
    return min(end, size)


@_jit
def attend_block(scaled, key_panels, values, bias, ends, fill, out, b, g, per, first, stop):
    """out[b, g's query heads, first:stop] = softmax(their scaled rows @ keys.T + bias) @ values, a
    row whose softmax is NaN set to `fill`, for KV head g shared by `per` query heads: scaled (B, H,
    Q, D) the query times the scale and out (B, H, Q, W), any layout; values (K, W) the KV head's
    rows the block sees and key_panels (P D, NR) the head's keys as the panels of keys.T
    (`key_panels_into`: made once a call, every block reads them in order), both C-contiguous,
    K >= 1, D at most KC; bias broadcasting to (B, H, Q, >= K), or with no columns (none); the keys
    from each row's end on (ends as in `block_limit`) masked."""
    depth, width, size = scaled.shape[3], out.shape[3], values.shape[0]
    count = stop - first
    rows = per * count
    stacked = np.empty((rows, depth), np.float32)
    for h in range(per):
        for r in range(count):
            stacked[h * count + r] = scaled[b, g * per + h, first + r]
    scores = np.empty((rows, size), np.float32)
    a_panels = np.empty((min(rows, MC) + MR - 1) // MR * MR * KC, np.float32)
    b_panel, edge = np.empty(KC * NR, np.float32), np.empty((MR, NR), np.float32)
    panels_product(stacked, key_panels, scores, a_panels, edge)
    for h in range(per):
        for r in range(count):
            row = scores[h * count + r]
            if bias.shape[3] > 0:
                added = bias[b if bias.shape[0] > 1 else 0, g * per + h if bias.shape[1] > 1 else 0,
                             first + r if bias.shape[2] > 1 else 0]
                if added.shape[0] == 1:
                    one = added[0]
                    for j in range(size):
                        row[j] += one
                else:
                    for j in range(size):
                        row[j] += added[j]
            if ends.shape[2] > 0:
                end = ends[b if ends.shape[0] > 1 else 0, g * per + h if ends.shape[1] > 1 else 0,
                           first + r if ends.shape[2] > 1 else 0]
                for j in range(np.int64(end), size):
                    row[j] = -np.inf
    softmax_rows_float32(scores, fill)
    result = np.empty((rows, width), np.float32)
    gemm_columns(read_only(scores), read_only(values), any_layout(result), np.int64(0), width, a_panels, b_panel, edge,
                 np.bool_(False), b_panel)  # (as `product_columns` calls it: one compiled product)
    for h in range(per):
        for r in range(count):
            out[b, g * per + h, first + r] = result[h * count + r]
