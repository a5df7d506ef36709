"""Mapping between ONNX element types and numpy dtypes (ml_dtypes supplies the narrow floats/ints)."""
import ml_dtypes
import numpy as np
from onnx import TensorProto

ONNX_TO_NUMPY = {
    TensorProto.FLOAT: np.dtype(np.float32),
    TensorProto.DOUBLE: np.dtype(np.float64),
    TensorProto.FLOAT16: np.dtype(np.float16),
    TensorProto.BFLOAT16: np.dtype(ml_dtypes.bfloat16),
    TensorProto.FLOAT8E4M3FN: np.dtype(ml_dtypes.float8_e4m3fn),
    TensorProto.FLOAT8E4M3FNUZ: np.dtype(ml_dtypes.float8_e4m3fnuz),
    TensorProto.FLOAT8E5M2: np.dtype(ml_dtypes.float8_e5m2),
    TensorProto.FLOAT8E5M2FNUZ: np.dtype(ml_dtypes.float8_e5m2fnuz),
    TensorProto.FLOAT8E8M0: np.dtype(ml_dtypes.float8_e8m0fnu),
    TensorProto.FLOAT4E2M1: np.dtype(ml_dtypes.float4_e2m1fn),
    TensorProto.INT4: np.dtype(ml_dtypes.int4),
    TensorProto.UINT4: np.dtype(ml_dtypes.uint4),
    TensorProto.INT2: np.dtype(ml_dtypes.int2),
    TensorProto.UINT2: np.dtype(ml_dtypes.uint2),
    TensorProto.INT8: np.dtype(np.int8),
    TensorProto.INT16: np.dtype(np.int16),
    TensorProto.INT32: np.dtype(np.int32),
    TensorProto.INT64: np.dtype(np.int64),
    TensorProto.UINT8: np.dtype(np.uint8),
    TensorProto.UINT16: np.dtype(np.uint16),
    TensorProto.UINT32: np.dtype(np.uint32),
    TensorProto.UINT64: np.dtype(np.uint64),
    TensorProto.BOOL: np.dtype(np.bool_),
    TensorProto.COMPLEX64: np.dtype(np.complex64),
    TensorProto.COMPLEX128: np.dtype(np.complex128),
    TensorProto.STRING: np.dtype(object),
}
NUMPY_TO_ONNX = {dtype: code for code, dtype in ONNX_TO_NUMPY.items()}
# onnxruntime spells element types as 'tensor(float)'; keep the same strings.
ONNX_TYPE_NAMES = {
    TensorProto.FLOAT: "float", TensorProto.DOUBLE: "double", TensorProto.FLOAT16: "float16",
    TensorProto.BFLOAT16: "bfloat16", TensorProto.INT8: "int8", TensorProto.INT16: "int16",
    TensorProto.INT32: "int32", TensorProto.INT64: "int64", TensorProto.UINT8: "uint8",
    TensorProto.UINT16: "uint16", TensorProto.UINT32: "uint32", TensorProto.UINT64: "uint64",
    TensorProto.BOOL: "bool", TensorProto.STRING: "string", TensorProto.COMPLEX64: "complex64",
    TensorProto.COMPLEX128: "complex128", TensorProto.FLOAT8E4M3FN: "float8e4m3fn",
    TensorProto.FLOAT8E4M3FNUZ: "float8e4m3fnuz", TensorProto.FLOAT8E5M2: "float8e5m2",
    TensorProto.FLOAT8E5M2FNUZ: "float8e5m2fnuz", TensorProto.INT4: "int4", TensorProto.UINT4: "uint4",
    TensorProto.FLOAT4E2M1: "float4e2m1", TensorProto.FLOAT8E8M0: "float8e8m0",
    TensorProto.INT2: "int2", TensorProto.UINT2: "uint2",
}


def numpy_dtype(elem_type: int) -> np.dtype:
    """The numpy dtype of an ONNX element type; KeyError for unknown codes (callers wrap it)."""
    return ONNX_TO_NUMPY[elem_type]


def onnx_type(dtype) -> int:
    """The ONNX element type of a numpy dtype (str-like numpy dtypes map to STRING)."""
    dtype = np.dtype(dtype)
    if dtype.kind in "OUS":
        return TensorProto.STRING
    return NUMPY_TO_ONNX[dtype]


def type_name(elem_type: int) -> str:
    """onnxruntime's 'tensor(float)' spelling for an element type."""
    return f"tensor({ONNX_TYPE_NAMES.get(elem_type, 'undefined')})"
