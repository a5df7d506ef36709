"""Pooling: MaxPool (with indices), AveragePool, LpPool, the Global* pools, MaxUnpool, MaxRoiPool, RoiAlign.

Windowed pools read a strided view (N, C, *out, *kernel) of the padded input and reduce it one
kernel offset at a time: each step is one vectorised numpy operation over every output pixel, and
there are only prod(kernel) steps. RoiAlign's per-sample bilinear loops live in numba.
"""
from __future__ import annotations

import itertools
import math

import numpy as np

from runnx.errors import RunnxError
from runnx.ops._kernels_nn import roi_align
from runnx.ops._nn_util import Padding, pad_spatial, resolve_padding, spatial_attrs, windows, lowest
from runnx.ops.registry import register

Ints = tuple[int, ...] | None


def _geometry(x, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode):
    if not kernel_shape:
        raise RunnxError("pooling needs kernel_shape")
    kernel = tuple(kernel_shape)
    strides, dilations, pads = spatial_attrs(x.ndim - 2, kernel, strides, dilations, pads)
    padding = resolve_padding(x.shape[2:], kernel, strides, dilations, pads, auto_pad, ceil_mode)
    return kernel, strides, dilations, padding


def _summable(x: np.ndarray) -> np.ndarray:
    """x in a type whose sums do not lose precision: half floats are summed in float32."""
    return x.astype(np.float32) if x.dtype.itemsize < 4 else x


def _reduce_windows(x, kernel, strides, dilations, padding: Padding, fill, combine):
    """combine(acc, window_values) folded over the kernel offsets; returns (N, C, *out)."""
    padded = pad_spatial(x, padding.begin, padding.reach, fill)
    view = windows(padded, kernel, strides, dilations, padding.out_shape)
    offsets = itertools.product(*(range(k) for k in kernel))
    acc = np.array(view[(Ellipsis,) + next(offsets)])
    for offset in offsets:
        combine(acc, view[(Ellipsis,) + offset], out=acc)
    return acc


def _max_indices(x, kernel, strides, dilations, padding: Padding, storage_order):
    """Flat input indices of each window's maximum (first one on ties), as MaxPool's second output."""
    rank = len(kernel)
    padded = pad_spatial(x, padding.begin, padding.reach, lowest(x.dtype))
    view = windows(padded, kernel, strides, dilations, padding.out_shape)
    arg = view.reshape(view.shape[:2 + rank] + (-1,)).argmax(axis=-1)
    taps = np.unravel_index(arg, kernel)
    n, c = x.shape[:2]
    spatial = x.shape[2:]
    coords = []
    for axis in range(rank):
        start = np.arange(padding.out_shape[axis]) * strides[axis] - padding.begin[axis]
        coords.append(start.reshape((-1,) + (1,) * (rank - 1 - axis)) + taps[axis] * dilations[axis])
    if storage_order == 1:  # column-major spatial layout
        flat = np.ravel_multi_index(tuple(reversed(coords)), tuple(reversed(spatial)), mode="clip")
    else:
        flat = np.ravel_multi_index(tuple(coords), spatial, mode="clip")
    base = np.arange(n * c, dtype=np.int64).reshape((n, c) + (1,) * rank) * math.prod(spatial)
    return (base + flat).astype(np.int64)


