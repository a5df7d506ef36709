"""numba kernels behind onnxruntime's contrib operators (`contrib_*.py`): the skip-add norms and the
block-quantized (MatMulNBits) products that read packed weights directly."""
from __future__ import annotations

import math

import numba
import numpy as np


@numba.njit(cache=True)
def skip_norm_rows(x, skip, bias, gamma, beta, epsilon, simplified, out, total, mean, inv_std):
    """Per row r: s = x[r] + skip[r % len(skip)] + bias (into total[r]), then LayerNorm (mean from
    E[s] and variance E[s^2] - E[s]^2, as onnxruntime computes it) or RMSNorm (simplified) of s,
    times gamma plus beta. bias and beta have no elements when absent."""
    rows, cols = x.shape
    skip_rows = skip.shape[0]
    has_bias, has_beta = bias.shape[0] > 0, beta.shape[0] > 0
    for r in range(rows):
        s = r % skip_rows if skip_rows else 0
        acc, squares = 0.0, 0.0
        for c in range(cols):
            value = x[r, c]
            if skip_rows:
                value += skip[s, c]
            if has_bias:
                value += bias[c]
            total[r, c] = value
            acc += value
            squares += value * value
        average = 0.0 if simplified else acc / cols
        variance = squares / cols - average * average
        inverse = 1.0 / math.sqrt(variance + epsilon)
        mean[r] = average
        inv_std[r] = inverse
        for c in range(cols):
            value = (total[r, c] - average) * inverse * gamma[c]
            if has_beta:
                value += beta[c]
            out[r, c] = value
