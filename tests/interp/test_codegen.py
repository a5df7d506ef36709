"""The bytecode of generated functions (interp/codegen.py) is kept on disk: a later process reads a
plan's back instead of compiling it, runs it to the same results and names a failing node as a
freshly compiled one does; a damaged or unwritable cache costs a compile, never a wrong function."""
import numpy as np
import pytest
from onnx import helper

import runnx
from _graphs import chain, float_model
from runnx.errors import RunnxError
from runnx.interp import codegen


@pytest.fixture
def code_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RUNNX_CACHE", str(tmp_path))
    return tmp_path / "code"


def _kept(cache) -> list:
    return sorted(p for p in cache.rglob("*") if p.is_file())


def _no_compile(monkeypatch):
    def refuse(*args):
        raise AssertionError("compiled although its bytecode was kept")
    monkeypatch.setattr(codegen, "compile", refuse, raising=False)


def _run(model_proto, x, y):
    model = runnx.load(model_proto, compile_after=1)
    return model.run({"x": x, "y": y})["out"], model


def test_a_plan_compiled_once_is_read_back_and_gives_the_same_results(code_cache, monkeypatch):
    x, y = np.arange(8, dtype=np.float32).reshape(2, 4), np.full((2, 4), 3, np.float32)
    first, model = _run(chain(), x, y)
    assert all(callable(plan.state.get("compiled")) for plan in model._plans.values())
    assert len(_kept(code_cache)) == 1
    _no_compile(monkeypatch)
    again, model = _run(chain(), x, y)  # a new model, as in a later process
    assert all(callable(plan.state.get("compiled")) for plan in model._plans.values())
    np.testing.assert_array_equal(again, first)
    np.testing.assert_array_equal(again, (3 - x) * 3 - 3)


def test_another_graph_is_compiled_and_kept_beside(code_cache):
    x, y = np.ones((2, 4), np.float32), np.ones((2, 4), np.float32)
    _run(chain(), x, y)
    other = float_model([helper.make_node("Add", ["x", "y"], ["out"], name="add")], ["x", "y"], ["out"], ["n", 4])
    out, _ = _run(other, x, y)
    np.testing.assert_array_equal(out, x + y)
    assert len(_kept(code_cache)) == 2


def test_a_node_failing_in_bytecode_read_back_is_named_as_when_compiled(code_cache, monkeypatch):
    proto = float_model([helper.make_node("Relu", ["x"], ["a"], name="first_relu"),
                         helper.make_node("Add", ["a", "y"], ["out"], name="the_add")], ["x", "y"], ["out"])
    x = np.ones((2, 4), np.float32)
    model = runnx.load(proto, compile_after=1)
    model.run({"x": x, "y": x})
    _no_compile(monkeypatch)
    model = runnx.load(proto, compile_after=1)
    model.run({"x": x, "y": x})
    assert all(callable(plan.state.get("compiled")) for plan in model._plans.values())
    with pytest.raises(RunnxError, match="the_add"):
        model.run({"x": x, "y": np.ones((3, 4), np.float32)})


@pytest.mark.parametrize("damage", [b"", b"\x00\x01not bytecode", None])
def test_a_damaged_file_is_compiled_again_and_replaced(code_cache, damage):
    x, y = np.arange(8, dtype=np.float32).reshape(2, 4), np.full((2, 4), 3, np.float32)
    _run(chain(), x, y)
    (path,) = _kept(code_cache)
    whole = path.read_bytes()
    path.write_bytes(whole[:len(whole) // 2] if damage is None else damage)  # None: cut short
    out, _ = _run(chain(), x, y)
    np.testing.assert_array_equal(out, (3 - x) * 3 - 3)
    assert path.read_bytes() == whole


def test_a_cache_that_cannot_be_written_only_costs_a_compile(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("RUNNX_CACHE", str(blocker))
    x, y = np.arange(8, dtype=np.float32).reshape(2, 4), np.full((2, 4), 3, np.float32)
    for _ in range(2):
        out, _ = _run(chain(), x, y)
        np.testing.assert_array_equal(out, (3 - x) * 3 - 3)
    assert blocker.read_text() == "not a folder"


def test_the_kept_code_is_keyed_by_the_source_and_its_name(code_cache):
    first = codegen.compiled("def run():\n    return 1\n", "<runnx test>")
    same = codegen.compiled("def run():\n    return 1\n", "<runnx test>")
    other = codegen.compiled("def run():\n    return 2\n", "<runnx test>")
    renamed = codegen.compiled("def run():\n    return 1\n", "<runnx another>")
    assert first == same and first is not same  # (the second read back)
    assert len(_kept(code_cache)) == 3
    namespace = {}
    exec(other, namespace)
    assert namespace["run"]() == 2
    assert renamed.co_filename == "<runnx another>"


def test_attributes_passed_as_keywords_never_shadow_a_generated_functions_arguments():
    """A kernel whose attributes cannot be bound as defaults of a copy (not a plain function) gets
    them as a global dict of keywords, named apart from the locals the callers name their inputs
    (a shape memo's a0, a1, ...): the call reads the dict, not the input."""
    class Scaled:
        def __call__(self, x, *, alpha):
            return x * alpha

    program = codegen.Program(None, "a0", "kernel with keyword attributes")
    program.emit(f"r = {program.call(0, Scaled(), {'alpha': 3.0}, ['a0'])}")
    run = program.build("r")
    np.testing.assert_array_equal(run(np.ones(2, np.float32)), np.full(2, 3, np.float32))
