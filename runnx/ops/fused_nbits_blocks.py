"""A decoder layer's MLP in 4-bit products (`runnx/interp/fusion/nbits_products.py`): GatedMLPNBits,
a residual add and its RMS norm, the SiLU-gated MLP's gate, up and down products (onnxruntime's
MatMulNBits) and the residual add and norm after it, as one node of thirteen inputs. Any decoder
whose MLP weights are 4-bit MatMulNBits matches it (onnxruntime-genai's int4 builds, onnxruntime's
quantizer over an Optimum export), whatever the architecture around it.

A decode step's rows (and a short prompt's) run as two native calls posting the decode pool's
products jobs, numpy's exp of the gate in the first (`_decode_blocks.py`; or between them where numba
cannot call it: `fused_norms.decayed`): the kernels the replaced nodes call,
in their order, so the same bits, where the nodes took four calls and Python between them; given
leave, the down product's job is left open, its residual add and norm after it
(`runtime/open_jobs.py`). Other rows run the nodes' kernels in turn.
"""
from __future__ import annotations

import numpy as np

from runnx.ops import _kernels_numpy_exp, _native
from runnx.ops._decode_blocks import (add_norm_into, gated_down_nbits, gated_down_nbits_into,
                                     normed_gate_down_nbits_into, normed_gate_nbits, normed_gate_nbits_into,
                                     open_gated_down_nbits)
from runnx.ops._fused_common import DOMAIN
from runnx.ops._kernels_nibble_tiles import CHUNK_BYTES
from runnx.ops.contrib_quantized import MatMulNBits, SharedInputMatMulNBits, reads_tiles
from runnx.ops.nibble_tiles import four_bit_tiles, joined_four_bit_tiles, prepack_joined_tiles, prepack_tiles
from runnx.ops.fused_norms import AddRMSNorm, decayed, defer_gated_mlp
from runnx.ops.registry import register
from runnx.runtime import pool as decode_pool, take_leave
from runnx.runtime.rows import SHARED_FROM

_FLOAT32 = np.dtype(np.float32)


def _prepack_block(inputs: tuple, attrs: dict) -> list:
    """The gate and up weights' joined tiles and the down weight's, planned ahead as their own
    nodes' prepacks plan them (`registry`'s prepack)."""
    parts, down = inputs[3:9], inputs[9:12]
    K, block_size, columns = attrs.get("K"), attrs.get("block_size"), attrs.get("columns")
    pending = [prepack_joined_tiles((None, *parts), {"K": K, "block_size": block_size, "columns": columns}),
               prepack_tiles((None, *down), {"K": columns[0], "N": K, "bits": 4, "block_size": block_size})]
    return [p for p in pending if p is not None]


