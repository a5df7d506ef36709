"""Resampling: Resize (every mode, coordinate transform, antialias, axes, aspect policy), Upsample,
GridSample and AffineGrid.

Resize is separable: each resized axis gets a small table of source taps and weights per output
index (nearest: one tap; linear: 2; cubic: 4; antialiased: the filter stretched by 1/scale), and is
applied with one `np.take` per tap. GridSample gathers its taps for all output points at once.
"""
from __future__ import annotations

import itertools
import math

import numpy as np

from runnx.errors import RunnxError
from runnx.ops.registry import register

Ints = tuple[int, ...] | None


def _source_coordinates(mode: str, out_len: int, in_len: int, scale: float, roi_start: float, roi_end: float):
    """Source coordinate of every output index along one axis (the spec's coordinate_transformation_mode)."""
    y = np.arange(out_len, dtype=np.float64)
    out_extent = scale * in_len  # the un-rounded output length
    if mode == "half_pixel":
        return (y + 0.5) / scale - 0.5
    if mode == "half_pixel_symmetric":
        offset = in_len / 2 * (1 - out_len / out_extent)
        return offset + (y + 0.5) / scale - 0.5
    if mode == "pytorch_half_pixel":
        return (y + 0.5) / scale - 0.5 if out_len > 1 else np.full(out_len, -0.5)
    if mode == "align_corners":
        return y * (in_len - 1) / (out_extent - 1) if out_extent != 1 else np.zeros(out_len)
    if mode == "asymmetric":
        return y / scale
    if mode == "tf_crop_and_resize":
        if out_extent == 1:
            return np.full(out_len, (roi_end - roi_start) * (in_len - 1) / 2 + roi_start * (in_len - 1))
        return y * (roi_end - roi_start) * (in_len - 1) / (out_extent - 1) + roi_start * (in_len - 1)
    raise RunnxError(f"unknown coordinate_transformation_mode '{mode}'")


def _nearest_index(x: np.ndarray, nearest_mode: str) -> np.ndarray:
    if nearest_mode == "round_prefer_floor":
        return np.ceil(x - 0.5)
    if nearest_mode == "round_prefer_ceil":
        return np.floor(x + 0.5)
    if nearest_mode == "floor":
        return np.floor(x)
    if nearest_mode == "ceil":
        return np.ceil(x)
    raise RunnxError(f"unknown nearest_mode '{nearest_mode}'")


def _cubic_kernel(d: np.ndarray, a: float) -> np.ndarray:
    d = np.abs(d)
    near = ((a + 2) * d - (a + 3)) * d * d + 1
    far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
    return np.where(d <= 1, near, np.where(d < 2, far, 0.0))


def _taps(x: np.ndarray, in_len: int, mode: str, scale: float, antialias: bool, cubic_a: float,
          exclude_outside: bool, nearest_mode: str):
    """(indices, weights), each (out_len, taps): the source samples of every output index."""
    if mode == "nearest":
        return np.clip(_nearest_index(x, nearest_mode), 0, in_len - 1).astype(np.intp)[:, None], None
    stretch = min(scale, 1.0) if antialias else 1.0  # antialiasing widens the filter when downsampling
    support = 1 if mode == "linear" else 2
    first = math.floor(-support / stretch) + 1
    base = np.floor(x)
    index = base[:, None] + np.arange(first, 2 - first)[None, :]
    distance = (index - x[:, None]) * stretch
    weight = np.maximum(0.0, 1 - np.abs(distance)) if mode == "linear" else _cubic_kernel(distance, cubic_a)
    if exclude_outside:
        weight = np.where((index < 0) | (index >= in_len), 0.0, weight)
    total = weight.sum(axis=1, keepdims=True)
    weight = weight / np.where(total == 0, 1.0, total)
    return np.clip(index, 0, in_len - 1).astype(np.intp), weight


