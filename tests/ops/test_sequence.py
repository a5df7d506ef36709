"""Sequence and optional ops: new lists instead of edited ones, positions, SplitToSequence's chunk
and keepdims rules, ConcatFromSequence with a new axis, SequenceMap over a body graph."""
import numpy as np
import pytest
from onnx import TensorProto, helper

import runnx
from runnx.errors import RunnxError

F32 = np.float32
I64 = np.int64


def _run(nodes, feeds: dict, outputs: list, opset=18):
    """Run `nodes`; a list feed is declared a float sequence, an array a tensor of its dtype."""
    infos = []
    for name, value in feeds.items():
        if isinstance(value, list):
            infos.append(helper.make_tensor_sequence_value_info(name, TensorProto.FLOAT, None))
        else:
            infos.append(helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(value.dtype), None))
    graph = helper.make_graph(nodes, "g", infos, [helper.make_value_info(n, helper.TypeProto()) for n in outputs])
    model = runnx.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]))
    result = model.run(feeds)
    return [result[n] for n in outputs]


def _seq(*lengths):
    return [np.arange(n, dtype=F32) for n in lengths]


def test_insert_and_erase_build_new_lists_and_leave_the_fed_one_alone():
    fed = _seq(1, 2)
    inserted, erased, length = _run(
        [helper.make_node("SequenceInsert", ["s", "t", "p"], ["inserted"]),
         helper.make_node("SequenceErase", ["s"], ["erased"]),
         helper.make_node("SequenceLength", ["inserted"], ["n"])],
        {"s": fed, "t": np.full(3, 7, F32), "p": np.array(-1, I64)}, ["inserted", "erased", "n"])
    assert [len(a) for a in inserted] == [1, 3, 2]  # -1 inserts before the last element
    assert [len(a) for a in erased] == [1]
    assert length == 3 and length.dtype == I64
    assert [len(a) for a in fed] == [1, 2]


def test_sequence_at_counts_negative_positions_from_the_end_and_checks_range():
    (last,) = _run([helper.make_node("SequenceAt", ["s", "p"], ["x"])], {"s": _seq(1, 2, 3), "p": np.array(-1, I64)},
                   ["x"])
    np.testing.assert_array_equal(last, [0, 1, 2])
    with pytest.raises(RunnxError, match="out of range"):
        _run([helper.make_node("SequenceAt", ["s", "p"], ["x"])], {"s": _seq(1), "p": np.array(1, I64)}, ["x"])


def test_construct_empty_and_concat_from_sequence():
    a, b = np.ones((2, 3), F32), np.zeros((2, 3), F32)
    stacked, joined, empty = _run(
        [helper.make_node("SequenceConstruct", ["a", "b"], ["s"]),
         helper.make_node("ConcatFromSequence", ["s"], ["stacked"], axis=-1, new_axis=1),
         helper.make_node("ConcatFromSequence", ["s"], ["joined"], axis=-1),
         helper.make_node("SequenceEmpty", [], ["empty"])],
        {"a": a, "b": b}, ["stacked", "joined", "empty"])
    assert stacked.shape == (2, 3, 2) and joined.shape == (2, 6) and empty == []
    np.testing.assert_array_equal(stacked[..., 0], a)


def test_split_to_sequence_chunks_and_keepdims():
    x = np.arange(10, dtype=F32).reshape(5, 2)
    chunks, pieces, sized = _run(
        [helper.make_node("SplitToSequence", ["x", "two"], ["chunks"]),
         helper.make_node("SplitToSequence", ["x"], ["pieces"], axis=1, keepdims=0),
         helper.make_node("SplitToSequence", ["x", "sizes"], ["sized"])],
        {"x": x, "two": np.array(2, I64), "sizes": np.array([1, 4], I64)}, ["chunks", "pieces", "sized"])
    assert [c.shape for c in chunks] == [(2, 2), (2, 2), (1, 2)]  # the remainder comes last
    assert [p.shape for p in pieces] == [(5,), (5,)]
    np.testing.assert_array_equal(pieces[1], [1, 3, 5, 7, 9])
    assert [s.shape for s in sized] == [(1, 2), (4, 2)]


def test_sequence_map_pairs_elements_and_broadcasts_tensors():
    body = helper.make_graph(
        [helper.make_node("Add", ["x", "bias"], ["y"]), helper.make_node("Shape", ["x"], ["shape"])], "body",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("bias", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("shape", TensorProto.INT64, None)])
    added, shapes = _run([helper.make_node("SequenceMap", ["s", "bias"], ["added", "shapes"], body=body)],
                         {"s": _seq(1, 3), "bias": np.array([10], F32)}, ["added", "shapes"])
    assert [a.tolist() for a in added] == [[10], [10, 11, 12]]
    assert [s.tolist() for s in shapes] == [[1], [3]]


def test_optionals():
    x = np.ones(2, F32)
    has, got, empty_has = _run(
        [helper.make_node("Optional", ["x"], ["opt"]),
         helper.make_node("OptionalHasElement", ["opt"], ["has"]),
         helper.make_node("OptionalGetElement", ["opt"], ["got"]),
         helper.make_node("OptionalHasElement", [], ["empty_has"])],
        {"x": x}, ["has", "got", "empty_has"])
    assert has and not empty_has
    np.testing.assert_array_equal(got, x)
    tensor_type = helper.make_tensor_type_proto(TensorProto.FLOAT, None)
    with pytest.raises(RunnxError, match="empty optional"):
        _run([helper.make_node("Optional", [], ["opt"], type=tensor_type),
              helper.make_node("OptionalGetElement", ["opt"], ["got"])], {}, ["got"])
