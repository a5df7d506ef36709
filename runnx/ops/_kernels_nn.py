"""numba kernels of the neural-network families, for loops numpy cannot vectorise (per-ROI sampling grids)."""
from __future__ import annotations

import math

import numba
import numpy as np

from runnx.ops import _jit_cache  # noqa: F401  (numba caches this module's kernels under RUNNX_CACHE)
from runnx.ops._vector_width import full_width


@numba.njit(cache=True)
def _bilinear_corners(y, x, height, width):
    """(flat index, weight) of the 4 neighbours of (y, x), onnxruntime's RoiAlign clamping; weights 0 outside."""
    index = np.zeros(4, dtype=np.int64)
    weight = np.zeros(4)
    if y < -1.0 or y > height or x < -1.0 or x > width:
        return index, weight
    y = max(y, 0.0)
    x = max(x, 0.0)
    y_low, x_low = int(y), int(x)
    if y_low >= height - 1:
        y_low = y_high = height - 1
        y = float(y_low)
    else:
        y_high = y_low + 1
    if x_low >= width - 1:
        x_low = x_high = width - 1
        x = float(x_low)
    else:
        x_high = x_low + 1
    ly, lx = y - y_low, x - x_low
    hy, hx = 1.0 - ly, 1.0 - lx
    index[0], index[1] = y_low * width + x_low, y_low * width + x_high
    index[2], index[3] = y_high * width + x_low, y_high * width + x_high
    weight[0], weight[1], weight[2], weight[3] = hy * hx, hy * lx, ly * hx, ly * lx
    return index, weight


@numba.njit(cache=True)
def roi_align(x, rois, batch_indices, pooled_h, pooled_w, sampling_ratio, scale, use_max, half_pixel):
    """RoiAlign over x (N, C, H, W) float64 -> (R, C, pooled_h, pooled_w); max mode takes the largest
    weighted corner, as onnxruntime does."""
    channels, height, width = x.shape[1], x.shape[2], x.shape[3]
    out = np.zeros((rois.shape[0], channels, pooled_h, pooled_w))
    shift = 0.5 if half_pixel else 0.0
    for r in range(rois.shape[0]):
        image = x[batch_indices[r]].reshape(channels, height * width)
        start_w, start_h = rois[r, 0] * scale - shift, rois[r, 1] * scale - shift
        roi_w, roi_h = rois[r, 2] * scale - shift - start_w, rois[r, 3] * scale - shift - start_h
        if not half_pixel:  # malformed ROIs become 1x1
            roi_w, roi_h = max(roi_w, 1.0), max(roi_h, 1.0)
        bin_h, bin_w = roi_h / pooled_h, roi_w / pooled_w
        grid_h = sampling_ratio if sampling_ratio > 0 else int(math.ceil(roi_h / pooled_h))
        grid_w = sampling_ratio if sampling_ratio > 0 else int(math.ceil(roi_w / pooled_w))
        count = max(grid_h * grid_w, 1)
        for ph in range(pooled_h):
            for pw in range(pooled_w):
                first = True
                for iy in range(grid_h):
                    y = start_h + ph * bin_h + (iy + 0.5) * bin_h / grid_h
                    for ix in range(grid_w):
                        xx = start_w + pw * bin_w + (ix + 0.5) * bin_w / grid_w
                        index, weight = _bilinear_corners(y, xx, height, width)
                        for c in range(channels):
                            if use_max:
                                value = weight[0] * image[c, index[0]]
                                for k in range(1, 4):
                                    value = max(value, weight[k] * image[c, index[k]])
                                if first or value > out[r, c, ph, pw]:
                                    out[r, c, ph, pw] = value
                            else:
                                value = 0.0
                                for k in range(4):
                                    value += weight[k] * image[c, index[k]]
                                out[r, c, ph, pw] += value
                        first = False
                if not use_max:
                    for c in range(channels):
                        out[r, c, ph, pw] /= count
    return out


@numba.njit(cache=True)
def pairwise_total(terms, n):
    """terms[0] + ... + terms[n - 1] (n >= 1) as a fixed pairwise tree, overwriting terms: halvings
    terms[j] += terms[j + half] (an odd one out joins the first) down to 8, then those in order.
    Each step is element by element, so it vectorises without fast-math flags and every compiled
    copy of a caller (a decode block's, a pool worker's) rounds alike; eight running sums, whose
    order no flag may change, stay scalar."""
    full_width()
    while n > 8:
        half = n // 2
        for j in range(half):
            terms[j] += terms[j + half]
        if n % 2:
            terms[0] += terms[n - 1]
        n = half
    total = terms[0]
    for j in range(1, n):
        total += terms[j]
    return total


@numba.njit(cache=True)
def _float64_sum(row, centre, squares, scratch):
    """sum(row - centre) (squares False) or sum((row - centre) ** 2) in float64 (`pairwise_total`
    of the terms in scratch, float64 of row's length)."""
    full_width()
    if squares:
        for j in range(row.shape[0]):
            v = np.float64(row[j]) - centre
            scratch[j] = v * v
    else:
        for j in range(row.shape[0]):
            scratch[j] = np.float64(row[j]) - centre
    return pairwise_total(scratch, row.shape[0])


@numba.njit(cache=True, nogil=True)
def layer_norm_rows(x, scale, bias, epsilon, out, mean, inv_std):
    """Normalise every row of x (rows, cols) in two passes, statistics accumulated in float64
    (`_float64_sum`); writes out = (x - mean) * inv_std * scale + bias, and the per-row mean and
    inv_std."""
    full_width()
    scratch = np.empty(x.shape[1])
    for r in range(x.shape[0]):
        mean[r], inv_std[r] = _normalised_row(x[r], scale, bias, epsilon, out[r], scratch)


@numba.njit(cache=True, nogil=True)
def add_layer_norm_rows(a, b, offset, scale, bias, epsilon, summed, out):
    """summed = a + (b + offset) (an empty offset: a + b), row by row, each normalised into out as
    `layer_norm_rows` does while in cache: a residual add, the bias of the product b before it,
    and the norm in one pass over memory where numpy's adds took two more. summed may be a or b."""
    full_width()
    scratch = np.empty(a.shape[1])
    for r in range(a.shape[0]):
        row, first, second = summed[r], a[r], b[r]
        if offset.shape[0]:
            for c in range(row.shape[0]):
                row[c] = first[c] + (second[c] + offset[c])
        else:
            for c in range(row.shape[0]):
                row[c] = first[c] + second[c]
        _normalised_row(row, scale, bias, epsilon, out[r], scratch)


@numba.njit(cache=True)
def _normalised_row(row, scale, bias, epsilon, out, scratch):
    """out = LayerNorm(row); (mean, 1/std)."""
    full_width()
    m = _float64_sum(row, 0.0, False, scratch) / row.shape[0]
    inv = 1.0 / math.sqrt(_float64_sum(row, m, True, scratch) / row.shape[0] + epsilon)
    _normalised(row, m, inv, scale, bias, out)
    return m, inv


@numba.njit(cache=True, fastmath={"contract", "nsz", "arcp"})
def _normalised(row, m, inv, scale, bias, out):
    """out = (row - m) * inv * scale + bias, element by element (no sum for the flags to reorder)."""
    full_width()
    for c in range(row.shape[0]):
        out[c] = (row[c] - m) * inv * scale[c] + bias[c]
