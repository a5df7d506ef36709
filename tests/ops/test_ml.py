"""ai.onnx.ml Binarizer and TreeEnsemble against hand-evaluated trees."""
import numpy as np
import pytest

from runnx.errors import InvalidModelError
from runnx.ops.ml import Binarizer, TreeEnsemble

# Tree 0: x0 <= 1 (NaN goes true) ? leaf 0 : (x1 in {2, 3} ? leaf 1 : leaf 2).
# Tree 1: a single leaf (leaf 3), written as a node whose branches both reach it.
TREES = dict(
    tree_roots=(0, 2), nodes_modes=np.array([0, 6, 1], np.uint8), nodes_featureids=(0, 1, 0),
    nodes_splits=np.array([1.0, np.nan, 0.0], np.float32), nodes_truenodeids=(0, 1, 3),
    nodes_falsenodeids=(1, 2, 3), nodes_trueleafs=(1, 1, 1), nodes_falseleafs=(0, 1, 1),
    nodes_missing_value_tracks_true=(1, 0, 0), membership_values=np.array([2, 3, np.nan], np.float32),
    leaf_weights=np.array([10, 20, 30, 5], np.float32), leaf_targetids=(0, 1, 0, 1), n_targets=2)
ROWS = np.array([[0.5, 9], [2, 3], [2, 4], [np.nan, 4]], np.float32)
SUMS = np.array([[10, 5], [0, 25], [30, 5], [10, 5]], np.float32)


def test_binarizer():
    got = Binarizer(np.array([-1, 0.5, 2], np.float64), threshold=0.5)
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, [0, 0, 1])


def test_tree_ensemble_sum_average_and_logistic():
    np.testing.assert_array_equal(TreeEnsemble(ROWS, **TREES), SUMS)
    np.testing.assert_allclose(TreeEnsemble(ROWS, **TREES, aggregate_function=0), SUMS / 2)
    np.testing.assert_allclose(TreeEnsemble(ROWS, **TREES, post_transform=2), 1 / (1 + np.exp(-SUMS)), rtol=1e-6)


def test_tree_ensemble_max_keeps_lowest_for_targets_no_leaf_reached():
    got = TreeEnsemble(ROWS, **TREES, aggregate_function=3)
    np.testing.assert_array_equal(got[:, 1], [5, 20, 5, 5])
    assert got[1, 0] == np.finfo(np.float32).min


def test_tree_ensemble_membership_sets_must_match_member_nodes():
    with pytest.raises(InvalidModelError, match="membership"):
        TreeEnsemble(ROWS, **{**TREES, "membership_values": np.array([2, 3], np.float32)})


def test_tree_ensemble_refuses_branches_to_missing_leaves():
    with pytest.raises(InvalidModelError, match="does not exist"):
        TreeEnsemble(ROWS, **{**TREES, "nodes_falsenodeids": (1, 7, 3)})