@register("MaxPool", since=1)
def MaxPool(x, *, auto_pad: str = "NOTSET", ceil_mode: int = 0, dilations: Ints = None,
            kernel_shape: Ints = None, pads: Ints = None, storage_order: int = 0, strides: Ints = None,
            output_count):
    kernel, strides, dilations, padding = _geometry(x, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
    values = _reduce_windows(x, kernel, strides, dilations, padding, lowest(x.dtype), np.maximum)
    if output_count < 2:  # the indices cost an argmax pass: only when asked for
        return values
    return values, _max_indices(x, kernel, strides, dilations, padding, storage_order)


def _window_counts(in_shape, kernel, strides, dilations, padding: Padding, include_pad: bool):
    """How many elements of each window lie in the input (or in input + declared padding)."""
    counts = 1
    rank = len(in_shape)
    for axis in range(rank):
        starts = np.arange(padding.out_shape[axis]) * strides[axis] - padding.begin[axis]
        positions = starts[:, None] + np.arange(kernel[axis]) * dilations[axis]
        low, high = (-padding.begin[axis], in_shape[axis] + padding.end[axis]) if include_pad else (0, in_shape[axis])
        inside = ((positions >= low) & (positions < high)).sum(axis=1)
        counts = counts * inside.reshape((-1,) + (1,) * (rank - 1 - axis))
    return counts


@register("AveragePool", since=1)
def AveragePool(x, *, auto_pad: str = "NOTSET", ceil_mode: int = 0, count_include_pad: int = 0,
                dilations: Ints = None, kernel_shape: Ints = None, pads: Ints = None, strides: Ints = None):
    kernel, strides, dilations, padding = _geometry(x, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
    total = _reduce_windows(_summable(x), kernel, strides, dilations, padding, 0, np.add)
    counts = _window_counts(x.shape[2:], kernel, strides, dilations, padding, bool(count_include_pad))
    return (total / np.maximum(counts, 1)).astype(x.dtype, copy=False)


@register("LpPool", since=2)
def LpPool(x, *, auto_pad: str = "NOTSET", ceil_mode: int = 0, dilations: Ints = None, kernel_shape: Ints = None,
           p: int = 2, pads: Ints = None, strides: Ints = None):
    kernel, strides, dilations, padding = _geometry(x, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
    total = _reduce_windows(np.abs(_summable(x)) ** p, kernel, strides, dilations, padding, 0, np.add)
    return (total ** (1.0 / p)).astype(x.dtype, copy=False)


def _spatial_axes(x):
    return tuple(range(2, x.ndim))


@register("GlobalAveragePool", since=1)
def GlobalAveragePool(x):
    return x.mean(axis=_spatial_axes(x), keepdims=True).astype(x.dtype, copy=False)


@register("GlobalMaxPool", since=1)
def GlobalMaxPool(x):
    return x.max(axis=_spatial_axes(x), keepdims=True)


@register("GlobalLpPool", since=2)
def GlobalLpPool(x, *, p: int = 2):
    total = (np.abs(_summable(x)) ** p).sum(axis=_spatial_axes(x), keepdims=True)
    return (total ** (1.0 / p)).astype(x.dtype, copy=False)


@register("MaxUnpool", since=9)
def MaxUnpool(x, indices, output_shape=None, *, kernel_shape: Ints = None, pads: Ints = None, strides: Ints = None,
              ctx):
    kernel = tuple(kernel_shape or ())
    strides, _, pads = spatial_attrs(x.ndim - 2, kernel, strides, None, pads)
    rank = len(kernel)
    shape = x.shape[:2] + tuple((x.shape[2 + i] - 1) * strides[i] + kernel[i] - pads[i] - pads[i + rank]
                                for i in range(rank))
    ctx.check_elements(shape, "MaxUnpool output")
    out = np.zeros(math.prod(shape), dtype=x.dtype)
    out[indices.reshape(-1)] = x.reshape(-1)
    out = out.reshape(shape)
    if output_shape is None:
        return out
    # the indices address the default shape; a given output_shape extends (or trims) it at the end
    wanted = tuple(int(v) for v in output_shape)
    ctx.check_elements(wanted, "MaxUnpool output")
    result = np.zeros(wanted, dtype=x.dtype)
    common = tuple(slice(0, min(a, b)) for a, b in zip(shape, wanted))
    result[common] = out[common]
    return result


@register("MaxRoiPool", since=1)
def MaxRoiPool(x, rois, *, pooled_shape: tuple[int, ...], spatial_scale: float = 1.0, ctx=None):
    pooled_h, pooled_w = pooled_shape
    height, width = x.shape[2:]
    ctx.check_elements((rois.shape[0], x.shape[1], pooled_h, pooled_w), "MaxRoiPool output")
    out = np.zeros((rois.shape[0], x.shape[1], pooled_h, pooled_w), dtype=x.dtype)
    for r, (batch, x1, y1, x2, y2) in enumerate(rois):
        start_w, start_h = round(float(x1) * spatial_scale), round(float(y1) * spatial_scale)
        end_w, end_h = round(float(x2) * spatial_scale), round(float(y2) * spatial_scale)
        bin_h = max(end_h - start_h + 1, 1) / pooled_h
        bin_w = max(end_w - start_w + 1, 1) / pooled_w
        for ph in range(pooled_h):  # loops over the (small) pooled grid; each bin is one numpy max
            h0 = min(max(math.floor(ph * bin_h) + start_h, 0), height)
            h1 = min(max(math.ceil((ph + 1) * bin_h) + start_h, 0), height)
            for pw in range(pooled_w):
                w0 = min(max(math.floor(pw * bin_w) + start_w, 0), width)
                w1 = min(max(math.ceil((pw + 1) * bin_w) + start_w, 0), width)
                if h1 > h0 and w1 > w0:
                    out[r, :, ph, pw] = x[int(batch), :, h0:h1, w0:w1].max(axis=(1, 2))
    return out


def _roi_align(x, rois, batch_indices, mode, output_height, output_width, sampling_ratio, spatial_scale,
               half_pixel: bool, ctx):
    ctx.check_elements((rois.shape[0], x.shape[1], output_height, output_width), "RoiAlign output")
    if mode not in ("avg", "max"):
        raise RunnxError(f"RoiAlign mode must be 'avg' or 'max', got '{mode}'")
    out = roi_align(np.ascontiguousarray(x, dtype=np.float64), np.ascontiguousarray(rois, dtype=np.float64),
                    np.ascontiguousarray(batch_indices, dtype=np.int64), output_height, output_width,
                    sampling_ratio, float(spatial_scale), mode == "max", half_pixel)
    return out.astype(x.dtype)


@register("RoiAlign", since=10)
def RoiAlign_10(x, rois, batch_indices, *, mode: str = "avg", output_height: int = 1, output_width: int = 1,
                sampling_ratio: int = 0, spatial_scale: float = 1.0, ctx=None):
    # opset 10 had no coordinate_transformation_mode; it behaved like 'output_half_pixel'
    return _roi_align(x, rois, batch_indices, mode, output_height, output_width, sampling_ratio, spatial_scale,
                      False, ctx)


@register("RoiAlign", since=16)
def RoiAlign(x, rois, batch_indices, *, coordinate_transformation_mode: str = "half_pixel", mode: str = "avg",
             output_height: int = 1, output_width: int = 1, sampling_ratio: int = 0, spatial_scale: float = 1.0,
             ctx=None):
    if coordinate_transformation_mode not in ("half_pixel", "output_half_pixel"):
        raise RunnxError(f"unknown coordinate_transformation_mode '{coordinate_transformation_mode}'")
    return _roi_align(x, rois, batch_indices, mode, output_height, output_width, sampling_ratio, spatial_scale,
                      coordinate_transformation_mode == "half_pixel", ctx)
