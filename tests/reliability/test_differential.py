"""Every optimization equals plain interpretation: the same cases run with optimization_level
"all" and "disabled" give the same results (differential.py says how close: bitwise but floats,
which a fused kernel may sum in another order). Cases: every fixture model over several decode
steps (KV handed back as runnx.Owned, first in capacity buffers), the official ONNX backend
suite's models on their own inputs, generated decoder-like graphs hitting every decoder fusion
pattern with usual and unexpected constants (and dynamically quantized ones, compared bitwise),
and hazards: overridable initializers fed new
values, masks computed in place after their first reader, callers' read-only views of buffers
changed between runs, If/Loop captures."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import onnx.backend.test
import onnxruntime
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import helper, numpy_helper

import runnx
import runnx.backend
from differential import (
    BOOL, F, I64, TOLERANCE, assert_runs_agree, assert_same, decode_and_compare, decoder, fused_ops, kv_names,
    load_both, mask_rewritten_in_place, random_shape, step_feeds,
)
from test_random_graphs import RandomGraph
from test_random_graphs import _feeds as random_graph_feeds
from test_random_graphs import _runnx_feeds as random_graph_runnx_feeds

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


# -- fixtures: several decode steps ---------------------------------------------------------------


def _decoder_fixtures():
    return [p for p in sorted(FIXTURES.glob("*/*.onnx")) if p.name != "encoder_model.onnx"]


def _present(name: str) -> str:
    return name.replace("past_key_values", "present")


def _fixture_feeds(model, config: dict, rng, past: int, new: int, step: int) -> dict:
    """A decode step's feeds for an Optimum export by input name; KV inputs are left to the caller."""
    feeds = {}
    for info in model.inputs:
        name = info.name
        if name == "input_ids":
            feeds[name] = rng.integers(0, config.get("vocab_size", 16), (1, new))
        elif name == "attention_mask":
            feeds[name] = np.ones((1, past + new), np.int64)
        elif name == "position_ids":
            feeds[name] = np.arange(past, past + new)[None]
        elif name == "use_cache_branch":
            feeds[name] = np.array([step > 0])
        elif name == "encoder_hidden_states":
            feeds[name] = rng.standard_normal((1, 6, info.shape[-1])).astype(np.float32)
    return feeds


