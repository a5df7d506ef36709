"""Quantisation: QuantizeLinear / DequantizeLinear (per tensor, per axis, blocked; 8/16/4/2-bit integers,
float8 and float4 outputs), DynamicQuantizeLinear, QLinearConv, QLinearMatMul.

Integer arithmetic is exact: quantised operands are widened to int32 after subtracting their zero
points, and only the final requantisation goes through float (round half to even, then saturate).
"""
from __future__ import annotations

import numpy as np

from runnx.errors import RunnxError
from runnx.interp.dtypes import numpy_dtype
from runnx.ops import _native
from runnx.ops._kernels_integer import dequantize_into, dynamic_quantize_into
from runnx.ops._nn_util import convolve, resolve_padding, spatial_attrs
from runnx.ops.registry import register

Ints = tuple[int, ...] | None
# by dtype name: ml_dtypes' types (int4, float8...) without importing it until a value of one exists
_INTEGER_RANGES = {**{np.dtype(t).name: (int(np.iinfo(t).min), int(np.iinfo(t).max))
                      for t in (np.uint8, np.int8, np.uint16, np.int16)},
                   "uint4": (0, 15), "int4": (-8, 7), "uint2": (0, 3), "int2": (-2, 1)}
_FLOAT8 = frozenset(("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz"))


def _broadcastable(value: np.ndarray, shape: tuple[int, ...], axis: int, block_size: int) -> np.ndarray:
    """A scale or zero point shaped to broadcast against x: per tensor, per `axis`, or in blocks along it."""
    if value.ndim == 0 or value.size == 1:
        return value.reshape(())
    axis = axis + len(shape) if axis < 0 else axis
    if not block_size:
        if value.ndim != 1 or value.size != shape[axis]:
            raise RunnxError(f"per-axis scale of shape {value.shape} does not fit axis {axis} of {shape}")
        return value.reshape((1,) * axis + (-1,) + (1,) * (len(shape) - axis - 1))
    expanded = np.repeat(value, block_size, axis=axis)
    expanded = expanded.take(np.arange(shape[axis]), axis=axis)
    if expanded.shape != tuple(shape):
        raise RunnxError(f"blocked scale of shape {value.shape} does not fit {shape} with block_size {block_size}")
    return expanded


def _requantize(real: np.ndarray, zero_point, dtype: np.dtype) -> np.ndarray:
    """round-half-even(real) + zero_point, saturated into integer `dtype`."""
    low, high = _INTEGER_RANGES[dtype.name]
    rounded = np.rint(real)
    if zero_point is not None:
        rounded = rounded + zero_point.astype(np.int64)
    return np.clip(rounded, low, high).astype(dtype)


def _quantize(x, scale, zero_point, *, axis=1, saturate=1, block_size=0, output_dtype=0, precision=0):
    if zero_point is not None:
        dtype = zero_point.dtype
        if output_dtype and numpy_dtype(output_dtype) != dtype:
            raise RunnxError(f"output_dtype {output_dtype} does not match the zero point's type {dtype}")
    else:
        dtype = numpy_dtype(output_dtype) if output_dtype else np.dtype(np.uint8)
    scale = _broadcastable(scale, x.shape, axis, block_size)
    if precision:
        work = numpy_dtype(precision)
        real = x.astype(work) / scale.astype(work)
    else:
        real = x / scale
    if zero_point is not None:
        zero_point = _broadcastable(zero_point, x.shape, axis, block_size)
    if dtype.name in _INTEGER_RANGES:
        return _requantize(real, zero_point, dtype)
    if dtype.name in _FLOAT8:  # float8 zero points are zero by definition
        if saturate:
            import ml_dtypes  # loaded already: `dtype` is its type
            info = ml_dtypes.finfo(dtype)
            real = np.clip(real, float(info.min), float(info.max))
        return real.astype(dtype)
    if dtype.name == "float4_e2m1fn":
        if zero_point is not None:
            real = real + zero_point.astype(np.float32)
        return real.astype(dtype)
    raise RunnxError(f"QuantizeLinear cannot produce {dtype}")


@register("QuantizeLinear", since=10)
def QuantizeLinear_10(x, y_scale, y_zero_point=None):
    return _quantize(x, y_scale, y_zero_point)


@register("QuantizeLinear", since=13)
def QuantizeLinear_13(x, y_scale, y_zero_point=None, *, axis: int = 1):
    return _quantize(x, y_scale, y_zero_point, axis=axis)


@register("QuantizeLinear", since=19)
def QuantizeLinear_19(x, y_scale, y_zero_point=None, *, axis: int = 1, saturate: int = 1):
    return _quantize(x, y_scale, y_zero_point, axis=axis, saturate=saturate)


@register("QuantizeLinear", since=21)
def QuantizeLinear_21(x, y_scale, y_zero_point=None, *, axis: int = 1, block_size: int = 0, output_dtype: int = 0,
                      saturate: int = 1):
    return _quantize(x, y_scale, y_zero_point, axis=axis, saturate=saturate, block_size=block_size,
                     output_dtype=output_dtype)


@register("QuantizeLinear", since=23)
def QuantizeLinear(x, y_scale, y_zero_point=None, *, axis: int = 1, block_size: int = 0, output_dtype: int = 0,
                   precision: int = 0, saturate: int = 1):
    return _quantize(x, y_scale, y_zero_point, axis=axis, saturate=saturate, block_size=block_size,
                     output_dtype=output_dtype, precision=precision)


_PER_TENSOR_KERNEL_DTYPES = (np.dtype(np.int8), np.dtype(np.uint8), np.dtype(np.int16), np.dtype(np.uint16))
_ONNX_FLOAT = 1  # TensorProto.FLOAT
_ONE_PASS_QUANTIZE = 4096  # elements up to which DynamicQuantizeLinear's one pass beats numpy's seven


