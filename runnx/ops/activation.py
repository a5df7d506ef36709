"""Activation functions (Relu family, sigmoids, Gelu, Mish, Swish, SwiGLU, ...), computed in the
input's dtype; those that can write into a dying input declare it."""
from __future__ import annotations

import math

import numpy as np

from runnx.errors import RunnxError
from runnx.ops import _native
from runnx.ops._elementwise_util import erf, output_buffer, sigmoid
from runnx.ops.registry import register
from runnx.runtime.pool import gelu_rows

_NO_BIAS = np.empty(0, np.float32)
_SQRT_2 = float(np.float32(math.sqrt(2)))  # the divisor in float32, as the numpy path divides

_ZEROS: dict = {}  # dtype -> a read-only 0-d zero


def _zero(dtype) -> np.ndarray:
    """A 0-d zero of `dtype`: np.maximum against it skips the scalar's creation and conversion
    (Relu on a few elements: ~2.3 -> ~1.0 us, the dispatch benchmark's chain)."""
    zero = _ZEROS.get(dtype)
    if zero is None:
        zero = _ZEROS[dtype] = np.zeros((), dtype)
        zero.flags.writeable = False
    return zero


@register("Relu", since=6, inplace=(0,))
def Relu(x, *, overwrite=()):
    return np.maximum(x, _zero(x.dtype), out=output_buffer(x, overwrite))


@register("LeakyRelu", since=6, inplace=(0,))
def LeakyRelu(x, *, alpha: float = 0.01, overwrite=()):
    return _scale_negatives(x, alpha, overwrite)


def _scale_negatives(x, factor, overwrite):
    """x where x >= 0, x * factor elsewhere (factor broadcasts to x)."""
    if np.ndim(factor) and np.broadcast_shapes(x.shape, factor.shape) != x.shape:
        raise RunnxError(f"slope of shape {factor.shape} does not broadcast to the input's shape {x.shape}")
    out = output_buffer(x, overwrite)
    negative = x < 0
    if out is not x:
        np.copyto(out, x, where=~negative)
    return np.multiply(x, factor, out=out, where=negative)


@register("PRelu", since=1, inplace=(0,))
def PRelu_1(x, slope, *, consumed_inputs: tuple[int, ...] | None = None, overwrite=()):
    # before opset 7 a 1-D slope holds one value per channel (axis 1), not per last-axis element
    if slope.ndim == 1 and slope.size > 1 and x.ndim > 2:
        slope = slope.reshape((-1,) + (1,) * (x.ndim - 2))
    return _scale_negatives(x, slope, overwrite)


@register("PRelu", since=7, inplace=(0,))
def PRelu(x, slope, *, overwrite=()):
    # slope broadcasts to x (unidirectionally), so the result always has x's shape
    return _scale_negatives(x, slope, overwrite)


@register("ThresholdedRelu", since=10, inplace=(0,))
def ThresholdedRelu(x, *, alpha: float = 1.0, overwrite=()):
    below = ~(x > alpha)  # NaN is below too
    out = output_buffer(x, overwrite)
    if out is not x:
        np.copyto(out, x)
    out[below] = 0
    return out


@register("Elu", since=6)
def Elu(x, *, alpha: float = 1.0):
    return np.where(x > 0, x, alpha * np.expm1(np.minimum(x, 0))).astype(x.dtype, copy=False)


@register("Selu", since=6)
def Selu(x, *, alpha: float = 1.67326319217681884765625, gamma: float = 1.05070102214813232421875):
    return (gamma * np.where(x > 0, x, alpha * np.expm1(np.minimum(x, 0)))).astype(x.dtype, copy=False)


@register("Celu", since=12)
def Celu(x, *, alpha: float = 1.0):
    negative = alpha * np.expm1(np.minimum(x, 0) / alpha)
    return np.where(x > 0, x, negative).astype(x.dtype, copy=False)


@register("Sigmoid", since=6, inplace=(0,))
def Sigmoid(x, *, overwrite=()):
    return sigmoid(x, overwrite)


