"""Fusion patterns of LayerNorm blocks (runnx/interp/fusion/layer_norm_blocks.py): attention with heads split and merged
by Reshape targets built from shapes, and the erf GELU, as Optimum exports them; fused outputs
against the unfused graph, on small graphs, the tiny fixture and (when built) whisper tiny.en."""
import math

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import runnx

F = TensorProto.FLOAT
HEADS, DEPTH = 2, 4
SHAPE_OPS = {"Shape", "Gather", "Unsqueeze", "Concat"}


def _model(nodes, inputs, outputs, constants):
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(n, F, None) for n in inputs],
        [helper.make_tensor_value_info(n, F, None) for n in outputs],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in constants.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def _dims(prefix, source):
    """Unsqueeze(Gather(Shape(source), i), [0]) for i = 0, 1 as the exporter writes them: values prefix0, prefix1."""
    nodes = []
    for i in (0, 1):
        nodes += [helper.make_node("Shape", [source], [f"{prefix}shape{i}"]),
                  helper.make_node("Gather", [f"{prefix}shape{i}", f"index{i}"], [f"{prefix}dim{i}"], axis=0),
                  helper.make_node("Unsqueeze", [f"{prefix}dim{i}", "axis0"], [f"{prefix}{i}"])]
    return nodes


def _attention_nodes(key_layout, value_split, mask, source="x"):
    """x (batch, length, hidden) -> attention -> y; key/value as (batch, heads, kv, depth) inputs, or
    (batch, kv, hidden) inputs split the encoder's way; mask: Add(bias) and IsNaN/Where after the softmax;
    the Reshape targets from dimensions 0 and 1 of `source`."""
    nodes = _dims("q", source) + _dims("o", source) + [
        helper.make_node("Add", ["query_bias", "x"], ["xb"]),
        helper.make_node("Mul", ["xb", "query_scale"], ["qs"]),
        helper.make_node("Concat", ["q0", "q1", "minus_one", "depth"], ["q_target"], axis=0),
        helper.make_node("Reshape", ["qs", "q_target"], ["q4"]),
        helper.make_node("Transpose", ["q4"], ["qt"], perm=[0, 2, 1, 3]),
        helper.make_node("Mul", ["qt", "one"], ["qh"])]
    if key_layout == "split":
        nodes += [helper.make_node("Reshape", ["k", "kv_target"], ["k4"]),
                  helper.make_node("Transpose", ["k4"], ["kt"], perm=[0, 2, 3, 1])]
    else:
        nodes.append(helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]))
    if value_split:
        nodes += [helper.make_node("Reshape", ["v", "kv_target"], ["v4"]),
                  helper.make_node("Transpose", ["v4"], ["vh"], perm=[0, 2, 1, 3])]
    nodes += [helper.make_node("Mul", ["kt", "one"], ["kh"]),
              helper.make_node("MatMul", ["qh", "kh"], ["scores"])]
    probabilities = "p"
    if mask:
        nodes += [helper.make_node("Add", ["scores", "bias"], ["biased"]),
                  helper.make_node("Softmax", ["biased"], ["p"], axis=-1),
                  helper.make_node("IsNaN", ["p"], ["nan"]),
                  helper.make_node("Where", ["nan", "zero", "p"], ["pz"])]
        probabilities = "pz"
    else:
        nodes.append(helper.make_node("Softmax", ["scores"], ["p"], axis=-1))
    nodes += [helper.make_node("MatMul", [probabilities, "vh" if value_split else "v"], ["heads_out"]),
              helper.make_node("Transpose", ["heads_out"], ["merged"], perm=[0, 2, 1, 3]),
              helper.make_node("Concat", ["o0", "o1", "minus_one"], ["o_target"], axis=0),
              helper.make_node("Reshape", ["merged", "o_target"], ["y"])]
    return nodes


CONSTANTS = {"index0": np.array(0), "index1": np.array(1), "axis0": np.array([0]), "minus_one": np.array([-1]),
             "depth": np.array([DEPTH]), "kv_target": np.array([1, -1, HEADS, DEPTH]),
             "query_scale": np.float32(DEPTH ** -0.5), "one": np.float32(1), "zero": np.float32(0),
             "query_bias": np.linspace(-1, 1, HEADS * DEPTH, dtype=np.float32)}


def _both(model, feeds):
    """(fused outputs, unfused outputs, the fused plan's op types)."""
    fused = runnx.load(model, shape_cache=False)
    plain = runnx.load(model, shape_cache=False, fuse=False)
    return fused.run(feeds), plain.run(feeds), [n.op_type for n in fused.plan()]