@pytest.mark.parametrize("path", _decoder_fixtures(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_fixture_decoders_agree_over_decode_steps(path):
    config = json.loads((path.parent / "config.json").read_text())
    plain, optimized = load_both(path)
    kv = [i for i in plain.inputs if i.name.startswith("past_key_values.")]
    rng = np.random.default_rng(0)
    caches = {}
    for model in (plain, optimized):
        caches[id(model)] = {i.name: runnx.with_capacity(np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32), 2, 32)
                             for i in kv}
    past, new = 0, 3
    encoder = None
    for step in range(4):
        feeds = _fixture_feeds(plain, config, rng, past, new, step)
        if "encoder_hidden_states" in feeds:  # one encoder output for the whole decode
            encoder = feeds["encoder_hidden_states"] = encoder if encoder is not None else feeds["encoder_hidden_states"]
        results = []
        for model in (plain, optimized):
            outputs = model.run({**feeds, **caches[id(model)]})
            caches[id(model)] = {name: (runnx.Owned(outputs[_present(name)]) if ".encoder." not in name or step == 0
                                        else caches[id(model)][name]) for name in caches[id(model)]}
            results.append(outputs)
        for name in results[0]:
            assert_same(results[0][name], results[1][name], f"step {step}: {name}")
        past, new = (past + new, 1) if kv else (0, new + 1)  # a model without a cache: longer prompts


def test_the_fixture_encoder_agrees():
    plain, optimized = load_both(FIXTURES / "tiny-whisper" / "encoder_model.onnx")
    features = np.random.default_rng(1).standard_normal((1, 80, 3000)).astype(np.float32)
    assert_runs_agree(plain, optimized, lambda: {"input_features": features})


# -- the official backend suite ------------------------------------------------------------------


def _backend_cases() -> dict:
    """The node cases of onnx's backend suite (built in memory, as onnx.backend.test does)."""
    from onnx.backend.test.loader import load_node_model_tests
    return {case.name: case for case in load_node_model_tests() if case.model is not None and case.data_sets}


BACKEND_CASES = _backend_cases()
RANDOM_OPS = {"Bernoulli", "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Dropout"}


def _unseeded_draws(model: onnx.ModelProto) -> bool:
    """Whether the model draws random numbers without a seed (Dropout: when training), which
    differ from run to run: then only dtypes and shapes are compared."""
    return any(node.op_type in RANDOM_OPS and not any(a.name == "seed" for a in node.attribute)
               for node in model.graph.node)


@pytest.mark.parametrize("name", sorted(BACKEND_CASES))
def test_backend_suite_cases_agree(name):
    case = BACKEND_CASES[name]
    inputs = case.data_sets[0][0]
    try:
        expected = runnx.backend.RunnxRep(runnx.load(case.model, optimization_level="disabled")).run(inputs)
    except runnx.RunnxError as error:  # unsupported: so must it be with optimizations (same error type)
        with pytest.raises(type(error)):
            runnx.backend.RunnxRep(runnx.load(case.model, optimization_level="all")).run(inputs)
        return
    optimized = runnx.backend.RunnxRep(runnx.load(case.model, optimization_level="all"))
    drawn = _unseeded_draws(case.model)
    for _ in range(3):  # interpreted, then compiled
        got = optimized.run(inputs)
        assert len(got) == len(expected)
        for index, (a, b) in enumerate(zip(expected, got)):
            if drawn:
                assert (np.asarray(a).dtype, np.shape(a)) == (np.asarray(b).dtype, np.shape(b)), f"output {index}"
            else:
                assert_same(a, b, f"output {index}")


# -- generated decoders --------------------------------------------------------------------------


def _agrees_with_onnxruntime(model, optimized, shape, seed: int) -> None:
    """A prompt after a past: the optimized model's outputs as onnxruntime computes them."""
    rng = np.random.default_rng(seed)
    feeds = step_feeds(shape, rng, 2, 3)
    feeds.update({n: rng.standard_normal((1, shape.groups, 2, shape.head_size)).astype(np.float32)
                  for n in kv_names(shape)})
    session = onnxruntime.InferenceSession(model.SerializeToString())
    theirs = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    ours = optimized.run(feeds)
    for name, value in theirs.items():
        np.testing.assert_allclose(ours[name], value, **TOLERANCE, equal_nan=True, err_msg=name)


@pytest.mark.parametrize("usual", [True, False], ids=["usual", "unexpected"])
@pytest.mark.parametrize("style", ["llama", "gpt"])
@pytest.mark.parametrize("seed", range(3))
def test_generated_decoders_agree_over_decode_steps(style, usual, seed):
    shape = random_shape(np.random.default_rng(seed), style, usual)
    model, _ = decoder(shape)
    plain, optimized = load_both(model)
    if usual:  # every pattern of the style is hit
        expected = {"llama": {"RotateHalf", "RepeatedKVAttention", "ResidualGatedMLP", "ProjectedRopeAppend",
                              "AddRMSNorm", "SiluMul"},
                    "gpt": {"RepeatedKVAttention", "ErfGelu", "AddLayerNorm", "ResidualGeluMLP"}}[style]
        assert expected <= set(optimized.fused), optimized.fused
    decode_and_compare(plain, optimized, shape, seed, steps=5)
    _agrees_with_onnxruntime(model, optimized, shape, seed)


@pytest.mark.parametrize("style", ["llama", "gpt"])
@pytest.mark.parametrize("seed", range(3))
def test_generated_decoders_of_fused_projections_agree_and_fuse_alike(style, seed):
    """One product for q/k/v and one for the MLP's gate/up, cut into pieces (and a rotary embedding
    over the first Shape(cos)[-1] columns): cut into separate products at load, they fuse into the
    same nodes as the separate-projection decoder, and agree with plain interpretation."""
    shape = random_shape(np.random.default_rng(seed), style, True)
    plain, optimized = load_both(decoder(replace(shape, fused_projections=True))[0])
    assert optimized.rewritten["split_products"] == shape.layers * (2 if style == "llama" else 1)
    separate = load_both(decoder(shape)[0])[1]
    assert optimized.fused == separate.fused
    decode_and_compare(plain, optimized, shape, seed, steps=5)


@pytest.mark.parametrize("quantized", ["all", "attention"])
@pytest.mark.parametrize("usual", [True, False], ids=["usual", "unexpected"])
@pytest.mark.parametrize("style", ["llama", "gpt"])
@pytest.mark.parametrize("seed", range(3))
def test_generated_quantized_decoders_are_bitwise_plain_interpretation(style, usual, quantized, seed):
    """Products as quantize_dynamic writes them (DynamicQuantizeLinear -> MatMulInteger with zero
    points -> Cast -> Mul by the scales; or the attention's only, the MLP float) and a
    DequantizeLinear embedding table read by Gather: every output bitwise over decode steps, and
    onnxruntime's on a prompt after a past."""
    shape = random_shape(np.random.default_rng(seed), style, usual, quantized)
    model, _ = decoder(shape)
    plain, optimized = load_both(model)
    if usual:  # the patterns bitwise their nodes still fuse
        expected = {"llama": {"RotateHalf", "AddRMSNorm", "SiluMul"}, "gpt": {"AddLayerNorm"}}[style]
        assert expected <= set(optimized.fused), optimized.fused
    decode_and_compare(plain, optimized, shape, seed, steps=5)
    _agrees_with_onnxruntime(model, optimized, shape, seed)


@pytest.mark.parametrize("style", ["llama", "gpt"])
@pytest.mark.parametrize("seed", range(2))
def test_generated_4_bit_decoders_agree_over_decode_steps(style, seed):
    """Every product a 4-bit MatMulNBits (q/k/v and gate/up as one SharedInputMatMulNBits each) and
    a llama head tied to its 8-bit embedding table (DequantizedMatMul): the fused model agrees with
    plain interpretation over decode steps, and with onnxruntime on a prompt after a past."""
    shape = random_shape(np.random.default_rng(seed), style, True, "nbits")
    model, _ = decoder(shape)
    plain, optimized = load_both(model)
    expected = {"llama": {"SharedInputMatMulNBits", "DequantizedMatMul"}, "gpt": {"SharedInputMatMulNBits"}}[style]
    assert expected <= set(optimized.fused) | fused_ops(optimized), optimized.fused
    decode_and_compare(plain, optimized, shape, seed, steps=5)
    _agrees_with_onnxruntime(model, optimized, shape, seed)


def test_every_fusion_pattern_is_met_by_the_fixtures_or_the_generated_decoders():
    """So that each fused kernel is held to plain interpretation above (a new pattern must be met too)."""
    import re
    patterns = set()
    for source in (Path(runnx.__file__).parent / "interp" / "fusion").glob("*.py"):
        patterns |= set(re.findall(r'Fused\(\s*"(\w+)"', source.read_text()))
    met = set()
    models = [runnx.load(path) for path in sorted(FIXTURES.glob("*/*.onnx"))]
    models += [runnx.load(decoder(random_shape(np.random.default_rng(seed), style, True, quantized))[0])
               for seed in range(3) for style in ("llama", "gpt") for quantized in ("", "all", "nbits")]
    for model in models:  # those a later pattern absorbed are counted in model.fused
        met |= set(model.fused) | fused_ops(model)
    assert patterns and patterns <= met, sorted(patterns - met)


HONOURED = {"llama": ("w", "epsilon", "norm_weight", "one", "scale", "fill", "then", "else", "split"),
            "gpt": ("w", "b", "ln_scale", "ln_bias", "scale", "fill", "then", "else", "divisor", "one",
                    "half")}


def _fed(name: str, value: np.ndarray) -> np.ndarray:
    """A new value for an overridable constant: floats scaled and shifted; the rotary split moved."""
    if name.startswith("split"):
        return np.array([1])
    return (value * np.float32(1.7) + np.float32(0.3)).astype(value.dtype)


@pytest.mark.parametrize("style", ["llama", "gpt"])
def test_generated_decoders_fed_new_values_of_overridable_constants_their_kernels_read_agree(style):
    """Weights, biases, epsilons, scales, fills, mask values, GELU constants, the rotary split:
    listed as graph inputs too and fed new values, which fused kernels read at run time."""
    shape = random_shape(np.random.default_rng(11), style, True)
    model, constants = decoder(shape, HONOURED[style])
    assert {name.rsplit("_", 1)[0] for name in shape.overridable} == set(HONOURED[style])
    plain, optimized = load_both(model)
    fed = {name: _fed(name, constants[name]) for name in shape.overridable}
    decode_and_compare(plain, optimized, shape, 2, steps=3, extra=fed)


@pytest.mark.parametrize("prefix, value", [("exponent", np.float32(3.0)), ("axes", np.array([1]))])
def test_a_generated_decoder_fed_a_new_rms_norm_exponent_or_axis_agrees(prefix, value):
    """The RMSNorm matcher checks the exponent (2) and reads the ReduceMean axes at load."""
    shape = random_shape(np.random.default_rng(12), "llama", True)
    model, constants = decoder(shape, (prefix,))
    assert shape.overridable
    plain, optimized = load_both(model)
    decode_and_compare(plain, optimized, shape, 4, steps=2, extra={name: value for name in shape.overridable})


# -- hazards ---------------------------------------------------------------------------------------


def _model(nodes, inputs, outputs, initializers=(), overridable=()):
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs] +
        [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in initializers if t.name in overridable],
        [helper.make_tensor_value_info(n, t, None) for n, t in outputs], list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


