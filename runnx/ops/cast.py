"""Cast and CastLike between every ONNX element type, strings included.

Numeric conversions are numpy/ml_dtypes `astype` (round to nearest even, integers wrap) except
where ONNX says otherwise: with `saturate` (the default, opset 19+) float8 targets clamp
out-of-range values and infinities to the largest finite value instead of overflowing to
inf/NaN, and float8e8m0 (a pure power of two) rounds as `round_mode` says. Strings parse as
decimal or scientific numbers with case-insensitive INF/+INF/-INF/NaN; numbers print in their
shortest round-trip form.
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto

from runnx.errors import RunnxError
from runnx.interp.dtypes import numpy_dtype, onnx_type
from runnx.ops.registry import register

# ml_dtypes' types by name: it is imported only once a value of one of them exists
_SATURATING_FLOAT8 = frozenset(("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz"))
_NUMPY_FLOATS = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))
_E8M0_MAX_EXPONENT = 0xFE  # 0xFF is NaN
_FLOAT32_EXPONENT_BITS = 0xFF


def cast(x: np.ndarray, to: int, saturate: int = 1, round_mode: str = "up") -> np.ndarray:
    """x converted to ONNX element type `to` (a TensorProto code)."""
    if to == TensorProto.STRING:
        return _to_strings(x)
    try:
        target = numpy_dtype(to)
    except KeyError:
        raise RunnxError(f"Cast to unknown element type {to}") from None
    if x.dtype == object:
        x = _parse_strings(x, target)
    if x.dtype == target:
        return x
    with np.errstate(invalid="ignore", over="ignore"):
        if target.name == "float8_e8m0fnu":
            return _to_e8m0(x, saturate, round_mode)
        if saturate and target.name in _SATURATING_FLOAT8:
            import ml_dtypes  # loaded already: `target` is its type
            info = ml_dtypes.finfo(target)
            wide = x if x.dtype in _NUMPY_FLOATS else x.astype(np.float32)
            # NaN passes through maximum/minimum; infinities clamp like any out-of-range value
            clamped = np.minimum(np.maximum(wide, wide.dtype.type(info.min)), wide.dtype.type(info.max))
            return clamped.astype(target)
        return x.astype(target)


def _to_strings(x):
    texts = x.astype(np.str_) if x.dtype != object else x
    result = np.empty(x.shape, dtype=object)
    result.reshape(-1)[:] = [str(t) for t in texts.reshape(-1)]
    return result


def _parse_number(text, integral: bool):
    if isinstance(text, bytes):
        text = text.decode("utf-8")
    text = str(text).strip()
    if integral:
        try:
            return int(text)
        except ValueError:
            pass  # "100.5" or "1e3": go through float, truncating like C
    try:
        value = float(text)  # accepts inf/+inf/-inf/nan in any case
    except ValueError:
        raise RunnxError(f"Cast cannot parse {text!r} as a number") from None
    return int(value) if integral else value


def _parse_strings(x, target):
    if target == np.bool_:
        return np.array([_parse_bool(t) for t in x.reshape(-1)], dtype=np.bool_).reshape(x.shape)
    integral = target.kind in "iu"
    values = [_parse_number(t, integral) for t in x.reshape(-1)]
    if integral:
        # wrap like a fixed-point conversion rather than failing on out-of-range text
        bits = target.itemsize * 8
        values = [v % (1 << bits) for v in values]
        unsigned = np.array(values, dtype=np.uint64).astype(np.dtype(f"u{target.itemsize}"))
        return unsigned.view(target).reshape(x.shape)
    return np.array(values, dtype=np.float64).reshape(x.shape)


def _parse_bool(text):
    text = (text.decode("utf-8") if isinstance(text, bytes) else str(text)).strip().lower()
    if text in ("true", "false"):
        return text == "true"
    return _parse_number(text, False) != 0


def _to_e8m0(x, saturate, round_mode):
    """float8e8m0 keeps only a float32's exponent; the dropped mantissa decides the rounding."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32)
    exponent = ((bits >> 23) & _FLOAT32_EXPONENT_BITS).astype(np.uint16)
    special = exponent == _FLOAT32_EXPONENT_BITS
    if round_mode == "up":
        bump = (bits & 0x7FFFFF) > 0
    elif round_mode == "down":
        bump = np.zeros(bits.shape, dtype=np.bool_)
    elif round_mode == "nearest":
        # ties round up: the first dropped bit decides (for subnormal inputs only past a tie)
        half = (bits & 0x400000) > 0
        bump = half & (((bits & 0x3FFFFF) > 0) | (exponent > 0))
    else:
        raise RunnxError(f"Cast round_mode must be 'up', 'down' or 'nearest', got {round_mode!r}")
    bump &= ~special
    if saturate:
        bump &= exponent != _E8M0_MAX_EXPONENT
    exponent += bump
    # NaN stays NaN; with saturate +-inf becomes the largest power of two, otherwise NaN
    infinite = special & ((bits & 0x7FFFFF) == 0)
    exponent[special] = _FLOAT32_EXPONENT_BITS
    if saturate:
        exponent[infinite] = _E8M0_MAX_EXPONENT
    return exponent.astype(np.uint8).view(numpy_dtype(TensorProto.FLOAT8E8M0))


@register("Cast", since=1)
def Cast_1(x, *, to: str):
    # opset 1 names the type ("FLOAT", "INT64", ...) instead of giving its code
    try:
        code = TensorProto.DataType.Value(to.upper())
    except ValueError:
        raise RunnxError(f"Cast to unknown element type {to!r}") from None
    return cast(x, code)


@register("Cast", since=6)
def Cast(x, *, to: int):
    return cast(x, to)


@register("Cast", since=19)
def Cast_19(x, *, to: int, saturate: int = 1):
    return cast(x, to, saturate)


@register("Cast", since=24)
def Cast_24(x, *, to: int, saturate: int = 1, round_mode: str = "up"):
    return cast(x, to, saturate, round_mode)


@register("CastLike", since=15)
def CastLike(x, target_type):
    return cast(x, onnx_type(target_type.dtype))


@register("CastLike", since=19)
def CastLike_19(x, target_type, *, saturate: int = 1):
    return cast(x, onnx_type(target_type.dtype), saturate)


@register("CastLike", since=24)
def CastLike_24(x, target_type, *, saturate: int = 1, round_mode: str = "up"):
    return cast(x, onnx_type(target_type.dtype), saturate, round_mode)
