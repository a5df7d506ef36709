"""Property: on random graphs mixing views (Reshape, Transpose, Slice, Squeeze, Unsqueeze,
Identity), in-place-capable ops, Concat onto a capacity buffer and If branches capturing outer
values, runnx gives bitwise the same results with and without in-place execution, matches onnx's
ReferenceEvaluator, and never writes into a borrowed caller array."""
from collections import Counter

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import runnx
from corpus import BOOL, F, const, make_model

node = helper.make_node
UNARY = ["Neg", "Abs", "Relu", "Sqrt", "Tanh"]
BINARY = ["Add", "Sub", "Mul", "Max", "Min"]
INPUTS = {"x": (3, 4), "y": (4,), "z": (2, 3, 4), "cache": (2, 4)}


class RandomGraph:
    """Builds one random graph from a `pick(n) -> int in [0, n)` source of choices."""

    def __init__(self, pick):
        self.pick = pick
        self.nodes, self.initializers = [], []
        self.shapes = dict(INPUTS)  # value name -> static shape
        self.cache = "cache"  # the latest value grown from the capacity input
        self.count = 0

    def choose(self, items):
        items = list(items)
        return items[self.pick(len(items))]

    def fresh(self, prefix="v"):
        self.count += 1
        return f"{prefix}{self.count}"

    def emit(self, op, inputs, shape, **attrs):
        out = self.fresh()
        self.nodes.append(node(op, inputs, [out], name=f"{op.lower()}_{out}", **attrs))
        self.shapes[out] = tuple(shape)
        return out

    def constant(self, values):
        name = self.fresh("c")
        self.initializers.append(const(name, values))
        return name

    def partner(self, shape, into=False):
        """A value broadcastable with `shape` (into: without growing it), else None."""
        options = []
        for name, other in self.shapes.items():
            try:
                joined = np.broadcast_shapes(shape, other)
            except ValueError:
                continue
            if not into or joined == tuple(shape):
                options.append(name)
        return self.choose(options) if options else None

    def step(self):
        names = list(self.shapes)
        # mostly one of the latest values: chains of ops, whose intermediates die and may be reused
        a = names[-1 - self.pick(min(3, len(names)))] if self.pick(4) else self.choose(names)
        shape = self.shapes[a]
        kind = self.pick(9)
        if kind == 0:
            return self.emit(self.choose(UNARY), [a], shape)
        if kind == 1:
            b = self.partner(shape)
            operands = [a, b] if self.pick(2) else [b, a]
            return self.emit(self.choose(BINARY), operands, np.broadcast_shapes(shape, self.shapes[b]))
        if kind == 2:
            target = self.choose([[-1], list(reversed(shape)), [1, *shape], [int(np.prod(shape)), 1]])
            size = int(np.prod(shape))
            resolved = [size] if target == [-1] else target
            return self.emit("Reshape", [a, self.constant(target)], resolved)
        if kind == 3 and len(shape) >= 2:
            perm = list(np.roll(np.arange(len(shape)), 1 + self.pick(len(shape) - 1)))
            return self.emit("Transpose", [a], [shape[p] for p in perm], perm=[int(p) for p in perm])
        if kind == 4 and any(d >= 2 for d in shape):
            axis = self.choose([i for i, d in enumerate(shape) if d >= 2])
            step = 1 + self.pick(2)
            out = list(shape)
            out[axis] = len(range(1, shape[axis], step))
            return self.emit("Slice", [a, self.constant([1]), self.constant([shape[axis]]), self.constant([axis]),
                                       self.constant([step])], out)
        if kind == 5:
            ones = [i for i, d in enumerate(shape) if d == 1]
            if ones and self.pick(2):
                axis = self.choose(ones)
                return self.emit("Squeeze", [a, self.constant([axis])], shape[:axis] + shape[axis + 1:])
            return self.emit("Unsqueeze", [a, self.constant([0])], (1, *shape))
        if kind == 6:
            rows = self.choose([n for n, s in self.shapes.items() if len(s) == 2 and s[1] == 4])
            grown = self.emit("Concat", [self.cache, rows], (self.shapes[self.cache][0] + self.shapes[rows][0], 4),
                              axis=0)
            self.cache = grown
            return grown
        if kind == 7 and shape:
            axis = self.pick(len(shape))
            others = [n for n, s in self.shapes.items()
                      if len(s) == len(shape) and all(s[i] == shape[i] for i in range(len(shape)) if i != axis)]
            b = self.choose(others)
            out = list(shape)
            out[axis] += self.shapes[b][axis]
            return self.emit("Concat", [a, b], out, axis=axis)
        if kind == 8:
            return self.branch(a, shape)
        return self.emit("Identity", [a], shape)

    def branch(self, a, shape):
        """If(flag): then = a (op) w with w captured, else = a unary op; both of a's shape."""
        w = self.partner(shape, into=True)
        then_out, else_out = self.fresh("t"), self.fresh("e")
        then = helper.make_graph([node(self.choose(BINARY), [a, w], [then_out], name=f"then_{then_out}")], "then",
                                 [], [helper.make_tensor_value_info(then_out, F, None)])
        other = helper.make_graph([node(self.choose(UNARY), [a], [else_out], name=f"else_{else_out}")], "else",
                                  [], [helper.make_tensor_value_info(else_out, F, None)])
        return self.emit("If", ["flag"], shape, then_branch=then, else_branch=other)

    def model(self, steps):
        last = None
        for _ in range(steps):
            last = self.step()
        produced = [n for n in self.shapes if n not in INPUTS]
        extra = [self.choose(produced + list(INPUTS)) for _ in range(self.pick(3))]
        outputs = list(dict.fromkeys([last, *extra]))
        inputs = [(n, F, list(s)) for n, s in INPUTS.items()] + [("flag", BOOL, [])]
        return make_model(self.nodes, inputs, [(n, F, None) for n in outputs], self.initializers), outputs


