"""Initializers also listed as graph inputs are defaults the caller may feed: with every load-time
pass on (folding, shape memos and their read-ahead, each fusion family, last position, branch
specialization, compiled plans), runnx gives onnxruntime's results for several fed values and for
the default, on one model run after run (so that nothing one run leaves behind decides the next)."""
import math
import warnings

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import runnx
import test_fusion
import test_fusion_layer_norm_blocks
from runnx.errors import InputShapeError, InputTypeError, InvalidModelError

ort = pytest.importorskip("onnxruntime")

F, I64 = TensorProto.FLOAT, TensorProto.INT64
OPSET = [helper.make_opsetid("", 18)]


def _overridable(model, names=None):
    """`model` with its initializers (those in `names`, or all) also listed as inputs."""
    model = _copy(model)
    for tensor in model.graph.initializer:
        if names is None or tensor.name in names:
            model.graph.input.append(helper.make_tensor_value_info(tensor.name, tensor.data_type, tensor.dims))
    return model


def _copy(model):
    copy = type(model)()
    copy.CopyFrom(model)
    return copy


def _defaults(model) -> dict:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def _variants(default: np.ndarray, chosen) -> list:
    """Values to feed instead of `default`: those `chosen`, else two made from it."""
    if chosen is not None:
        return [np.asarray(v, default.dtype).reshape(default.shape) for v in chosen]
    if default.dtype.kind != "f":
        return []
    with np.errstate(over="ignore"):
        made = [default * 1.5 + 0.25, default * -0.5 + 0.125]
    return [np.where(np.isfinite(v), v, default).astype(default.dtype) for v in made]


def _onnxruntime(model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        options = ort.SessionOptions()
        options.log_severity_level = 3  # not its warning about each overridable initializer
        return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _assert_same_as_onnxruntime(model, feeds, values=None, vary=None, **options):
    """Feed each overridable initializer (those in `vary`, or all) each of its variants in turn,
    between runs with the defaults, on one runnx model; each run as onnxruntime computes it."""
    defaults = _defaults(model)
    overridable = [i.name for i in model.graph.input if i.name in defaults]
    runs = [{}]
    for name in vary if vary is not None else overridable:
        for value in _variants(defaults[name], (values or {}).get(name)):
            runs += [{name: value}, {}]
    runs += runs[1:3]  # a fed value again, now the plans are compiled
    reference = _onnxruntime(model)
    output_names = [o.name for o in reference.get_outputs()]
    got_model = runnx.load(model, **options)
    for fed in runs:
        want = dict(zip(output_names, reference.run(None, {**feeds, **fed})))
        got = got_model.run({**feeds, **fed})
        for name in output_names:
            np.testing.assert_allclose(got[name], want[name], rtol=2e-5, atol=2e-5, equal_nan=True,
                                       err_msg=f"output '{name}' with {sorted(fed) or 'the defaults'} fed")
    return got_model


def _fused_ops(model) -> list:
    return [n.op_type for n in runnx.load(model).plan()]


# --- shape memos ---------------------------------------------------------------------------------

def _shape_plus_k_model():
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Add", ["s", "k"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [None])],
                              [helper.make_tensor_value_info("y", I64, None)],
                              [numpy_helper.from_array(np.array([1], np.int64), "k")])
    return helper.make_model(graph, opset_imports=OPSET, ir_version=9)


def test_a_shape_memo_reads_a_fed_initializer_as_an_input():
    model = _overridable(_shape_plus_k_model())
    got = _assert_same_as_onnxruntime(model, {"x": np.zeros(3, np.float32)}, {"k": [[10], [-2], [7]]})
    assert got.run({"x": np.zeros(3, np.float32), "k": np.array([10])})["y"].tolist() == [13]
    assert got.run({"x": np.zeros(3, np.float32)})["y"].tolist() == [4]  # not fed: the default
    assert runnx.load(_shape_plus_k_model()).memoized  # the same graph, k a constant: memoized