@register("GatedMLPNBits", since=1, domain=DOMAIN, overlaps_jobs=True, prepack=_prepack_block)
def GatedMLPNBits(a, b, norm_weight, gate_or_up, gate_or_up_scales, gate_or_up_zeros, up_or_gate, up_or_gate_scales,
                  up_or_gate_zeros, down, down_scales, down_zeros, down_norm_weight, *, K: int, block_size: int,
                  columns: tuple, gated: tuple, epsilon: float, one: float = 1.0, down_epsilon: float,
                  down_one: float = 1.0, skip: int = 0, to: int = 0, cast: int = 0):
    """(s, n) = AddRMSNorm(a, b, norm_weight); the gate and up products of n (4-bit weights of K
    rows, `columns` each, in the order SharedInputMatMulNBits joined them, `gated` saying which is
    the gate); (s', n') = AddRMSNorm(s, SiluMul(gate, up) times the down weight, down_norm_weight);
    every weight in blocks of block_size. Returns (s', n'). skip: both norms are onnxruntime's
    SkipSimplifiedLayerNormalization (AddRMSNorm's `skip`: statistics in float64, no `one`); else
    RMSNorm's unfused arithmetic with `one`, and AddRMSNorm's `to` and `cast` (0, or float32's: the
    two norms' own, which float32 rows leave as they are)."""
    leave = take_leave()  # (for its last job only: its nodes' kernels finish theirs)
    parts = (gate_or_up, gate_or_up_scales, gate_or_up_zeros, up_or_gate, up_or_gate_scales, up_or_gate_zeros)
    skipped = bool(skip)
    if _native_rows(a, b, norm_weight, down_norm_weight, K, columns):
        tiles = joined_four_bit_tiles((K, block_size, columns), *parts)
        down_tiles = four_bit_tiles(down, down_scales, down_zeros, columns[0], K, block_size)
        rows = a.size // K
        gate_at, up_at = (sum(columns[:p]) for p in gated)
        if leave and decode_pool.pool() is None:  # one thread: the calls deferred (`runtime.defer`)
            summed, normed = defer_gated_mlp(
                normed_gate_nbits_into, (a.reshape(rows, K), b.reshape(rows, K), epsilon, one, norm_weight, skipped,
                                         *tiles, sum(columns), gate_at, up_at, columns[0]),
                gated_down_nbits_into, down_tiles, (down_epsilon, down_one, down_norm_weight, skipped), rows, K,
                columns[0], normed_gate_down_nbits_into)
            return summed.reshape(a.shape), normed.reshape(a.shape)
        summed, gate, decay, up, largest = decode_pool.shared_call(
            normed_gate_nbits, a.reshape(rows, K), b.reshape(rows, K), epsilon, one, norm_weight, skipped, *tiles,
            sum(columns), gate_at, up_at, columns[0], _kernels_numpy_exp.EXP)
        decay = decayed(decay, largest)
        if leave:  # the down product left open, its residual add and norm after it (the next node's checks meanwhile)
            product, normed = np.empty((rows, K), np.float32), np.empty((rows, K), np.float32)
            if decode_pool.open_shared_call(open_gated_down_nbits, (gate, decay, up, *down_tiles, product),
                                            (gate, decay, up, *down_tiles, product), add_norm_into,
                                            (summed, product, down_epsilon, down_one, down_norm_weight, skipped,
                                             normed), rows * down_tiles[0].shape[1] * (2 * CHUNK_BYTES + 1)):
                return product.reshape(a.shape), normed.reshape(a.shape)
        summed, normed = decode_pool.shared_call(gated_down_nbits, gate, decay, up, *down_tiles, K, summed,
                                                 down_epsilon, down_one, down_norm_weight, skipped)
        return summed.reshape(a.shape), normed.reshape(a.shape)
    decode_pool.settle()  # (a or b may be a job's output left open)
    summed, normed = AddRMSNorm(a, b, norm_weight, epsilon=np.float32(epsilon), one=np.float32(one), to=to, cast=cast,
                                skip=skip)
    (activated,) = SharedInputMatMulNBits(normed, *parts, K=K, columns=columns, block_size=block_size, gated=gated)
    product = MatMulNBits(activated, down, down_scales, down_zeros, K=columns[0], N=K, bits=4, block_size=block_size)
    decode_pool.settle()  # (MatMulNBits may leave its job open)
    return AddRMSNorm(summed, product, down_norm_weight, epsilon=np.float32(down_epsilon), one=np.float32(down_one),
                      to=to, cast=cast, skip=skip)


def _native_rows(a, b, norm_weight, down_norm_weight, K: int, columns: tuple) -> bool:
    """Whether the block's rows take the two native calls: C-contiguous float32 a and b of one
    shape, K wide, few enough rows that the nodes' kernels would run them on one thread too (their
    products on the tiles, their norms and gate unshared), and float32 norm weights of K values."""
    if not (_native.enabled and a.dtype == _FLOAT32 and b.dtype == _FLOAT32 and a.ndim and b.shape == a.shape
            and a.shape[-1] == K and a.flags.c_contiguous and b.flags.c_contiguous and len(columns) == 2
            and columns[0] == columns[1]):
        return False
    rows = a.size // K if K else 0
    return (0 < rows and reads_tiles(rows) and rows * max(K, columns[0]) < SHARED_FROM
            and all(w.dtype == _FLOAT32 and w.shape == (K,) and w.flags.c_contiguous
                    for w in (norm_weight, down_norm_weight)))
