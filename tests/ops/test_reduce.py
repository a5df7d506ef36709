"""Reductions and the Softmax family: axes as attribute vs input by opset, noop_with_empty_axes,
keepdims, empty-set identities, select_last_index, CumSum/CumProd options, and Softmax's
flatten-to-2D semantics before opset 13 vs per-axis after."""
import numpy as np
import pytest
from _single_node import run_node

F32 = np.float32
X = np.arange(24, dtype=F32).reshape(2, 3, 4) / 7 - 1
AXES = np.array([0, -1], np.int64)


@pytest.mark.parametrize("op, reference", [
    ("ReduceSum", lambda x, a, k: np.sum(x, axis=a, keepdims=k)),
    ("ReduceMean", lambda x, a, k: np.mean(x, axis=a, keepdims=k)),
    ("ReduceMax", lambda x, a, k: np.max(x, axis=a, keepdims=k)),
    ("ReduceMin", lambda x, a, k: np.min(x, axis=a, keepdims=k)),
    ("ReduceProd", lambda x, a, k: np.prod(x, axis=a, keepdims=k)),
    ("ReduceL1", lambda x, a, k: np.sum(np.abs(x), axis=a, keepdims=k)),
    ("ReduceL2", lambda x, a, k: np.sqrt(np.sum(x * x, axis=a, keepdims=k))),
    ("ReduceSumSquare", lambda x, a, k: np.sum(x * x, axis=a, keepdims=k)),
    ("ReduceLogSum", lambda x, a, k: np.log(np.sum(np.abs(x), axis=a, keepdims=k))),
    ("ReduceLogSumExp", lambda x, a, k: np.log(np.sum(np.exp(x), axis=a, keepdims=k))),
])
def test_axes_attribute_before_and_input_after(op, reference):
    x = np.abs(X) if op == "ReduceLogSum" else X
    input_since = 13 if op == "ReduceSum" else 18
    for keepdims in (0, 1):
        expected = reference(x.astype(np.float64), (0, 2), bool(keepdims))
        old = run_node(op, [x], opset=input_since - 1, axes=[0, -1], keepdims=keepdims)
        new = run_node(op, [x, AXES], opset=input_since, keepdims=keepdims)
        for got in (old, new):
            assert got.dtype == F32 and got.shape == expected.shape
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    # no axes: everything is reduced, unless noop_with_empty_axes asks for no reduction at all
    assert run_node(op, [x], opset=input_since).shape == (1, 1, 1)
    assert run_node(op, [x, np.array([], np.int64)], opset=input_since, keepdims=0).shape == ()
    noop = run_node(op, [x, np.array([], np.int64)], opset=input_since, noop_with_empty_axes=1)
    np.testing.assert_allclose(noop, reference(x.astype(np.float64), (), True), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op, identity", [
    ("ReduceSum", 0), ("ReduceProd", 1), ("ReduceMax", -np.inf), ("ReduceMin", np.inf), ("ReduceL1", 0),
    ("ReduceL2", 0), ("ReduceSumSquare", 0), ("ReduceLogSum", -np.inf), ("ReduceLogSumExp", -np.inf),
])
def test_empty_reductions_give_the_identity(op, identity):
    empty = np.zeros((2, 0, 4), F32)
    got = run_node(op, [empty, np.array([1], np.int64)], opset=18)
    assert got.shape == (2, 1, 4)
    np.testing.assert_array_equal(got, np.full((2, 1, 4), identity, F32))


def test_integer_and_bool_extremes():
    np.testing.assert_array_equal(run_node("ReduceMax", [np.zeros((0, 2), np.int32)], opset=18, keepdims=0),
                                  np.full((), np.iinfo(np.int32).min))
    flags = np.array([[True, False], [False, False]])
    np.testing.assert_array_equal(run_node("ReduceMax", [flags, np.array([1], np.int64)], opset=20, keepdims=0),
                                  [True, False])
    np.testing.assert_array_equal(run_node("ReduceMean", [np.array([[1, 2], [4, 4]], np.int32)], opset=13,
                                           axes=[1], keepdims=0), [1, 4])  # integer mean truncates


