"""Elementwise math and activations: the sign, rounding, overflow and opset rules the backend suite
checks only partly, against hand-computed or exact-integer expectations; and in-place reuse."""
import math

import ml_dtypes
import numpy as np
import pytest
from _single_node import run_node

F32 = np.float32


def test_integer_div_truncates_toward_zero():
    a = np.array([-7, 7, -7, 7, -6, 0], dtype=np.int32)
    b = np.array([2, 2, -2, -2, 3, -5], dtype=np.int32)
    np.testing.assert_array_equal(run_node("Div", [a, b]), [-3, 3, 3, -3, -2, 0])


def test_int64_div_is_exact_beyond_float_precision():
    a = np.array([2**62 + 1, -(2**62) - 7, 2**63 - 1], dtype=np.int64)
    b = np.array([3, 5, -2], dtype=np.int64)
    expected = [abs(x) // abs(y) * (1 if (x < 0) == (y < 0) else -1) for x, y in zip(a.tolist(), b.tolist())]
    np.testing.assert_array_equal(run_node("Div", [a, b]), expected)


def test_unsigned_div():
    np.testing.assert_array_equal(run_node("Div", [np.array([7, 255], np.uint8), np.array([2, 16], np.uint8)]), [3, 15])


@pytest.mark.parametrize("dtype", [np.int32, np.float32])
def test_mod_sign_follows_divisor_or_dividend(dtype):
    a = np.array([-7, 7, -7, 7], dtype=dtype)
    b = np.array([3, -3, -3, 3], dtype=dtype)
    # fmod=0 (floats allowed from opset 28 on): the result has the divisor's sign
    np.testing.assert_array_equal(run_node("Mod", [a, b], opset=28), [2, -2, -1, 1])
    # fmod=1: C fmod, the dividend's sign
    np.testing.assert_array_equal(run_node("Mod", [a, b], fmod=1), [-1, 1, -1, 1])


def test_pow_keeps_the_base_type():
    base = np.array([2, 3, -2], dtype=np.int32)
    got = run_node("Pow", [base, np.array([0.5, 2.0, 3.0], dtype=F32)])
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, [1, 9, -8])
    got = run_node("Pow", [np.array([2.0, 4.0], F32), np.array([3, -1], np.int64)])
    assert got.dtype == F32
    np.testing.assert_array_equal(got, [8.0, 0.25])
    x = np.array([1.1, -3.7, 1e20], F32)
    squared = run_node("Pow", [x, np.array(2.0)])  # float64 exponent: still float32, exactly x*x
    assert squared.dtype == F32
    np.testing.assert_array_equal(squared, np.square(x))


def test_integer_pow_with_negative_exponent_truncates():
    base = np.array([2, 1, -1, -1, 5], dtype=np.int64)
    exponent = np.array([-1, -3, -3, -2, 2], dtype=np.int64)
    np.testing.assert_array_equal(run_node("Pow", [base, exponent]), [0, 1, -1, 1, 25])


def test_bitshift_edges():
    x = np.array([-8, -8, 5, 1, -1], dtype=np.int8)
    y = np.array([1, 9, -1, 7, 8], dtype=np.int8)
    # arithmetic right shift; out-of-range shifts give the sign fill
    np.testing.assert_array_equal(run_node("BitShift", [x, y], direction="RIGHT", opset=28), [-4, -1, 0, 0, -1])
    # left shift discards bits pushed past the sign bit; out-of-range shifts give 0
    np.testing.assert_array_equal(run_node("BitShift", [x, y], direction="LEFT", opset=28), [-16, 0, 0, -128, 0])
    u = np.array([1, 255], np.uint8)
    np.testing.assert_array_equal(run_node("BitShift", [u, np.array([7, 1], np.uint8)], direction="LEFT"), [128, 254])


def test_round_halves_to_even():
    x = np.array([0.5, 1.5, 2.5, -0.5, -1.5, 2.4], dtype=F32)
    np.testing.assert_array_equal(run_node("Round", [x]), [0, 2, 2, -0.0, -2, 2])