def dequantize(x, scale, zero_point, *, axis=1, block_size=0, output_dtype=0):
    if (_native.enabled and x.dtype in _PER_TENSOR_KERNEL_DTYPES and scale.size == 1
            and scale.dtype == np.float32 and (zero_point is None or zero_point.size == 1)
            and output_dtype in (0, _ONNX_FLOAT)):  # one scale: one pass, numpy's arithmetic
        out = np.empty(x.shape, np.float32)
        zero = np.float32(0 if zero_point is None else zero_point.reshape(-1)[0])
        dequantize_into(np.ascontiguousarray(x).reshape(-1), zero, np.float32(scale.reshape(-1)[0]), out.reshape(-1))
        return out
    values = x.astype(np.float32)
    # float8 zero points are zero by definition; float4's is added like an integer one
    if zero_point is not None and x.dtype.name not in _FLOAT8:
        values = values - _broadcastable(zero_point, x.shape, axis, block_size).astype(np.float32)
    values = values * _broadcastable(scale, x.shape, axis, block_size)
    return values.astype(numpy_dtype(output_dtype) if output_dtype else scale.dtype)


@register("DequantizeLinear", since=10)
def DequantizeLinear_10(x, x_scale, x_zero_point=None):
    return dequantize(x, x_scale, x_zero_point)


@register("DequantizeLinear", since=13)
def DequantizeLinear_13(x, x_scale, x_zero_point=None, *, axis: int = 1):
    return dequantize(x, x_scale, x_zero_point, axis=axis)


@register("DequantizeLinear", since=21)
def DequantizeLinear_21(x, x_scale, x_zero_point=None, *, axis: int = 1, block_size: int = 0):
    return dequantize(x, x_scale, x_zero_point, axis=axis, block_size=block_size)


@register("DequantizeLinear", since=23)
def DequantizeLinear(x, x_scale, x_zero_point=None, *, axis: int = 1, block_size: int = 0, output_dtype: int = 0):
    return dequantize(x, x_scale, x_zero_point, axis=axis, block_size=block_size, output_dtype=output_dtype)


@register("DynamicQuantizeLinear", since=11)
def DynamicQuantizeLinear(x):
    # float32 arithmetic throughout, as the spec's reference and onnxruntime compute it (a float64
    # quotient rounded once can differ from theirs in the last bit); a decode step's rows of finite
    # float32 in one numba pass (numpy's vectorised passes win on a prompt's)
    if _native.enabled and x.dtype == np.float32 and x.size <= _ONE_PASS_QUANTIZE:
        out = np.empty(x.shape, np.uint8)
        scale, zero = dynamic_quantize_into(np.ascontiguousarray(x).reshape(-1), out.reshape(-1))
        if not np.isnan(scale):
            return out, np.array(scale, np.float32), np.array(zero, np.uint8)
    low = np.minimum(x.min(initial=0.0), 0).astype(np.float32)
    high = np.maximum(x.max(initial=0.0), 0).astype(np.float32)
    scale = (high - low) / np.float32(255)
    if scale == 0:  # all zeros: any scale reproduces them; keep 0 like the reference
        return np.zeros(x.shape, np.uint8), np.array(scale, np.float32), np.array(0, np.uint8)
    zero_point = np.clip(np.rint(-low / scale), 0, 255)
    y = np.clip(np.rint(x / scale) + zero_point, 0, 255).astype(np.uint8)
    return y, np.array(scale, np.float32), np.array(zero_point, np.uint8)


def _widen(values: np.ndarray, zero_point) -> np.ndarray:
    """Quantised values minus their zero point, as exact int32."""
    wide = values.astype(np.int32)
    return wide if zero_point is None else wide - zero_point.astype(np.int32)


@register("QLinearConv", since=10)
def QLinearConv(x, x_scale, x_zero_point, w, w_scale, w_zero_point, y_scale, y_zero_point, b=None, *,
                auto_pad: str = "NOTSET", dilations: Ints = None, group: int = 1, kernel_shape: Ints = None,
                pads: Ints = None, strides: Ints = None):
    kernel = tuple(kernel_shape) if kernel_shape else w.shape[2:]
    strides, dilations, pads = spatial_attrs(x.ndim - 2, kernel, strides, dilations, pads)
    padding = resolve_padding(x.shape[2:], kernel, strides, dilations, pads, auto_pad)
    per_channel = (-1,) + (1,) * (w.ndim - 1)
    w_zero = None if w_zero_point is None else w_zero_point.reshape(per_channel if w_zero_point.size > 1 else ())
    acc = convolve(_widen(x, x_zero_point), _widen(w, w_zero), group, strides, dilations, padding.begin,
                   padding.end, padding.out_shape)
    if b is not None:
        acc += b.reshape((1, -1) + (1,) * (acc.ndim - 2))
    multiplier = (x_scale.astype(np.float64) * w_scale.astype(np.float64).reshape(-1) / y_scale.astype(np.float64))
    real = acc * multiplier.reshape((1, -1) + (1,) * (acc.ndim - 2))
    return _requantize(real, y_zero_point, y_zero_point.dtype)


@register("QLinearMatMul", since=10)
def QLinearMatMul(a, a_scale, a_zero_point, b, b_scale, b_zero_point, y_scale, y_zero_point):
    def rows(v):  # per-row parameters of a are given as (M,)
        return v.reshape(-1, 1) if v.ndim == 1 and v.size > 1 else v

    acc = np.matmul(_widen(a, rows(a_zero_point)), _widen(b, b_zero_point))
    real = acc * (rows(a_scale).astype(np.float32) * b_scale.astype(np.float32) / y_scale.astype(np.float32))
    return _requantize(real, y_zero_point, y_zero_point.dtype)
