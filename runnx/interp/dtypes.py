"""Mapping between ONNX element types and numpy dtypes (ml_dtypes supplies the narrow floats/ints).

ml_dtypes takes seconds to import, so it is imported the first time a narrow type is asked for:
a model with none of them never loads it (an array of one of them means it is loaded already).
"""
import sys

import numpy as np


class ElementType:
    """ONNX's element type codes (onnx.TensorProto's), fixed by the standard: `import onnx` takes
    seconds (it imports ml_dtypes), and `import runnx` does not need it."""
    UNDEFINED, FLOAT, UINT8, INT8, UINT16, INT16, INT32, INT64, STRING, BOOL = range(10)
    FLOAT16, DOUBLE, UINT32, UINT64, COMPLEX64, COMPLEX128, BFLOAT16 = range(10, 17)
    FLOAT8E4M3FN, FLOAT8E4M3FNUZ, FLOAT8E5M2, FLOAT8E5M2FNUZ, UINT4, INT4 = range(17, 23)
    FLOAT4E2M1, FLOAT8E8M0, UINT2, INT2 = range(23, 27)


# the element types ml_dtypes supplies, by the name of its type
_NARROW = {
    ElementType.BFLOAT16: "bfloat16", ElementType.FLOAT8E4M3FN: "float8_e4m3fn",
    ElementType.FLOAT8E4M3FNUZ: "float8_e4m3fnuz", ElementType.FLOAT8E5M2: "float8_e5m2",
    ElementType.FLOAT8E5M2FNUZ: "float8_e5m2fnuz", ElementType.FLOAT8E8M0: "float8_e8m0fnu",
    ElementType.FLOAT4E2M1: "float4_e2m1fn", ElementType.INT4: "int4", ElementType.UINT4: "uint4",
    ElementType.INT2: "int2", ElementType.UINT2: "uint2",
}


class _ElementTypes(dict):
    """ONNX element type -> numpy dtype, numpy's own types from the start, ml_dtypes' added (all
    at once, importing it) the first time one of them is looked up."""

    def _add_narrow(self) -> None:
        import ml_dtypes
        for code, name in _NARROW.items():
            dtype = np.dtype(getattr(ml_dtypes, name))
            self[code] = dtype
            NUMPY_TO_ONNX[dtype] = code

    def __missing__(self, code):
        if code not in _NARROW:
            raise KeyError(code)
        self._add_narrow()
        return self[code]

    def __contains__(self, code) -> bool:
        return dict.__contains__(self, code) or code in _NARROW

    def get(self, code, default=None):
        try:
            return self[code]
        except (KeyError, TypeError):
            return default


ONNX_TO_NUMPY = _ElementTypes({
    ElementType.FLOAT: np.dtype(np.float32),
    ElementType.DOUBLE: np.dtype(np.float64),
    ElementType.FLOAT16: np.dtype(np.float16),
    ElementType.INT8: np.dtype(np.int8),
    ElementType.INT16: np.dtype(np.int16),
    ElementType.INT32: np.dtype(np.int32),
    ElementType.INT64: np.dtype(np.int64),
    ElementType.UINT8: np.dtype(np.uint8),
    ElementType.UINT16: np.dtype(np.uint16),
    ElementType.UINT32: np.dtype(np.uint32),
    ElementType.UINT64: np.dtype(np.uint64),
    ElementType.BOOL: np.dtype(np.bool_),
    ElementType.COMPLEX64: np.dtype(np.complex64),
    ElementType.COMPLEX128: np.dtype(np.complex128),
    ElementType.STRING: np.dtype(object),
})
NUMPY_TO_ONNX = {dtype: code for code, dtype in ONNX_TO_NUMPY.items()}
# onnxruntime spells element types as 'tensor(float)'; keep the same strings.
ONNX_TYPE_NAMES = {
    ElementType.FLOAT: "float", ElementType.DOUBLE: "double", ElementType.FLOAT16: "float16",
    ElementType.BFLOAT16: "bfloat16", ElementType.INT8: "int8", ElementType.INT16: "int16",
    ElementType.INT32: "int32", ElementType.INT64: "int64", ElementType.UINT8: "uint8",
    ElementType.UINT16: "uint16", ElementType.UINT32: "uint32", ElementType.UINT64: "uint64",
    ElementType.BOOL: "bool", ElementType.STRING: "string", ElementType.COMPLEX64: "complex64",
    ElementType.COMPLEX128: "complex128", ElementType.FLOAT8E4M3FN: "float8e4m3fn",
    ElementType.FLOAT8E4M3FNUZ: "float8e4m3fnuz", ElementType.FLOAT8E5M2: "float8e5m2",
    ElementType.FLOAT8E5M2FNUZ: "float8e5m2fnuz", ElementType.INT4: "int4", ElementType.UINT4: "uint4",
    ElementType.FLOAT4E2M1: "float4e2m1", ElementType.FLOAT8E8M0: "float8e8m0",
    ElementType.INT2: "int2", ElementType.UINT2: "uint2",
}


def numpy_dtype(elem_type: int) -> np.dtype:
    """The numpy dtype of an ONNX element type; KeyError for unknown codes (callers wrap it)."""
    return ONNX_TO_NUMPY[elem_type]


def onnx_type(dtype) -> int:
    """The ONNX element type of a numpy dtype (str-like numpy dtypes map to STRING)."""
    dtype = np.dtype(dtype)
    if dtype.kind in "OUS":
        return ElementType.STRING
    if dtype not in NUMPY_TO_ONNX and "ml_dtypes" in sys.modules:  # a narrow type's value: loaded already
        ONNX_TO_NUMPY._add_narrow()
    return NUMPY_TO_ONNX[dtype]


def type_name(elem_type: int) -> str:
    """onnxruntime's 'tensor(float)' spelling for an element type."""
    return f"tensor({ONNX_TYPE_NAMES.get(elem_type, 'undefined')})"