def _feeds(length, size, key_layout, value_split, mask, rng):
    x = rng.standard_normal((1, length, HEADS * DEPTH)).astype(np.float32)
    split = (1, size, HEADS * DEPTH)
    heads = (1, HEADS, size, DEPTH)
    feeds = {"x": x, "k": rng.standard_normal(split if key_layout == "split" else heads).astype(np.float32),
             "v": rng.standard_normal(split if value_split else heads).astype(np.float32)}
    if mask:
        bias = np.where(np.tril(np.ones((length, size)), size - length) > 0, 0, -np.inf).astype(np.float32)
        bias[-1] = -np.inf  # a fully masked row: NaN -> 0
        feeds["bias"] = bias.reshape(1, 1, length, size)
    return feeds


@pytest.mark.parametrize("key_layout, value_split, mask", [
    ("heads", False, True),  # a decoder's self-attention over its cache
    ("heads", False, False),  # a decoder's cross-attention over the encoder's keys and values
    ("split", True, False),  # the encoder
])
def test_attention_and_its_shape_chains_become_one_node(key_layout, value_split, mask):
    inputs = ["x", "k", "v"] + (["bias"] if mask else [])
    model = _model(_attention_nodes(key_layout, value_split, mask), inputs, ["y"], CONSTANTS)
    feeds = _feeds(3, 5, key_layout, value_split, mask, np.random.default_rng(1))
    fused, plain, ops = _both(model, feeds)
    assert ops == (["Reshape", "Reshape"] if key_layout == "split" else []) + ["HeadsAttention"]
    np.testing.assert_allclose(fused["y"], plain["y"], rtol=1e-5, atol=1e-6)
    if mask:
        np.testing.assert_array_equal(fused["y"][0, -1], 0)


def test_attention_whose_probabilities_are_read_elsewhere_is_not_fused():
    model = _model(_attention_nodes("heads", False, False), ["x", "k", "v"], ["y", "p"], CONSTANTS)
    feeds = _feeds(2, 4, "heads", False, False, np.random.default_rng(2))
    fused, plain, ops = _both(model, feeds)
    assert "HeadsAttention" not in ops and "Softmax" in ops
    np.testing.assert_array_equal(fused["y"], plain["y"])


def test_a_query_target_from_an_unrecognised_chain_is_kept_as_an_input():
    nodes = [n if n.output[0] != "q_target" else helper.make_node("Concat", ["q0", "q1", "heads", "minus_one"],
                                                                     ["q_target"], axis=0)
             for n in _attention_nodes("heads", False, False)]
    nodes.append(helper.make_node("Add", ["heads_x", "zero_int"], ["heads"]))  # not a shape dimension
    model = _model(nodes, ["x", "k", "v"], ["y"], {**CONSTANTS, "heads_x": np.array([HEADS]),
                                                   "zero_int": np.array([0])})
    feeds = _feeds(2, 4, "heads", False, False, np.random.default_rng(3))
    fused = runnx.load(model, shape_cache=False, fold_constants=False)
    plain = runnx.load(model, shape_cache=False, fold_constants=False, fuse=False)
    ops = [n.op_type for n in fused.plan()]
    assert "HeadsAttention" in ops and "Concat" in ops  # the query's target still runs, the output's does not
    np.testing.assert_allclose(fused.run(feeds)["y"], plain.run(feeds)["y"], rtol=1e-5, atol=1e-6)


def test_a_first_step_reads_its_keys_from_the_present_output_whose_heads_are_split_once():
    """The decoder's first step splits the projected keys twice, (0, 2, 1, 3) for the present output
    and (0, 2, 3, 1) for the scores: attention reads the present one, split as one contiguous array."""
    nodes = _attention_nodes("split", False, False)
    nodes += [helper.make_node("Reshape", ["v", "kv_target"], ["v4"]),
              helper.make_node("Transpose", ["v4"], ["v_present"], perm=[0, 2, 1, 3]),
              helper.make_node("Transpose", ["k4"], ["k_present"], perm=[0, 2, 1, 3])]
    nodes = [helper.make_node("MatMul", n.input[:1] + ["v_present"], n.output) if n.output[0] == "heads_out" else n
             for n in nodes]
    model = _model(nodes, ["x", "k", "v"], ["y", "k_present", "v_present"], CONSTANTS)
    feeds = _feeds(3, 6, "split", True, False, np.random.default_rng(6))
    fused, plain, ops = _both(model, feeds)
    assert sorted(ops) == ["HeadsAttention", "SplitHeads", "SplitHeads"]
    for name in ("k_present", "v_present"):
        assert fused[name].flags.c_contiguous
        np.testing.assert_array_equal(fused[name], plain[name])
    np.testing.assert_allclose(fused["y"], plain["y"], rtol=1e-5, atol=1e-6)


