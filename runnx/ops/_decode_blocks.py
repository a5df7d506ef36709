"""Decoder blocks of several fused nodes as native calls that post the decode pool's jobs, so that a
decode step runs their products, residual adds and norms with no Python between them (each node's
Python, its checks and its hand-off to the pool cost ~10-30 us, a few percent of a SmolLM2 step).

A block is cut where numpy must compute: the SiLU gate's exp is numpy's (numba's differs from it
by up to 2 ulp on a third of float32 inputs), so that a block's results are bitwise those of its
nodes run one by one. Called through `_decode_pool.shared_call` (the pool's workers, or alone on a
mailbox of the call: the same compiled code, so the same results); each returns what it computed.
"""
from __future__ import annotations

import numba
import numpy as np

from runnx.ops._decode_pool import _products
from runnx.ops._kernels_fused import add_rms_norm, silu_mul_into
from runnx.ops._kernels_linalg import chunk_count

_jit = numba.njit(cache=True, nogil=True, error_model="numpy")


@_jit
def _product(box, workers, row, matrix):
    """row @ matrix as one pool job."""
    out = np.empty(matrix.shape[1], np.float32)
    _products(box, workers, row, (matrix,), (out,), np.empty(chunk_count(row.size) * out.size, np.float32))
    return out


@_jit
def projected_gate(box, workers, x, weight, residual, epsilon, one, norm_weight, gate_weight, up_weight):
    """(s, gate, -gate, up, max(-gate)) for s = residual + x @ weight and gate, up its RMSNorm @
    gate_weight, @ up_weight (one job for the two), float32 rows and C-contiguous matrices: an
    attention's output projection, the residual add, the MLP's norm and its gate and up products."""
    summed = _product(box, workers, x, weight)
    normed = add_rms_norm(residual, summed, summed, epsilon, one, norm_weight)
    gate, up = np.empty(gate_weight.shape[1], np.float32), np.empty(up_weight.shape[1], np.float32)
    _products(box, workers, normed, (gate_weight, up_weight), (gate, up),
              np.empty(chunk_count(normed.size) * (gate.size + up.size), np.float32))
    negated = np.empty_like(gate)
    largest = -np.inf
    for i in range(gate.size):
        negated[i] = -gate[i]
        largest = max(largest, negated[i])
    return summed, gate, negated, up, largest


@_jit
def gated_down(box, workers, gate, decay, up, weight, residual, epsilon, one, norm_weight):
    """(residual + silu(gate) * up @ weight, its RMSNorm) for decay = exp(-gate) (numpy's): the
    MLP's activation, down product, residual add and the next norm."""
    summed = _product(box, workers, silu_mul_into(gate, decay, up), weight)
    return summed, add_rms_norm(residual, summed, summed, epsilon, one, norm_weight)