def _resample_axis(data: np.ndarray, axis: int, index: np.ndarray, weight) -> np.ndarray:
    if weight is None:
        return np.take(data, index[:, 0], axis=axis)
    shape = (1,) * axis + (-1,) + (1,) * (data.ndim - axis - 1)
    result = None
    for t in range(index.shape[1]):
        term = np.take(data, index[:, t], axis=axis) * weight[:, t].astype(data.dtype).reshape(shape)
        result = term if result is None else np.add(result, term, out=result)
    return result


def _resize(x, scales, sizes, roi, *, mode, coordinate_transformation_mode="half_pixel", cubic_coeff_a=-0.75,
            exclude_outside=0, extrapolation_value=0.0, nearest_mode="round_prefer_floor", antialias=0,
            axes=None, keep_aspect_ratio_policy="stretch", ctx):
    rank = x.ndim
    axes = [a + rank if a < 0 else a for a in axes] if axes else list(range(rank))
    if mode not in ("nearest", "linear", "cubic"):
        raise RunnxError(f"unknown Resize mode '{mode}'")
    roi_values = np.asarray(roi, dtype=np.float64).reshape(-1) if roi is not None and np.size(roi) else None
    if sizes is not None and np.size(sizes):
        sizes = [int(v) for v in np.asarray(sizes).reshape(-1)]
        if len(sizes) != len(axes):
            raise RunnxError(f"Resize got {len(sizes)} sizes for {len(axes)} axes")
        scale_list = [sizes[i] / x.shape[a] if x.shape[a] else 1.0 for i, a in enumerate(axes)]
        if keep_aspect_ratio_policy != "stretch":
            if keep_aspect_ratio_policy not in ("not_larger", "not_smaller"):
                raise RunnxError(f"unknown keep_aspect_ratio_policy '{keep_aspect_ratio_policy}'")
            common = min(scale_list) if keep_aspect_ratio_policy == "not_larger" else max(scale_list)
            scale_list = [common] * len(axes)
            sizes = [int(common * x.shape[a] + 0.5) for a in axes]
    elif scales is not None and np.size(scales):
        scale_list = [float(s) for s in np.asarray(scales).reshape(-1)]
        if not all(0 < s < math.inf for s in scale_list):
            raise RunnxError(f"Resize scales must be positive, got {scale_list}")
        if len(scale_list) == rank and len(axes) != rank:
            scale_list = [scale_list[a] for a in axes]
        if len(scale_list) != len(axes):
            raise RunnxError(f"Resize got {len(scale_list)} scales for {len(axes)} axes")
        sizes = [int(math.floor(s * x.shape[a])) for s, a in zip(scale_list, axes)]
    else:
        raise RunnxError("Resize needs either scales or sizes")
    if any(size < 0 for size in sizes):
        raise RunnxError(f"Resize output sizes must not be negative, got {sizes}")
    out_shape = list(x.shape)
    for axis, size in zip(axes, sizes):
        out_shape[axis] = size
    ctx.check_elements(out_shape, "Resize output")
    if 0 in out_shape or x.size == 0:
        return np.zeros(out_shape, x.dtype)
    work_dtype = x.dtype if x.dtype in (np.float32, np.float64) else np.dtype(np.float32)
    result = x if mode == "nearest" else x.astype(work_dtype, copy=False)
    for i, axis in enumerate(axes):
        in_len, out_len, scale = x.shape[axis], sizes[i], scale_list[i]
        if roi_values is not None:
            roi_start, roi_end = roi_values[i], roi_values[i + len(axes)]
        else:
            roi_start, roi_end = 0.0, 1.0
        if out_len == in_len and scale == 1 and (roi_start, roi_end) == (0.0, 1.0):
            continue
        coords = _source_coordinates(coordinate_transformation_mode, out_len, in_len, scale, roi_start, roi_end)
        index, weight = _taps(coords, in_len, mode, scale, bool(antialias), cubic_coeff_a, bool(exclude_outside),
                              nearest_mode)
        result = _resample_axis(result, axis, index, weight)
        if coordinate_transformation_mode == "tf_crop_and_resize":
            outside = (coords < 0) | (coords > in_len - 1)
            if outside.any():
                shape = (1,) * axis + (-1,) + (1,) * (rank - axis - 1)
                result = np.where(outside.reshape(shape), np.asarray(extrapolation_value, result.dtype), result)
    if result.dtype != x.dtype:
        if x.dtype.kind in "iu":
            info = np.iinfo(x.dtype)
            result = np.clip(np.round(result), info.min, info.max)
        result = result.astype(x.dtype)
    return result


