"""Load-time constant folding: constant-only nodes run once at load, results identical."""
from __future__ import annotations

import mmap

import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

import runnx
from runnx.interp.folding import contiguous_copy

OPSET = [helper.make_opsetid("", 18)]


def _weight():
    return helper.make_tensor("w", T.FLOAT, [3, 4], np.arange(12, dtype=np.float32).tolist())


def _lm_head_model():
    """y = x @ Transpose(w), the way Optimum exports a tied embedding's output projection."""
    graph = helper.make_graph(
        [helper.make_node("Transpose", ["w"], ["w_t"]), helper.make_node("MatMul", ["x", "w_t"], ["y"])], "g",
        [helper.make_tensor_value_info("x", T.FLOAT, [2, 4])], [helper.make_tensor_value_info("y", T.FLOAT, None)],
        [_weight()])
    return helper.make_model(graph, opset_imports=OPSET)


def test_constant_only_nodes_are_folded_into_contiguous_constants():
    model = runnx.load(_lm_head_model())
    assert [n.op_type for n in model.plan()] == ["MatMul"]
    folded = model.graph.constants[model.graph.ids["w_t"]]
    assert folded.flags.c_contiguous and not folded.flags.writeable
    x = np.ones((2, 4), np.float32)
    unfolded = runnx.load(_lm_head_model(), fold_constants=False)
    assert [n.op_type for n in unfolded.plan()] == ["Transpose", "MatMul"]
    assert model.run({"x": x})["y"].tobytes() == unfolded.run({"x": x})["y"].tobytes()


@pytest.mark.parametrize("rows, columns, dtype", [(300, 200, np.float32), (1100, 520, np.float32),
                                                  (130, 4100, np.float16), (3, 4, np.int64)])
def test_a_transposed_constant_folds_into_the_same_values_through_tiles(rows, columns, dtype):
    """A tied LM head's Transpose of the embeddings: copied tile by tile (a large one into a map of
    its own, from 2 MiB), every value where numpy's own copy puts it."""
    weights = (np.arange(rows * columns) % 9973).astype(dtype).reshape(rows, columns)
    copied = contiguous_copy(weights.T)
    assert copied.flags.c_contiguous and copied.dtype == dtype
    np.testing.assert_array_equal(copied, weights.T.copy())
    graph = helper.make_graph([helper.make_node("Transpose", ["w"], ["w_t"])], "g", [],
                              [helper.make_tensor_value_info("w_t", T.FLOAT, None)],
                              [numpy_helper.from_array(weights.astype(np.float32), "w")])
    model = runnx.load(helper.make_model(graph, opset_imports=OPSET))
    assert model.plan() == []
    folded = model.run({})["w_t"]
    assert folded.tobytes() == np.ascontiguousarray(weights.astype(np.float32).T).tobytes()
    kept = model.graph.constants[model.graph.ids["w_t"]]
    storage = kept
    while isinstance(storage, np.ndarray):
        storage = storage.base
    # a large one stays in its own map (copied once, its huge pages kept), a small one owns its bytes
    if kept.nbytes >= 1 << 21:
        assert isinstance(getattr(storage, "obj", storage), mmap.mmap)
    else:
        assert storage is None


def _tied_model(embedding):
    """logits = x @ Transpose(E) beside h = Gather(E, ids): Optimum's tied embedding and LM head."""
    graph = helper.make_graph(
        [helper.make_node("Gather", ["E", "ids"], ["h"]), helper.make_node("Transpose", ["E"], ["E_t"]),
         helper.make_node("MatMul", ["x", "E_t"], ["logits"])], "g",
        [helper.make_tensor_value_info("ids", T.INT64, [1]), helper.make_tensor_value_info("x", T.FLOAT, None)],
        [helper.make_tensor_value_info("h", T.FLOAT, None), helper.make_tensor_value_info("logits", T.FLOAT, None)],
        [numpy_helper.from_array(embedding, "E")])
    return helper.make_model(graph, opset_imports=OPSET)


@pytest.mark.parametrize("rows", [1, 3])
def test_a_large_transposed_constant_only_matmuls_read_stays_a_view_and_computes_alike(rows):
    """A tied LM head: the transposed embedding (2 MiB and more) is folded as a read-only view of the
    embedding, not copied, and MatMul reads the embedding's rows (`linalg._by_columns`): the same
    bits folded or not, close to numpy's product; a small one, or one a graph output reads, is copied."""
    from runnx.runtime import pool as decode_pool

    embedding = np.random.default_rng(rows).standard_normal((1100, 576)).astype(np.float32)  # 2.4 MiB
    x = np.random.default_rng(7).standard_normal((1, rows, 576)).astype(np.float32)
    feeds = {"ids": np.array([3]), "x": x}
    model = runnx.load(_tied_model(embedding))
    transposed = model.graph.constants[model.graph.ids["E_t"]]
    assert np.shares_memory(transposed, model.graph.constants[model.graph.ids["E"]])
    assert not transposed.flags.writeable and transposed.T.flags.c_contiguous
    unfolded = runnx.load(_tied_model(embedding), fold_constants=False)
    for workers in (0, 2):  # on this thread, and as the decode pool's job
        decode_pool.set_workers(workers)
        try:
            got = model.run(feeds)["logits"]
            assert got.tobytes() == unfolded.run(feeds)["logits"].tobytes()
        finally:
            decode_pool.set_workers(None)
        if workers == 0:
            alone = got
        else:
            assert got.tobytes() == alone.tobytes()
    np.testing.assert_allclose(got, x @ embedding.T, rtol=1e-4, atol=1e-4)
    small = runnx.load(_lm_head_model()).graph
    assert small.constants[small.ids["w_t"]].flags.c_contiguous