def test_erf_matches_math_erf_in_float32_and_float16():
    x = np.linspace(-4, 4, 41)
    expected = [math.erf(v) for v in x]
    np.testing.assert_allclose(run_node("Erf", [x.astype(F32)]), expected, rtol=1e-6, atol=1e-7)
    half_x = x.astype(np.float16)
    half = run_node("Erf", [half_x])
    assert half.dtype == np.float16  # erf of the float16 input, rounded once
    np.testing.assert_array_equal(half, np.array([math.erf(v) for v in half_x.tolist()], dtype=np.float16))


SPECIAL = np.array([np.nan, np.inf, -np.inf, 3e38, -3e38, 4.0, -4.0, 3.919206, -3.9192057, 1e-40, -1e-40, 1e-45,
                    0.0, -0.0, 0.5, -2.0], F32)


def exact_erf(x: np.ndarray) -> np.ndarray:
    """libm's erf of each element (NaN for NaN), rounded once to x's dtype."""
    flat = [math.erf(v) if v == v else math.nan for v in x.astype(np.float64).ravel().tolist()]
    return np.array(flat).astype(x.dtype).reshape(x.shape)


@pytest.mark.parametrize("repeat", [1, 8])  # alone, and in vectorised loops
def test_erf_of_nan_infinities_huge_denormal_and_signed_zero_is_libms(repeat):
    x = np.tile(SPECIAL, repeat)
    got, want = run_node("Erf", [x]), exact_erf(x)
    assert np.isnan(got[0::len(SPECIAL)]).all()
    finite = ~np.isnan(want)
    np.testing.assert_array_equal(np.signbit(got[finite]), np.signbit(want[finite]))  # -0.0 stays -0.0
    # a denormal result is right to a few denormal steps (x * P(x^2) is a smaller denormal first)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-6, atol=1e-43)
    saturated = np.abs(x) >= F32(3.919206)  # erf is exactly +-1 there in float32 (and +-inf)
    np.testing.assert_array_equal(got[saturated], np.sign(x[saturated]))


def test_clip_versions():
    x = np.array([-5, 0, 5], dtype=F32)
    np.testing.assert_array_equal(run_node("Clip", [x], opset=6, min=-1.0, max=2.0), [-1, 0, 2])
    np.testing.assert_array_equal(run_node("Clip", [x], opset=6), x)  # defaults: the float range
    # from opset 11 the bounds are optional inputs; min > max gives max everywhere
    np.testing.assert_array_equal(run_node("Clip", [x, np.array(3, F32), np.array(1, F32)], opset=13), [1, 1, 1])
    np.testing.assert_array_equal(run_node("Clip", [x, None, np.array(1, F32)], opset=13), [-5, 0, 1])
    ints = np.array([-128, 0, 127], np.int8)
    np.testing.assert_array_equal(run_node("Clip", [ints, np.array(-3, np.int8)], opset=13), [-3, 0, 127])


def test_opset6_broadcast_aligns_b_from_axis():
    a = np.zeros((2, 3, 4), F32)
    b = np.array([1, 2, 3], F32)
    got = run_node("Add", [a, b], opset=6, broadcast=1, axis=1)
    np.testing.assert_array_equal(got, np.broadcast_to(b.reshape(1, 3, 1), (2, 3, 4)))
    np.testing.assert_array_equal(run_node("Mul", [np.ones((2, 3), F32), b], opset=6, broadcast=1), [b, b])
    with pytest.raises(Exception, match="broadcast=0"):
        run_node("Sub", [a, b], opset=6)
    rows = np.array([[1, 2], [3, 4]], np.int32)
    np.testing.assert_array_equal(run_node("Less", [rows, np.array([2, 3], np.int32)], opset=1, broadcast=1, axis=0),
                                  [[True, False], [False, False]])
    np.testing.assert_array_equal(run_node("Clip", [np.array([1, 60000], np.float16)], opset=6), [1, 60000])


