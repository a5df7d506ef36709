"""Compiled plans (interp/compiled.py) keep every rule of the interpreted loop: in-place reuse only
of owned, dying, unaliased storage, caller arrays untouched, KV appends into capacity, errors that
name the node, and bitwise the interpreted results. Observed without profiling (a profiled run is
interpreted): through shared memory and the outputs themselves."""
import hashlib

import numpy as np
import pytest
from onnx import TensorProto, helper

import runnx
from _graphs import F, broadcast_chain, chain, float_model
from runnx.errors import RunnxError


def _compiled(graph) -> list:
    return [plan.state.get("compiled") for plan in graph.__dict__.get("_plans", {}).values()]


def test_the_first_run_compiles_with_compile_after_1_and_never_with_0():
    x, y = np.arange(8, dtype=np.float32).reshape(2, 4), np.full((2, 4), 3, np.float32)
    eager = runnx.load(chain(), compile_after=1)
    eager.run({"x": x, "y": y})
    assert all(callable(plan.state.get("compiled")) for plan in eager._plans.values())
    never = runnx.load(chain(), compile_after=0)
    for _ in range(3):
        never.run({"x": x, "y": y})
    assert not any(plan.state.get("compiled") for plan in never._plans.values())


def test_an_owned_input_is_consumed_in_place_and_a_borrowed_one_never_written():
    model = runnx.load(chain(), compile_after=1)
    y = np.full((2, 4), 3, np.float32)
    for _ in range(3):
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        expected = (3 - x) * 3 - 3
        out = model.run({"x": runnx.Owned(x), "y": y})["out"]
        assert np.shares_memory(out, x)  # the whole chain ran in the caller's buffer
        np.testing.assert_array_equal(out, expected)
        borrowed = np.arange(8, dtype=np.float32).reshape(2, 4)
        digest = hashlib.sha256(borrowed.tobytes()).hexdigest()
        out = model.run({"x": borrowed, "y": y})["out"]
        assert not np.shares_memory(out, borrowed)
        assert hashlib.sha256(borrowed.tobytes()).hexdigest() == digest
        np.testing.assert_array_equal(out, expected)
        np.testing.assert_array_equal(y, 3)


def test_inline_ufuncs_write_only_where_their_kernels_would():
    """Kernels registered with a ufunc run it inline in compiled plans, into a granted input only
    where the kernel would write it (the result's shape and dtype, C-contiguous): a transposed
    view is not written (its result C-ordered, as copy mode makes it), nor an input broadcasting
    would grow; a grant of the second input alone writes it when it fits."""
    nodes = [
        helper.make_node("Neg", ["x"], ["a"]),                              # inline, into x
        helper.make_node("Add", ["a", "y"], ["b"]),                         # inline, into a
        helper.make_node("Transpose", ["b"], ["t"], perm=[1, 0]),           # a view of b's storage
        helper.make_node("Sub", ["t", "w"], ["c"]),                         # granted, strided: kernel
        helper.make_node("Sub", ["w", "c"], ["d"]),                         # only c granted: kernel
        helper.make_node("Mul", ["z", "d"], ["out"]),                       # d granted, broadcast: kernel
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, F, None) for n in "xyzw"],
                              [helper.make_tensor_value_info("out", F, None)])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    compiled, interpreted = runnx.load(proto, compile_after=1), runnx.load(proto, compile_after=0)
    y, z, w = (np.linspace(-2, 2, n, dtype=np.float32).reshape(s) for n, s in ((8, (2, 4)), (2, (1, 2)), (8, (4, 2))))
    for _ in range(3):
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        out = compiled.run({"x": runnx.Owned(x), "y": y, "z": z, "w": w})["out"]
        expected = interpreted.run({"x": runnx.Owned(np.arange(8, dtype=np.float32).reshape(2, 4)),
                                    "y": y, "z": z, "w": w})["out"]
        np.testing.assert_array_equal(out, z * (w - ((-np.arange(8, dtype=np.float32).reshape(2, 4) + y).T - w)))
        np.testing.assert_array_equal(out, expected)
        assert out.strides == expected.strides and out.flags.c_contiguous
        np.testing.assert_array_equal(x, -np.arange(8, dtype=np.float32).reshape(2, 4) + y)  # written twice
        np.testing.assert_array_equal(w, np.linspace(-2, 2, 8, dtype=np.float32).reshape(4, 2))  # borrowed
    (function,) = _compiled(compiled)
    assert {f"u{i}" for i in (0, 1, 3, 4, 5)} <= set(function.__globals__)  # every ufunc kernel inline


