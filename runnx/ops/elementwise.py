"""Elementwise math: arithmetic, unary math, comparisons, logic and bitwise ops, the variadic
Sum/Mean/Max/Min, Where and Clip. Binary ops broadcast like numpy and, like unary ops, write into a
dying input when the executor grants it (see _elementwise_util)."""
from __future__ import annotations

import numpy as np

from runnx.errors import RunnxError
from runnx.ops._elementwise_util import binary, broadcast_fold, broadcast_shape, erf, unary
from runnx.ops.registry import register

# --- arithmetic -----------------------------------------------------------------------------------
# Before opset 7, binary ops broadcast only B, only with broadcast=1, aligning B's dims with A's
# from `axis` on (default: A's trailing dims); the *_1 kernels turn that into numpy broadcasting.


def legacy_broadcast(a, b, broadcast: int, axis: int | None):
    """B reshaped so that numpy broadcasting gives the opset < 7 result of op(A, B)."""
    if not broadcast:
        if a.shape != b.shape:
            raise RunnxError(f"shapes {a.shape} and {b.shape} differ and broadcast=0 (before opset 7)")
        return b
    if axis is None:
        return b
    axis = axis + a.ndim if axis < 0 else axis
    if axis + b.ndim > a.ndim:
        raise RunnxError(f"cannot broadcast shape {b.shape} into {a.shape} from axis {axis}")
    return b.reshape((1,) * axis + b.shape + (1,) * (a.ndim - axis - b.ndim))


@register("Add", since=1, inplace=(0, 1))
def Add_1(a, b, *, broadcast: int = 0, axis: int | None = None, consumed_inputs: tuple[int, ...] | None = None,
          overwrite=()):
    return Add(a, legacy_broadcast(a, b, broadcast, axis), overwrite=overwrite)


@register("Sub", since=1, inplace=(0, 1))
def Sub_1(a, b, *, broadcast: int = 0, axis: int | None = None, consumed_inputs: tuple[int, ...] | None = None,
          overwrite=()):
    return Sub(a, legacy_broadcast(a, b, broadcast, axis), overwrite=overwrite)


@register("Mul", since=1, inplace=(0, 1))
def Mul_1(a, b, *, broadcast: int = 0, axis: int | None = None, consumed_inputs: tuple[int, ...] | None = None,
          overwrite=()):
    return Mul(a, legacy_broadcast(a, b, broadcast, axis), overwrite=overwrite)


@register("Div", since=1, inplace=(0, 1))
def Div_1(a, b, *, broadcast: int = 0, axis: int | None = None, consumed_inputs: tuple[int, ...] | None = None,
          overwrite=()):
    return Div(a, legacy_broadcast(a, b, broadcast, axis), overwrite=overwrite)


@register("Add", since=7, inplace=(0, 1), ufunc=np.add)
def Add(a, b, *, overwrite=()):
    return binary(np.add, a, b, overwrite)


@register("Sub", since=7, inplace=(0, 1), ufunc=np.subtract)
def Sub(a, b, *, overwrite=()):
    return binary(np.subtract, a, b, overwrite)


@register("Mul", since=7, inplace=(0, 1), ufunc=np.multiply)
def Mul(a, b, *, overwrite=()):
    return binary(np.multiply, a, b, overwrite)


def _truncating_divide(a, b):
    """Integer division rounding toward zero (C semantics), where numpy floors."""
    with np.errstate(divide="ignore", invalid="ignore"):
        quotient = np.asarray(np.floor_divide(a, b))
    if a.dtype.kind == "i":
        # floor and trunc differ by one exactly when the division is inexact and the signs differ
        inexact = (quotient * b != a) & ((a < 0) != (b < 0)) & (b != 0)
        quotient += inexact
    return quotient


@register("Div", since=7, inplace=(0, 1))
def Div(a, b, *, overwrite=()):
    if a.dtype.kind in "iu":
        # the correction reads a and b after the floor division, so never write into either
        return _truncating_divide(a, b)
    return binary(np.divide, a, b, overwrite)


@register("Mod", since=10, inplace=(0, 1))
def Mod(a, b, *, fmod: int = 0, overwrite=()):
    # fmod=0: the result takes the divisor's sign (numpy's mod); fmod=1: the dividend's (C fmod)
    with np.errstate(divide="ignore", invalid="ignore"):
        return binary(np.fmod if fmod else np.mod, a, b, overwrite)