def _projected_model(source):
    """a -> MatMul(a, wq) = x -> Whisper's cross-attention (no mask) -> y, targets from `source`'s shape."""
    nodes = [helper.make_node("MatMul", ["a", "wq"], ["x"])] + _attention_nodes("heads", False, False, source)
    wq = np.random.default_rng(7).standard_normal((12, HEADS * DEPTH)).astype(np.float32) / 3
    return _model(nodes, ["a", "k", "v"], ["y"], {**CONSTANTS, "wq": wq})


@pytest.mark.parametrize("workers", [0, 1])
def test_a_query_projection_joins_its_attention_and_a_decode_row_is_one_native_call(workers, monkeypatch):
    """Whisper's cross-attention: its query projection and the attention as one node; a decode step's
    row (batch 1, one position) runs the product, the query's bias and scale and the attention as one
    native call (`_decode_blocks.attended_row`), longer queries the MatMul then HeadsAttention."""
    from runnx.ops import _decode_blocks, fused_layer_norm_blocks
    from runnx.runtime import pool as decode_pool

    calls = []
    shared_call = fused_layer_norm_blocks.shared_call
    monkeypatch.setattr(fused_layer_norm_blocks, "shared_call", lambda job, *a: calls.append(job) or shared_call(job, *a))
    model = _projected_model("a")
    rng = np.random.default_rng(8)
    try:
        decode_pool.set_workers(workers)
        for length in (1, 3):
            calls.clear()
            feeds = {"a": rng.standard_normal((1, length, 12)).astype(np.float32),
                     "k": rng.standard_normal((1, HEADS, 1500, DEPTH)).astype(np.float32),
                     "v": rng.standard_normal((1, HEADS, 1500, DEPTH)).astype(np.float32)}
            fused, plain, ops = _both(model, feeds)
            assert ops == ["ProjectedHeadsAttention"]
            assert calls == ([_decode_blocks.attended_row] if length == 1 else [])
            assert fused["y"].shape == (1, length, HEADS * DEPTH)
            np.testing.assert_allclose(fused["y"], plain["y"], rtol=1e-5, atol=1e-6)
    finally:
        decode_pool.set_workers(None)


def test_a_query_projection_whose_shape_sets_the_targets_stays_a_matmul():
    """The targets read from the product's own shape: the product must run before the attention."""
    rng = np.random.default_rng(9)
    feeds = {"a": rng.standard_normal((1, 1, 12)).astype(np.float32),
             "k": rng.standard_normal((1, HEADS, 7, DEPTH)).astype(np.float32),
             "v": rng.standard_normal((1, HEADS, 7, DEPTH)).astype(np.float32)}
    fused, plain, ops = _both(_projected_model("x"), feeds)
    assert ops == ["MatMul", "HeadsAttention"]
    np.testing.assert_allclose(fused["y"], plain["y"], rtol=1e-5, atol=1e-6)


def _appending_model():
    """x -> q, and the k and v projections (v with its bias) split into heads and appended to the
    past caches: a Whisper decoder layer's self-attention projections and KV cache growth."""
    nodes = [helper.make_node("MatMul", ["x", "wq"], ["q"]), helper.make_node("MatMul", ["x", "wk"], ["k"]),
             helper.make_node("MatMul", ["x", "wv"], ["vp"]), helper.make_node("Add", ["vp", "bv"], ["v"])]
    for name in ("k", "v"):
        nodes += [helper.make_node("Reshape", [name, "kv_target"], [f"{name}4"]),
                  helper.make_node("Transpose", [f"{name}4"], [f"{name}t"], perm=[0, 2, 1, 3]),
                  helper.make_node("Concat", [f"past_{name}", f"{name}t"], [f"present_{name}"], axis=2)]
    rng = np.random.default_rng(10)
    constants = {name: rng.standard_normal((HEADS * DEPTH, HEADS * DEPTH)).astype(np.float32)
                 for name in ("wq", "wk", "wv")}
    constants.update(bv=rng.standard_normal(HEADS * DEPTH).astype(np.float32), kv_target=CONSTANTS["kv_target"])
    return _model(nodes, ["x", "past_k", "past_v"], ["q", "present_k", "present_v"], constants)