def test_a_read_ahead_memo_reads_a_fed_initializer_as_an_input():
    """Decode-like growing shapes: a memo reading ahead computes with the fed value, not the default."""
    model = _overridable(_shape_plus_k_model())
    reference, got = _onnxruntime(model), runnx.load(model)
    for length in range(1, 12):
        fed = {} if length % 3 == 0 else {"k": np.array([length * 5], np.int64)}
        feeds = {"x": np.zeros(length, np.float32), **fed}
        assert got.run(feeds)["y"].tolist() == reference.run(None, feeds)[0].tolist(), length


# --- fusion: one pattern of each family ----------------------------------------------------------

def test_rms_norm_decoder_pattern_reads_fed_exponent_epsilon_and_weight():
    plain = test_fusion._rms_norm_model()
    assert _fused_ops(plain) == ["RMSNorm"]
    x = np.random.default_rng(1).standard_normal((2, 3, 16)).astype(np.float32)
    _assert_same_as_onnxruntime(_overridable(plain), {"x": x},
                                {"two": [4.0, 3.0, 2.0], "eps": [0.5, 10.0], "one": [2.0]}, shape_cache=False)
    _assert_same_as_onnxruntime(_overridable(plain), {"x": x}, {"two": [4.0]})  # memos on too


def test_rotary_decoder_pattern_reads_fed_slice_bounds():
    plain = test_fusion._rotary_model()
    assert _fused_ops(plain) == ["RotateHalf"]
    rng = np.random.default_rng(3)
    feeds = {n: rng.standard_normal(shape).astype(np.float32)
             for n, shape in (("x", (1, 3, 5, 8)), ("cos", (1, 1, 5, 8)), ("sin", (1, 1, 5, 8)))}
    _assert_same_as_onnxruntime(_overridable(plain), feeds, {"half": [[2], [6]]},
                                vary=["half"])


def test_attention_decoder_pattern_reads_fed_scale_and_fill():
    plain = test_fusion._attention_model(2, 2, 5)
    assert "RepeatedKVAttention" in _fused_ops(plain)
    rng = np.random.default_rng(6)
    bias = np.where(rng.random((1, 1, 3, 5)) < 0.3, -np.inf, 0).astype(np.float32)
    bias[..., 0, :] = -np.inf  # a fully masked row: Where(IsNaN(p), zero, p) gives the fill
    feeds = {"q": rng.standard_normal((1, 4, 3, 8)).astype(np.float32),
             "k": rng.standard_normal((1, 2, 5, 8)).astype(np.float32),
             "v": rng.standard_normal((1, 2, 5, 8)).astype(np.float32), "bias": bias}
    _assert_same_as_onnxruntime(_overridable(plain), feeds, {"scale": [0.25, 1.0], "zero": [0.5, -3.0]},
                                vary=["scale", "zero"])


def test_products_pattern_reads_fed_matrices():
    rng = np.random.default_rng(0)
    weights = {name: rng.standard_normal((32, width)).astype(np.float32) for name, width in (("wq", 32), ("wk", 8))}
    nodes = [helper.make_node("MatMul", ["x", "wq"], ["yq"]), helper.make_node("MatMul", ["x", "wk"], ["yk"])]
    plain = test_fusion._model(nodes, [("x", F)], [("yq", F), ("yk", F)], weights)
    assert _fused_ops(plain) == ["SharedInputMatMul"]
    x = rng.standard_normal((1, 3, 32)).astype(np.float32)
    _assert_same_as_onnxruntime(_overridable(plain), {"x": x})
    _assert_same_as_onnxruntime(_overridable(plain, {"wk"}), {"x": x})  # one of the two


def test_erf_gelu_whisper_pattern_reads_fed_constants_and_bias():
    plain = test_fusion_layer_norm_blocks._gelu_model()
    assert _fused_ops(plain) == ["MatMul", "ErfGelu"]
    x = np.random.default_rng(5).standard_normal((2, 3, 8)).astype(np.float32)
    _assert_same_as_onnxruntime(_overridable(plain), {"x": x}, {"sqrt2": [1.0, math.sqrt(2)], "half": [0.25]})


