"""Convolutions: Conv, ConvInteger, ConvTranspose, DeformConv, CausalConvWithState (opset 27).

Conv is im2col + one batched BLAS matmul (`_nn_util.convolve`); ConvTranspose is the adjoint: one
matmul to columns, then a scatter-add per kernel offset (a handful of strided slice additions,
vectorised over all pixels). DeformConv samples its columns bilinearly with numpy gathers.
"""
from __future__ import annotations

import itertools
import math

import numpy as np

from runnx.errors import RunnxError
from runnx.ops._nn_util import convolve, resolve_padding, spatial_attrs
from runnx.ops.registry import register
from runnx.ops._matmul import matmul

Ints = tuple[int, ...] | None


_NARROW_FLOATS = ("float16", "bfloat16")  # bfloat16: ml_dtypes', by name (it is imported when needed)


def _accumulation_dtype(dtype: np.dtype) -> np.dtype:
    """float32 for half-precision inputs: BLAS has no float16 GEMM, and numpy's own float16 matmul
    accumulates in float32 anyway, only much more slowly."""
    return np.dtype(np.float32) if dtype.name in _NARROW_FLOATS else dtype


def _add_bias(out: np.ndarray, bias) -> np.ndarray:
    if bias is not None:
        out += bias.reshape((1, -1) + (1,) * (out.ndim - 2)).astype(out.dtype, copy=False)
    return out


def _conv_geometry(x, w, auto_pad, dilations, kernel_shape, pads, strides):
    kernel = tuple(kernel_shape) if kernel_shape else w.shape[2:]
    strides, dilations, pads = spatial_attrs(x.ndim - 2, kernel, strides, dilations, pads)
    padding = resolve_padding(x.shape[2:], kernel, strides, dilations, pads, auto_pad)
    return strides, dilations, padding.begin, padding.end, padding.out_shape


@register("Conv", since=1)
def Conv(x, w, b=None, *, auto_pad: str = "NOTSET", dilations: Ints = None, group: int = 1,
         kernel_shape: Ints = None, pads: Ints = None, strides: Ints = None):
    strides, dilations, begin, end, out_shape = _conv_geometry(x, w, auto_pad, dilations, kernel_shape, pads, strides)
    work = _accumulation_dtype(x.dtype)
    out = convolve(x.astype(work, copy=False), w.astype(work, copy=False), group, strides, dilations, begin, end,
                   out_shape)
    return _add_bias(out, b).astype(x.dtype, copy=False)


@register("ConvInteger", since=10)
def ConvInteger(x, w, x_zero_point=None, w_zero_point=None, *, auto_pad: str = "NOTSET", dilations: Ints = None,
                group: int = 1, kernel_shape: Ints = None, pads: Ints = None, strides: Ints = None):
    strides, dilations, begin, end, out_shape = _conv_geometry(x, w, auto_pad, dilations, kernel_shape, pads, strides)
    # subtracting the zero points first makes the padding value 0, as the spec wants (pad = x_zero_point)
    xs = x.astype(np.int32) - (np.int32(0) if x_zero_point is None else x_zero_point.astype(np.int32))
    w_zero = np.int32(0) if w_zero_point is None else w_zero_point.astype(np.int32)
    if np.ndim(w_zero) == 1:  # per output channel
        w_zero = w_zero.reshape((-1,) + (1,) * (w.ndim - 1))
    ws = w.astype(np.int32) - w_zero
    return convolve(xs, ws, group, strides, dilations, begin, end, out_shape)