@pytest.mark.parametrize("fed", [10, -1, 0])
def test_an_overridable_constant_added_to_a_shape_agrees(fed):
    model = _model([helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Add", ["s", "k"], ["y"])],
                   [("x", F, None)], [("y", I64)], [numpy_helper.from_array(np.array([1]), "k")], overridable=("k",))
    plain, optimized = load_both(model)
    feeds = {"x": np.zeros(3, np.float32), "k": np.array([fed])}
    assert_runs_agree(plain, optimized, lambda: feeds)


def test_overridable_constants_fed_or_not_agree_with_onnxruntime():
    """Folding-shaped graph: an overridable initializer read by nodes whose other inputs are
    constants; fed, not fed, several values."""
    model = _model([helper.make_node("Mul", ["a", "k"], ["m"]), helper.make_node("Add", ["x", "m"], ["y"])],
                   [("x", F, None)], [("y", F)],
                   [numpy_helper.from_array(np.float32(2), "a"), numpy_helper.from_array(np.float32(3), "k")],
                   overridable=("k",))
    plain, optimized = load_both(model)
    session = onnxruntime.InferenceSession(model.SerializeToString())
    x = np.arange(4, dtype=np.float32)
    for fed in ({}, {"k": np.array(5, np.float32)}, {"k": np.array(-1, np.float32)}):
        feeds = {"x": x, **fed}
        expected = assert_runs_agree(plain, optimized, lambda: feeds)
        np.testing.assert_array_equal(expected["y"], session.run(None, feeds)[0])


def test_a_callers_read_only_view_changed_between_runs_agrees():
    """A shape input and a Where condition fed as the same read-only view of a buffer the caller
    changes between runs."""
    model = _model([helper.make_node("Reshape", ["x", "shape"], ["r"]),
                    helper.make_node("Where", ["keep", "r", "zero"], ["y"])],
                   [("x", F, None), ("shape", I64, [2]), ("keep", BOOL, None)], [("y", F)],
                   [numpy_helper.from_array(np.float32(0), "zero")])
    plain, optimized = load_both(model)
    target, keep = np.array([2, 3]), np.zeros((2, 3), bool)
    views = [target.view(), keep.view()]
    for view in views:
        view.flags.writeable = False
    x = np.arange(6, dtype=np.float32)
    for step, shape in enumerate(([2, 3], [3, 2], [2, 3], [6, 1])):
        target[:] = shape
        keep[:] = np.random.default_rng(step).random((2, 3)) < 0.5
        feeds = {"x": x, "shape": views[0], "keep": views[1].reshape(shape) if shape != [2, 3] else views[1]}
        expected = assert_runs_agree(plain, optimized, lambda: feeds)
        assert expected["y"].shape == tuple(shape)


def test_a_mask_computed_in_place_after_its_first_reader_agrees():
    model, shape = mask_rewritten_in_place()
    plain, optimized = load_both(model)
    decode_and_compare(plain, optimized, shape, 5, steps=3)


def _branch(name, nodes, output):
    return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(output, F, None)])