def test_prelu_slope_is_per_channel_before_opset7():
    x = -np.ones((1, 3, 2), F32)
    slope = np.array([1, 2, 3], F32)
    np.testing.assert_array_equal(run_node("PRelu", [x, slope], opset=6), -np.array([[[1, 1], [2, 2], [3, 3]]]))
    x = -np.ones((1, 2, 3), F32)
    np.testing.assert_array_equal(run_node("PRelu", [x, slope], opset=9), -np.array([[[1, 2, 3], [1, 2, 3]]]))


def test_variadic_ops_broadcast():
    a = np.array([[1], [5]], F32)
    b = np.array([2, 4, 6], F32)
    c = np.array(3, F32)
    np.testing.assert_array_equal(run_node("Sum", [a, b, c]), a + b + c)
    np.testing.assert_array_equal(run_node("Mean", [a, b, c]), (a + b + c) / 3)
    np.testing.assert_array_equal(run_node("Max", [a, b, c]), np.maximum(np.maximum(a, b), c))
    np.testing.assert_array_equal(run_node("Min", [a, b]), np.minimum(a, b))
    assert np.isnan(run_node("Max", [np.array([np.nan, 1], F32), np.array([0, 2], F32)])[0])


def test_isinf_directions():
    x = np.array([-np.inf, np.inf, 0, np.nan], F32)
    np.testing.assert_array_equal(run_node("IsInf", [x]), [True, True, False, False])
    np.testing.assert_array_equal(run_node("IsInf", [x], detect_positive=0), [True, False, False, False])
    np.testing.assert_array_equal(run_node("IsInf", [x], detect_negative=0), [False, True, False, False])


def test_sigmoid_is_stable_and_accurate_at_the_tails():
    x = np.array([-100, -20, 0, 20, 100], np.float64)
    np.testing.assert_allclose(run_node("Sigmoid", [x]), 1 / (1 + np.exp(-x)), rtol=1e-12)
    with np.errstate(over="raise"):
        assert run_node("Sigmoid", [np.array([-1e4], F32)])[0] == 0
    half = np.array([-16, -12, 0, 12], np.float16)
    np.testing.assert_allclose(run_node("Sigmoid", [half]).astype(np.float64),
                               1 / (1 + np.exp(-half.astype(np.float64))), rtol=1e-3, atol=1e-7)


def test_activations_against_formulas():
    x = np.linspace(-3, 3, 13).astype(np.float64)
    erf = np.vectorize(math.erf)
    cases = {
        ("Elu", 6, ()): np.where(x > 0, x, np.exp(x) - 1),
        ("Celu", 12, (("alpha", 2.0),)): np.maximum(0, x) + np.minimum(0, 2 * (np.exp(x / 2) - 1)),
        ("HardSigmoid", 6, ()): np.clip(0.2 * x + 0.5, 0, 1),
        ("HardSwish", 14, ()): x * np.clip(x / 6 + 0.5, 0, 1),
        ("Softplus", 1, ()): np.log1p(np.exp(x)),
        ("Softsign", 1, ()): x / (1 + np.abs(x)),
        ("Mish", 18, ()): x * np.tanh(np.log1p(np.exp(x))),
        ("Gelu", 20, ()): 0.5 * x * (1 + erf(x / np.sqrt(2))),
        ("Gelu", 20, (("approximate", "tanh"),)):
            0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3))),
        ("ThresholdedRelu", 10, (("alpha", 1.5),)): np.where(x > 1.5, x, 0),
        ("Shrink", 9, (("bias", 0.5), ("lambd", 1.0))): np.where(x < -1, x + 0.5, np.where(x > 1, x - 0.5, 0)),
        ("Swish", 24, (("alpha", 2.0),)): x / (1 + np.exp(-2 * x)),
        ("LeakyRelu", 6, ()): np.where(x < 0, 0.01 * x, x),
    }
    for (op, opset, attributes), expected in cases.items():
        np.testing.assert_allclose(run_node(op, [x], opset=opset, **dict(attributes)), expected, rtol=1e-12,
                                   atol=1e-15, err_msg=op)