def test_add_layer_norm_whisper_pattern_reads_fed_scale_and_bias():
    rng = np.random.default_rng(7)
    nodes = [helper.make_node("Add", ["x", "r"], ["s"]),
             helper.make_node("LayerNormalization", ["s", "w", "b"], ["y"], axis=-1, epsilon=1e-5),
             helper.make_node("Add", ["s", "y"], ["next"])]
    plain = test_fusion_layer_norm_blocks._model(nodes, ["x", "r"], ["next"], {
        "w": rng.standard_normal(16).astype(np.float32), "b": rng.standard_normal(16).astype(np.float32)})
    assert _fused_ops(plain) == ["AddLayerNorm", "Add"]
    feeds = {n: rng.standard_normal((2, 3, 16)).astype(np.float32) for n in "xr"}
    _assert_same_as_onnxruntime(_overridable(plain), feeds)


# --- last position -------------------------------------------------------------------------------

def _lm_head_model():
    graph = helper.make_graph([helper.make_node("MatMul", ["h", "w"], ["logits"])], "g",
                              [helper.make_tensor_value_info("h", F, [1, "n", 4])],
                              [helper.make_tensor_value_info("logits", F, [1, "n", 6])],
                              [numpy_helper.from_array(
                                  np.random.default_rng(2).standard_normal((4, 6)).astype(np.float32), "w")])
    return helper.make_model(graph, opset_imports=OPSET, ir_version=9)


def test_an_lm_head_whose_weight_may_be_fed_reads_the_fed_weight():
    assert runnx.load(_lm_head_model(), last_position=("logits",)).last_position == 1
    h = np.random.default_rng(3).standard_normal((1, 5, 4)).astype(np.float32)
    got = _assert_same_as_onnxruntime(_overridable(_lm_head_model()), {"h": h}, last_position=("logits",))
    assert got.last_position == 0  # every position, as onnxruntime gives


# --- subgraphs -----------------------------------------------------------------------------------

def _branches_model():
    """If(cond) whose branches read the overridable k (the model is one If: its branches run as
    graphs of their own, interp/branches.py) through a shape memo and a constant-only chain."""
    def branch(name, op):
        nodes = [helper.make_node("Shape", ["x"], [f"{name}_s"]), helper.make_node(op, [f"{name}_s", "k"], [f"{name}_y"])]
        return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(f"{name}_y", I64, None)])
    graph = helper.make_graph(
        [helper.make_node("If", ["cond"], ["y"], then_branch=branch("then", "Add"), else_branch=branch("else", "Mul"))],
        "g", [helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
              helper.make_tensor_value_info("x", F, [None])],
        [helper.make_tensor_value_info("y", I64, None)], [numpy_helper.from_array(np.array([1], np.int64), "k")])
    return helper.make_model(graph, opset_imports=OPSET, ir_version=9)


@pytest.mark.parametrize("specialize", [True, False])
@pytest.mark.parametrize("cond", [True, False])
def test_if_branches_read_a_fed_initializer_of_the_model(cond, specialize):
    feeds = {"cond": np.array(cond), "x": np.zeros(3, np.float32)}
    _assert_same_as_onnxruntime(_overridable(_branches_model()), feeds, {"k": [[10], [-4]]},
                                specialize_branches=specialize)


def _loop_model():
    """A Loop body adding Shape(x) + k (k the model's, overridable) to its carried value, 3 times."""
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]), helper.make_node("Shape", ["x"], ["s"]),
         helper.make_node("Add", ["s", "k"], ["sk"]), helper.make_node("Add", ["acc_in", "sk"], ["acc_out"])],
        "body", [helper.make_tensor_value_info("i", I64, []), helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
                 helper.make_tensor_value_info("acc_in", I64, [1])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), helper.make_tensor_value_info("acc_out", I64, [1])])
    graph = helper.make_graph(
        [helper.make_node("Loop", ["trips", "", "acc"], ["y"], body=body)], "g",
        [helper.make_tensor_value_info("x", F, [None])], [helper.make_tensor_value_info("y", I64, None)],
        [numpy_helper.from_array(np.array([1], np.int64), "k"), numpy_helper.from_array(np.array(3, np.int64), "trips"),
         numpy_helper.from_array(np.array([0], np.int64), "acc")])
    return helper.make_model(graph, opset_imports=OPSET, ir_version=9)