def test_an_initializer_a_feed_may_override_is_not_folded():
    graph = helper.make_graph([helper.make_node("Neg", ["w"], ["y"])], "g",
                              [helper.make_tensor_value_info("w", T.FLOAT, [3, 4])],
                              [helper.make_tensor_value_info("y", T.FLOAT, None)], [_weight()])
    model = runnx.load(helper.make_model(graph, opset_imports=OPSET))
    override = np.full((3, 4), 2, np.float32)
    np.testing.assert_array_equal(model.run({"w": override})["y"], -override)
    np.testing.assert_array_equal(model.run({})["y"], -np.arange(12, dtype=np.float32).reshape(3, 4))


def test_a_branch_reading_a_parent_constant_owns_it_and_folds_with_it():
    then_branch = helper.make_graph(
        [helper.make_node("Transpose", ["w"], ["w_t"]), helper.make_node("MatMul", ["x", "w_t"], ["then_y"])],
        "then", [], [helper.make_tensor_value_info("then_y", T.FLOAT, None)])
    else_branch = helper.make_graph([helper.make_node("MatMul", ["x", "w_t_outer"], ["else_y"])], "else", [],
                                    [helper.make_tensor_value_info("else_y", T.FLOAT, None)])
    graph = helper.make_graph(
        [helper.make_node("Transpose", ["w"], ["w_t_outer"]),
         helper.make_node("If", ["cond"], ["y"], then_branch=then_branch, else_branch=else_branch)], "g",
        [helper.make_tensor_value_info("cond", T.BOOL, []), helper.make_tensor_value_info("x", T.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", T.FLOAT, None)], [_weight()])
    model = runnx.load(helper.make_model(graph, opset_imports=OPSET))
    (if_node,) = model.plan()
    assert if_node.captures == (model.graph.ids["x"],)  # w and w_t_outer are the branches' own constants now
    assert [n.op_type for n in if_node.subgraphs["then_branch"].nodes] == ["MatMul"]
    x = np.ones((2, 4), np.float32)
    expected = x @ np.arange(12, dtype=np.float32).reshape(3, 4).T
    for cond in (True, False):
        np.testing.assert_array_equal(model.run({"cond": np.array(cond), "x": x})["y"], expected)


def test_equal_small_constants_become_one_array_and_others_stay_apart():
    """Per-layer copies of the same slice bounds or scalars are one array after load (facts kept
    about a constant by identity then hold for every layer); other values, dtypes or shapes, large
    constants and initializers a feed may override keep their own."""
    import ml_dtypes

    def constant(name, values, dtype):
        return helper.make_tensor(name, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), [len(values)],
                                  np.array(values, dtype).tobytes(), raw=True)

    inputs = {"a": ([1, 2], np.int64), "b": ([1, 2], np.int64), "c": ([1, 3], np.int64),
              "d": ([1, 2], np.int32), "e": ([56], ml_dtypes.float8_e4m3fn), "f": ([56], ml_dtypes.float8_e5m2),
              "big": (list(range(1024)), np.int64), "big2": (list(range(1024)), np.int64), "fed": ([1, 2], np.int64)}
    names = list(inputs)
    graph = helper.make_graph([helper.make_node("Identity", [n], [f"out_{n}"]) for n in names], "g",
                              [helper.make_tensor_value_info("fed", T.INT64, [2])],
                              [helper.make_tensor_value_info(f"out_{n}", 0, None) for n in names],
                              [constant(n, *inputs[n]) for n in names])
    model = runnx.load(helper.make_model(graph, opset_imports=OPSET))
    constant_of = {n: {**model.graph.constants, **model.graph.defaults}[model.graph.ids[n]] for n in names}
    assert constant_of["a"] is constant_of["b"]
    others = [constant_of[n] for n in ("a", "c", "d", "e", "f", "big", "big2", "fed")]
    assert len({id(value) for value in others}) == len(others)
    got = model.run({})
    for name in names:
        want = np.array(*inputs[name])
        assert got[f"out_{name}"].dtype == want.dtype and got[f"out_{name}"].tobytes() == want.tobytes(), name
    unshared = runnx.load(helper.make_model(graph, opset_imports=OPSET), fold_constants=False).graph
    assert unshared.constants[unshared.ids["a"]] is not unshared.constants[unshared.ids["b"]]


def test_a_dequantized_8_bit_weight_is_folded_once():
    """DequantizeLinear of constant 8-bit weights runs at load (its float32 result four times their
    bytes): a transformers.js int8 export's tied LM head is no longer dequantized every step. With
    fusion on, a MatMul reads the bytes themselves instead (tests/interp/test_fusion_dequantized_products.py)."""
    weights = helper.make_tensor("w", T.UINT8, [4, 3], list(range(12)))
    graph = helper.make_graph(
        [helper.make_node("DequantizeLinear", ["w", "s", "z"], ["w_f"]), helper.make_node("MatMul", ["x", "w_f"], ["y"])],
        "g", [helper.make_tensor_value_info("x", T.FLOAT, [2, 4])], [helper.make_tensor_value_info("y", T.FLOAT, None)],
        [weights, helper.make_tensor("s", T.FLOAT, [], [0.5]), helper.make_tensor("z", T.UINT8, [], [3])])
    model = runnx.load(helper.make_model(graph, opset_imports=OPSET), fuse=False)
    assert [n.op_type for n in model.plan()] == ["MatMul"]
    x = np.ones((2, 4), np.float32)
    expected = x @ ((np.arange(12, dtype=np.float32).reshape(4, 3) - 3) * 0.5)
    assert model.run({"x": x})["y"].tobytes() == expected.tobytes()