def test_swiglu_requires_equal_shapes():
    a = np.array([-1.0, 2.0], F32)
    b = np.array([3.0, 4.0], F32)
    np.testing.assert_allclose(run_node("SwiGLU", [a, b], opset=28), a / (1 + np.exp(-a)) * b, rtol=1e-6)
    with pytest.raises(Exception, match="one shape"):
        run_node("SwiGLU", [a, b[:1]], opset=28)


def test_half_precision_stays_in_its_dtype():
    x = np.array([0.1, 1.7, -2.3], np.float16)
    for op in ("Exp", "Tanh", "Sigmoid", "Relu", "Sqrt", "Gelu"):
        assert run_node(op, [np.abs(x) if op == "Sqrt" else x], opset=20).dtype == np.float16, op
    bf = x.astype(ml_dtypes.bfloat16)
    got = run_node("Add", [bf, bf])
    assert got.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got, bf + bf)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, ml_dtypes.bfloat16, np.int8, np.int64])
def test_relu_matches_maximum_with_zero_in_every_dtype(dtype):
    """Relu compares with a kept 0-d zero of the dtype: the result is numpy's maximum against the
    dtype's zero (NaN kept, -0.0 as numpy gives it), in place or not, and the kept zero stays 0."""
    values = np.array([-3, -0.0, 0, 2.5, np.nan, -np.inf, np.inf] if np.dtype(dtype).kind == "f" else [-3, 0, 5])
    x = values.astype(dtype)
    expected = np.maximum(x, np.dtype(dtype).type(0))
    for owned in (False, True):
        got = run_node("Relu", [x.copy()], opset=14, owned=owned)
        assert got.dtype == x.dtype
        np.testing.assert_array_equal(got.view(np.uint8), expected.view(np.uint8))  # bitwise, sign of zero too
    assert run_node("Relu", [np.array([-1.0], dtype)], opset=14)[0] == 0


@pytest.mark.parametrize("op, inputs, attributes", [
    ("Add", [np.arange(6, dtype=F32).reshape(2, 3), np.arange(3, dtype=F32)], {}),
    ("Sub", [np.arange(3, dtype=F32), np.arange(6, dtype=F32).reshape(2, 3)], {}),
    ("Relu", [np.linspace(-1, 1, 5).astype(F32)], {}),
    ("Sigmoid", [np.linspace(-9, 9, 7).astype(F32)], {}),
    ("LeakyRelu", [np.linspace(-1, 1, 5).astype(F32)], {"alpha": 0.3}),
    ("Clip", [np.linspace(-2, 2, 5).astype(F32), np.array(-1, F32), np.array(1, F32)], {}),
    ("Where", [np.array([True, False, True]), np.arange(3, dtype=F32), np.array(7, F32)], {}),
    ("Sum", [np.ones((2, 2), F32), np.arange(2, dtype=F32), np.ones((2, 2), F32)], {}),
    ("Mean", [np.ones((2, 2), F32), np.arange(2, dtype=F32)], {}),
    ("Erf", [np.linspace(-1, 1, 5).astype(F32)], {}),
    ("ThresholdedRelu", [np.linspace(-2, 2, 5).astype(F32)], {}),
    ("Softsign", [np.linspace(-2, 2, 5).astype(F32)], {}),
    ("Softmax", [np.linspace(-2, 2, 6).astype(F32).reshape(2, 3)], {}),
    ("LogSoftmax", [np.linspace(-2, 2, 6).astype(F32).reshape(2, 3)], {"axis": 0}),
])
def test_in_place_gives_the_out_of_place_result(op, inputs, attributes):
    borrowed = run_node(op, inputs, opset=18, **attributes)
    owned, profile = run_node(op, inputs, opset=18, owned=True, profile=True, **attributes)
    np.testing.assert_array_equal(owned, borrowed)
    assert profile.inplace[op] == 1, f"{op} did not reuse its input"


@pytest.mark.parametrize("op", ["Abs", "Neg", "Sqrt", "Exp", "Erf", "Sigmoid", "Relu", "HardSwish", "HardSigmoid",
                                "Softsign", "Softplus", "Gelu", "Mish", "LeakyRelu", "ThresholdedRelu", "Softmax",
                                "LogSoftmax"])
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2)])
def test_scalars_and_empty_tensors(op, shape):
    x = np.full(shape, 0.5, F32)
    borrowed = run_node(op, [x], opset=20)
    owned = run_node(op, [x], opset=20, owned=True)
    assert borrowed.shape == shape and borrowed.dtype == F32
    np.testing.assert_array_equal(owned, borrowed)