def test_a_loop_body_reads_fed_initializers_of_the_model():
    _assert_same_as_onnxruntime(_overridable(_loop_model()), {"x": np.zeros(3, np.float32)},
                                {"k": [[10], [-1]], "trips": [5, 0], "acc": [[100]]})


# --- loading and feeding -------------------------------------------------------------------------

def test_overridable_initializers_are_inputs_with_defaults_never_constants():
    model = runnx.load(_overridable(test_fusion._rms_norm_model()))
    graph = model.graph
    assert not graph.constants.keys() & graph.defaults.keys()
    assert {graph.names[v] for v in graph.defaults} == {"two", "axes", "eps", "one", "w"}
    assert model.input_names == ["x"]  # as onnxruntime's get_inputs(): the defaults are not required
    assert model.fused == {} and model.folded == 0


def test_a_fed_initializer_of_another_dtype_or_shape_is_refused():
    model = runnx.load(_overridable(_lm_head_model()))
    h = np.ones((1, 2, 4), np.float32)
    with pytest.raises(InputTypeError, match="input 'w' expects tensor\\(float\\)"):
        model.run({"h": h, "w": np.ones((4, 6), np.float64)})
    with pytest.raises(InputShapeError, match="input 'w' expects dimension 1 to be 6"):
        model.run({"h": h, "w": np.ones((4, 7), np.float32)})


def test_an_initializer_declared_as_an_input_of_another_type_is_refused():
    model = _lm_head_model()
    model.graph.input.append(helper.make_tensor_value_info("w", TensorProto.DOUBLE, [4, 6]))
    with pytest.raises(InvalidModelError, match="input 'w' is declared tensor\\(double\\).*tensor\\(float\\)"):
        runnx.load(model)


def test_a_declared_symbolic_dimension_lets_a_fed_initializer_change_size():
    model = _lm_head_model()
    model.graph.input.append(helper.make_tensor_value_info("w", F, [4, "vocab"]))
    model.graph.output[0].CopyFrom(helper.make_tensor_value_info("logits", F, None))
    h = np.ones((1, 2, 4), np.float32)
    _assert_same_as_onnxruntime(model, {"h": h}, {"w": [np.arange(4 * 6, dtype=np.float32) / 7]})
    wide = np.ones((4, 9), np.float32)
    np.testing.assert_array_equal(runnx.load(model).run({"h": h, "w": wide})["logits"], h @ wide)


def test_a_loop_body_input_that_is_also_its_initializer_keeps_its_position_and_is_fed():
    """The Loop feeds its body's inputs by position: one that has an initializer too gets the
    carried value, the initializer is only a default (onnxruntime refuses such a body; runnx had
    dropped the input from the body's positions and read the default every iteration)."""
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]), helper.make_node("Add", ["acc_in", "c"], ["acc_out"])],
        "body", [helper.make_tensor_value_info("i", I64, []), helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
                 helper.make_tensor_value_info("acc_in", I64, [1])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), helper.make_tensor_value_info("acc_out", I64, [1])],
        [numpy_helper.from_array(np.array([7], np.int64), "acc_in"), numpy_helper.from_array(np.array([2], np.int64), "c")])
    graph = helper.make_graph([helper.make_node("Loop", ["trips", "", "acc"], ["y"], body=body)], "g",
                              [helper.make_tensor_value_info("acc", I64, [1])], [helper.make_tensor_value_info("y", I64, None)],
                              [numpy_helper.from_array(np.array(3, np.int64), "trips")])
    model = runnx.load(_overridable(helper.make_model(graph, opset_imports=OPSET, ir_version=9)))
    assert model.run({"acc": np.array([100])})["y"].tolist() == [106]
    assert model.run({"acc": np.array([1]), "trips": np.array(2)})["y"].tolist() == [5]