def _broadcast_chain_reference(x, y, b, constants, count):
    """The chain of `_graphs.broadcast_chain` in numpy, one op at a time."""
    seconds = (constants[0], y, b, y, constants[1], y)
    value = x.copy()
    for index in range(count):
        value = (np.add, np.multiply, np.subtract)[index % 3](value, seconds[index % 6])
    return value


@pytest.mark.parametrize("mode", [{"compile_after": 1}, {"compile_after": 0}, {"check_inplace": True}])
def test_a_broadcasting_chain_runs_in_the_buffer_handed_over(mode):
    """Add/Mul/Sub whose second input is a [64] constant, a [1, 1, 64] input, a 0-d constant or an
    input of x's shape: every node writes the running value in place, so the whole chain ends in
    the caller's Owned buffer, bitwise numpy's result; borrowed inputs and constants untouched
    (compiled, interpreted, and checked against out-of-place runs)."""
    model_proto, constants = broadcast_chain(30)
    model = runnx.load(model_proto, **mode)
    rng = np.random.default_rng(0)
    y = rng.uniform(0.5, 1, (1, 8, 64)).astype(np.float32)
    b = rng.uniform(0.5, 1, (1, 1, 64)).astype(np.float32)
    y_before, b_before = y.copy(), b.copy()
    for _ in range(3):
        x = rng.uniform(0.5, 1, (1, 8, 64)).astype(np.float32)
        expected = _broadcast_chain_reference(x, y, b, constants, 30)
        borrowed, start = x.copy(), x.copy()
        out = model.run({"x": runnx.Owned(x), "y": y, "b": b})["out"]
        assert np.shares_memory(out, x)
        assert out.tobytes() == expected.tobytes()
        out = model.run({"x": borrowed, "y": y, "b": b})["out"]
        assert not np.shares_memory(out, borrowed) and out.tobytes() == expected.tobytes()
        np.testing.assert_array_equal(borrowed, start)
        np.testing.assert_array_equal(y, y_before)
        np.testing.assert_array_equal(b, b_before)


@pytest.mark.parametrize("compile_after", [1, 0])
def test_an_owned_input_broadcasting_would_grow_is_left_as_it_is(compile_after):
    """Add(x [1, 1, 64], y [1, 8, 64]) with x handed over: the result is a fresh [1, 8, 64] array
    and x keeps its values; the next node (Mul by a [64] input) then writes that fresh array."""
    model = runnx.load(float_model([helper.make_node("Add", ["x", "y"], ["a"]),
                                    helper.make_node("Mul", ["a", "c"], ["out"])], ["x", "y", "c"], ["out"]),
                       compile_after=compile_after)
    y, c = np.full((1, 8, 64), 2, np.float32), np.linspace(0, 1, 64, dtype=np.float32)
    for _ in range(3):
        x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(1, 1, 64)
        out = model.run({"x": runnx.Owned(x), "y": y, "c": c})["out"]
        assert out.shape == (1, 8, 64) and not np.shares_memory(out, x)
        np.testing.assert_array_equal(x, np.linspace(-1, 1, 64, dtype=np.float32).reshape(1, 1, 64))
        np.testing.assert_array_equal(out, (x + y) * c)