@register("Resize", since=10)
def Resize_10(x, scales, *, mode: str = "nearest", ctx):
    # opset 10 resized like Upsample: asymmetric coordinates, nearest rounds down
    return _resize(x, scales, None, None, mode=mode, coordinate_transformation_mode="asymmetric",
                   nearest_mode="floor", ctx=ctx)


@register("Resize", since=11)
def Resize_11(x, roi=None, scales=None, sizes=None, *, coordinate_transformation_mode: str = "half_pixel",
              cubic_coeff_a: float = -0.75, exclude_outside: int = 0, extrapolation_value: float = 0.0,
              mode: str = "nearest", nearest_mode: str = "round_prefer_floor", ctx):
    return _resize(x, scales, sizes, roi, mode=mode, coordinate_transformation_mode=coordinate_transformation_mode,
                   cubic_coeff_a=cubic_coeff_a, exclude_outside=exclude_outside,
                   extrapolation_value=extrapolation_value, nearest_mode=nearest_mode, ctx=ctx)


@register("Resize", since=18)
def Resize(x, roi=None, scales=None, sizes=None, *, antialias: int = 0, axes: Ints = None,
           coordinate_transformation_mode: str = "half_pixel", cubic_coeff_a: float = -0.75,
           exclude_outside: int = 0, extrapolation_value: float = 0.0, keep_aspect_ratio_policy: str = "stretch",
           mode: str = "nearest", nearest_mode: str = "round_prefer_floor", ctx):
    return _resize(x, scales, sizes, roi, mode=mode, coordinate_transformation_mode=coordinate_transformation_mode,
                   cubic_coeff_a=cubic_coeff_a, exclude_outside=exclude_outside,
                   extrapolation_value=extrapolation_value, nearest_mode=nearest_mode, antialias=antialias,
                   axes=axes, keep_aspect_ratio_policy=keep_aspect_ratio_policy, ctx=ctx)


def _upsample(x, scales, mode, ctx):
    if mode == "bilinear":
        mode = "linear"
    return _resize(x, scales, None, None, mode=mode, coordinate_transformation_mode="asymmetric",
                   nearest_mode="floor", ctx=ctx)


@register("Upsample", since=7)
def Upsample_7(x, *, mode: str = "nearest", scales: tuple[float, ...], ctx):
    return _upsample(x, np.asarray(scales), mode, ctx)


@register("Upsample", since=9)
def Upsample(x, scales, *, mode: str = "nearest", ctx):
    return _upsample(x, scales, mode, ctx)


def _reflect(v: np.ndarray, low: float, high: float) -> np.ndarray:
    """Fold coordinates into [low, high] by reflecting at the borders (repeatedly)."""
    span = high - low
    if span <= 0:
        return np.full_like(v, low)
    below, above = low - v, v - high
    beyond = np.where(v < low, below, np.where(v > high, above, 0.0))
    turns = np.floor(beyond / span)
    rest = beyond - turns * span
    even = turns % 2 == 0
    folded_low = np.where(even, low + rest, high - rest)
    folded_high = np.where(even, high - rest, low + rest)
    return np.where(v < low, folded_low, np.where(v > high, folded_high, v))