def test_if_and_loop_capturing_outer_values_agree():
    """If branches and a Loop body capture outer values, one dying at the node (moved into the
    subgraph, written there in place), over runs with both conditions."""
    node = helper.make_node
    then = _branch("then", [node("Mul", ["h", "two"], ["t"]), node("Add", ["t", "x"], ["out_t"])], "out_t")
    other = _branch("else", [node("Sub", ["h", "x"], ["out_e"])], "out_e")
    body = helper.make_graph(
        [node("Add", ["acc", "h"], ["acc_next"]), node("Identity", ["cond"], ["cond_out"])], "body",
        [helper.make_tensor_value_info("i", I64, []), helper.make_tensor_value_info("cond", BOOL, []),
         helper.make_tensor_value_info("acc", F, None)],
        [helper.make_tensor_value_info("cond_out", BOOL, []), helper.make_tensor_value_info("acc_next", F, None)])
    model = _model([node("Neg", ["x"], ["h"]),
                    node("If", ["flag"], ["b"], then_branch=then, else_branch=other),
                    node("Loop", ["trips", "", "b"], ["looped"], body=body),
                    node("Relu", ["looped"], ["y"])],
                   [("x", F, None), ("flag", BOOL, []), ("trips", I64, [])], [("y", F), ("b", F)],
                   [numpy_helper.from_array(np.float32(2), "two")])
    plain, optimized = load_both(model)
    rng = np.random.default_rng(0)
    for step in range(4):
        feeds = {"x": rng.standard_normal((2, 3)).astype(np.float32), "flag": np.array(step % 2 == 0),
                 "trips": np.array(step + 1)}
        assert_runs_agree(plain, optimized, lambda: {**feeds, "x": runnx.Owned(feeds["x"].copy())})


@settings(max_examples=60, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(st.data(), st.integers(2, 12), st.integers(0, 2**32 - 1), st.sets(st.sampled_from(["x", "y", "z"])))
def test_random_graphs_agree(data, steps, seed, owned):
    """test_random_graphs.py's graphs (views, in-place ops, Concat onto a capacity buffer, If
    branches capturing outer values), inputs handed over or not, run twice (then compiled)."""
    graph = RandomGraph(lambda n: data.draw(st.integers(0, n - 1)) if n > 1 else 0)
    model, _ = graph.model(steps)
    plain, optimized = load_both(model)
    arrays = random_graph_feeds(seed)
    for _ in range(3):
        assert_runs_agree(plain, optimized, lambda: random_graph_runnx_feeds(arrays, owned))
