"""Options.optimization_level: one switch capping every optimization, "disabled" being plain
interpretation; onnxruntime's GraphOptimizationLevel maps to it. The switches it replaced are
Options fields only: in the environment they warn."""
import os
import re
import warnings
from pathlib import Path

import numpy as np
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

import runnx
from runnx.interp.options import LEVELS

F, I64 = TensorProto.FLOAT, TensorProto.INT64


def _model():
    """A SiLU gate (fusable), a shape-derived Reshape target (a memo), a foldable Add of constants,
    and a MatMul by a constant matrix as a graph output (last position)."""
    rng = np.random.default_rng(0)
    constants = {"a": np.array([1]), "b": np.array([-2]), "head": rng.standard_normal((8, 3)).astype(np.float32),
                 "up": rng.standard_normal(8).astype(np.float32)}
    nodes = [helper.make_node("Sigmoid", ["x"], ["s"]),
             helper.make_node("Mul", ["x", "s"], ["silu"]),
             helper.make_node("Mul", ["silu", "up"], ["y"]),
             helper.make_node("Shape", ["x"], ["shape"]),
             helper.make_node("Slice", ["shape", "zero", "one_i"], ["batch"]),
             helper.make_node("Add", ["a", "b"], ["minus_one"]),
             helper.make_node("Concat", ["batch", "minus_one", "eight"], ["target"], axis=0),
             helper.make_node("Reshape", ["y", "target"], ["h"]),
             helper.make_node("MatMul", ["h", "head"], ["logits"])]
    constants.update(zero=np.array([0]), one_i=np.array([1]), eight=np.array([8]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, ["b", "s", 8])],
                              [helper.make_tensor_value_info("logits", F, ["b", "s", 3])],
                              [numpy_helper.from_array(np.asarray(v), k) for k, v in constants.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def _applied(model) -> dict:
    """Which optimizations a loaded model has applied."""
    return {"fold_constants": model.folded > 0, "shape_cache": model.memoized > 0, "fuse": bool(model.fused),
            "last_position": model.last_position > 0}


def _compiles(model, x) -> bool:
    for _ in range(3):
        model.run({"x": x})
    return any(plan.state.get("compiled") for plan in model._plans.values())


X = np.random.default_rng(1).standard_normal((2, 5, 8)).astype(np.float32)


@pytest.mark.parametrize("level, applied", [
    ("disabled", {"fold_constants": False, "shape_cache": False, "fuse": False, "last_position": False}),
    ("basic", {"fold_constants": True, "shape_cache": True, "fuse": False, "last_position": False}),
    ("extended", {"fold_constants": True, "shape_cache": True, "fuse": True, "last_position": False}),
    ("all", {"fold_constants": True, "shape_cache": True, "fuse": True, "last_position": True}),
])
def test_each_level_applies_its_optimizations_and_the_lower_levels(level, applied):
    model = runnx.load(_model(), optimization_level=level, last_position=("logits",))
    assert _applied(model) == applied
    assert _compiles(model, X) == (level in ("extended", "all"))
    assert model.options.memo_read_ahead == (level != "disabled")
    assert model.options.specialize_branches == model.options.overlap_jobs == (level in ("extended", "all"))
    plain = runnx.load(_model(), optimization_level="disabled").run({"x": X})["logits"]
    got = model.run({"x": X})["logits"]
    np.testing.assert_allclose(got, plain[:, -1:] if applied["last_position"] else plain, rtol=1e-5, atol=1e-6)


def test_the_level_caps_a_switch_set_on_and_a_switch_set_off_stays_off():
    capped = runnx.load(_model(), optimization_level="disabled", fuse=True, fold_constants=True)
    assert not capped.fused and not capped.folded and capped.options.fuse is False
    off = runnx.load(_model(), optimization_level="all", fuse=False)
    assert not off.fused and off.folded


def test_the_level_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("RUNNX_OPTIMIZATION_LEVEL", "disabled")
    model = runnx.load(_model())
    assert model.options.optimization_level == "disabled" and _applied(model) == dict.fromkeys(_applied(model), False)


@pytest.mark.parametrize("level", ["none", "ALL", 3, ""])
def test_an_unknown_level_is_refused_naming_the_known_ones(level):
    with pytest.raises(runnx.InvalidOptionError, match="disabled, basic, extended, all"):
        runnx.Options(optimization_level=level)


@pytest.mark.parametrize("level, expected", [
    (onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL, "disabled"),
    (onnxruntime.GraphOptimizationLevel.ORT_ENABLE_BASIC, "basic"),
    (onnxruntime.GraphOptimizationLevel.ORT_ENABLE_EXTENDED, "extended"),
    (onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL, "all"),
    (runnx.GraphOptimizationLevel.ORT_DISABLE_ALL, "disabled"),
    (99, "all"),
])
def test_session_options_graph_optimization_level_maps_to_the_level(level, expected):
    settings = runnx.SessionOptions()
    settings.graph_optimization_level = level
    session = runnx.InferenceSession(_model().SerializeToString(), settings)
    assert session.model.options.optimization_level == expected
    assert expected in LEVELS


def test_session_options_refuse_an_unknown_graph_optimization_level():
    settings = runnx.SessionOptions()
    settings.graph_optimization_level = 7
    with pytest.raises(runnx.InvalidOptionError, match="ORT_ENABLE_EXTENDED \\(2\\)"):
        runnx.InferenceSession(_model().SerializeToString(), settings)


@pytest.fixture
def fresh_warnings(monkeypatch):
    """The process has not warned about any variable yet, and no RUNNX_* variable is set."""
    from runnx.interp import options
    monkeypatch.setattr(options, "_warned", set())
    for name in [name for name in os.environ if name.startswith("RUNNX_")]:
        monkeypatch.delenv(name)


@pytest.mark.parametrize("name, replacement", [
    ("RUNNX_FUSE", "RUNNX_OPTIMIZATION_LEVEL=basic"), ("RUNNX_FOLD_CONSTANTS", "RUNNX_OPTIMIZATION_LEVEL=disabled"),
    ("RUNNX_SHAPE_CACHE", "RUNNX_OPTIMIZATION_LEVEL=disabled"), ("RUNNX_INPLACE", "inplace=False"),
])
def test_a_removed_switch_in_the_environment_warns_once_and_changes_nothing(fresh_warnings, monkeypatch, name,
                                                                            replacement):
    monkeypatch.setenv(name, "0")
    with pytest.warns(UserWarning, match=f"runnx ignores {name}: .*{replacement}"):
        model = runnx.load(_model(), last_position=("logits",))
    assert _applied(model) == dict.fromkeys(_applied(model), True) and model.options.inplace
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process: a second load is silent
        runnx.load(_model())


def test_an_unknown_runnx_variable_warns_naming_it_and_the_known_ones(fresh_warnings, monkeypatch):
    monkeypatch.setenv("RUNNX_THREDS", "1")
    with pytest.warns(UserWarning, match=r"runnx ignores RUNNX_THREDS: not a runnx variable; .*\(RUNNX_OPTIMIZATION_LEVEL, "
                                         "RUNNX_THREADS, "):
        runnx.Options()


def test_known_variables_load_silently(fresh_warnings, monkeypatch):
    monkeypatch.setenv("RUNNX_OPTIMIZATION_LEVEL", "basic")
    monkeypatch.setenv("RUNNX_CHECK_INPLACE", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert runnx.load(_model()).options.check_inplace


def test_every_runnx_variable_the_project_reads_is_known():
    """A variable read anywhere (package, scripts, tests, CI) is in ENVIRONMENT, or it would warn;
    the README's table lists the documented ones."""
    from runnx.interp.options import DOCUMENTED, ENVIRONMENT, REMOVED
    root = Path(__file__).parents[2]
    files = [p for folder in ("runnx", "scripts", "tests") for p in (root / folder).rglob("*.py")]
    files += [root / "Makefile", *(root / ".ci").glob("*")]
    named = {name for path in files if path.is_file() and path != Path(__file__) and path.name != "options.py"
             for name in re.findall(r"RUNNX_[A-Z_]*[A-Z]", path.read_text(errors="replace"))}
    assert named and named - set(REMOVED) <= set(ENVIRONMENT), named - set(ENVIRONMENT)
    assert not set(REMOVED) & set(ENVIRONMENT)
    readme = (root / "README.md").read_text()
    table = readme[readme.index("| environment variable | what |"):]
    table = table[:table.index("\n\n")]
    assert set(re.findall(r"RUNNX_[A-Z_]*[A-Z]", table)) == set(DOCUMENTED)