@register("Pow", since=1, inplace=(0,))
def Pow_1(base, exponent, *, broadcast: int = 0, axis: int | None = None, overwrite=()):
    return Pow(base, legacy_broadcast(base, exponent, broadcast, axis), overwrite=overwrite)


@register("Pow", since=7, inplace=(0,))
def Pow(base, exponent, *, overwrite=()):
    # the output has the base's type whatever the exponent's type is (opset 12 allows mixing)
    with np.errstate(all="ignore"):
        if base.dtype.kind not in "iu" and exponent.ndim == 0 and exponent == 2:
            # x*x is exact in any wider type, so this is bitwise pow's result, and much faster (RMSNorm)
            return unary(np.square, base, overwrite)
        if base.dtype == exponent.dtype:
            if base.dtype.kind in "iu":
                return np.asarray(_integer_power(base, exponent))
            return binary(np.power, base, exponent, overwrite)
        if base.dtype.kind in "iu" and exponent.dtype.kind in "iu":
            return np.asarray(_integer_power(base, exponent.astype(base.dtype)))
        return np.asarray(np.power(base, exponent)).astype(base.dtype, copy=False)


def _integer_power(base, exponent):
    """Integer power; numpy refuses negative integer exponents, C truncates 1/base**n toward zero."""
    negative = exponent < 0
    if not negative.any():
        return np.power(base, exponent)
    result = np.power(base, np.where(negative, 0, exponent))
    # base**-n truncates to 0 except for base 1 (1) and base -1 (+-1 by parity)
    inverse = np.where(base == 1, 1, np.where(base == -1, np.where(exponent % 2 == 0, 1, -1), 0))
    return np.where(negative, inverse, result).astype(base.dtype)


@register("Neg", since=6, inplace=(0,), ufunc=np.negative)
def Neg(x, *, overwrite=()):
    return unary(np.negative, x, overwrite)


@register("Abs", since=6, inplace=(0,), ufunc=np.absolute)
def Abs(x, *, overwrite=()):
    return unary(np.absolute, x, overwrite)


@register("Sign", since=9, inplace=(0,), ufunc=np.sign)
def Sign(x, *, overwrite=()):
    return unary(np.sign, x, overwrite)


@register("Reciprocal", since=6, inplace=(0,))
def Reciprocal(x, *, overwrite=()):
    with np.errstate(divide="ignore"):
        return unary(np.reciprocal, x, overwrite)


@register("Floor", since=6, inplace=(0,), ufunc=np.floor)
def Floor(x, *, overwrite=()):
    return unary(np.floor, x, overwrite)


@register("Ceil", since=6, inplace=(0,), ufunc=np.ceil)
def Ceil(x, *, overwrite=()):
    return unary(np.ceil, x, overwrite)


@register("Round", since=11, inplace=(0,))
def Round(x, *, overwrite=()):
    return unary(np.rint, x, overwrite)  # halves to even, as ONNX requires


# --- transcendental functions -----------------------------------------------------------------------


@register("Sqrt", since=6, inplace=(0,))
def Sqrt(x, *, overwrite=()):
    with np.errstate(invalid="ignore"):
        return unary(np.sqrt, x, overwrite)


@register("Exp", since=6, inplace=(0,))
def Exp(x, *, overwrite=()):
    with np.errstate(over="ignore"):
        return unary(np.exp, x, overwrite)


@register("Log", since=6, inplace=(0,))
def Log(x, *, overwrite=()):
    with np.errstate(divide="ignore", invalid="ignore"):
        return unary(np.log, x, overwrite)


@register("Sin", since=7, inplace=(0,), ufunc=np.sin)
def Sin(x, *, overwrite=()):
    return unary(np.sin, x, overwrite)


@register("Cos", since=7, inplace=(0,), ufunc=np.cos)
def Cos(x, *, overwrite=()):
    return unary(np.cos, x, overwrite)


@register("Tan", since=7, inplace=(0,), ufunc=np.tan)
def Tan(x, *, overwrite=()):
    return unary(np.tan, x, overwrite)


@register("Asin", since=7, inplace=(0,))
def Asin(x, *, overwrite=()):
    with np.errstate(invalid="ignore"):
        return unary(np.arcsin, x, overwrite)


@register("Acos", since=7, inplace=(0,))
def Acos(x, *, overwrite=()):
    with np.errstate(invalid="ignore"):
        return unary(np.arccos, x, overwrite)


@register("Atan", since=7, inplace=(0,), ufunc=np.arctan)
def Atan(x, *, overwrite=()):
    return unary(np.arctan, x, overwrite)