def test_kernels_declaring_a_ufunc_compute_exactly_it():
    """Compiled plans run a kernel's declared ufunc in place of the kernel (interp/compiled.py)."""
    from runnx.ops import load_families, registry

    load_families()  # every family registered, not only those this file imported
    declared = [k for versions in registry._REGISTRY.values() for k in versions if k.ufunc is not None]
    assert {"Add", "Sub", "Mul", "Neg"} <= {k.op_type for k in declared}
    rng = np.random.default_rng(3)
    for kernel in declared:
        ufunc = kernel.ufunc
        dtype = next(d for d in (np.float32, np.bool_, np.int32)
                     if any(t.startswith(np.dtype(d).char * ufunc.nin) for t in ufunc.types))
        inputs = [(rng.standard_normal(6) * 4).astype(dtype) for _ in range(ufunc.nin)]
        assert kernel.arity == (ufunc.nin, ufunc.nin) and kernel.inplace[:1] == (0,)
        for overwrite in ((), (0,)):
            copies = [a.copy() for a in inputs]
            np.testing.assert_array_equal(kernel.fn(*copies, overwrite=overwrite), ufunc(*inputs))


def _wide(*shape, dtype=F32, start=1):
    return (np.arange(math.prod(shape), dtype=np.float64).reshape(shape) % 7 + start).astype(dtype)


# (a, b, granted positions, the input expected to hold the result: 0, 1 or None for a fresh array)
_BROADCAST_CASES = {
    "equal shapes": (_wide(2, 3), _wide(2, 3, start=2), (0,), 0),
    "b a suffix": (_wide(1, 8, 64), _wide(64), (0,), 0),
    "b ones and a suffix": (_wide(1, 8, 64), _wide(1, 1, 64), (0,), 0),
    "b a 0-d scalar": (_wide(2, 3), np.array(0.75, F32), (0,), 0),
    "b a middle one": (_wide(2, 3, 4), _wide(2, 1, 4), (0,), 0),
    "a would grow": (_wide(64), _wide(1, 8, 64), (0,), None),
    "a would grow in a dim of 1": (_wide(1, 1, 64), _wide(1, 8, 64), (0,), None),
    "a would grow, b granted too": (_wide(1, 1, 64), _wide(1, 8, 64), (0, 1), 1),
    "only b granted, it fits": (_wide(64), _wide(3, 64), (1,), 1),
    "only b granted, it would grow": (_wide(3, 64), _wide(64), (1,), None),
    "both would grow": (_wide(3, 1), _wide(1, 4), (0, 1), None),
    "dtypes differ": (_wide(2, 3), _wide(3, dtype=np.float64), (0, 1), None),
    "dtypes differ, equal shapes": (_wide(2, 3, dtype=np.float16), _wide(2, 3), (0, 1), None),
    "both 0-d": (np.array(1.5, F32), np.array(0.25, F32), (0,), 0),
    "a 0-d would grow": (np.array(1.5, F32), _wide(3), (0,), None),
    "a 0-d, b granted": (np.array(1.5, F32), _wide(3), (0, 1), 1),
    "a empty, b a suffix": (_wide(0, 64), _wide(64), (0,), 0),
    "a would become empty": (_wide(1, 64), _wide(0, 64), (0,), None),
    "a empty, b 0-d": (_wide(2, 0), np.array(2, F32), (0,), 0),
    "int32 broadcast": (_wide(4, 5, dtype=np.int32), _wide(5, dtype=np.int32), (0,), 0),
    "a strided view": (_wide(4, 3).T, _wide(4), (0,), None),
    "nothing granted": (_wide(2, 3), _wide(3), (), None),
}


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul"])
@pytest.mark.parametrize("case", list(_BROADCAST_CASES))
def test_a_granted_input_holds_the_result_exactly_when_it_has_its_shape_and_dtype(op, case):
    """binary's rule (registry.inplace_target): a granted, C-contiguous input of the result's shape
    and dtype is written; one that would have to grow, or of another dtype, is left untouched and
    the result is a fresh array; either way bitwise the out-of-place result."""
    from runnx.ops import elementwise
    a, b, granted, holder = _BROADCAST_CASES[case]
    a, b = a.copy() if a.flags.c_contiguous else a.T.copy().T, b.copy()
    a_before, b_before = a.copy(), b.copy()
    expected = np.asarray(getattr(elementwise, op)(a_before, b_before))
    result = getattr(elementwise, op)(a, b, overwrite=granted)
    assert type(result) is np.ndarray and result.dtype == expected.dtype and result.shape == expected.shape
    np.testing.assert_array_equal(result, expected)
    assert result.tobytes() == expected.tobytes()
    for position, (array, before) in enumerate(((a, a_before), (b, b_before))):
        if position == holder:
            assert result is array  # written in place (np.shares_memory is true of empty arrays too)
        else:
            assert not (array.size and np.shares_memory(result, array))
            np.testing.assert_array_equal(array, before)  # untouched


