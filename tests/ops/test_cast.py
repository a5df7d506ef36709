"""Cast and CastLike: float8 saturation, float8e8m0 rounding modes, strings both ways, integer
wrap-around, narrow types, and the attributes each opset version knows."""
import ml_dtypes
import numpy as np
import pytest
from _single_node import run_node
from onnx import TensorProto

F32 = np.float32
EDGES = np.array([1e6, -1e6, np.inf, -np.inf, np.nan, 200, 0.1], F32)


def _cast(x, to, **attributes):
    return run_node("Cast", [x], to=to, opset=attributes.pop("opset", 24), **attributes)


@pytest.mark.parametrize("to, dtype, largest", [
    (TensorProto.FLOAT8E4M3FN, ml_dtypes.float8_e4m3fn, 448),
    (TensorProto.FLOAT8E4M3FNUZ, ml_dtypes.float8_e4m3fnuz, 240),
    (TensorProto.FLOAT8E5M2, ml_dtypes.float8_e5m2, 57344),
    (TensorProto.FLOAT8E5M2FNUZ, ml_dtypes.float8_e5m2fnuz, 57344),
])
def test_float8_saturates_by_default(to, dtype, largest):
    got = _cast(EDGES, to)
    assert got.dtype == dtype
    values = got.astype(F32)
    np.testing.assert_array_equal(values[:4], [largest, -largest, largest, -largest])
    assert np.isnan(values[4])
    np.testing.assert_array_equal(values[5:], EDGES[5:].astype(dtype).astype(F32))
    # the same from float16 input
    np.testing.assert_array_equal(_cast(EDGES[2:].astype(np.float16), to).astype(F32)[:2], [largest, -largest])


def test_float8_without_saturation_overflows():
    e4m3 = _cast(EDGES, TensorProto.FLOAT8E4M3FN, saturate=0).astype(F32)
    assert np.isnan(e4m3[:5]).all()  # E4M3FN has no infinity
    e5m2 = _cast(EDGES, TensorProto.FLOAT8E5M2, saturate=0).astype(F32)
    np.testing.assert_array_equal(e5m2[:4], [np.inf, -np.inf, np.inf, -np.inf])


def test_saturate_is_unknown_before_opset_19():
    with pytest.raises(Exception, match="saturate"):
        _cast(EDGES, TensorProto.FLOAT8E4M3FN, saturate=0, opset=13)


@pytest.mark.parametrize("mode, expected", [
    ("up", [0.125, 0.25, 2, 2, 4, 4]),
    ("down", [0.0625, 0.25, 1, 1, 2, 2]),
    ("nearest", [0.125, 0.25, 1, 2, 2, 4]),
])
def test_e8m0_rounding_modes(mode, expected):
    x = np.array([0.124, 0.25, 1.1, 1.5, 2.9, 3.0], F32)
    got = _cast(x, TensorProto.FLOAT8E8M0, round_mode=mode)
    assert got.dtype == ml_dtypes.float8_e8m0fnu
    np.testing.assert_array_equal(got.astype(F32), expected)


def test_e8m0_saturation():
    x = np.array([np.inf, 3e38, np.nan], F32)
    saturated = _cast(x, TensorProto.FLOAT8E8M0).astype(F32)
    np.testing.assert_array_equal(saturated[:2], [2.0**127, 2.0**127])
    assert np.isnan(saturated[2])
    assert np.isnan(_cast(x, TensorProto.FLOAT8E8M0, saturate=0).astype(F32)).all()


def test_strings_to_numbers():
    text = np.array(["3.5", "1e-5", "-INF", "+inf", "NaN", "1000", " 2 "], dtype=object)
    got = _cast(text, TensorProto.FLOAT)
    assert got.dtype == F32
    np.testing.assert_array_equal(got, np.array([3.5, 1e-5, -np.inf, np.inf, np.nan, 1000, 2], F32))
    integers = _cast(np.array(["100", "-7", "2.9", "9223372036854775807"], dtype=object), TensorProto.INT64)
    np.testing.assert_array_equal(integers, [100, -7, 2, 2**63 - 1])
    np.testing.assert_array_equal(_cast(np.array(["300"], dtype=object), TensorProto.UINT8), [44])  # wraps
    np.testing.assert_array_equal(_cast(np.array(["true", "False", "0", "2.5"], dtype=object), TensorProto.BOOL),
                                  [True, False, False, True])


def test_numbers_to_strings():
    got = _cast(np.array([1.5, 0.1, -2], F32), TensorProto.STRING)
    assert got.dtype == object and all(type(v) is str for v in got)
    np.testing.assert_array_equal(got, ["1.5", "0.1", "-2.0"])
    np.testing.assert_array_equal(_cast(np.array([7, -1], np.int64), TensorProto.STRING), ["7", "-1"])
    np.testing.assert_array_equal(_cast(np.array([True]), TensorProto.STRING), ["True"])


def test_integers_wrap_and_floats_round_to_nearest_even():
    np.testing.assert_array_equal(_cast(np.array([200, -129], np.int16), TensorProto.INT8), [-56, 127])
    np.testing.assert_array_equal(_cast(np.array([0.0, -0.0, 0.5, np.nan], F32), TensorProto.BOOL),
                                  [False, False, True, True])
    # 1 + 2**-8 lies halfway between two bfloat16 values: ties to even gives 1
    bf = _cast(np.array([1 + 2.0**-8, 1 + 3 * 2.0**-8], F32), TensorProto.BFLOAT16)
    np.testing.assert_array_equal(bf.astype(F32), [1.0, 1 + 2.0**-6])


def test_four_bit_types():
    got = _cast(np.array([-8, 7, 1.6], F32), TensorProto.INT4)  # float to integer truncates
    assert got.dtype == ml_dtypes.int4
    np.testing.assert_array_equal(got.astype(np.int8), [-8, 7, 1])
    np.testing.assert_array_equal(_cast(got, TensorProto.FLOAT), [-8, 7, 1])
    np.testing.assert_array_equal(_cast(np.array([0.25, 5, -7], F32), TensorProto.FLOAT4E2M1).astype(F32),
                                  [0.0, 4.0, -6.0])


def test_castlike_takes_the_type_of_its_second_input():
    like = np.array([], dtype=np.float16)
    got = run_node("CastLike", [np.array([1 + 2.0**-11, 70000], F32), like], opset=15)
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, np.array([1.0, np.inf], np.float16))
    saturated = run_node("CastLike", [EDGES[:1], np.array([], ml_dtypes.float8_e4m3fn)], opset=19, saturate=1)
    assert saturated.astype(F32)[0] == 448
    strings = run_node("CastLike", [np.array([2], np.int32), np.array(["x"], dtype=object)], opset=15)
    np.testing.assert_array_equal(strings, ["2"])


def test_opset1_names_the_target_type():
    got = run_node("Cast", [np.array([1.7, -2.2], F32)], to="INT32", opset=1)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, [1, -2])
