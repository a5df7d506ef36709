"""Branch specialization: a model that is one If on one of its inputs runs the chosen branch as a
graph of its own, with the results, ownership and errors of the If run as a node."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper

import runnx
from runnx.errors import RunnxError

FIXTURES = Path(os.environ.get("RUNNX_FIXTURES", Path(__file__).parents[1] / "fixtures"))
MERGED = FIXTURES / "tiny-llama-merged" / "decoder_model_merged.onnx"
AS_NODE = {"specialize_branches": False}


def _if_model(extra_reader=False):
    """cond ? (x + 1) * scale : -x, with x and scale (three elements) read through the captures."""
    then_branch = helper.make_graph(
        [helper.make_node("Add", ["x", "one"], ["a"]), helper.make_node("Mul", ["a", "scale"], ["y_then"])],
        "then", [], [helper.make_tensor_value_info("y_then", T.FLOAT, None)],
        [helper.make_tensor("one", T.FLOAT, [], [1.0])])
    else_branch = helper.make_graph([helper.make_node("Neg", ["x"], ["y_else"])], "else", [],
                                    [helper.make_tensor_value_info("y_else", T.FLOAT, None)])
    nodes = [helper.make_node("If", ["cond"], ["y"], then_branch=then_branch, else_branch=else_branch)]
    outputs = [helper.make_tensor_value_info("y", T.FLOAT, None)]
    if extra_reader:
        nodes.append(helper.make_node("Abs", ["x"], ["magnitude"]))
        outputs.append(helper.make_tensor_value_info("magnitude", T.FLOAT, None))
    graph = helper.make_graph(nodes, "if", [helper.make_tensor_value_info("cond", T.BOOL, None),
                                            helper.make_tensor_value_info("x", T.FLOAT, [None])],
                              outputs, [helper.make_tensor("scale", T.FLOAT, [3], [3.0] * 3)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


@pytest.mark.parametrize("cond", [True, False])
def test_the_chosen_branch_runs_as_the_graph_with_the_ifs_results(cond):
    x = np.linspace(-2, 2, 3, dtype=np.float32)
    feeds = {"cond": np.array([cond]), "x": x}
    result, profile = runnx.load(_if_model()).run(feeds, profile=True)
    as_node, node_profile = runnx.load(_if_model(), **AS_NODE).run(feeds, profile=True)
    assert profile.op_calls["If"] == 0 and node_profile.op_calls["If"] == 1
    assert result["y"].tobytes() == as_node["y"].tobytes()
    np.testing.assert_array_equal(result["y"], (x + 1) * 3 if cond else -x)
    np.testing.assert_array_equal(x, np.linspace(-2, 2, 3, dtype=np.float32))  # the caller's array


def test_a_handed_over_feed_is_consumed_in_place_by_the_branch():
    buffer = np.arange(3, dtype=np.float32)
    result, profile = runnx.load(_if_model()).run({"cond": np.array([True]), "x": runnx.Owned(buffer)}, profile=True)
    assert profile.inplace["Add"] == 1 and profile.inplace["Mul"] == 1 and np.shares_memory(result["y"], buffer)
    np.testing.assert_array_equal(result["y"], (np.arange(3, dtype=np.float32) + 1) * 3)


def test_a_model_with_more_than_the_if_runs_the_if_as_a_node():
    model = runnx.load(_if_model(extra_reader=True))
    result, profile = model.run({"cond": np.array([False]), "x": np.array([-1.0, 2.0], np.float32)}, profile=True)
    assert profile.op_calls["If"] == 1
    np.testing.assert_array_equal(result["y"], [1.0, -2.0])
    np.testing.assert_array_equal(result["magnitude"], [1.0, 2.0])


def test_a_condition_of_two_elements_gets_the_ifs_error():
    with pytest.raises(RunnxError, match="If node.*If condition must hold exactly one element, got shape \\[2\\]"):
        runnx.load(_if_model()).run({"cond": np.array([True, False]), "x": np.zeros(2, np.float32)})


def test_a_failing_node_in_the_branch_is_named():
    with pytest.raises(RunnxError, match=r"Mul node 'Mul_\d+' \(inputs a: float32\[4\], scale: float32\[3\]\)"):
        runnx.load(_if_model()).run({"cond": np.array([True]), "x": np.zeros(4, np.float32)})


def _merged_feeds(model, ids, past_length, past):
    feeds = {"input_ids": ids, "attention_mask": np.ones((1, past_length + ids.shape[1]), np.int64),
             "use_cache_branch": np.array([past_length > 0])}
    if "position_ids" in model.input_names:
        feeds["position_ids"] = np.arange(past_length, past_length + ids.shape[1], dtype=np.int64)[None]
    return {**feeds, **past}


def _plans_compiled(model) -> list[bool]:
    return [callable(plan.state.get("compiled")) for plan in model._plans.values()]


def test_a_merged_decoder_prefills_and_decodes_bitwise_as_through_its_if():
    models = runnx.load(MERGED), runnx.load(MERGED, **AS_NODE)
    past = {i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32)
            for i in models[0].inputs if i.name.startswith("past_key_values.")}
    prompt = np.arange(3, 10, dtype=np.int64)[None]
    firsts = [m.run(_merged_feeds(m, prompt, 0, past)) for m in models]
    assert firsts[0]["logits"].tobytes() == firsts[1]["logits"].tobytes()
    token = np.array([[int(firsts[0]["logits"][0, -1].argmax())]], np.int64)
    for _ in range(3):  # the decode step's plan compiles from its second run
        steps = []
        for model, first in zip(models, firsts):
            grown = {k: runnx.with_capacity(first[k.replace("past_key_values", "present")], 2, 64) for k in past}
            steps.append(model.run(_merged_feeds(model, token, prompt.shape[1], grown)))
        for name in steps[0]:
            assert steps[0][name].tobytes() == steps[1][name].tobytes(), name
    assert any(_plans_compiled(models[0])) and not any(_plans_compiled(models[1]))
