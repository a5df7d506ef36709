"""Shape memos read ahead: a memo missing on roots grown as a decode step grows them computes the
next steps' results while hot; they are what the steps compute, and a memo whose guesses fail
stops guessing."""
import numpy as np
from onnx import TensorProto, helper, numpy_helper

import runnx
from runnx.interp import read_ahead

F, I64 = TensorProto.FLOAT, TensorProto.INT64
STEPS = read_ahead.READ_AHEAD


def _model(twin: bool = False, **options):
    """out = x reshaped to (rows * columns,) + total, total = (rows(x) + rows(y)) * columns(x):
    memos of {x} (its reshape target, its dimensions), of {y} (its rows) and of {x, y} (total,
    from the other two memos' outputs: externals). With `twin`, out_z the same of x and an input
    z: memos of {z} and {x, z} computing what those of {y} and {x, y} do."""
    inputs = ("x", "y", "z") if twin else ("x", "y")
    nodes = [helper.make_node("Shape", ["x"], ["sx"]), helper.make_node("ReduceProd", ["sx"], ["size"], keepdims=1),
             helper.make_node("Gather", ["sx", "zero"], ["rows"], axis=0),
             helper.make_node("Gather", ["sx", "one"], ["columns"], axis=0),
             helper.make_node("Reshape", ["x", "size"], ["flat"])]
    for other in inputs[1:]:
        suffix = "" if other == "y" else "_" + other
        nodes += [helper.make_node("Shape", [other], ["s" + other]),
                  helper.make_node("Gather", ["s" + other, "zero"], [other + "_rows"], axis=0),
                  helper.make_node("Add", ["rows", other + "_rows"], ["both" + suffix]),
                  helper.make_node("Mul", ["both" + suffix, "columns"], ["total" + suffix]),
                  helper.make_node("Cast", ["total" + suffix], ["t" + suffix], to=F),
                  helper.make_node("Add", ["flat", "t" + suffix], ["out" + suffix])]
    outputs = ["out", "out_z"] if twin else ["out"]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(name, F, None) for name in inputs],
        [helper.make_tensor_value_info(name, F, None) for name in outputs],
        [numpy_helper.from_array(np.array(0, np.int64), "zero"), numpy_helper.from_array(np.array(1, np.int64), "one")])
    return runnx.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10), **options)


def _memos(model):
    return [node.kernel.fn for node in model.graph.nodes if node.op_type == "ShapeMemo"]


def _decode(model, lengths, y_rows=lambda length: 3):
    """Runs with x of (length, 2) and y of (y_rows(length), 1), the profile's counters, and
    whether every output is what the model without memos gives."""
    plain, profile, same = _model(shape_cache=False), runnx.Profile(), True
    for length in lengths:
        feeds = {"x": np.arange(2 * length, dtype=np.float32).reshape(length, 2),
                 "y": np.zeros((y_rows(length), 1), np.float32)}
        got = model.run(feeds, profile=profile)["out"]
        same &= got.tobytes() == plain.run(feeds)["out"].tobytes()
    return profile.counters, same


def test_a_memo_missing_on_a_grown_length_computes_the_next_steps_while_hot():
    model = _model()
    counters, same = _decode(model, range(1, 3 + STEPS))
    assert same
    # length 1: three memos miss; length 2: the two of x miss and read ahead, the one of {x, y}
    # too (y's memo unchanged since the first run: its output stays), y's hits; then all hit
    assert counters["ShapeMemo.misses"] == 3 + 2
    assert counters["ShapeMemo.read_ahead"] == 2 * STEPS
    counters, same = _decode(model, range(3 + STEPS, 6 + STEPS))  # beyond: one miss, then read ahead
    assert same and counters["ShapeMemo.misses"] == 2 and counters["ShapeMemo.read_ahead"] == 2 * 2 * STEPS


def test_a_memo_missing_right_after_all_it_read_ahead_reads_twice_as_far_up_to_a_bound():
    spans = [STEPS]
    while spans[-1] < read_ahead.MAX_READ_AHEAD:
        spans.append(min(2 * spans[-1], read_ahead.MAX_READ_AHEAD))
    spans.append(read_ahead.MAX_READ_AHEAD)  # and stays there
    last = 2 + sum(spans)  # the last length read ahead from the miss at length 2 on
    model = _model()
    counters, same = _decode(model, range(1, last + 1))
    assert same
    assert counters["ShapeMemo.misses"] == 3 + 2 * len(spans)  # x's memo and {x, y}'s, at each span's start
    assert counters["ShapeMemo.read_ahead"] == 2 * sum(spans)
    assert [memo.ahead.span for memo in _memos(model) if memo.external or len(memo.outputs) > 1] == \
        [read_ahead.MAX_READ_AHEAD] * 2