@pytest.mark.parametrize("workers", [0, 1])
def test_projections_and_kv_appends_become_one_node_writing_a_decode_row_in_place(workers, monkeypatch):
    """ProjectedAppend: with the caches handed over with room, a decode row's three products, the
    value's bias and both appends are one native call writing the new rows into the caches'
    buffers; other rows (and caches not handed over) take SharedInputMatMul and Concat. The same
    values as the unfused nodes either way, and a caller's caches are never written."""
    from runnx.ops import _decode_blocks
    from runnx.runtime import pool as decode_pool

    calls = []
    shared_call = decode_pool.shared_call
    monkeypatch.setattr(decode_pool, "shared_call", lambda job, *a: calls.append(job) or shared_call(job, *a))
    model = _appending_model()
    fused = runnx.load(model, shape_cache=False)
    plain = runnx.load(model, shape_cache=False, fuse=False)
    assert [n.op_type for n in fused.plan()] == ["ProjectedAppend"]
    rng = np.random.default_rng(11)
    try:
        decode_pool.set_workers(workers)
        for rows in (1, 3):
            x = rng.standard_normal((1, rows, HEADS * DEPTH)).astype(np.float32)
            past = {name: rng.standard_normal((1, HEADS, 5, DEPTH)).astype(np.float32) for name in ("past_k", "past_v")}
            kept = {name: cache.copy() for name, cache in past.items()}
            want = plain.run({"x": x, **past})
            owned = {name: runnx.with_capacity(cache, axis=2, capacity=16) for name, cache in past.items()}
            buffers = {name: cache.array.base for name, cache in owned.items()}
            calls.clear()
            got = fused.run({"x": x, **owned})
            assert calls == ([_decode_blocks.appended_products] if rows == 1 else [])
            for name in want:
                np.testing.assert_array_equal(got[name], want[name])
            for name in ("k", "v"):
                assert np.shares_memory(got[f"present_{name}"], buffers[f"past_{name}"])  # appended in place
            calls.clear()
            apart = fused.run({"x": x, **past})
            assert calls == []
            for name in want:
                np.testing.assert_array_equal(apart[name], want[name])
            for name, cache in past.items():
                np.testing.assert_array_equal(cache, kept[name])
    finally:
        decode_pool.set_workers(None)


def _gelu_model(extra_reader=False):
    nodes = [helper.make_node("MatMul", ["x", "w"], ["xw"]),
             helper.make_node("Add", ["b", "xw"], ["h"]),
             helper.make_node("Div", ["h", "sqrt2"], ["scaled"]),
             helper.make_node("Erf", ["scaled"], ["e"]),
             helper.make_node("Add", ["e", "one"], ["e1"]),
             helper.make_node("Mul", ["h", "e1"], ["he"]),
             helper.make_node("Mul", ["he", "half"], ["y"])]
    rng = np.random.default_rng(4)
    return _model(nodes, ["x"], ["y"] + (["h"] if extra_reader else []), {
        "w": rng.standard_normal((8, 16)).astype(np.float32), "b": rng.standard_normal(16).astype(np.float32),
        "sqrt2": np.float32(math.sqrt(2)), "one": np.float32(1), "half": np.float32(0.5)})