def test_shapes_that_do_not_broadcast_fail_as_numpy_does_whatever_is_granted():
    from runnx.ops import elementwise
    a, b = _wide(2, 3), _wide(4)
    with pytest.raises(ValueError, match="broadcast"):
        elementwise.Add(a, b, overwrite=(0, 1))
    np.testing.assert_array_equal(a, _wide(2, 3))


@pytest.mark.parametrize("strided", [False, True])
def test_where_and_sum_write_a_granted_input_only_when_it_fits_and_is_c_contiguous(strided):
    """Where writes x (or y) and Sum its first input when granted, of the broadcast shape and
    dtype, and C-contiguous; a strided or growing input is left as it is and the result is a
    fresh array, bitwise copy mode's down to its strides."""
    from runnx.ops import elementwise
    x = _wide(4, 3).T if strided else _wide(3, 4)
    y, condition = _wide(4, start=3), (np.arange(12).reshape(3, 4) % 3 == 0)
    for name, call in (("Where", lambda granted: elementwise.Where(condition, x, y, overwrite=granted)),
                       ("Sum", lambda granted: elementwise.Sum(x, y, y, overwrite=granted))):
        before = x.copy()
        expected = call(())
        result = call((0, 1) if name == "Sum" else (1, 2))
        assert result.tobytes() == expected.tobytes() and result.strides == expected.strides, name
        assert (result is x) == (not strided), name
        if strided:
            np.testing.assert_array_equal(x, before)
        x[...] = before
    small = _wide(1, 4)  # would have to grow to (3, 4): never written
    assert not np.shares_memory(elementwise.Where(condition, small, y, overwrite=(1,)), small)
    assert not np.shares_memory(elementwise.Sum(small, x, overwrite=(0,)), small)
    np.testing.assert_array_equal(small, _wide(1, 4))


def test_the_inline_forms_of_the_in_place_rules_agree_with_the_rules():
    """Compiled plans test `writes_first_inline` / `writable_alone_inline` instead of calling
    `inplace_target` / `unary`'s check: the expressions must be true exactly on the rules' cases
    they stand for (same shapes), and never where the rules refuse."""
    from runnx.ops.registry import inplace_target, writable_alone_inline, writes_first_inline

    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    arrays = [base, base.copy(), base[:, ::2], base.T, base.astype(np.float64), base[:1], np.float32(2) * base[0],
              np.ones((4, 6), np.float32)[:, :6]]
    for a in arrays:
        assert eval(writable_alone_inline("a")) == a.flags.c_contiguous
        for b in arrays:
            inline = eval(writes_first_inline("a", "b"))
            try:
                rule = inplace_target(a, b, (0,)) is a
            except ValueError:
                rule = False
            if a.shape == b.shape:
                assert inline == rule, (a.shape, a.strides, a.dtype, b.shape, b.dtype)
            else:
                assert not inline