@register("HardSigmoid", since=6, inplace=(0,))
def HardSigmoid(x, *, alpha: float = 0.2, beta: float = 0.5, overwrite=()):
    out = np.multiply(x, alpha, out=output_buffer(x, overwrite))
    out += x.dtype.type(beta)
    return _unit_clamp(out)


def _unit_clamp(out):
    """out clamped to [0, 1] in place."""
    np.maximum(out, out.dtype.type(0), out=out)
    return np.minimum(out, out.dtype.type(1), out=out)


@register("HardSwish", since=14)
def HardSwish(x):
    gate = np.divide(x, x.dtype.type(6), out=np.empty_like(x))
    gate += x.dtype.type(0.5)
    return np.multiply(x, _unit_clamp(gate), out=gate)


@register("Softplus", since=1)
def Softplus(x):
    with np.errstate(over="ignore"):
        return np.logaddexp(x.dtype.type(0), x)


@register("Softsign", since=1, inplace=(0,))
def Softsign(x, *, overwrite=()):
    denominator = np.abs(x)
    denominator += x.dtype.type(1)
    return np.divide(x, denominator, out=output_buffer(x, overwrite))


@register("Gelu", since=20)
def Gelu(x, *, approximate: str = "none"):
    """x * (1 + erf(x / sqrt 2)) / 2, or its tanh approximation. Float32 erf GELU rows take the
    decode pool's rows job (one pass a row, shared with its workers: ErfGelu's kernel), the rest
    numpy's operators in one working array that is the result too."""
    if approximate == "none" and _native.enabled and x.dtype == np.float32 and x.ndim >= 1 and x.size:
        rows = np.ascontiguousarray(x).reshape(-1, x.shape[-1])
        out = np.empty(rows.shape, np.float32)
        gelu_rows(rows, _NO_BIAS, _SQRT_2, 1.0, 0.5, out)
        return out.reshape(x.shape)
    if approximate == "tanh":
        work = np.multiply(x, x, out=np.empty_like(x))
        work *= x
        work *= x.dtype.type(0.044715)
        work += x
        work *= x.dtype.type(math.sqrt(2 / math.pi))
        np.tanh(work, out=work)
    elif approximate == "none":
        work = erf(np.divide(x, x.dtype.type(math.sqrt(2)), out=np.empty_like(x)), overwrite=(0,))
    else:
        raise RunnxError(f"Gelu approximate must be 'none' or 'tanh', got {approximate!r}")
    work += x.dtype.type(1)
    work *= x
    work *= x.dtype.type(0.5)
    return work


@register("Mish", since=18)
def Mish(x):
    with np.errstate(over="ignore"):
        work = np.logaddexp(x.dtype.type(0), x, out=np.empty_like(x))
    np.tanh(work, out=work)
    work *= x
    return work


@register("Shrink", since=9)
def Shrink(x, *, bias: float = 0.0, lambd: float = 0.5):
    return np.where(x < -lambd, x + bias, np.where(x > lambd, x - bias, 0)).astype(x.dtype, copy=False)


def _swish(x, alpha):
    """x * sigmoid(alpha * x) in one new array."""
    work = sigmoid(np.multiply(x, x.dtype.type(alpha), out=np.empty_like(x)), overwrite=(0,))
    work *= x
    return work


@register("Swish", since=24)
def Swish(x, *, alpha: float = 1.0):
    return _swish(x, alpha)


@register("SwiGLU", since=28, inplace=(1,))
def SwiGLU(gate, value, *, alpha: float = 1.0, overwrite=()):
    if gate.shape != value.shape or gate.dtype != value.dtype:
        raise RunnxError(f"SwiGLU needs A and B of one shape and dtype (no broadcasting), got "
                         f"{gate.shape} {gate.dtype} and {value.shape} {value.dtype}")
    swish = _swish(gate, alpha)
    return np.multiply(swish, value, out=value if 1 in overwrite else swish)