def _feeds(seed):
    rng = np.random.default_rng(seed)
    arrays = {n: rng.standard_normal(s).astype(np.float32) for n, s in INPUTS.items()}
    arrays["flag"] = np.array(bool(rng.integers(2)))
    return arrays


def _runnx_feeds(arrays, owned):
    """Fresh feeds: the cache always with capacity (Owned), the inputs named in `owned` handed over."""
    feeds = {n: runnx.Owned(a.copy()) if n in owned else a for n, a in arrays.items()}
    feeds["cache"] = runnx.with_capacity(arrays["cache"], axis=0, capacity=64)
    return feeds


TOTALS = Counter()


@settings(max_examples=250, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(st.data(), st.integers(2, 12), st.integers(0, 2**32 - 1), st.sets(st.sampled_from(["x", "y", "z"])))
def test_random_graphs_agree_with_copy_mode_and_the_reference(data, steps, seed, owned):
    graph = RandomGraph(lambda n: data.draw(st.integers(0, n - 1)) if n > 1 else 0)
    model, outputs = graph.model(steps)
    arrays = _feeds(seed)
    snapshot = {n: a.copy() for n, a in arrays.items()}
    expected = dict(zip(outputs, ReferenceEvaluator(model).run(None, {n: a.copy() for n, a in arrays.items()})))
    fast, profile = runnx.load(model).run(_runnx_feeds(arrays, owned), profile=True)
    slow = runnx.load(model, inplace=False).run(_runnx_feeds(arrays, owned))
    checked = runnx.load(model, check_inplace=True).run(_runnx_feeds(arrays, owned))
    for name in outputs:
        assert fast[name].dtype == slow[name].dtype == np.float32
        assert fast[name].shape == slow[name].shape == expected[name].shape, name
        assert fast[name].tobytes() == slow[name].tobytes() == checked[name].tobytes(), name
        np.testing.assert_allclose(fast[name], expected[name], rtol=1e-6, atol=0, equal_nan=True, err_msg=name)
    for name, array in arrays.items():  # borrowed caller arrays are bitwise unchanged
        assert array.tobytes() == snapshot[name].tobytes(), name
    TOTALS["graphs"] += 1
    TOTALS["nodes"] += len(model.graph.node)
    TOTALS["in place"] += profile.inplace_total
    TOTALS["moves"] += profile.moves
    TOTALS["Concat.appends_in_place"] += profile.counters["Concat.appends_in_place"]


def test_the_random_graphs_exercised_in_place_execution():
    """Runs after the property (file order): the generator must actually reach the in-place paths."""
    if not TOTALS["graphs"]:
        test_random_graphs_agree_with_copy_mode_and_the_reference()
    print(f"random graphs: {dict(TOTALS)}")
    assert TOTALS["graphs"] >= 250
    assert TOTALS["in place"] > TOTALS["graphs"] // 2
    assert TOTALS["Concat.appends_in_place"] > 0
    assert TOTALS["moves"] > 0