@pytest.mark.parametrize("compile_after", [1, 0])
@pytest.mark.parametrize("shape", [(), (0, 64), (2, 0)])
def test_0d_and_empty_values_run_in_place_through_ufunc_kernels(compile_after, shape):
    """Neg, Add of a 0-d input and Mul of a [64]-or-0-d input on a 0-d or empty x handed over:
    every node writes x (a 0-d ufunc result is an array, never a numpy scalar), as numpy computes."""
    model = runnx.load(float_model([helper.make_node("Neg", ["x"], ["a"]),
                                    helper.make_node("Add", ["a", "s"], ["b"]),
                                    helper.make_node("Mul", ["b", "c"], ["out"])], ["x", "s", "c"], ["out"]),
                       compile_after=compile_after)
    s, c = np.array(0.5, np.float32), np.full(shape[-1:] if shape[-1:] == (64,) else (), 3, np.float32)
    for _ in range(3):
        x = np.full(shape, 2, np.float32)
        out = model.run({"x": runnx.Owned(x), "s": s, "c": c})["out"]
        assert type(out) is np.ndarray and out.shape == shape and out.dtype == np.float32
        assert out.tobytes() == ((-np.full(shape, 2, np.float32) + s) * c).tobytes()
        assert out.__array_interface__["data"][0] == x.__array_interface__["data"][0]  # x itself (even empty)


def test_a_live_view_blocks_the_in_place_write():
    """a = Neg(x); v = Reshape(a) is requested; Add may not write a's storage while v lives."""
    shape = helper.make_tensor("shape", TensorProto.INT64, [1], [8])
    model = runnx.load(float_model([
        helper.make_node("Neg", ["x"], ["a"]),
        helper.make_node("Reshape", ["a", "shape"], ["v"]),
        helper.make_node("Add", ["a", "y"], ["out"]),
    ], ["x", "y"], ["out"], None, [shape]), compile_after=1)
    for _ in range(2):
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        out = model.run({"x": runnx.Owned(x), "y": np.ones((2, 4), np.float32)}, ["v", "out"])
        np.testing.assert_array_equal(out["v"], -np.arange(8, dtype=np.float32))
        np.testing.assert_array_equal(out["out"], 1 - np.arange(8, dtype=np.float32).reshape(2, 4))
        assert not np.shares_memory(out["v"], out["out"])


def test_concat_appends_into_capacity_step_after_step():
    model = runnx.load(float_model([helper.make_node("Concat", ["past", "new"], ["present"], axis=1)],
                              ["past", "new"], ["present"]), compile_after=1)
    past = np.arange(6, dtype=np.float32).reshape(2, 3)
    cache = runnx.with_capacity(past, axis=1, capacity=8)
    buffer = cache.array.base
    expected = past
    for step in range(4):
        new = np.full((2, 1), -step, np.float32)
        present = model.run({"past": cache, "new": new})["present"]
        expected = np.concatenate([expected, new], axis=1)
        np.testing.assert_array_equal(present, expected)
        assert present.base is buffer  # O(new rows): the same buffer every step
        cache = runnx.Owned(present)


def test_a_failing_node_is_named_with_its_inputs():
    shape = helper.make_tensor("shape", TensorProto.INT64, [2], [3, -1])
    model = runnx.load(float_model([helper.make_node("Relu", ["x"], ["a"], name="relu"),
                               helper.make_node("Reshape", ["a", "shape"], ["out"], name="bad_reshape")],
                              ["x"], ["out"], None, [shape]), compile_after=1)
    np.testing.assert_array_equal(model.run({"x": np.ones(6, np.float32)})["out"], np.ones((3, 2)))
    with pytest.raises(RunnxError, match=r"Reshape node .bad_reshape. \(inputs a: float32\[4\].*cannot reshape"):
        model.run({"x": np.ones(4, np.float32)})