def test_memos_computing_the_same_find_each_others_results_by_identity(monkeypatch):
    """Two memos of the same structure (here the {x, y} memo's twin over x and z, z shaped as
    y) share their kept results and what the externals' identities found: the twin, fed the
    same arrays, hashes no external's bytes, though it never read ahead itself."""
    from runnx.interp import shape_cache

    model, plain = _model(twin=True), _model(twin=True, shape_cache=False)
    assert len({id(memo.results) for memo in _memos(model) if memo.external}) == 1
    feeds = lambda length: {"x": np.ones((length, 2), np.float32), "y": np.zeros((3, 1), np.float32),
                            "z": np.zeros((3, 1), np.float32)}
    for length in range(1, 3):  # length 2 misses and reads ahead
        model.run(feeds(length))
    hashed = []
    monkeypatch.setattr(shape_cache, "value_key", lambda value: hashed.append(value) or read_ahead.value_key(value))
    for length in range(3, 3 + STEPS):
        got, want = model.run(feeds(length)), plain.run(feeds(length))
        assert all(got[name].tobytes() == want[name].tobytes() for name in want)
    assert hashed == []


def test_a_memo_reads_ahead_with_an_external_found_kept_since_its_producer_last_missed():
    """A later generation: y's memo finds its result kept (from an earlier generation) and misses
    no more, its own state naming a prefill's key; the {x, y} memo reads ahead all the same, that
    external being the very array it had at its last miss (SmolLM2's mask memo had missed, cold,
    at every step of a second generation)."""
    model = _model()
    _decode(model, range(1, 3))  # y of 3 rows: y's memo keeps its result
    _decode(model, [10], y_rows=lambda length: 5)  # a prefill: y's memo misses on 5 rows
    counters, same = _decode(model, range(20, 22 + STEPS))  # y of 3 rows again: found kept
    assert same
    # lengths 20 and 21: x's memo and {x, y}'s miss, the second time reading ahead; then all hit
    assert counters["ShapeMemo.misses"] == 2 + 2
    assert counters["ShapeMemo.read_ahead"] == 2 * STEPS


def test_without_read_ahead_every_new_length_misses():
    counters, same = _decode(_model(memo_read_ahead=False), range(1, 3 + STEPS))
    assert same and counters["ShapeMemo.misses"] == 3 + 2 * (1 + STEPS) and not counters["ShapeMemo.read_ahead"]


def test_steps_read_ahead_find_their_externals_by_identity(monkeypatch):
    # the {x, y} memo's externals at a step read ahead are the arrays the other memos read ahead:
    # that step finds its result by their identity, not by hashing their bytes (outside a profile)
    from runnx.interp import shape_cache

    model = _model()
    _decode(model, range(1, 3))  # length 2 misses and reads ahead
    hashed = []
    monkeypatch.setattr(shape_cache, "value_key", lambda value: hashed.append(value) or read_ahead.value_key(value))
    plain = _model(shape_cache=False)
    for length in range(3, 3 + STEPS):
        feeds = {"x": np.ones((length, 2), np.float32), "y": np.zeros((3, 1), np.float32)}
        assert model.run(feeds)["out"].tobytes() == plain.run(feeds)["out"].tobytes()
    assert hashed == []


def test_lengths_that_do_not_grow_by_steps_read_nothing_ahead():
    counters, same = _decode(_model(), [4, 2, 9, 20, 7])
    assert same and not counters["ShapeMemo.read_ahead"]


def test_a_memo_whose_guesses_fail_stops_guessing_and_stays_right():
    """y's rows change with x's length, every fourth step: the memo of {x, y} guessed y unchanged,
    misses within what it read ahead and reads ahead no more; x's and y's memos go on."""
    model = _model()
    counters, same = _decode(model, range(1, 4 + 2 * STEPS), y_rows=lambda length: 3 + length // 4)
    assert same and counters["ShapeMemo.read_ahead_off"] == 1
    memos = [node.kernel.fn for node in model.graph.nodes if node.op_type == "ShapeMemo"]
    assert [memo.ahead.off for memo in memos if memo.external] == [True]
    assert all(memo.ahead.keys and not memo.ahead.off for memo in memos if not memo.external)  # x's, y's


def test_what_memos_read_ahead_keeps_no_model_alive():
    import gc
    import weakref

    model = _model()
    _decode(model, range(1, 4))
    assert read_ahead.ORIGINS
    memos = [weakref.ref(node.kernel.fn) for node in model.graph.nodes if node.op_type == "ShapeMemo"]
    del model
    gc.collect()
    assert all(memo() is None for memo in memos)