@pytest.mark.parametrize("extra_reader", [False, True])
def test_erf_gelu_takes_the_bias_add_unless_it_is_read_elsewhere(extra_reader):
    x = np.random.default_rng(5).standard_normal((2, 3, 8)).astype(np.float32)
    fused, plain, ops = _both(_gelu_model(extra_reader), {"x": x})
    # read elsewhere, the bias add stays the product's (a BiasedMatMul node)
    assert ops == (["BiasedMatMul", "ErfGelu"] if extra_reader else ["MatMul", "ErfGelu"])
    for name in fused:
        np.testing.assert_allclose(fused[name], plain[name], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("stats_read", [False, True])
def test_the_residual_add_joins_the_layer_norm_reading_it_and_stays_an_output(stats_read):
    rng = np.random.default_rng(7)
    norm_outputs = ["y", "mean"] if stats_read else ["y"]
    nodes = [helper.make_node("Add", ["x", "r"], ["s"]),
             helper.make_node("LayerNormalization", ["s", "w", "b"], norm_outputs, axis=-1, epsilon=1e-5),
             helper.make_node("Add", ["s", "y"], ["next"])]
    model = _model(nodes, ["x", "r"], ["next"] + (["mean"] if stats_read else []),
                   {"w": rng.standard_normal(16).astype(np.float32), "b": rng.standard_normal(16).astype(np.float32)})
    feeds = {n: rng.standard_normal((2, 3, 16)).astype(np.float32) for n in "xr"}
    fused, plain, ops = _both(model, feeds)
    assert ops == (["Add", "LayerNormalization", "Add"] if stats_read else ["AddLayerNorm", "Add"])
    for name in plain:
        np.testing.assert_array_equal(fused[name], plain[name])  # the LayerNormalization kernel's own loop


def _gelu_mlp_parts(source="a", depth=256):
    """(nodes, constants) of a Whisper layer from its attention's output `source` (width `depth`):
    output projection with bias, residual add and norm, fc1 with bias, erf GELU, fc2 with bias,
    residual add and the next layer's norm."""
    rng = np.random.default_rng(12)
    nodes = [helper.make_node("MatMul", [source, "wo"], ["o"]), helper.make_node("Add", ["o", "bo"], ["ob"]),
             helper.make_node("Add", ["r", "ob"], ["s1"]),
             helper.make_node("LayerNormalization", ["s1", "g1", "c1"], ["n1"], axis=-1, epsilon=1e-5),
             helper.make_node("MatMul", ["n1", "w1"], ["f"]), helper.make_node("Add", ["b1", "f"], ["h"]),
             helper.make_node("Div", ["h", "sqrt2"], ["scaled"]), helper.make_node("Erf", ["scaled"], ["e"]),
             helper.make_node("Add", ["e", "one"], ["e1"]), helper.make_node("Mul", ["h", "e1"], ["he"]),
             helper.make_node("Mul", ["he", "half"], ["m"]),
             helper.make_node("MatMul", ["m", "w2"], ["d"]), helper.make_node("Add", ["d", "b2"], ["db"]),
             helper.make_node("Add", ["s1", "db"], ["s2"]),
             helper.make_node("LayerNormalization", ["s2", "g2", "c2"], ["n2"], axis=-1, epsilon=1e-5)]
    shapes = {"wo": (depth, 384), "bo": (384,), "g1": (384,), "c1": (384,), "w1": (384, 1536), "b1": (1536,),
              "w2": (1536, 384), "b2": (384,), "g2": (384,), "c2": (384,)}
    constants = {name: (rng.standard_normal(shape) / (np.sqrt(shape[0]) if len(shape) == 2 else 1)).astype(np.float32)
                 for name, shape in shapes.items()}
    constants.update(sqrt2=np.float32(math.sqrt(2)), one=np.float32(1), half=np.float32(0.5))
    return nodes, constants


def _gelu_mlp_model(extra_output=None):
    nodes, constants = _gelu_mlp_parts()
    return _model(nodes, ["a", "r"], ["s2", "n2", *([extra_output] if extra_output else [])], constants)


@pytest.mark.parametrize("workers", [0, 1])
def test_an_output_projection_and_gelu_mlp_up_to_the_next_norm_become_one_node(workers, monkeypatch):
    """Decoding (one float32 row) runs it as one native call posting the decode pool's jobs, its
    GELU ErfGelu's own job: bitwise the four fused nodes it replaces, rows or not, pool or not."""
    from runnx.interp import fusion
    from runnx.interp.fusion import products
    from runnx.runtime import pool as decode_pool

    model = _gelu_mlp_model()
    four_nodes = [p for p in fusion.PATTERNS if p[1] is not products._residual_gelu_mlp]
    rng = np.random.default_rng(13)
    try:
        decode_pool.set_workers(workers)
        for rows in (1, 3):
            feeds = {"a": rng.standard_normal((1, rows, 256)).astype(np.float32),
                     "r": (rng.standard_normal((1, rows, 384)) * 10).astype(np.float32)}
            fused, plain, ops = _both(model, feeds)
            assert ops == ["ResidualGeluMLP"]
            with monkeypatch.context() as patch:
                patch.setattr(fusion, "PATTERNS", four_nodes)
                apart = runnx.load(model, shape_cache=False)
                assert [n.op_type for n in apart.plan()] == ["MatMulAddLayerNorm", "MatMul", "ErfGelu",
                                                             "MatMulAddLayerNorm"]
                apart = apart.run(feeds)
            for name in plain:
                assert fused[name].shape == (1, rows, 384)
                np.testing.assert_array_equal(fused[name], apart[name])
                np.testing.assert_allclose(fused[name], plain[name], rtol=1e-4, atol=1e-4)
    finally:
        decode_pool.set_workers(None)


def _attended_model(block):
    """An attention and the block after it: "norm", the self-attention (over a cache, with a mask)
    then its output projection, residual add and norm; "mlp", the cross-attention with its query
    projection then the rest of the layer (`_gelu_mlp_parts`)."""
    if block == "norm":
        nodes = _attention_nodes("heads", False, True)[:-1] + [
            helper.make_node("Reshape", ["merged", "o_target"], ["a"])] + _gelu_mlp_parts(depth=HEADS * DEPTH)[0][:4]
        inputs, outputs = ["x", "k", "v", "bias", "r"], ["s1", "n1"]
    else:
        nodes = [helper.make_node("MatMul", ["t", "wq"], ["x"])] + _attention_nodes("heads", False, False, "t")[:-1] + [
            helper.make_node("Reshape", ["merged", "o_target"], ["a"])] + _gelu_mlp_parts(depth=HEADS * DEPTH)[0]
        inputs, outputs = ["t", "k", "v", "r"], ["s2", "n2"]
    rng = np.random.default_rng(16)
    constants = {**CONSTANTS, **_gelu_mlp_parts(depth=HEADS * DEPTH)[1],
                 "wq": rng.standard_normal((384, HEADS * DEPTH)).astype(np.float32) / 20}
    return _model(nodes, inputs, outputs, constants)


@pytest.mark.parametrize("block, fused_ops, jobs", [
    ("norm", ["HeadsAttention", "MatMulAddLayerNorm"], ["attended_row", "projected_layer_norm"]),
    ("mlp", ["ProjectedHeadsAttention", "ResidualGeluMLP"], ["attended_row", "gelu_mlp"])])
@pytest.mark.parametrize("workers", [0, 1])
def test_an_attention_and_the_block_after_it_run_a_decode_row_natively(block, fused_ops, jobs, workers, monkeypatch):
    """A decode step's row runs the attention and the block after it as one native call each, the
    same values as the unfused graph; longer queries take the nodes' kernels."""
    from runnx.ops import _decode_blocks, fused_layer_norm_blocks
    from runnx.runtime import pool as decode_pool

    calls = []
    shared_call = decode_pool.shared_call
    record = lambda job, *a: calls.append(job) or shared_call(job, *a)  # noqa: E731
    monkeypatch.setattr(decode_pool, "shared_call", record)
    monkeypatch.setattr(fused_layer_norm_blocks, "shared_call", record)
    model = _attended_model(block)
    rng = np.random.default_rng(17)
    try:
        decode_pool.set_workers(workers)
        for rows in (1, 3):
            feeds = {"k": rng.standard_normal((1, HEADS, 600, DEPTH)).astype(np.float32),
                     "v": rng.standard_normal((1, HEADS, 600, DEPTH)).astype(np.float32),
                     "r": (rng.standard_normal((1, rows, 384)) * 10).astype(np.float32)}
            if block == "norm":
                feeds["x"] = rng.standard_normal((1, rows, HEADS * DEPTH)).astype(np.float32)
                feeds["bias"] = np.where(rng.random((1, 1, rows, 600)) < 0.3, -np.inf, 0).astype(np.float32)
            else:
                feeds["t"] = rng.standard_normal((1, rows, 384)).astype(np.float32)
            calls.clear()
            fused, plain, ops = _both(model, feeds)
            assert ops == fused_ops
            assert calls == ([getattr(_decode_blocks, job) for job in jobs] if rows == 1 else [])
            for name in plain:
                assert fused[name].shape == (1, rows, 384)
                np.testing.assert_allclose(fused[name], plain[name], rtol=1e-4, atol=1e-4)
    finally:
        decode_pool.set_workers(None)


def test_a_gelu_mlp_whose_first_residual_is_read_elsewhere_keeps_its_nodes():
    rng = np.random.default_rng(14)
    feeds = {"a": rng.standard_normal((1, 1, 256)).astype(np.float32),
             "r": rng.standard_normal((1, 1, 384)).astype(np.float32)}
    fused, plain, ops = _both(_gelu_mlp_model(extra_output="s1"), feeds)
    assert ops == ["MatMulAddLayerNorm", "MatMul", "ErfGelu", "MatMulAddLayerNorm"]
    for name in plain:
        np.testing.assert_allclose(fused[name], plain[name], rtol=1e-4, atol=1e-4)


def test_a_gelu_mlp_block_rounds_as_its_nodes_whichever_numba_compiles_first():
    """The block calls ErfGelu's job from native code: in a fresh process that runs the block first,
    the GELU it compiled must still round as the standalone job (as the LayerNorm as its kernel)."""
    code = """
import numpy as np
from runnx.ops import fused_residual_blocks, linalg
from runnx.runtime import pool as decode_pool
from runnx.ops.fused_layer_norm_blocks import AddLayerNorm, ErfGelu
decode_pool.set_workers(0)
rng = np.random.default_rng(15)
f = lambda *shape: rng.standard_normal(shape).astype(np.float32)
differing = 0
for _ in range(40):
    x, w, r, w1, b1, w2 = f(1, 1, 64), f(64, 96), f(1, 1, 96) * 20, f(96, 200) / 4, f(200), f(200, 96) / 8
    g, c, g2, c2 = f(96), f(96), f(96), f(96)
    numbers = {"divisor": np.float32(2 ** 0.5), "one": np.float32(1), "half": np.float32(0.5)}
    block = fused_residual_blocks.ResidualGeluMLP(x, w, None, r, g, c, w1, b1, w2, None, g2, c2, **numbers)
    s, n = AddLayerNorm(r, linalg.MatMul(x, w), g, c)
    s2, n2 = AddLayerNorm(s, linalg.MatMul(ErfGelu(linalg.MatMul(n, w1), b1, **numbers), w2), g2, c2)
    differing += not (np.array_equal(block[0], s2) and np.array_equal(block[1], n2))
print(differing)
"""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0"]


# -- whole models --------------------------------------------------------------------------------
def _features(seed=0):
    return np.random.default_rng(seed).standard_normal((1, 80, 3000)).astype(np.float32)


def _encoders(folder):
    return runnx.load(folder / "encoder_model.onnx"), runnx.load(folder / "encoder_model.onnx", fuse=False)


def test_tiny_whisper_encoder_and_decoder_are_fused(fixtures_dir):
    folder = fixtures_dir / "tiny-whisper"
    fused, plain = _encoders(folder)
    assert fused.fused == {"HeadsAttention": 2, "ErfGelu": 4, "AddLayerNorm": 5, "SharedInputMatMul": 2,
                           "MatMulAddLayerNorm": 4, "ResidualGeluMLP": 2}
    assert not SHAPE_OPS & {n.op_type for n in fused.plan()}
    features = {"input_features": _features()}
    want = plain.run(features)["last_hidden_state"]
    np.testing.assert_allclose(fused.run(features)["last_hidden_state"], want, rtol=1e-4, atol=1e-5)
    decoder = runnx.load(folder / "decoder_model_merged.onnx", check_symbolic_dims=False)
    # both branches: 2 layers x (self + cross) attention and 2 GELUs each; heads split for the
    # self-attention cache (both branches) and the cross-attention keys and values (first step);
    # each layer's q/k/v projections as one node, and the first step's cross-attention keys and
    # values of both layers (they all read the encoder's output) as one more; the out-projections
    # and the second MLP product with their bias adds and the residual add + norm after them (3 a
    # layer, both branches), the last two with the MLP's first product and GELU between them as one
    # node (a layer from its cross-attention's output projection to the next norm); the
    # cross-attention's query projection joins it (2 layers, both branches); with a past, a layer's
    # q/k/v projections and its KV cache appends as one node
    assert decoder.fused == {"HeadsAttention": 8, "SplitHeads": 12, "ErfGelu": 4, "AddLayerNorm": 14,
                             "SharedInputMatMul": 5, "MatMulAddLayerNorm": 12, "ResidualGeluMLP": 4,
                             "ProjectedHeadsAttention": 4, "ProjectedAppend": 2}


def _greedy(folder, fuse, features):
    from runnx.generate.whisper import Whisper
    def load(path):  # the generation API's decoder options (load_decoder), fusing or not
        return runnx.load(path, check_symbolic_dims=False, last_position=("logits",), fuse=fuse)
    model = Whisper(folder, load=load)
    assert bool(model.encoder.fused) == fuse
    return [model.decode(model.encode(window)).tokens for window in features]


def test_tiny_whisper_greedy_tokens_are_identical_fused_and_not(fixtures_dir):
    features = [_features(seed)[None, 0] for seed in range(3)]
    folder = fixtures_dir / "tiny-whisper"
    assert _greedy(folder, True, features) == _greedy(folder, False, features)


def test_whisper_tiny_en_encoder_close_and_tokens_identical_fused_and_not(whisper_dir, audio_dir):
    from runnx.generate.audio import load_audio
    from runnx.generate.mel import window_features
    features = [window_features(load_audio(audio_dir / clip), 80) for clip in ("john.wav", "long.wav")]
    fused, plain = _encoders(whisper_dir)
    assert fused.fused == {"HeadsAttention": 4, "ErfGelu": 6, "AddLayerNorm": 9, "SharedInputMatMul": 4,
                           "MatMulAddLayerNorm": 8, "ResidualGeluMLP": 4}
    want = plain.run({"input_features": features[1]})["last_hidden_state"]
    got = fused.run({"input_features": features[1]})["last_hidden_state"]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-4)
    tokens = _greedy(whisper_dir, True, features)
    assert tokens == _greedy(whisper_dir, False, features) and all(len(t) > 5 for t in tokens)