def test_a_subgraph_plan_compiles_and_gives_the_interpreted_result():
    body_nodes = [helper.make_node("Add", ["x", "one"], ["a"]), helper.make_node("Mul", ["a", "a"], ["y_then"])]
    one = helper.make_tensor("one", F, [], [1.0])
    then_branch = helper.make_graph(body_nodes, "then", [], [helper.make_tensor_value_info("y_then", F, None)], [one])
    else_branch = helper.make_graph([helper.make_node("Neg", ["x"], ["y_else"])], "else", [],
                                    [helper.make_tensor_value_info("y_else", F, None)])
    graph = helper.make_graph([helper.make_node("If", ["cond"], ["y"], then_branch=then_branch,
                                                else_branch=else_branch)], "if",
                              [helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
                               helper.make_tensor_value_info("x", F, [4])],
                              [helper.make_tensor_value_info("y", F, None)])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    as_node = {"specialize_branches": False}  # the If runs as a node, its branches as subgraphs
    compiled, interpreted = runnx.load(proto, compile_after=1, **as_node), runnx.load(proto, compile_after=0, **as_node)
    x = np.linspace(-1, 1, 4, dtype=np.float32)
    for cond in (True, False, True):
        feeds = {"cond": np.array(cond), "x": x}
        assert compiled.run(feeds)["y"].tobytes() == interpreted.run(feeds)["y"].tobytes()
    branch = compiled.graph.nodes[0].subgraphs["then_branch"]
    assert any(callable(c) for c in _compiled(branch))
    np.testing.assert_array_equal(x, np.linspace(-1, 1, 4, dtype=np.float32))


@pytest.mark.parametrize("fixture", ["tiny-llama/model.onnx", "tiny-llama-merged/decoder_model_merged.onnx"])
def test_decode_steps_of_a_tiny_llama_are_bitwise_the_interpreted_ones(fixtures_dir, fixture):
    path = fixtures_dir / fixture
    models = {"compiled": runnx.load(path, compile_after=1), "interpreted": runnx.load(path, compile_after=0)}
    names = models["compiled"].input_names
    empty = {i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32)
             for i in models["compiled"].inputs if i.name.startswith("past_key_values.")}
    caches = {name: {n: runnx.with_capacity(v, 2, 16) for n, v in empty.items()} for name in models}
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 100, size=(1, 3))
    length = 0
    for _ in range(5):
        feeds = {"input_ids": ids, "attention_mask": np.ones((1, length + ids.shape[1]), np.int64)}
        if "position_ids" in names:
            feeds["position_ids"] = np.arange(length, length + ids.shape[1])[None]
        if "use_cache_branch" in names:
            feeds["use_cache_branch"] = np.array([length > 0])
        outputs = {name: model.run({**feeds, **caches[name]}) for name, model in models.items()}
        for key, value in outputs["interpreted"].items():
            assert outputs["compiled"][key].tobytes() == value.tobytes(), key
        caches = {name: {n.replace("present", "past_key_values"): runnx.Owned(v)
                         for n, v in result.items() if n.startswith("present")} for name, result in outputs.items()}
        length += ids.shape[1]
        ids = np.array([[int(outputs["compiled"]["logits"][0, -1].argmax())]])


def test_a_long_plan_compiles_to_a_function_with_few_locals():
    """Values whose lifetimes do not overlap share a local: a frame of thousands of locals filled
    Python 3.11's 16 KiB frame chunks, and every call made from it mapped and unmapped one."""
    nodes = [helper.make_node("Neg", [f"x{i}"], [f"x{i + 1}"]) for i in range(600)]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x0", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("x600", TensorProto.FLOAT, None)])
    model = runnx.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10))
    x = np.arange(4, dtype=np.float32)
    for _ in range(3):
        np.testing.assert_array_equal(model.run({"x0": x})["x600"], x)
    plan = next(iter(model._plans.values()))
    assert plan.state["compiled"].__code__.co_nlocals < 50  # 1,200 with a local per value


