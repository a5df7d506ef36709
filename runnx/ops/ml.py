"""Classic machine-learning operators of the ai.onnx.ml domain: Binarizer and TreeEnsemble (opset 5).
(LabelEncoder lives with the strings, ArrayFeatureExtractor with the gathers.)

TreeEnsemble walks every tree for all rows at once: each row holds a current node and moves one
level per step, so the work is numpy over rows, and a tree of depth d takes d steps."""
from __future__ import annotations

import numpy as np

from runnx.errors import InvalidModelError, RunnxError
from runnx.ops.registry import register

ML_DOMAIN = "ai.onnx.ml"

# nodes_modes: how a node compares its feature value with its split
_LEQ, _LT, _GTE, _GT, _EQ, _NEQ, _MEMBER = range(7)
_AVERAGE, _SUM, _MIN, _MAX = range(4)
_NONE, _SOFTMAX, _LOGISTIC, _SOFTMAX_ZERO, _PROBIT = range(5)


@register("Binarizer", since=1, domain=ML_DOMAIN)
def Binarizer(x, *, threshold: float = 0.0):
    return (x > threshold).astype(x.dtype)


def _member_sets(modes, membership_values) -> dict[int, np.ndarray]:
    """The members of each BRANCH_MEMBER node: NaN-delimited groups, in node order."""
    member_nodes = np.flatnonzero(modes == _MEMBER)
    if not member_nodes.size:
        return {}
    if membership_values is None:
        raise InvalidModelError("TreeEnsemble has BRANCH_MEMBER nodes but no membership_values")
    values = np.asarray(membership_values, dtype=np.float64).reshape(-1)
    ends = np.flatnonzero(np.isnan(values))
    if len(ends) != len(member_nodes):
        raise InvalidModelError(f"membership_values holds {len(ends)} NaN-delimited sets for "
                                f"{len(member_nodes)} BRANCH_MEMBER nodes")
    starts = np.concatenate(([0], ends[:-1] + 1))
    return {int(node): values[start:end] for node, start, end in zip(member_nodes, starts, ends)}


def _goes_true(modes, values, splits, nodes, members) -> np.ndarray:
    """Whether each row's node (`nodes`) sends its feature value (`values`) down the true branch."""
    mode, split = modes[nodes], splits[nodes]
    goes = np.select(
        [mode == _LEQ, mode == _LT, mode == _GTE, mode == _GT, mode == _EQ, mode == _NEQ],
        [values <= split, values < split, values >= split, values > split, values == split, values != split],
        default=False)
    for node in np.unique(nodes[mode == _MEMBER]):
        at_node = nodes == node
        goes[at_node] = np.isin(values[at_node], members[int(node)])
    return goes


def _leaves(x, roots, nodes, members) -> np.ndarray:
    """The leaf each row reaches in each tree: [trees, rows]."""
    (modes, features, splits, true_ids, false_ids, true_leafs, false_leafs, nan_true) = nodes
    rows = np.arange(x.shape[0])
    reached = np.empty((len(roots), x.shape[0]), dtype=np.int64)
    for tree, root in enumerate(roots):
        index = np.full(x.shape[0], root, dtype=np.int64)
        at_leaf = np.zeros(x.shape[0], dtype=bool)
        for _ in range(len(modes) + 1):  # no path is longer than the node count
            walking = ~at_leaf
            if not walking.any():
                break
            node = index[walking]
            values = x[rows[walking], features[node]]
            goes = _goes_true(modes, values, splits, node, members) | (nan_true[node] & np.isnan(values))
            index[walking] = np.where(goes, true_ids[node], false_ids[node])
            at_leaf[walking] = np.where(goes, true_leafs[node], false_leafs[node])
        else:
            raise InvalidModelError(f"TreeEnsemble tree {tree} (root {root}) has a cycle")
        reached[tree] = index
    return reached


def _check_branches(nodes, roots, leaf_count) -> None:
    """Every root names a node, every branch a node or a leaf that exists (else the walk would index out)."""
    _, _, _, true_ids, false_ids, true_leafs, false_leafs, _ = nodes
    node_count = len(true_ids)
    for ids, to_leaf in ((true_ids, true_leafs), (false_ids, false_leafs)):
        limits = np.where(to_leaf, leaf_count, node_count)
        if np.any((ids < 0) | (ids >= limits)):
            raise InvalidModelError("TreeEnsemble: a branch names a node or leaf that does not exist")
    if any(not 0 <= root < node_count for root in roots):
        raise InvalidModelError(f"TreeEnsemble: a tree root lies outside the {node_count} nodes")


