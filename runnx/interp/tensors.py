"""TensorProto -> numpy, zero-copy where the bytes allow it; external data confined to the model folder."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, numpy_helper

from runnx.errors import InvalidModelError
from runnx.interp.dtypes import ONNX_TO_NUMPY

# Element types whose raw bytes are the numpy layout (sub-byte types are packed and need unpacking).
_PACKED = {TensorProto.INT4, TensorProto.UINT4, TensorProto.FLOAT4E2M1, TensorProto.INT2, TensorProto.UINT2}


def tensor_to_array(tensor: TensorProto, external=None, raw=None) -> np.ndarray:
    """A read-only array for `tensor`; `external` resolves data stored outside the protobuf, `raw`
    is its raw_data when the caller read it apart from the protobuf (`model_file.py`)."""
    name = tensor.name or "<unnamed>"
    if tensor.data_type not in ONNX_TO_NUMPY:
        raise InvalidModelError(f"tensor '{name}' has unknown data type {tensor.data_type}")
    dtype = ONNX_TO_NUMPY[tensor.data_type]
    shape = tuple(tensor.dims)
    if any(d < 0 for d in shape):
        raise InvalidModelError(f"tensor '{name}' has a negative dimension: {shape}")
    count = int(np.prod(shape, dtype=np.int64))
    if tensor.data_location == TensorProto.EXTERNAL:
        if external is None:
            raise InvalidModelError(f"tensor '{name}' uses external data but the model was not loaded from a file")
        array = _from_raw(external.read(tensor), tensor, dtype, shape, count, name)
    elif raw is not None and dtype != object:
        array = _from_raw(raw, tensor, dtype, shape, count, name)
    elif tensor.HasField("raw_data") and tensor.data_type not in _PACKED and dtype != object:
        array = _from_raw(tensor.raw_data, tensor, dtype, shape, count, name)
    else:
        try:
            array = numpy_helper.to_array(tensor)
        except Exception as error:  # malformed typed fields
            raise InvalidModelError(f"tensor '{name}' cannot be decoded: {error}") from None
        if array.dtype != dtype and dtype != object:
            array = array.astype(dtype)
        if array.size != count:
            raise InvalidModelError(f"tensor '{name}' holds {array.size} values, its shape {shape} needs {count}")
        array = array.reshape(shape)
    if array.flags.writeable:
        array.flags.writeable = False
    return array


def _from_raw(raw, tensor, dtype, shape, count, name) -> np.ndarray:
    if tensor.data_type in _PACKED:
        # Sub-byte types: let onnx unpack a copy of the bytes (rare, small tensors).
        copy = TensorProto()
        copy.CopyFrom(tensor)
        copy.ClearField("external_data")
        copy.data_location = TensorProto.DEFAULT
        copy.raw_data = bytes(raw)
        return numpy_helper.to_array(copy).astype(dtype).reshape(shape)
    expected = count * dtype.itemsize
    if len(raw) != expected:
        raise InvalidModelError(
            f"tensor '{name}' has {len(raw)} bytes of data, its shape {shape} and type {dtype} need {expected}")
    array = np.frombuffer(raw, dtype=dtype, count=count)
    if not array.dtype.isnative:
        array = array.byteswap().view(array.dtype.newbyteorder())
    return array.reshape(shape)