def test_a_kernels_attributes_become_its_defaults_in_a_compiled_plan():
    """A kernel taking its attributes as keyword-only parameters runs through a copy of itself whose
    defaults are the node's attributes, called without keyword arguments (matching each of a fused
    node's two dozen to its parameters cost 3.5 us a call); the kernel itself keeps its defaults,
    and another node of the same op its own attributes."""
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0]),
             helper.make_node("Softmax", ["t"], ["s"], axis=0), helper.make_node("Softmax", ["s"], ["out"], axis=1)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [3, 2])])
    model = runnx.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), compile_after=1)
    interpreted = runnx.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), compile_after=0)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(model.run({"x": x})["out"], interpreted.run({"x": x})["out"])
    (plan,) = model._plans.values()
    namespace = plan.state["compiled"].__globals__
    kernels = [namespace[f"f{i}"] for i in range(len(plan.steps))]
    assert [{k: v for k, v in kernel.__kwdefaults__.items() if k != "overwrite"} for kernel in kernels] == [
        {"perm": (1, 0)}, {"axis": 0}, {"axis": 1}]
    assert not any(f"a{i}" in namespace for i in range(len(plan.steps)))
    assert all(k is not step.fn and k.__code__ is step.fn.__code__ for k, step in zip(kernels, plan.steps))
    assert plan.steps[1].fn.__kwdefaults__["axis"] == -1


