"""Indexing ops: scatter reductions with repeated indices, scatters writing into a dying input,
index range checks, TopK's tie rule, Unique in order of appearance, GatherND batch dims."""
import numpy as np
import pytest
from _single_node import run_node

from runnx.errors import RunnxError
from runnx.ops.indexing import ArrayFeatureExtractor

I64 = np.int64


@pytest.mark.parametrize("reduction, expected", [
    ("none", [1, 20, 3, 5]),  # a repeated index: the last update wins
    ("add", [1, 2 + 10 + 20, 3, 4 + 5]),
    ("mul", [1, 2 * 10 * 20, 3, 4 * 5]),
    ("max", [1, 20, 3, 5]),
    ("min", [1, 2, 3, 4]),
])
def test_scatternd_reductions_apply_repeated_indices_one_by_one(reduction, expected):
    data = np.array([1, 2, 3, 4], dtype=np.float32)
    indices = np.array([[1], [1], [3]], dtype=I64)
    updates = np.array([10, 20, 5], dtype=np.float32)
    np.testing.assert_array_equal(run_node("ScatterND", [data, indices, updates], reduction=reduction), expected)


def test_scatternd_replaces_whole_slices():
    data = np.zeros((3, 2), dtype=np.int32)
    got = run_node("ScatterND", [data, np.array([[2], [0]], I64), np.array([[1, 2], [3, 4]], np.int32)])
    np.testing.assert_array_equal(got, [[3, 4], [0, 0], [1, 2]])


def test_scatter_elements_reduction_along_an_axis_with_negative_indices():
    data = np.ones((2, 3), dtype=np.float32)
    indices = np.array([[-1, 0], [1, 1]], dtype=I64)
    updates = np.array([[2, 3], [4, 5]], dtype=np.float32)
    got = run_node("ScatterElements", [data, indices, updates], axis=1, reduction="add")
    np.testing.assert_array_equal(got, [[4, 1, 3], [1, 10, 1]])


@pytest.mark.parametrize("op, extra", [("ScatterND", {}), ("ScatterElements", {"axis": 0})])
def test_scatters_write_into_an_owned_dying_input(op, extra):
    data = np.zeros(4, dtype=np.float32)
    indices = np.array([[2]], I64) if op == "ScatterND" else np.array([2], I64)
    got, record = run_node(op, [data, indices, np.array([7], np.float32)], owned=True, profile=True, **extra)
    np.testing.assert_array_equal(got, [0, 0, 7, 0])
    assert record.inplace[op] == 1


def test_scatter_into_a_borrowed_input_leaves_it_alone():
    data = np.zeros(3, dtype=np.float32)
    run_node("ScatterND", [data, np.array([[0]], I64), np.array([1], np.float32)])
    np.testing.assert_array_equal(data, [0, 0, 0])


@pytest.mark.parametrize("op, inputs", [
    ("Gather", [np.arange(3.0), np.array([3], I64)]),
    ("GatherElements", [np.arange(3.0), np.array([-4], I64)]),
    ("ScatterND", [np.arange(3.0), np.array([[5]], I64), np.array([1.0])]),
])
def test_indices_out_of_range_are_errors_not_wrap_around(op, inputs):
    with pytest.raises(RunnxError, match="out of range"):
        run_node(op, inputs)


def test_gather_with_a_scalar_index_drops_the_axis():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(run_node("Gather", [x, np.array(-1, I64)], axis=1), [2, 5])


def test_gathernd_with_batch_dims():
    data = np.arange(8, dtype=np.int32).reshape(2, 2, 2)
    indices = np.array([[1], [0]], dtype=I64)  # per batch: row 1 of batch 0, row 0 of batch 1
    np.testing.assert_array_equal(run_node("GatherND", [data, indices], batch_dims=1), [[2, 3], [4, 5]])
    indices = np.array([[[0, 1]], [[1, 0]]], dtype=I64)
    np.testing.assert_array_equal(run_node("GatherND", [data, indices], batch_dims=1), [[1], [6]])


def test_topk_ties_go_to_the_lower_index_both_ways():
    x = np.array([[3, 1, 3, 1, 2]], dtype=np.uint64)  # unsigned: negating would wrap
    values, indices = run_node("TopK", [x, np.array([3], I64)], outputs=2)
    np.testing.assert_array_equal(values, [[3, 3, 2]])
    np.testing.assert_array_equal(indices, [[0, 2, 4]])
    values, indices = run_node("TopK", [x, np.array([3], I64)], outputs=2, largest=0)
    np.testing.assert_array_equal(indices, [[1, 3, 4]])
    values, indices = run_node("TopK", [x.astype(np.float32).T], outputs=2, k=2, axis=0, opset=9)
    np.testing.assert_array_equal(indices.ravel(), [0, 2])


def test_unique_unsorted_keeps_order_of_first_appearance():
    x = np.array([2, 1, 1, 3, 4, 3], dtype=np.int64)
    y, first, inverse, counts = run_node("Unique", [x], outputs=4, sorted=0)
    np.testing.assert_array_equal(y, [2, 1, 3, 4])
    np.testing.assert_array_equal(first, [0, 1, 3, 4])
    np.testing.assert_array_equal(inverse, [0, 1, 1, 2, 3, 2])
    np.testing.assert_array_equal(counts, [1, 2, 2, 1])


def test_onehot_negative_indices_count_from_depth_and_out_of_range_is_all_off():
    got = run_node("OneHot", [np.array([-1, 5, 0], I64), np.array(3, I64), np.array([0, 9], np.float32)], axis=0)
    np.testing.assert_array_equal(got, [[0, 0, 9], [0, 0, 0], [9, 0, 0]])


def test_compress_nonzero_trilu_reverse_sequence():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(run_node("Compress", [x, np.array([False, True])], axis=1), [[1], [4]])
    np.testing.assert_array_equal(run_node("Compress", [x, np.array([True, False, True])]), [0, 2])
    np.testing.assert_array_equal(run_node("NonZero", [np.array([[0, 1], [1, 0]], np.int32)]), [[0, 1], [1, 0]])
    assert run_node("NonZero", [np.array(5, np.int32)]).shape == (0, 1)
    np.testing.assert_array_equal(run_node("Trilu", [x, np.array(1, I64)], upper=0), [[0, 1, 0], [3, 4, 5]])
    seqs = np.arange(8, dtype=np.float32).reshape(4, 2)  # time x batch
    got = run_node("ReverseSequence", [seqs, np.array([3, 0], I64)], batch_axis=1, time_axis=0)
    np.testing.assert_array_equal(got, [[4, 1], [2, 3], [0, 5], [6, 7]])


def test_array_feature_extractor_picks_last_axis_columns():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(ArrayFeatureExtractor(x, np.array([2, 0], I64)), [[2, 0], [5, 3]])
    np.testing.assert_array_equal(ArrayFeatureExtractor(x[0], np.array([[1]], I64)), [[1]])


@pytest.mark.parametrize("upper, k", [(1, 0), (1, 2), (1, -1), (0, 0), (0, -2), (0, 3)])
def test_trilu_matches_numpy_and_runs_in_place_when_it_may(upper, k):
    x = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4) + 1
    expected = np.triu(x, k) if upper else np.tril(x, k)
    np.testing.assert_array_equal(run_node("Trilu", [x, np.array(k, I64)], upper=upper), expected)
    got, record = run_node("Trilu", [x, np.array(k, I64)], upper=upper, owned=True, profile=True)
    np.testing.assert_array_equal(got, expected)
    assert record.inplace["Trilu"] == 1