@register("Sinh", since=9, inplace=(0,))
def Sinh(x, *, overwrite=()):
    with np.errstate(over="ignore"):
        return unary(np.sinh, x, overwrite)


@register("Cosh", since=9, inplace=(0,))
def Cosh(x, *, overwrite=()):
    with np.errstate(over="ignore"):
        return unary(np.cosh, x, overwrite)


@register("Tanh", since=6, inplace=(0,), ufunc=np.tanh)
def Tanh(x, *, overwrite=()):
    return unary(np.tanh, x, overwrite)


@register("Asinh", since=9, inplace=(0,), ufunc=np.arcsinh)
def Asinh(x, *, overwrite=()):
    return unary(np.arcsinh, x, overwrite)


@register("Acosh", since=9, inplace=(0,))
def Acosh(x, *, overwrite=()):
    with np.errstate(invalid="ignore"):
        return unary(np.arccosh, x, overwrite)


@register("Atanh", since=9, inplace=(0,))
def Atanh(x, *, overwrite=()):
    with np.errstate(divide="ignore", invalid="ignore"):
        return unary(np.arctanh, x, overwrite)


@register("Erf", since=9, inplace=(0,))
def Erf(x, *, overwrite=()):
    return erf(x, overwrite)


# --- classification of floats -------------------------------------------------------------------------


@register("IsNaN", since=9)
def IsNaN(x):
    return np.isnan(x)


@register("IsInf", since=10)
def IsInf(x, *, detect_negative: int = 1, detect_positive: int = 1):
    if detect_negative and detect_positive:
        return np.isinf(x)
    if detect_negative:
        return np.isneginf(x)
    if detect_positive:
        return np.isposinf(x)
    return np.zeros(x.shape, dtype=np.bool_)


# --- variadic broadcasting ops ---------------------------------------------------------------------
# Opset 6 wants equal shapes and opset 8 broadcasts; broadcasting serves both.


@register("Sum", since=6, inplace=(0,))
def Sum(*inputs, overwrite=()):
    return broadcast_fold(np.add, inputs, overwrite)


@register("Mean", since=6, inplace=(0,))
def Mean(*inputs, overwrite=()):
    total = broadcast_fold(np.add, inputs, overwrite)
    if len(inputs) == 1:
        return total
    # the fold wrote into a fresh array or into the granted input 0, so dividing in place is safe
    return np.true_divide(total, len(inputs), out=total, casting="unsafe")  # integers truncate


@register("Max", since=6, inplace=(0,))
def Max(*inputs, overwrite=()):
    return broadcast_fold(np.maximum, inputs, overwrite)


@register("Min", since=6, inplace=(0,))
def Min(*inputs, overwrite=()):
    return broadcast_fold(np.minimum, inputs, overwrite)


@register("Where", since=9, inplace=(1, 2))
def Where(condition, x, y, *, overwrite=()):
    if overwrite:
        shape = broadcast_shape(condition.shape, x.shape, y.shape)
        if 1 in overwrite and x.shape == shape and x.dtype == y.dtype and x.flags.c_contiguous:
            np.copyto(x, y, where=~condition)
            return x
        if 2 in overwrite and y.shape == shape and x.dtype == y.dtype and y.flags.c_contiguous:
            np.copyto(y, x, where=condition)
            return y
    return np.where(condition, x, y)


def _clip(x, low, high, overwrite):
    # minimum/maximum rather than np.clip: they work for every dtype (bfloat16 too), and apply max
    # last so that min > max gives max everywhere, as the spec says
    out = x if overwrite and x.flags.c_contiguous else np.array(x, order="C")  # written below either way
    if low is not None:
        np.maximum(out, low, out=out)
    if high is not None:
        np.minimum(out, high, out=out)
    return out


@register("Clip", since=6, inplace=(0,))
def Clip(x, *, min: float = -3.4028234663852886e38, max: float = 3.4028234663852886e38, overwrite=()):
    with np.errstate(over="ignore"):  # the float32 range as float16 bounds is +-inf: still no clipping
        return _clip(x, min, max, overwrite)


@register("Clip", since=11, inplace=(0,))
def Clip_11(x, min=None, max=None, *, overwrite=()):
    return _clip(x, None if min is None else min.reshape(()), None if max is None else max.reshape(()),
                 overwrite)


# --- comparisons ---------------------------------------------------------------------------------------
# Comparisons and logic ops take the opset < 7 broadcast/axis attributes too (see legacy_broadcast).


@register("Equal", since=1)
def Equal_1(a, b, *, broadcast: int = 0, axis: int | None = None):
    return Equal(a, legacy_broadcast(a, b, broadcast, axis))