def _helper_paths():
    """Steps taking each of the compiled plan's shared helpers: a split (several outputs, views of
    one storage), a dying view whose storage the other view holds (its grant decided by `may_write`:
    refused), then the other view, alone on it (granted: written in the caller's buffer), a top-k
    (two outputs of two dtypes), a reduction to 0-d, a broadcasting product run in place, and an
    owned input consumed inline."""
    nodes = [helper.make_node("Neg", ["x"], ["a"]),
             helper.make_node("Split", ["a"], ["s1", "s2"], axis=0, num_outputs=2),
             helper.make_node("Relu", ["s1"], ["b1"]),
             helper.make_node("Abs", ["s2"], ["b2"]),
             helper.make_node("Concat", ["b1", "b2"], ["c"], axis=0),
             helper.make_node("TopK", ["c", "k"], ["v", "i"], axis=1),
             helper.make_node("ReduceSum", ["v"], ["m"], keepdims=0),
             helper.make_node("Mul", ["c", "m"], ["out"]),
             helper.make_node("Sigmoid", ["z"], ["q"])]
    graph = helper.make_graph(nodes, "helpers", [helper.make_tensor_value_info("x", F, [4, 6]),
                                                 helper.make_tensor_value_info("z", F, [3])],
                              [helper.make_tensor_value_info(n, F, None) for n in ("out", "v", "q", "m", "b1", "b2")]
                              + [helper.make_tensor_value_info("i", TensorProto.INT64, None)],
                              [helper.make_tensor("k", TensorProto.INT64, [1], [2])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def test_steps_through_shared_helpers_decide_as_the_interpreted_loop():
    """Every output bitwise the interpreted one and written where the interpreted loop writes it
    (sharing the caller's handed-over buffers exactly when it does), run after run."""
    models = {"compiled": runnx.load(_helper_paths(), compile_after=1),
              "interpreted": runnx.load(_helper_paths(), compile_after=0)}
    rng = np.random.default_rng(3)
    for _ in range(3):
        x, z = rng.standard_normal((4, 6)).astype(np.float32), rng.standard_normal(3).astype(np.float32)
        results, shares = {}, {}
        for name, model in models.items():
            given = {"x": x.copy(), "z": z.copy()}
            results[name] = model.run({n: runnx.Owned(v) for n, v in given.items()})
            shares[name] = {(o, n): np.shares_memory(v, given[n]) for o, v in results[name].items() for n in given}
        for key, value in results["interpreted"].items():
            got = results["compiled"][key]
            assert type(got) is type(value) and got.dtype == value.dtype and got.shape == value.shape, key
            assert got.tobytes() == value.tobytes(), key
        assert shares["compiled"] == shares["interpreted"]
        assert shares["compiled"][("q", "z")] and shares["compiled"][("b2", "x")]  # written in the caller's buffers
        assert not shares["compiled"][("b1", "x")]
    assert all(callable(c) for c in _compiled(models["compiled"].graph))


def test_a_failing_node_deep_in_a_long_plan_is_named():
    """The compiled plan finds the failing step by the line it failed on: a step of several
    outputs, and the step after it."""
    nodes = [helper.make_node("Neg", [f"x{i}"], [f"x{i + 1}"], name=f"neg{i}") for i in range(40)]
    nodes += [helper.make_node("Split", ["x40", "sizes"], ["p", "r"], axis=0, name="split"),
              helper.make_node("Reshape", ["r", "shape"], ["t"], name="bad_reshape"),
              helper.make_node("Concat", ["p", "t"], ["u"], axis=0, name="concat"),
              helper.make_node("Neg", ["u"], ["out"], name="last")]
    constants = [helper.make_tensor("sizes", TensorProto.INT64, [2], [2, 6]),
                 helper.make_tensor("shape", TensorProto.INT64, [2], [4, -1])]
    model = runnx.load(float_model(nodes, ["x0"], ["out"], None, constants), compile_after=1)
    with pytest.raises(RunnxError, match=r"Reshape node .bad_reshape. \(inputs r: float32\[6\].*cannot reshape"):
        model.run({"x0": np.ones(8, np.float32)})
    with pytest.raises(RunnxError, match=r"Split node .split."):
        model.run({"x0": np.ones(5, np.float32)})
    assert all(callable(c) for c in _compiled(model.graph))  # both failures came from the compiled plan


class _RecordedOwnership(dict):
    """A StorageTable's `owned` map writing down each storage entering the table (with its owned
    flag), borrowed after entering, and leaving it: every hold of a new storage, grant-free output
    and release the run decides, in order."""

    def __init__(self, events: list):
        super().__init__()
        self.events = events

    def __setitem__(self, key, owned):
        if key not in self:
            self.events.append(("new", key, bool(owned)))
        elif not owned:
            self.events.append(("borrowed", key))
        super().__setitem__(key, owned)

    def __delitem__(self, key):
        self.events.append(("free", key))
        super().__delitem__(key)


def _decisions(events: list) -> list:
    """The owned storages' events, each storage named by the order it entered in (ids come back):
    the memo results a compiled plan leaves uncounted are read-only, never owned."""
    named, out = {}, []
    for event in events:
        if event[0] == "new":
            named[event[1]] = len(named) if event[2] else None
            if event[2]:
                out.append(("new", named[event[1]]))
        elif named.get(event[1]) is not None:
            out.append((event[0], named[event[1]]))
    return out


@pytest.fixture
def recorded(monkeypatch):
    """Every run's ownership events and in-place writes into kept storages, run by run."""
    from runnx.capture import ownership
    from runnx.interp import context, executor
    runs = []

    class Recorded(ownership.StorageTable):
        def __init__(self, track_bytes=False):
            super().__init__(track_bytes)
            runs.append([])
            self.owned = _RecordedOwnership(runs[-1])

    overwriting = context.RunContext.overwriting
    monkeypatch.setattr(executor, "StorageTable", Recorded)
    monkeypatch.setattr(context.RunContext, "overwriting",
                        lambda self, keys: runs[-1].append(("overwriting", keys[0])) or overwriting(self, keys))
    return runs


@pytest.fixture
def kept_negation():
    """KeptNeg (domain runnx.test): -x, kept once a run for the same array x (`RunContext.keep`, as
    fused attention keeps its mask bias): an in-place write into x must make the run forget it."""
    from runnx.ops import registry

    def KeptNeg(x, *, ctx):
        return ctx.keep(("negated", id(x)), (x,), lambda: -x)

    registry.register("KeptNeg", since=1, domain="runnx.test")(KeptNeg)
    yield
    registry._REGISTRY.pop(("runnx.test", "KeptNeg"))


def _kept_model():
    """b = KeptNeg(a), a written in place by Add, then KeptNeg of the very same array: the second
    must not be the first's kept result."""
    nodes = [helper.make_node("Relu", ["x"], ["a"]),
             helper.make_node("KeptNeg", ["a"], ["b"], domain="runnx.test"),
             helper.make_node("Add", ["a", "y"], ["c"]),
             helper.make_node("KeptNeg", ["c"], ["d"], domain="runnx.test"),
             helper.make_node("Sub", ["d", "b"], ["out"])]
    graph = helper.make_graph(nodes, "kept", [helper.make_tensor_value_info(n, F, [2, 4]) for n in "xy"],
                              [helper.make_tensor_value_info("out", F, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("runnx.test", 1)],
                             ir_version=10)


def _live_view_model():
    shape = helper.make_tensor("shape", TensorProto.INT64, [1], [8])
    return float_model([helper.make_node("Neg", ["x"], ["a"]), helper.make_node("Reshape", ["a", "shape"], ["v"]),
                        helper.make_node("Add", ["a", "y"], ["out"]), helper.make_node("Relu", ["v"], ["w"])],
                       ["x", "y"], ["out", "w", "v"], None, [shape])


def _memo_model():
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Cast", ["s"], ["f"], to=F),
             helper.make_node("Add", ["x", "f"], ["out"]), helper.make_node("Reshape", ["out", "s"], ["r"])]
    return float_model(nodes, ["x"], ["r"])


def _shape_read_after_the_write_model():
    """Add consumes a in place, yet a lives on: the memo of Max and Abs, whose roots are a and c,
    reads its shape after the Add."""
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Add", ["a", "y"], ["b"]),
             helper.make_node("Relu", ["b"], ["c"]), helper.make_node("Shape", ["a"], ["sa"]),
             helper.make_node("Shape", ["c"], ["sc"]), helper.make_node("Max", ["sa", "sc"], ["m"]),
             helper.make_node("Abs", ["m"], ["s"]), helper.make_node("Reshape", ["c", "s"], ["out"])]
    return float_model(nodes, ["x", "y"], ["out"])


@pytest.mark.parametrize("build, feeds, memoized", [
    (chain, {"x": (2, 4), "y": (2, 4)}, 0),  # in-place reuse, step after step
    (_live_view_model, {"x": (2, 4), "y": (2, 4)}, 0),  # a view kept as an output: no write under it
    (_helper_paths, {"x": (4, 6), "z": (3,)}, 0),  # views of one storage, several outputs, kept outputs
    (_kept_model, {"x": (2, 4), "y": (2, 4)}, 0),  # a write into a kept storage
    (_memo_model, {"x": (4,)}, 2),  # a memo (Shape, Cast): its outputs uncounted compiled
    (_shape_read_after_the_write_model, {"x": (2, 4), "y": (2, 4)}, 4),  # written in place, read for its shape
])
def test_compiled_and_interpreted_runs_decide_the_same(recorded, kept_negation, build, feeds, memoized):
    """The same storages enter, are borrowed and are released in the same order, the same writes
    into kept storages are reported, and the outputs are bitwise equal, run after run: grants and
    releases decided alike by the rules (capture/ownership.py) the interpreted loop calls and the
    generated code inlines."""
    models = {"interpreted": runnx.load(build(), compile_after=0), "compiled": runnx.load(build(), compile_after=1)}
    assert models["compiled"].memoized == memoized
    rng = np.random.default_rng(5)
    for _ in range(3):
        given = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in feeds.items()}
        decided, results = {}, {}
        for name, model in models.items():
            before = len(recorded)
            results[name] = model.run({n: runnx.Owned(v.copy()) for n, v in given.items()})
            decided[name] = [_decisions(events) for events in recorded[before:]]
        assert decided["compiled"] == decided["interpreted"] and any(decided["compiled"])
        for key, value in results["interpreted"].items():
            assert results["compiled"][key].tobytes() == value.tobytes(), key
    assert all(callable(c) for c in _compiled(models["compiled"].graph))
    if build is _kept_model:
        np.testing.assert_array_equal(results["compiled"]["out"], -(np.maximum(given["x"], 0) + given["y"]) +
                                      np.maximum(given["x"], 0))
        assert any(event[0] == "overwriting" for event in recorded[-1])
