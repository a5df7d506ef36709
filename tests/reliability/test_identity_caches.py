"""What runnx remembers by an array's identity stays true: a kept attention bias is forgotten when
an in-place op writes a new value into the mask's object, and a caller's read-only view of a
buffer the caller changes between runs is read afresh each run."""
import numpy as np
import pytest
from onnx import helper

import runnx
from differential import DecoderGraph, assert_same, load_both, random_shape, step_feeds
from runnx.ops import _shape_util

F = 1  # TensorProto.FLOAT


def _mask_rewritten_after_its_first_reader():
    """Two attention layers: the first reads mask m = Not(mask); then m's object is written in
    place by Xor(m, True) (its last reader, run after the first layer: it reads that layer's sum),
    whose value, the fed mask again, the second layer reads. Both layers' Where(Slice(m)) biases
    are made by the fused attention (`_mask_bias`, kept per run by identity)."""
    shape = random_shape(np.random.default_rng(7), "llama", usual=True)
    shape.layers = 2
    b = DecoderGraph(shape)
    inverted = b.node("Not", ["mask"])
    h = b.node("Add", ["hidden", b.attention(b.norm("hidden"), 0, mask=inverted)])
    flip = b.node("Less", [b.node("ReduceMax", [h], keepdims=0), b.f32("huge", 1e30)])
    again = b.node("Xor", [inverted, flip])
    h = b.node("Add", [h, b.attention(b.norm(h), 1, mask=again)])
    return b.finish(h), shape


def test_a_kept_attention_bias_is_forgotten_when_its_mask_is_overwritten_in_place():
    model, shape = _mask_rewritten_after_its_first_reader()
    plain, optimized = load_both(model)
    assert optimized.fused.get("RepeatedKVAttention", 0) + optimized.fused.get("AttentionGatedMLP", 0) >= 2
    rng = np.random.default_rng(0)
    feeds = step_feeds(shape, rng, 3, 2)
    for name in ("past_key.0", "past_value.0", "past_key.1", "past_value.1"):
        feeds[name] = rng.standard_normal((1, shape.groups, 3, shape.head_size)).astype(np.float32)
    expected = plain.run(feeds)
    for _ in range(3):  # interpreted, then compiled
        got, profile = optimized.run(feeds, profile=True)
        assert profile.inplace.get("Xor") == 1  # the hazard: the mask's object holds a new value
        for name in expected:
            assert_same(expected[name], got[name], name)
    for _ in range(3):
        got = optimized.run(feeds)  # compiled from the second (profiles run interpreted)
        for name in expected:
            assert_same(expected[name], got[name], name)


def _reshape_model():
    graph = helper.make_graph([helper.make_node("Reshape", ["x", "shape"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", F, None), helper.make_tensor_value_info("shape", 7, [2])],
                              [helper.make_tensor_value_info("y", F, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


@pytest.mark.parametrize("level", ["disabled", "all"])
def test_a_callers_read_only_view_of_a_changed_buffer_is_read_again(level):
    """int_tuple remembers small read-only arrays by identity: the caller's view is the same object
    each run, its buffer not."""
    model = runnx.load(_reshape_model(), optimization_level=level)
    buffer = np.array([2, 3])
    view = buffer.view()
    view.flags.writeable = False
    x = np.arange(6, dtype=np.float32)
    for target in ([2, 3], [3, 2], [6, 1], [1, 6]):
        buffer[:] = target
        assert model.run({"x": x, "shape": view})["y"].shape == tuple(target)


def test_remembered_values_do_not_keep_their_arrays_alive():
    values = np.array([4, 5])
    values.flags.writeable = False
    assert _shape_util.int_tuple(values) == (4, 5)
    identity = id(values)
    assert identity in _shape_util._remembered
    del values
    assert identity not in _shape_util._remembered
