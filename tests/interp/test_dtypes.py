"""ONNX element types <-> numpy dtypes (runnx/interp/dtypes.py): onnx's codes without importing
onnx, ml_dtypes' narrow types imported only once one of them is asked for."""
import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
from onnx import TensorProto

from runnx.interp.dtypes import ONNX_TO_NUMPY, ElementType, numpy_dtype, onnx_type

ROOT = Path(__file__).resolve().parents[2]


def test_the_codes_are_onnxs():
    ours = {name: value for name, value in vars(ElementType).items() if name.isupper()}
    assert ours == {name: value for name, value in TensorProto.DataType.items() if name in ours}
    assert len(ours) >= 27


def test_narrow_types_map_both_ways():
    assert numpy_dtype(TensorProto.BFLOAT16) == np.dtype(ml_dtypes.bfloat16)
    assert ONNX_TO_NUMPY.get(TensorProto.INT4) == np.dtype(ml_dtypes.int4)
    assert TensorProto.FLOAT8E4M3FN in ONNX_TO_NUMPY and 99 not in ONNX_TO_NUMPY
    assert ONNX_TO_NUMPY.get(99) is None and ONNX_TO_NUMPY.get(99, "none") == "none"
    assert onnx_type(ml_dtypes.float8_e5m2) == TensorProto.FLOAT8E5M2
    assert onnx_type(np.float32) == TensorProto.FLOAT and onnx_type(np.str_) == TensorProto.STRING


def test_ml_dtypes_is_imported_by_the_first_narrow_type_only():
    script = """
import sys
from runnx.interp.dtypes import ONNX_TO_NUMPY, ElementType, onnx_type
import numpy as np
assert ONNX_TO_NUMPY[ElementType.FLOAT] == np.float32 and ONNX_TO_NUMPY.get(ElementType.INT64) == np.int64
assert ElementType.BFLOAT16 in ONNX_TO_NUMPY and onnx_type(np.float16) == ElementType.FLOAT16
assert "ml_dtypes" not in sys.modules, "no narrow type asked for yet"
assert ONNX_TO_NUMPY.get(ElementType.BFLOAT16).name == "bfloat16"
assert "ml_dtypes" in sys.modules
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=300)