def test_a_whisper_decode_step_runs_five_native_calls_a_layer(fixtures_dir, monkeypatch):
    """A decode step of the two-layer model runs each layer as five native calls: its projections
    and KV cache appends (ProjectedAppend), its self-attention (HeadsAttention), output projection
    and norm (MatMulAddLayerNorm), its cross-attention with its query projection
    (ProjectedHeadsAttention) and its MLP to the next norm (ResidualGeluMLP), called at once or
    deferred (their `_into` forms, `runtime.defer`); the prefill's rows take the nodes' kernels. The
    tokens are those of the model without fusion."""
    from runnx.generate.whisper import Whisper
    from runnx.ops import _decode_blocks, fused_layer_norm_blocks
    from runnx.runtime import pool as decode_pool

    folder = fixtures_dir / "tiny-whisper"
    calls = []
    shared_call, run_calls = decode_pool.shared_call, decode_pool.run_calls
    into = {_decode_blocks.appended_products_into: _decode_blocks.appended_products,
            _decode_blocks.projected_layer_norm_into: _decode_blocks.projected_layer_norm,
            _decode_blocks.gelu_mlp_into: _decode_blocks.gelu_mlp}
    record = lambda job, *a: calls.append(job) or shared_call(job, *a)  # noqa: E731

    def record_deferred(deferred):
        calls.extend(into.get(function, function) for function, _, _ in deferred)
        return run_calls(deferred)

    monkeypatch.setattr(decode_pool, "shared_call", record)
    monkeypatch.setattr(fused_layer_norm_blocks, "shared_call", record)
    monkeypatch.setattr(decode_pool, "run_calls", record_deferred)
    model = Whisper(folder)
    jobs = {_decode_blocks.appended_products: 1, _decode_blocks.attended_row: 2, _decode_blocks.projected_layer_norm: 1,
            _decode_blocks.gelu_mlp: 1}
    features = [_features(seed)[None, 0] for seed in (5, 6)]
    for window in features:
        calls.clear()
        decoded = model.decode(model.encode(window), max_new_tokens=24)
        steps = len(decoded.tokens) - 1  # after the prefill, which gave the first token
        assert len(decoded.tokens) > 3
        assert {job: calls.count(job) for job in jobs} == {job: 2 * steps * n for job, n in jobs.items()}
    assert _greedy(folder, True, features) == _greedy(folder, False, features)


def test_appends_whose_caches_are_not_granted_run_the_nodes_kernels(fixtures_dir):
    """The decoder run with caches it may not write (plain arrays, not `Owned`): ProjectedAppend
    takes its nodes' kernels, appending by copy, and gives what the model without fusion gives."""
    decoder = fixtures_dir / "tiny-whisper" / "decoder_model_merged.onnx"
    fused = runnx.load(decoder, check_symbolic_dims=False)
    plain = runnx.load(decoder, check_symbolic_dims=False, fuse=False)
    rng = np.random.default_rng(7)
    feeds = {}
    for spec in fused.inputs:
        if spec.name == "input_ids":
            feeds[spec.name] = np.array([[3]], np.int64)
        elif spec.name == "use_cache_branch":
            feeds[spec.name] = np.array([True])
        elif spec.name == "encoder_hidden_states":
            feeds[spec.name] = rng.standard_normal((1, 1500, 64)).astype(np.float32)
        else:
            length = 1500 if ".encoder." in spec.name else 5
            feeds[spec.name] = rng.standard_normal((1, 4, length, 16)).astype(np.float32)
    got, want = fused.run(feeds), plain.run(feeds)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-4)
