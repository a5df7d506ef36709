"""A corpus of malformed models and feeds: each raises its specific runnx error naming the node,
op, tensor or input involved — never an IndexError/KeyError/AttributeError from inside runnx."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import runnx
from corpus import BOOL, F, I64, const, make_model, seed_models

node = helper.make_node
X = [("x", F, [2, 3])]
Y = [("y", F, None)]
ONES = {"x": np.ones((2, 3), np.float32)}


def _valid():
    return make_model([node("Neg", ["x"], ["a"], name="neg"), node("Add", ["a", "x"], ["y"], name="add")], X, Y)


def _edited(edit):
    model = _valid()
    edit(model)
    return model


def _tensor(name, data_type, dims, raw=b""):
    tensor = onnx.TensorProto(name=name, data_type=data_type, dims=dims)
    tensor.raw_data = raw
    return tensor


def _if(then_nodes, then_output="t", outputs=("y",)):
    then = helper.make_graph(then_nodes, "then", [], [helper.make_tensor_value_info(then_output, F, None)])
    other = helper.make_graph([node("Identity", ["x"], ["e"], name="else_id")], "else", [],
                              [helper.make_tensor_value_info("e", F, None)])
    return make_model([node("If", ["c"], list(outputs), name="branch", then_branch=then, else_branch=other)],
                      [("c", BOOL, []), *X], Y)


def _attribute(name, value, kind=None):
    attribute = helper.make_attribute(name, value)
    if kind is not None:
        attribute.type = kind
    return attribute


def _with_attribute(op, inputs, attribute):
    made = node(op, inputs, ["y"], name="target")
    made.attribute.append(attribute)
    return make_model([made], X, Y)


def _sparse(indices, dims):
    values = numpy_helper.from_array(np.array([1, 2], np.float32), "s")
    sparse = helper.make_sparse_tensor(values, numpy_helper.from_array(np.array(indices, np.int64), "i"), dims)
    graph = helper.make_graph([node("Add", ["x", "s"], ["y"], name="add")], "g",
                              [helper.make_tensor_value_info("x", F, [2, 3])], [helper.make_tensor_value_info("y", F, None)],
                              sparse_initializer=[sparse])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _garbled(data: bytes, at: int, byte: int) -> bytes:
    return data[:at] + bytes([byte]) + data[at + 1:]


VALID_BYTES = _valid().SerializeToString()

# (id, model (proto or bytes), feeds, error class, substrings the message must name)
MODEL_CASES = [
    ("truncated-in-a-varint", VALID_BYTES[:3], {}, runnx.ModelLoadError, ["not an ONNX model"]),
    ("truncated-mid-message", VALID_BYTES[:len(VALID_BYTES) // 2], {}, runnx.ModelLoadError, ["not an ONNX model"]),
    ("garbled-tag", _garbled(VALID_BYTES, 0, 0xFF), {}, runnx.ModelLoadError, ["not an ONNX model"]),
    ("random-bytes", np.random.default_rng(0).bytes(200), {}, runnx.ModelLoadError, ["not an ONNX model"]),
    ("invalid-utf8-op-type", VALID_BYTES.replace(b"Neg", b"N\xffg"), {}, runnx.InvalidModelError,
     ["not valid UTF-8"]),
    ("opset-below-every-version", make_model([node("Neg", ["x"], ["y"], name="neg")], X, Y, opset=1), ONES,
     runnx.UnsupportedOpError, ["Neg at opset 1", "from opset 6", "'neg'"]),
    ("unknown-op", make_model([node("Frobnicate", ["x"], ["y"], name="frob")], X, Y), ONES,
     runnx.UnsupportedOpError, ["ai.onnx::Frobnicate at opset 18", "'frob'"]),
    ("empty-op-type", make_model([node("", ["x"], ["y"], name="blank")], X, Y), ONES,
     runnx.UnsupportedOpError, ["'blank'"]),
    ("domain-not-imported", make_model([node("Neg", ["x"], ["y"], name="neg", domain="com.example")], X, Y), ONES,
     runnx.InvalidModelError, ["com.example.Neg node 'neg'", "does not import"]),
    ("unknown-domain", _edited(lambda m: (m.opset_import.append(helper.make_opsetid("com.example", 1)),
                                          m.graph.node[0].__setattr__("domain", "com.example"))), ONES,
     runnx.UnsupportedOpError, ["com.example::Neg at opset 1", "'neg'"]),
    ("missing-required-attribute", make_model([node("Concat", ["x", "x"], ["y"], name="cat")], X, Y), ONES,
     runnx.InvalidModelError, ["Concat node 'cat'", "required attribute 'axis'"]),
    ("mistyped-attribute", _with_attribute("Concat", ["x", "x"], _attribute("axis", "one")), ONES,
     runnx.InvalidModelError, ["Concat node 'target'", "'axis' should be int, got str"]),
    ("attribute-of-unset-type", _with_attribute("Concat", ["x", "x"], _attribute("axis", 1, kind=0)), ONES,
     runnx.InvalidModelError, ["Concat node 'target'", "'axis' has an unknown or unset type"]),
    ("unknown-attribute", _with_attribute("Neg", ["x"], _attribute("bogus", 1)), ONES,
     runnx.InvalidModelError, ["Neg node 'target'", "unknown attribute 'bogus'"]),
    ("attribute-not-utf8", _with_attribute("Neg", ["x"], _attribute("bogus", b"\xff\xfe")), ONES,
     runnx.InvalidModelError, ["Neg node 'target'", "'bogus' is not valid UTF-8"]),
    ("constant-without-value", make_model([node("Constant", [], ["y"], name="const")], X, Y), ONES,
     runnx.InvalidModelError, ["Constant node 'const'"]),
    ("constant-without-output", make_model([node("Constant", [], [], value_float=1.0, name="const"),
                                            node("Neg", ["x"], ["y"], name="neg")], X, Y), ONES,
     runnx.InvalidModelError, ["Constant node 'const' has 0 outputs"]),
    ("too-few-inputs", make_model([node("Add", ["x"], ["y"], name="add")], X, Y), ONES,
     runnx.InvalidModelError, ["Add node 'add' has 1 inputs", "takes 2"]),
    ("too-many-inputs", make_model([node("Neg", ["x", "x"], ["y"], name="neg")], X, Y), ONES,
     runnx.InvalidModelError, ["Neg node 'neg' has 2 inputs", "takes 1"]),
    ("too-many-outputs", make_model([node("Neg", ["x"], ["y", "z"], name="neg")], X, Y), ONES,
     runnx.NodeError, ["Neg node 'neg' produced 1 outputs"]),
    ("inconsistent-shapes", make_model([node("Add", ["x", "w"], ["y"], name="add")], X, Y,
                                       [numpy_helper.from_array(np.ones((4, 5), np.float32), "w")]), ONES,
     runnx.NodeError, ["Add node 'add'", "x: float32[2, 3], w: float32[4, 5]"]),
    ("inconsistent-matmul", make_model([node("MatMul", ["x", "x"], ["y"], name="mm")], X, Y), ONES,
     runnx.NodeError, ["MatMul node 'mm'", "x: float32[2, 3]"]),
    ("impossible-reshape", make_model([node("Reshape", ["x", "s"], ["y"], name="rs")], X, Y, [const("s", [4, 4])]),
     ONES, runnx.RunnxError, ["Reshape node 'rs'", "s: int64[2]"]),
    ("bad-permutation", make_model([node("Transpose", ["x"], ["y"], perm=[0, 0], name="tr")], X, Y), ONES,
     runnx.RunnxError, ["Transpose node 'tr'", "[0, 0]"]),
    ("unknown-initializer-dtype", make_model([node("Add", ["x", "w"], ["y"], name="add")], X, Y,
                                             [_tensor("w", 999, [3], b"\0" * 12)]), ONES,
     runnx.InvalidModelError, ["tensor 'w' has unknown data type 999"]),
    ("unknown-constant-dtype", make_model([node("Constant", [], ["y"], name="const",
                                                value=_tensor("v", 77, [1], b"\0"))], X, Y), ONES,
     runnx.InvalidModelError, ["Constant node 'const'", "unknown data type 77"]),
    ("raw-data-of-wrong-size", make_model([node("Add", ["x", "w"], ["y"], name="add")], X, Y,
                                          [_tensor("w", TensorProto.FLOAT, [3], b"\0" * 5)]), ONES,
     runnx.InvalidModelError, ["tensor 'w' has 5 bytes", "need 12"]),
    ("negative-dimension", make_model([node("Add", ["x", "w"], ["y"], name="add")], X, Y,
                                      [_tensor("w", TensorProto.FLOAT, [-3])]), ONES,
     runnx.InvalidModelError, ["tensor 'w' has a negative dimension"]),
    ("sparse-index-out-of-range", _sparse([0, 99], [2, 3]), ONES, runnx.InvalidModelError,
     ["sparse tensor 's'", "outside [0, 6)"]),
    ("graph-cycle", make_model([node("Add", ["x", "q"], ["p"], name="first"), node("Neg", ["p"], ["q"], name="second"),
                                node("Identity", ["p"], ["y"], name="out")], X, Y), ONES,
     runnx.CycleError, ["cycle through", "node '"]),
    ("duplicate-node-output", make_model([node("Neg", ["x"], ["y"], name="one"), node("Neg", ["x"], ["y"], name="two")],
                                         X, Y), ONES,
     runnx.InvalidModelError, ["value 'y' is defined twice", "Neg node 'one'", "Neg node 'two'"]),
    ("node-output-shadows-input", make_model([node("Neg", ["x"], ["x"], name="neg")], X, [("x", F, None)]), ONES,
     runnx.InvalidModelError, ["value 'x' is defined twice", "input 'x'", "Neg node 'neg'"]),
    ("duplicate-initializer", make_model([node("Add", ["x", "w"], ["y"], name="add")], X, Y,
                                         [const("w", [1.0], np.float32), const("w", [2.0], np.float32)]), ONES,
     runnx.InvalidModelError, ["value 'w' is defined twice"]),
    ("undefined-value", make_model([node("Add", ["x", "ghost"], ["y"], name="add")], X, Y), ONES,
     runnx.InvalidModelError, ["Add node 'add' uses 'ghost'"]),
    ("undefined-output", make_model([node("Neg", ["x"], ["y"], name="neg")], X, [("nowhere", F, None)]), ONES,
     runnx.InvalidModelError, ["output 'nowhere' uses 'nowhere'"]),
    ("subgraph-uses-undefined-name", _if([node("Identity", ["ghost"], ["t"], name="then_id")]),
     {"c": np.array(True), **ONES}, runnx.InvalidModelError, ["If node 'branch' uses 'ghost'"]),
    ("subgraph-output-undefined", _if([node("Neg", ["x"], ["t"], name="then_neg")], then_output="missing"),
     {"c": np.array(True), **ONES}, runnx.InvalidModelError, ["If node 'branch' uses 'missing'"]),
    ("subgraph-missing", make_model([node("If", ["c"], ["y"], name="branch", then_branch=helper.make_graph(
        [], "then", [], [helper.make_tensor_value_info("c", BOOL, None)]))], [("c", BOOL, [])], Y),
     {"c": np.array(True)}, runnx.InvalidModelError, ["If node 'branch'", "required attribute 'else_branch'"]),
    ("subgraph-node-unsupported", _if([node("Frobnicate", ["x"], ["t"], name="inner")]),
     {"c": np.array(True), **ONES}, runnx.UnsupportedOpError, ["Frobnicate", "'inner'"]),
    ("if-condition-not-scalar", _if([node("Neg", ["x"], ["t"], name="then_neg")]),
     {"c": np.array([True, False]), **ONES}, runnx.InputShapeError, ["input 'c' expects rank 0"]),
    ("loop-trip-count-over-the-limit", make_model(
        [node("Loop", ["trips", "", "x"], ["y"], name="loop", body=helper.make_graph(
            [node("Identity", ["cond"], ["cond_out"], name="c"), node("Identity", ["acc"], ["acc_out"], name="a")],
            "body", [helper.make_tensor_value_info("i", I64, []), helper.make_tensor_value_info("cond", BOOL, []),
                     helper.make_tensor_value_info("acc", F, None)],
            [helper.make_tensor_value_info("cond_out", BOOL, []), helper.make_tensor_value_info("acc_out", F, None)]))],
        [("trips", I64, []), *X], Y), {"trips": np.array(10**12), **ONES},
     runnx.ResourceLimitError, ["Loop node 'loop'", "limit of 10000000"]),
]

FEED_CASES = [
    ("unknown-input-name", {"x": ONES["x"], "z": ONES["x"]}, runnx.UnknownInputError, ["'z'", "inputs: x"]),
    ("missing-input", {}, runnx.MissingInputError, ["input 'x'", "Neg node 'neg'"]),
    ("wrong-dtype", {"x": np.ones((2, 3))}, runnx.InputTypeError, ["input 'x'", "tensor(float)", "float64"]),
    ("python-list-of-wrong-dtype", {"x": [[1, 2, 3], [4, 5, 6]]}, runnx.InputTypeError, ["input 'x'", "int64"]),
    ("wrong-rank", {"x": np.ones(6, np.float32)}, runnx.InputShapeError, ["input 'x'", "rank 2", "[6]"]),
    ("scalar-for-matrix", {"x": np.float32(1)}, runnx.InputShapeError, ["input 'x'", "rank 2"]),
    ("wrong-static-dim", {"x": np.ones((2, 4), np.float32)}, runnx.InputShapeError, ["input 'x'", "dimension 1"]),
    ("none-feed", {"x": None}, runnx.InputTypeError, ["input 'x'", "NoneType"]),
    ("owned-wrong-dtype", {"x": runnx.Owned(np.ones((2, 3), np.int32))}, runnx.InputTypeError, ["input 'x'", "int32"]),
    ("non-string-key", {0: ONES["x"]}, runnx.UnknownInputError, ["'0'"]),
]


@pytest.mark.parametrize("name, model, feeds, error, names", MODEL_CASES, ids=[c[0] for c in MODEL_CASES])
def test_malformed_model_raises_its_error_naming_the_culprit(name, model, feeds, error, names):
    with pytest.raises(error) as caught:
        runnx.load(model).run(feeds)
    message = str(caught.value)
    for expected in names:
        assert expected in message, f"{name}: {expected!r} not in {message!r}"


@pytest.mark.parametrize("name, feeds, error, names", FEED_CASES, ids=[c[0] for c in FEED_CASES])
def test_malformed_feeds_raise_their_error_naming_the_input(name, feeds, error, names):
    with pytest.raises(error) as caught:
        runnx.load(_valid()).run(feeds)
    for expected in names:
        assert expected in str(caught.value)


def test_every_truncation_of_every_seed_fails_cleanly_or_loads():
    """All prefixes of each seed's bytes: a RunnxError or a (smaller) valid model, nothing else."""
    cases = 0
    for seed in seed_models().values():
        data = seed.SerializeToString()
        for end in range(0, len(data), max(1, len(data) // 150)):
            try:
                runnx.load(data[:end])
            except runnx.RunnxError:
                pass
            cases += 1
    assert cases >= 300


def _edge_model():
    return make_model([node("Neg", ["x"], ["a"], name="neg"), node("Transpose", ["a"], ["t"], name="tr"),
                       node("Reshape", ["t", "flat"], ["r"], name="rs"), node("Add", ["r", "r"], ["y"], name="add")],
                      [("x", F, ["n", "m"])], Y, [const("flat", [-1])])


@pytest.mark.parametrize("x", [
    np.arange(24, dtype=np.float32).reshape(4, 6)[::2, 1::2],  # non-contiguous
    np.arange(24, dtype=np.float32).reshape(4, 6).T,  # Fortran order
    np.zeros((0, 5), np.float32), np.zeros((3, 0), np.float32),  # zero-size
    np.array([[np.nan, np.inf], [-np.inf, 0.0]], np.float32),  # NaN / Inf
], ids=["strided", "transposed", "zero-rows", "zero-cols", "nan-inf"])
@pytest.mark.parametrize("owned", [False, True])
def test_unusual_but_valid_feeds_give_correct_results(x, owned):
    before = x.copy()
    feed = runnx.Owned(x.copy()) if owned else x
    y = runnx.load(_edge_model()).run({"x": feed})["y"]
    np.testing.assert_array_equal(y, 2 * (-x).T.reshape(-1))
    np.testing.assert_array_equal(x, before)