def _transpose_padding(in_shape, kernel, strides, dilations, pads, output_padding, output_shape, auto_pad):
    """(pads_begin, out_shape) of ConvTranspose, following the spec's rules for output_shape and auto_pad."""
    rank = len(in_shape)
    natural = [strides[i] * (in_shape[i] - 1) + output_padding[i] + (kernel[i] - 1) * dilations[i] + 1
               for i in range(rank)]
    if output_shape or auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        target = (tuple(output_shape)[-rank:] if output_shape
                  else tuple(in_shape[i] * strides[i] for i in range(rank)))
        begin = []
        for i in range(rank):
            total = natural[i] - target[i]
            begin.append(total // 2 if auto_pad == "SAME_UPPER" else total - total // 2)
        return tuple(begin), target
    return tuple(pads[:rank]), tuple(natural[i] - pads[i] - pads[i + rank] for i in range(rank))


@register("ConvTranspose", since=1)
def ConvTranspose(x, w, b=None, *, auto_pad: str = "NOTSET", dilations: Ints = None, group: int = 1,
                  kernel_shape: Ints = None, output_padding: Ints = None, output_shape: Ints = None,
                  pads: Ints = None, strides: Ints = None, ctx):
    n, channels = x.shape[:2]
    in_shape = x.shape[2:]
    rank = len(in_shape)
    kernel = tuple(kernel_shape) if kernel_shape else w.shape[2:]
    strides, dilations, pads = spatial_attrs(rank, kernel, strides, dilations, pads)
    output_padding = tuple(output_padding) if output_padding else (0,) * rank
    if channels != w.shape[0] or channels % group:
        raise RunnxError(f"input channels {channels} do not match weight {w.shape} and group {group}")
    c_group, m_group = channels // group, w.shape[1]
    m = m_group * group
    begin, out_shape = _transpose_padding(in_shape, kernel, strides, dilations, pads, output_padding,
                                          output_shape, auto_pad)
    # columns[n, g, (m, k...), pixel] = sum_c w[g, c, (m, k...)] * x[n, g, c, pixel]
    work = _accumulation_dtype(x.dtype)
    weight = w.astype(work, copy=False).reshape(group, c_group, m_group * math.prod(kernel))
    columns = matmul(weight.transpose(0, 2, 1), x.astype(work, copy=False).reshape(n, group, c_group, -1))
    columns = columns.reshape((n, m) + tuple(kernel) + tuple(in_shape))
    # scatter-add the columns into the uncropped output, one kernel offset at a time
    full_shape = [max(strides[i] * (in_shape[i] - 1) + (kernel[i] - 1) * dilations[i] + 1,
                      begin[i] + out_shape[i]) for i in range(rank)]
    lead = max(0, -min(begin))  # a negative begin pad means output before the first input position
    ctx.check_elements((n, m) + tuple(s + lead for s in full_shape), "ConvTranspose output")
    full = np.zeros((n, m) + tuple(s + lead for s in full_shape), dtype=work)
    for offset in itertools.product(*(range(k) for k in kernel)):
        target = tuple(slice(lead + o * d, lead + o * d + (size - 1) * s + 1, s)
                       for o, d, s, size in zip(offset, dilations, strides, in_shape))
        full[(slice(None), slice(None)) + target] += columns[(slice(None), slice(None)) + offset]
    crop = tuple(slice(lead + b, lead + b + size) for b, size in zip(begin, out_shape))
    out = np.ascontiguousarray(full[(slice(None), slice(None)) + crop])
    return _add_bias(out, b).astype(x.dtype, copy=False)


def _bilinear_gather(image: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """Bilinear samples of image (N, G, C, H, W) at (rows, cols) of shape (N, G, P); zero outside -> (N, G, C, P)."""
    height, width = image.shape[-2:]
    flat = image.reshape(image.shape[:3] + (height * width,))
    top, left = np.floor(rows), np.floor(cols)
    result = 0
    for dy, dx in ((0, 0), (0, 1), (1, 0), (1, 1)):
        r, c = top + dy, left + dx
        weight = (1 - np.abs(rows - r)) * (1 - np.abs(cols - c))
        inside = (r >= 0) & (r < height) & (c >= 0) & (c < width)
        index = np.where(inside, r * width + c, 0).astype(np.intp)
        values = np.take_along_axis(flat, index[:, :, None, :], axis=3)
        result = result + values * np.where(inside, weight, 0)[:, :, None, :]
    return result


@register("DeformConv", since=19)
def DeformConv(x, w, offset, b=None, mask=None, *, dilations: Ints = None, group: int = 1,
               kernel_shape: Ints = None, offset_group: int = 1, pads: Ints = None, strides: Ints = None):
    if x.ndim != 4:
        raise RunnxError("DeformConv is implemented for 2-d images (N, C, H, W) only")
    n, channels, height, width = x.shape
    kernel = tuple(kernel_shape) if kernel_shape else w.shape[2:]
    strides, dilations, pads = spatial_attrs(2, kernel, strides, dilations, pads)
    out_h, out_w = offset.shape[2:]
    taps = kernel[0] * kernel[1]
    # sampling grid before offsets: (K, P) rows and columns
    ki, kj = np.meshgrid(np.arange(kernel[0]), np.arange(kernel[1]), indexing="ij")
    oi, oj = np.meshgrid(np.arange(out_h), np.arange(out_w), indexing="ij")
    base_rows = (oi.reshape(1, -1) * strides[0] - pads[0] + ki.reshape(-1, 1) * dilations[0])
    base_cols = (oj.reshape(1, -1) * strides[1] - pads[1] + kj.reshape(-1, 1) * dilations[1])
    shifts = offset.reshape(n, offset_group, taps, 2, out_h * out_w)
    rows = (base_rows + shifts[:, :, :, 0]).reshape(n, offset_group, -1)
    cols = (base_cols + shifts[:, :, :, 1]).reshape(n, offset_group, -1)
    image = x.reshape(n, offset_group, channels // offset_group, height, width)
    sampled = _bilinear_gather(image, rows, cols)  # (N, OG, C/OG, K*P)
    sampled = sampled.reshape(n, offset_group, channels // offset_group, taps, out_h * out_w)
    if mask is not None:
        sampled = sampled * mask.reshape(n, offset_group, 1, taps, out_h * out_w)
    columns = sampled.reshape(n, group, channels // group * taps, out_h * out_w).astype(x.dtype, copy=False)
    m = w.shape[0]
    out = matmul(w.reshape(group, m // group, -1), columns).reshape(n, m, out_h, out_w)
    return _add_bias(out, b)


@register("CausalConvWithState", since=27)
def CausalConvWithState(x, w, b=None, past_state=None, *, activation: str = "none"):
    if activation not in ("none", "silu", "swish"):
        raise RunnxError(f"CausalConvWithState activation must be 'none', 'silu' or 'swish', got '{activation}'")
    if x.ndim != 3 or w.ndim != 3 or w.shape[:2] != (x.shape[1], 1):
        raise RunnxError(f"CausalConvWithState expects input (B, C, L) and weight (C, 1, k), got {x.shape}, {w.shape}")
    batch, channels, length = x.shape
    taps = w.shape[2]
    past = np.zeros((batch, channels, taps - 1), dtype=x.dtype) if past_state is None else past_state
    padded = np.concatenate([past.astype(x.dtype, copy=False), x], axis=2)
    # depthwise: one multiply-add of the whole sequence per kernel tap
    out = np.zeros((batch, channels, length), dtype=np.float32 if x.dtype.itemsize < 4 else x.dtype)
    for tap in range(taps):
        out += w[None, :, 0, tap, None] * padded[:, :, tap:tap + length]
    if b is not None:
        out += b[None, :, None]
    if activation != "none":
        out = out / (1.0 + np.exp(-out))
    return out.astype(x.dtype, copy=False), padded[:, :, padded.shape[2] - (taps - 1):]
