"""What runnx remembers by an array's identity stays true: a kept attention bias is forgotten when
an in-place op writes a new value into the mask's object, and a caller's read-only view of a
buffer the caller changes between runs is read afresh each run."""
import numpy as np
import pytest
from onnx import TensorProto, helper

import runnx
from differential import assert_same, load_both, mask_rewritten_in_place, step_feeds
from runnx.ops import _shape_util

F = TensorProto.FLOAT


def test_a_kept_attention_bias_is_forgotten_when_its_mask_is_overwritten_in_place():
    model, shape = mask_rewritten_in_place()
    plain, optimized = load_both(model)
    assert optimized.fused.get("RepeatedKVAttention", 0) >= 2
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
                              [helper.make_tensor_value_info("x", F, None), helper.make_tensor_value_info("shape", TensorProto.INT64, [2])],
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