def _post_transform(scores, transform):
    if transform == _NONE:
        return scores
    if transform == _LOGISTIC:
        return 1 / (1 + np.exp(-scores))
    if transform in (_SOFTMAX, _SOFTMAX_ZERO):
        # SOFTMAX_ZERO keeps exact zeros at zero (they are missing scores, not scores of 0)
        shifted = np.exp(scores - scores.max(axis=1, keepdims=True))
        if transform == _SOFTMAX_ZERO:
            shifted = np.where(scores == 0, 0, shifted)
        total = shifted.sum(axis=1, keepdims=True)
        return np.divide(shifted, total, out=np.zeros_like(shifted), where=total != 0)
    raise RunnxError(f"TreeEnsemble post_transform {transform} is not supported (NONE, SOFTMAX, LOGISTIC, "
                     f"SOFTMAX_ZERO are)")


@register("TreeEnsemble", since=5, domain=ML_DOMAIN)
def TreeEnsemble(x, *, tree_roots: tuple[int, ...], nodes_modes: np.ndarray, nodes_featureids: tuple[int, ...],
                 nodes_splits: np.ndarray, nodes_truenodeids: tuple[int, ...], nodes_falsenodeids: tuple[int, ...],
                 nodes_trueleafs: tuple[int, ...], nodes_falseleafs: tuple[int, ...],
                 leaf_targetids: tuple[int, ...], leaf_weights: np.ndarray, n_targets: int | None = None,
                 aggregate_function: int = 1, post_transform: int = 0, nodes_hitrates: np.ndarray | None = None,
                 nodes_missing_value_tracks_true: tuple[int, ...] | None = None,
                 membership_values: np.ndarray | None = None):
    """Regression scores [N, n_targets] of the ensemble on rows x [N, F]; nodes_hitrates is unused."""
    if x.ndim != 2:
        raise RunnxError(f"TreeEnsemble takes [N, F] rows, got shape {x.shape}")
    modes = np.asarray(nodes_modes, dtype=np.int64).reshape(-1)
    count = len(modes)
    tracks = nodes_missing_value_tracks_true or (0,) * count
    lists = (nodes_featureids, nodes_splits.reshape(-1), nodes_truenodeids, nodes_falsenodeids,
             nodes_trueleafs, nodes_falseleafs, tracks)
    if any(len(values) != count for values in lists) or len(leaf_targetids) != leaf_weights.size:
        raise InvalidModelError("TreeEnsemble: the nodes_* (or leaf_*) attributes differ in length")
    features = np.asarray(nodes_featureids, dtype=np.int64)
    if count and (features.min() < 0 or features.max() >= x.shape[1]):
        raise RunnxError(f"TreeEnsemble reads feature {features.max()} of rows with {x.shape[1]} features")
    nodes = (modes, features, nodes_splits.reshape(-1).astype(x.dtype), np.asarray(nodes_truenodeids),
             np.asarray(nodes_falsenodeids), np.asarray(nodes_trueleafs, dtype=bool),
             np.asarray(nodes_falseleafs, dtype=bool), np.asarray(tracks, dtype=bool))
    _check_branches(nodes, tree_roots, len(leaf_targetids))
    reached = _leaves(x, tree_roots, nodes, _member_sets(modes, membership_values))

    targets = np.asarray(leaf_targetids, dtype=np.int64)[reached]
    weights = leaf_weights.reshape(-1).astype(x.dtype)[reached]
    n_targets = int(targets.max(initial=-1)) + 1 if n_targets is None else n_targets
    rows = np.broadcast_to(np.arange(x.shape[0]), targets.shape)
    if aggregate_function in (_SUM, _AVERAGE):
        scores = np.zeros((x.shape[0], n_targets), dtype=x.dtype)
        np.add.at(scores, (rows, targets), weights)
        if aggregate_function == _AVERAGE:
            scores /= max(len(tree_roots), 1)
    elif aggregate_function in (_MIN, _MAX):
        limits = np.finfo(x.dtype)
        scores = np.full((x.shape[0], n_targets), limits.max if aggregate_function == _MIN else limits.min, x.dtype)
        (np.minimum if aggregate_function == _MIN else np.maximum).at(scores, (rows, targets), weights)
    else:
        raise RunnxError(f"TreeEnsemble aggregate_function {aggregate_function} is not AVERAGE/SUM/MIN/MAX (0-3)")
    return _post_transform(scores, post_transform)