def test_reduce_rejects_out_of_range_axes():
    with pytest.raises(Exception, match="out of range"):
        run_node("ReduceSum", [X, np.array([3], np.int64)], opset=13)


def test_argmax_argmin_select_last_index():
    x = np.array([[2, 5, 5], [1, 1, 0]], np.int32)
    np.testing.assert_array_equal(run_node("ArgMax", [x], axis=1, keepdims=0), [1, 0])
    np.testing.assert_array_equal(run_node("ArgMax", [x], axis=1, keepdims=0, select_last_index=1), [2, 1])
    np.testing.assert_array_equal(run_node("ArgMin", [x], axis=-1, select_last_index=1), [[0], [2]])
    np.testing.assert_array_equal(run_node("ArgMin", [x], axis=0, select_last_index=1), [[1, 1, 1]])
    assert run_node("ArgMax", [x]).dtype == np.int64
    with pytest.raises(Exception, match="select_last_index"):
        run_node("ArgMax", [x], opset=11, select_last_index=1)


@pytest.mark.parametrize("exclusive, reverse, expected", [
    (0, 0, [1, 3, 6, 10]), (1, 0, [0, 1, 3, 6]), (0, 1, [10, 9, 7, 4]), (1, 1, [9, 7, 4, 0]),
])
def test_cumsum_options(exclusive, reverse, expected):
    x = np.array([1, 2, 3, 4], np.int32)
    got = run_node("CumSum", [x, np.array(0, np.int64)], exclusive=exclusive, reverse=reverse)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, expected)


def test_cumsum_along_an_axis_and_cumprod():
    x = np.arange(1, 7, dtype=F32).reshape(2, 3)
    np.testing.assert_array_equal(run_node("CumSum", [x, np.array([-1], np.int32)]), np.cumsum(x, axis=1))
    np.testing.assert_array_equal(run_node("CumProd", [x, np.array(0, np.int64)], opset=26, exclusive=1),
                                  [[1, 1, 1], [1, 2, 3]])


def test_softmax_flattens_to_2d_before_opset13():
    x = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(F32)
    rows = x.reshape(2, 12)
    flat = np.exp(rows - rows.max(axis=1, keepdims=True))
    flat /= flat.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(run_node("Softmax", [x], opset=11), flat.reshape(x.shape), rtol=1e-6)
    per_axis = np.exp(x - x.max(axis=1, keepdims=True))
    per_axis /= per_axis.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(run_node("Softmax", [x], opset=13, axis=1), per_axis, rtol=1e-6)
    last = np.exp(x) / np.exp(x).sum(axis=-1, keepdims=True)
    np.testing.assert_allclose(run_node("Softmax", [x], opset=13), last, rtol=1e-6)  # default axis -1
    np.testing.assert_allclose(run_node("LogSoftmax", [x], opset=11), np.log(flat.reshape(x.shape)), rtol=1e-5)
    np.testing.assert_allclose(run_node("LogSoftmax", [x], opset=13), np.log(last), rtol=1e-5)


def test_softmax_is_stable_for_large_inputs():
    x = np.array([[1000, 1001, 1002]], F32)
    np.testing.assert_allclose(run_node("Softmax", [x]), [[0.09003057, 0.24472847, 0.66524096]], rtol=1e-6)
    np.testing.assert_allclose(run_node("LogSoftmax", [x]), [[-2.40760596, -1.40760596, -0.40760596]], rtol=1e-6)


def test_hardmax_marks_the_first_maximum():
    x = np.array([[[1, 3], [3, 0]], [[2, 2], [0, 1]]], F32)
    # opset 11: each batch's 2x2 block is one row; the first 3 (flat index 1) wins
    np.testing.assert_array_equal(run_node("Hardmax", [x], opset=11), [[[0, 1], [0, 0]], [[1, 0], [0, 0]]])
    np.testing.assert_array_equal(run_node("Hardmax", [x], opset=13), [[[0, 1], [1, 0]], [[1, 0], [0, 1]]])