@register("Greater", since=1)
def Greater_1(a, b, *, broadcast: int = 0, axis: int | None = None):
    return Greater(a, legacy_broadcast(a, b, broadcast, axis))


@register("Less", since=1)
def Less_1(a, b, *, broadcast: int = 0, axis: int | None = None):
    return Less(a, legacy_broadcast(a, b, broadcast, axis))



@register("Equal", since=7)
def Equal(a, b):
    return np.asarray(np.equal(a, b), dtype=np.bool_)


@register("Greater", since=7)
def Greater(a, b):
    return np.greater(a, b)


@register("Less", since=7)
def Less(a, b):
    return np.less(a, b)


@register("GreaterOrEqual", since=12)
def GreaterOrEqual(a, b):
    return np.greater_equal(a, b)


@register("LessOrEqual", since=12)
def LessOrEqual(a, b):
    return np.less_equal(a, b)


# --- logic and bits ------------------------------------------------------------------------------------


@register("And", since=7, inplace=(0, 1), ufunc=np.logical_and)
def And(a, b, *, overwrite=()):
    return binary(np.logical_and, a, b, overwrite)


@register("Or", since=7, inplace=(0, 1), ufunc=np.logical_or)
def Or(a, b, *, overwrite=()):
    return binary(np.logical_or, a, b, overwrite)


@register("Xor", since=7, inplace=(0, 1), ufunc=np.logical_xor)
def Xor(a, b, *, overwrite=()):
    return binary(np.logical_xor, a, b, overwrite)


@register("And", since=1, inplace=(0, 1))
def And_1(a, b, *, broadcast: int = 0, axis: int | None = None, overwrite=()):
    return And(a, legacy_broadcast(a, b, broadcast, axis), overwrite=overwrite)


@register("Or", since=1, inplace=(0, 1))
def Or_1(a, b, *, broadcast: int = 0, axis: int | None = None, overwrite=()):
    return Or(a, legacy_broadcast(a, b, broadcast, axis), overwrite=overwrite)


@register("Xor", since=1, inplace=(0, 1))
def Xor_1(a, b, *, broadcast: int = 0, axis: int | None = None, overwrite=()):
    return Xor(a, legacy_broadcast(a, b, broadcast, axis), overwrite=overwrite)


@register("Not", since=1, inplace=(0,), ufunc=np.logical_not)
def Not(x, *, overwrite=()):
    return unary(np.logical_not, x, overwrite)


@register("BitwiseAnd", since=18, inplace=(0, 1), ufunc=np.bitwise_and)
def BitwiseAnd(a, b, *, overwrite=()):
    return binary(np.bitwise_and, a, b, overwrite)


@register("BitwiseOr", since=18, inplace=(0, 1), ufunc=np.bitwise_or)
def BitwiseOr(a, b, *, overwrite=()):
    return binary(np.bitwise_or, a, b, overwrite)


@register("BitwiseXor", since=18, inplace=(0, 1), ufunc=np.bitwise_xor)
def BitwiseXor(a, b, *, overwrite=()):
    return binary(np.bitwise_xor, a, b, overwrite)


@register("BitwiseNot", since=18, inplace=(0,), ufunc=np.invert)
def BitwiseNot(x, *, overwrite=()):
    return unary(np.invert, x, overwrite)


@register("BitShift", since=11)
def BitShift(x, y, *, direction: str):
    if direction not in ("LEFT", "RIGHT"):
        raise RunnxError(f"BitShift direction must be 'LEFT' or 'RIGHT', got {direction!r}")
    bits = x.dtype.itemsize * 8
    # shifts outside [0, bits) are defined (opset 28) as what the sign fill alone gives; C leaves
    # them undefined, so clamp the amount and patch those lanes afterwards
    out_of_range = (y < 0) | (y >= bits)
    amount = np.where(out_of_range, 0, y).astype(x.dtype)
    if direction == "RIGHT":
        result = np.right_shift(x, amount)
        fill = np.where(x < 0, -1, 0).astype(x.dtype) if x.dtype.kind == "i" else 0
    else:
        # shift the two's complement bits: bits pushed past the sign bit are discarded
        unsigned = np.dtype(f"u{x.dtype.itemsize}")
        result = np.left_shift(x.view(unsigned), amount.view(unsigned) if amount.dtype.kind == "i"
                               else amount).view(x.dtype)
        fill = 0
    return np.where(out_of_range, fill, result).astype(x.dtype, copy=False)