def _grid_sample(x, grid, mode: str, padding_mode: str, align_corners: int):
    if mode not in ("nearest", "linear", "cubic"):
        raise RunnxError(f"unknown GridSample mode '{mode}'")
    if padding_mode not in ("zeros", "border", "reflection"):
        raise RunnxError(f"unknown GridSample padding_mode '{padding_mode}'")
    n, channels = x.shape[:2]
    dims = x.shape[2:]
    rank = len(dims)
    out_shape = grid.shape[1:-1]
    points = grid.reshape(n, -1, rank).astype(np.float64)[:, :, ::-1]  # grid lists x (the last axis) first
    per_axis = []  # for each spatial axis: list of (index, weight) taps, each (N, P)
    for axis, size in enumerate(dims):
        g = points[:, :, axis]
        low, high = (0.0, size - 1.0) if align_corners else (-0.5, size - 0.5)
        coord = (g + 1) / 2 * (size - 1) if align_corners else ((g + 1) * size - 1) / 2
        if mode == "nearest":
            coord = np.rint(coord)
        outside = (coord < low) | (coord > high)
        if padding_mode == "border":  # only coordinates beyond the border move (cubic sees the difference)
            coord = np.where(outside, np.clip(coord, 0, size - 1), coord)
        elif padding_mode == "reflection":
            coord = _reflect(coord, low, high)
        base = np.floor(coord)
        frac = coord - base
        if mode == "nearest":
            offsets, weights = [0], [np.ones_like(coord)]
        elif mode == "linear":
            offsets, weights = [0, 1], [1 - frac, frac]
        else:
            offsets = [-1, 0, 1, 2]
            weights = [_cubic_kernel(frac - o, -0.75) for o in offsets]
        taps = []
        for offset, weight in zip(offsets, weights):
            index = base + offset
            if padding_mode == "zeros":
                weight = np.where((index >= 0) & (index < size), weight, 0.0)
            elif padding_mode == "border":
                index = np.clip(index, 0, size - 1)
            else:
                index = np.clip(np.trunc(_reflect(index, low, high)), 0, size - 1)
            taps.append((np.clip(index, 0, size - 1).astype(np.intp), weight))
        per_axis.append(taps)
    flat = np.moveaxis(x, 1, -1).reshape(n, -1, channels)  # (N, spatial, C)
    strides = [math.prod(dims[a + 1:]) for a in range(rank)]
    batch = np.arange(n)[:, None]
    out = np.zeros((n, points.shape[1], channels), dtype=np.float64)
    for combo in itertools.product(*per_axis):
        position = sum(index * stride for (index, _), stride in zip(combo, strides))
        weight = math.prod(w for _, w in combo)
        out += flat[batch, position] * weight[:, :, None]
    return np.moveaxis(out, -1, 1).reshape((n, channels) + tuple(out_shape)).astype(x.dtype)


@register("GridSample", since=16)
def GridSample_16(x, grid, *, align_corners: int = 0, mode: str = "bilinear", padding_mode: str = "zeros"):
    names = {"bilinear": "linear", "bicubic": "cubic", "nearest": "nearest"}
    if mode not in names:
        raise RunnxError(f"unknown GridSample mode '{mode}'")
    return _grid_sample(x, grid, names[mode], padding_mode, align_corners)


@register("GridSample", since=20)
def GridSample(x, grid, *, align_corners: int = 0, mode: str = "linear", padding_mode: str = "zeros"):
    return _grid_sample(x, grid, mode, padding_mode, align_corners)


@register("AffineGrid", since=20)
def AffineGrid(theta, size, *, align_corners: int = 0, ctx):
    shape = [int(v) for v in size]
    spatial = shape[2:]
    if len(spatial) not in (2, 3) or theta.shape[1:] != (len(spatial), len(spatial) + 1):
        raise RunnxError(f"AffineGrid: theta {theta.shape} does not fit size {shape}")
    ctx.check_elements([theta.shape[0]] + spatial + [len(spatial)], "AffineGrid output")
    lines = []
    for length in spatial:
        steps = np.arange(length, dtype=np.float64)
        lines.append(np.linspace(-1, 1, length) if align_corners else (2 * steps + 1) / length - 1)
    mesh = np.meshgrid(*lines, indexing="ij")  # axis order (D,) H, W
    base = np.stack([m.reshape(-1) for m in reversed(mesh)] + [np.ones(math.prod(spatial))], axis=-1)
    grid = np.einsum("pk,njk->npj", base, theta.astype(np.float64))
    return grid.reshape([shape[0]] + spatial + [len(spatial)]).astype(theta.dtype)
