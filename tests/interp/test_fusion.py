"""Load-time fusion: each pattern, as Optimum exports it, becomes one fused node whose outputs are
those of the unfused graph; a pattern whose intermediate values are read elsewhere is left alone."""
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import runnx

F, I64 = TensorProto.FLOAT, TensorProto.INT64


def _model(nodes, inputs, outputs, constants):
    """inputs: (name, type) or (name, type, declared shape)."""
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(n, t, shape[0] if shape else None) for n, t, *shape in inputs],
        [helper.make_tensor_value_info(n, t, None) for n, t in outputs],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in constants.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def _both(model, feeds):
    """(fused outputs, unfused outputs, fused plan's op types)."""
    fused = runnx.load(model, shape_cache=False)
    plain = runnx.load(model, shape_cache=False, fuse=False)
    return fused.run(feeds), plain.run(feeds), [n.op_type for n in fused.plan()]


def _rms_norm_model(extra_reader=False):
    nodes = [helper.make_node("Pow", ["x", "two"], ["sq"]),
             helper.make_node("ReduceMean", ["sq", "axes"], ["mean"], keepdims=1),
             helper.make_node("Add", ["mean", "eps"], ["var"]),
             helper.make_node("Sqrt", ["var"], ["std"]),
             helper.make_node("Div", ["one", "std"], ["inv"]),
             helper.make_node("Mul", ["x", "inv"], ["normed"]),
             helper.make_node("Cast", ["normed"], ["cast"], to=F),
             helper.make_node("Mul", ["w", "cast"], ["y"])]
    outputs = [("y", F)] + ([("inv", F)] if extra_reader else [])
    return _model(nodes, [("x", F)], outputs, {
        "two": np.float32(2), "axes": np.array([-1]), "eps": np.float32(1e-5), "one": np.float32(1),
        "w": np.random.default_rng(0).standard_normal(16).astype(np.float32)})


def test_rms_norm_is_fused_and_bitwise_equal():
    x = np.random.default_rng(1).standard_normal((2, 3, 16)).astype(np.float32)
    fused, plain, ops = _both(_rms_norm_model(), {"x": x})
    assert ops == ["RMSNorm"]
    np.testing.assert_array_equal(fused["y"], plain["y"])


def test_a_float16_rms_norm_fuses_with_its_rounding_before_the_weight():
    """Converted to float16, the norm computes in float32 (interp/float16.py) and its Cast rounds to
    float16, widened again for the weight Mul: the fused norm's Cast to float16, bitwise."""
    from onnxruntime.transformers.float16 import convert_float_to_float16
    model = convert_float_to_float16(_rms_norm_model(), keep_io_types=False)
    x = (np.random.default_rng(1).standard_normal((2, 3, 16)) * 300).astype(np.float16)
    fused = runnx.load(model, shape_cache=False)
    plain = runnx.load(model, optimization_level="disabled")
    assert "RMSNorm" in [n.op_type for n in fused.plan()] and "Pow" not in [n.op_type for n in fused.plan()]
    got = fused.run({"x": x})["y"]
    assert got.dtype == np.float16 and np.isfinite(got).all()
    np.testing.assert_array_equal(got, plain.run({"x": x})["y"])


def test_a_pattern_whose_intermediate_is_read_elsewhere_is_not_fused():
    x = np.random.default_rng(1).standard_normal((2, 16)).astype(np.float32)
    fused, plain, ops = _both(_rms_norm_model(extra_reader=True), {"x": x})
    assert "RMSNorm" not in ops
    np.testing.assert_array_equal(fused["y"], plain["y"])


def test_the_residual_add_feeding_an_rms_norm_joins_it_and_stays_an_output():
    """h = Cast(a + b) is normed and read again by the next residual add, as in every Llama layer."""
    norm = _rms_norm_model().graph
    rename = {"x": "h", "y": "normed_h"}
    nodes = [helper.make_node("Add", ["a", "b"], ["sum"]), helper.make_node("Cast", ["sum"], ["h"], to=F)]
    for node in norm.node:
        nodes.append(helper.make_node(node.op_type, [rename.get(i, i) for i in node.input],
                                      [rename.get(o, o) for o in node.output], **{
                                          a.name: helper.get_attribute_value(a) for a in node.attribute}))
    nodes.append(helper.make_node("Add", ["h", "normed_h"], ["next"]))
    constants = {t.name: numpy_helper.to_array(t) for t in norm.initializer}
    model = _model(nodes, [("a", F), ("b", F)], [("next", F)], constants)
    rng = np.random.default_rng(5)
    feeds = {"a": rng.standard_normal((1, 2, 16)).astype(np.float32),
             "b": rng.standard_normal((1, 2, 16)).astype(np.float32)}
    fused, plain, ops = _both(model, feeds)
    assert sorted(ops) == ["Add", "AddRMSNorm"]
    np.testing.assert_array_equal(fused["next"], plain["next"])


def test_silu_gate_is_fused_and_bitwise_equal():
    nodes = [helper.make_node("Sigmoid", ["g"], ["s"]), helper.make_node("Mul", ["g", "s"], ["silu"]),
             helper.make_node("Mul", ["silu", "up"], ["y"])]
    model = _model(nodes, [("g", F), ("up", F)], [("y", F)], {})
    rng = np.random.default_rng(2)
    feeds = {"g": rng.standard_normal((1, 4, 32)).astype(np.float32) * 8,
             "up": rng.standard_normal((1, 4, 32)).astype(np.float32)}
    fused, plain, ops = _both(model, feeds)
    assert ops == ["SiluMul"]
    np.testing.assert_array_equal(fused["y"], plain["y"])


def _rotary_model():
    nodes = [helper.make_node("Slice", ["x", "zero", "half", "last"], ["x1"]),
             helper.make_node("Slice", ["x", "half", "end", "last"], ["x2"]),
             helper.make_node("Neg", ["x2"], ["neg"]),
             helper.make_node("Concat", ["neg", "x1"], ["rot"], axis=-1),
             helper.make_node("Mul", ["x", "cos"], ["a"]),
             helper.make_node("Mul", ["rot", "sin"], ["b"]),
             helper.make_node("Add", ["a", "b"], ["y"])]
    return _model(nodes, [("x", F), ("cos", F), ("sin", F)], [("y", F)], {
        "zero": np.array([0]), "half": np.array([4]), "end": np.array([2**62]), "last": np.array([-1])})


def test_rotary_embedding_is_fused_and_bitwise_equal():
    rng = np.random.default_rng(3)
    feeds = {"x": rng.standard_normal((1, 3, 5, 8)).astype(np.float32),
             "cos": rng.standard_normal((1, 1, 5, 8)).astype(np.float32),
             "sin": rng.standard_normal((1, 1, 5, 8)).astype(np.float32)}
    fused, plain, ops = _both(_rotary_model(), feeds)
    assert ops == ["RotateHalf"]
    assert len(runnx.load(_rotary_model()).plan()[0].inputs) == 5  # x, cos, sin and the halves' two bounds
    np.testing.assert_array_equal(fused["y"], plain["y"])


@pytest.mark.parametrize("change, fused_when", [
    ({"end": np.array([8])}, False),  # the first half's end not past any axis: not known to reach the end
    ({"zero": np.array([1])}, False),  # the second half not from 0
    ({"last": np.array([3])}, True),  # the slices' axis 3, the Concat's -1: the same of x's stated rank 4
])
def test_rotary_embedding_fuses_only_slices_that_cut_one_axis_into_halves(change, fused_when):
    model = _rotary_model()
    for tensor in model.graph.initializer:
        if tensor.name in change:
            tensor.CopyFrom(numpy_helper.from_array(change[tensor.name], tensor.name))
    model.graph.input[0].CopyFrom(helper.make_tensor_value_info("x", F, [1, 3, 5, 8]))
    rng = np.random.default_rng(4)
    feeds = {"x": rng.standard_normal((1, 3, 5, 8)).astype(np.float32),
             "cos": rng.standard_normal((1, 1, 5, 8)).astype(np.float32),
             "sin": rng.standard_normal((1, 1, 5, 8)).astype(np.float32)}
    assert ("RotateHalf" in [n.op_type for n in runnx.load(model).plan()]) == fused_when
    if "zero" not in change:  # (x[1:4] and x[4:] make 7 columns: x * cos has 8)
        fused, plain, _ = _both(model, feeds)
        np.testing.assert_array_equal(fused["y"], plain["y"])


def _attention_model(groups, repeat, length, with_shape_reader=False, merge_heads=False, declared=True):
    """Attention over k, v (1, groups, length, 8) repeated to groups * repeat heads by constant
    targets; declared: k's and v's shapes declared (what proves the repeat)."""
    def repeated(name):
        return [helper.make_node("Unsqueeze", [name, "axis2"], [f"{name}5"]),
                helper.make_node("Expand", [f"{name}5", f"{name}_expand"], [f"{name}x"]),
                helper.make_node("Reshape", [f"{name}x", f"{name}_target"], [f"{name}r"])]
    nodes = repeated("k") + repeated("v") + [
        helper.make_node("Transpose", ["kr"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("Mul", ["kt", "scale"], ["ks"]),
        helper.make_node("Mul", ["q", "scale"], ["qs"]),
        helper.make_node("MatMul", ["qs", "ks"], ["scores"]),
        helper.make_node("Add", ["scores", "bias"], ["biased"]),
        helper.make_node("Softmax", ["biased"], ["p"], axis=-1),
        helper.make_node("IsNaN", ["p"], ["nan"]),
        helper.make_node("Where", ["nan", "zero", "p"], ["pz"]),
        helper.make_node("MatMul", ["pz", "vr"], ["heads" if merge_heads else "y"])]
    if merge_heads:
        nodes += [helper.make_node("Transpose", ["heads"], ["th"], perm=[0, 2, 1, 3]),
                  helper.make_node("Reshape", ["th", "merged"], ["y"])]
    outputs = [("y", F)]
    if with_shape_reader:
        nodes.append(helper.make_node("Shape", ["kr"], ["kshape"]))
        outputs.append(("kshape", I64))
    heads = groups * repeat
    constants = {"axis2": np.array([2]), "scale": np.float32(0.5), "zero": np.float32(0), "merged": np.array([0, 0, -1])}
    for name in "kv":
        constants[f"{name}_expand"] = np.array([1, groups, repeat, length, 8])
        constants[f"{name}_target"] = np.array([1, heads, length, 8])
    cache = [(1, groups, length, 8)] if declared else []
    return _model(nodes, [("q", F), ("k", F, *cache), ("v", F, *cache), ("bias", F)], outputs, constants)


@pytest.mark.parametrize("groups, repeat", [(2, 3), (3, 1), (1, 4)])
def test_grouped_query_attention_reads_the_cache_in_place(groups, repeat):
    length, rng = 7, np.random.default_rng(4)
    buffer = rng.standard_normal((2, 1, groups, 16, 8)).astype(np.float32)
    key, value = buffer[0][:, :, :length], buffer[1][:, :, :length]  # prefix views of a capacity buffer
    bias = np.where(rng.random((1, 1, 2, length)) < 0.3, -np.inf, 0).astype(np.float32)
    bias[..., 0] = 0
    feeds = {"q": rng.standard_normal((1, groups * repeat, 2, 8)).astype(np.float32), "k": key, "v": value,
             "bias": bias}
    fused, plain, ops = _both(_attention_model(groups, repeat, length, with_shape_reader=True), feeds)
    assert ops.count("RepeatedKVAttention") == 1 and "Expand" not in ops and "Softmax" not in ops
    np.testing.assert_allclose(fused["y"], plain["y"], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(fused["kshape"], [1, groups * repeat, length, 8])
    plan = runnx.load(_attention_model(groups, repeat, length, with_shape_reader=True), shape_cache=False).plan()
    assert [n.attrs["repeat"] for n in plan if n.op_type == "RepeatedKVAttention"] == [repeat]
    assert [n.attrs["repeat"] for n in plan if n.op_type == "RepeatedKVShape"] == [repeat]


def test_a_head_repeat_the_graph_does_not_prove_stays_and_the_attention_reads_it():
    """Constant Expand/Reshape targets over a cache of undeclared shape: at run time the same
    nodes could broadcast a cache of one head, so the repeat is not the attention's; it still
    fuses, over the repeated cache, and computes the same."""
    length, rng = 5, np.random.default_rng(7)
    feeds = {"q": rng.standard_normal((1, 4, 2, 8)).astype(np.float32),
             "k": rng.standard_normal((1, 2, length, 8)).astype(np.float32),
             "v": rng.standard_normal((1, 2, length, 8)).astype(np.float32),
             "bias": np.zeros((1, 1, 2, length), np.float32)}
    fused, plain, ops = _both(_attention_model(2, 2, length, declared=False), feeds)
    assert ops.count("RepeatedKVAttention") == 1 and ops.count("Expand") == 2 and "Softmax" not in ops
    plan = runnx.load(_attention_model(2, 2, length, declared=False), shape_cache=False).plan()
    assert [n.attrs["repeat"] for n in plan if n.op_type == "RepeatedKVAttention"] == [1]
    np.testing.assert_allclose(fused["y"], plain["y"], rtol=1e-5, atol=1e-6)


def test_the_heads_merged_after_attention_join_the_attention_node():
    rng = np.random.default_rng(6)
    feeds = {"q": rng.standard_normal((1, 4, 3, 8)).astype(np.float32),
             "k": rng.standard_normal((1, 2, 5, 8)).astype(np.float32),
             "v": rng.standard_normal((1, 2, 5, 8)).astype(np.float32), "bias": np.zeros((1, 1, 3, 5), np.float32)}
    fused, plain, ops = _both(_attention_model(2, 2, 5, merge_heads=True), feeds)
    assert ops == ["RepeatedKVAttention"]
    assert fused["y"].shape == plain["y"].shape == (1, 3, 32)
    np.testing.assert_allclose(fused["y"], plain["y"], rtol=1e-5, atol=1e-6)


def test_fully_masked_attention_rows_give_the_fill_value():
    feeds = {"q": np.ones((1, 2, 1, 8), np.float32), "k": np.ones((1, 1, 3, 8), np.float32),
             "v": np.ones((1, 1, 3, 8), np.float32), "bias": np.full((1, 1, 1, 3), -np.inf, np.float32)}
    fused, plain, _ = _both(_attention_model(1, 2, 3), feeds)
    np.testing.assert_array_equal(fused["y"], plain["y"])
    np.testing.assert_array_equal(fused["y"], np.zeros((1, 2, 1, 8), np.float32))


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("workers", [0, 1])
def test_products_of_one_input_become_one_node(rows, workers):
    from runnx.runtime import pool as decode_pool

    rng = np.random.default_rng(0)
    weights = {name: rng.standard_normal((256, width)).astype(np.float32)
               for name, width in (("wq", 256), ("wk", 64), ("wv", 300), ("wo", 256))}
    nodes = [helper.make_node("MatMul", ["x", w], [w.replace("w", "y")]) for w in ("wq", "wk", "wv")]
    nodes += [helper.make_node("MatMul", ["x", "m"], ["ym"]),  # not a constant matrix: stays alone
              helper.make_node("MatMul", ["yq", "wo"], ["yo"])]  # another input: stays alone
    model = _model(nodes, [("x", F), ("m", F)], [(n, F) for n in ("yq", "yk", "yv", "ym", "yo")], weights)
    feeds = {"x": rng.standard_normal((1, rows, 256)).astype(np.float32),
             "m": rng.standard_normal((256, 8)).astype(np.float32)}
    try:
        decode_pool.set_workers(workers)
        fused, plain, ops = _both(model, feeds)
    finally:
        decode_pool.set_workers(None)
    assert sorted(ops) == ["MatMul", "MatMul", "SharedInputMatMul"]
    for name in plain:  # the same products, the pool's included (one job for the three)
        np.testing.assert_array_equal(fused[name], plain[name])


@pytest.mark.parametrize("folder", ["tiny-llama", "tiny-gpt2"])
def test_greedy_tokens_are_identical_with_each_optimisation_on_and_off(fixtures_dir, folder):
    import tokenizers
    from runnx.generate.generator import Generator
    tokenizer = tokenizers.Tokenizer.from_file(str(fixtures_dir / folder / "tokenizer.json"))
    produced = {}
    for shape_cache, fuse in [(False, False), (True, False), (False, True), (True, True)]:
        model = runnx.load(fixtures_dir / folder / "model.onnx", fuse=fuse, shape_cache=shape_cache,
                           check_symbolic_dims=False)
        assert bool(model.memoized) == shape_cache and bool(model.fused) == fuse  # gpt2: split heads
        generator = Generator.from_model(model, tokenizer, generation_config={"eos_token_id": -1})
        generator.generate("Once upon a time", max_new_tokens=16, stop_token_ids=())
        produced[shape_cache, fuse] = generator.generated[0]
    assert len(set(map(tuple, produced.values()))) == 1 and len(produced[True, True]) == 16


def test_a_key_rotated_by_another_table_keeps_the_layers_products_and_rope_apart(fixtures_dir):
    """ProjectedRopeAppend takes one cos/sin pair: where layer 0's key reads a cos table of its own
    (an Unsqueeze of its own, equal in value), that layer keeps SharedInputMatMul and RopeAppend, the
    other layer fuses, and the logits and caches are the unfused graph's."""
    model = onnx.load(fixtures_dir / "tiny-llama" / "model.onnx")
    unsqueeze = next(n for n in model.graph.node if n.name == "/model/layers.0/self_attn/Unsqueeze_6")
    key_cos = next(n for n in model.graph.node if n.name == "/model/layers.0/self_attn/Mul_2")
    assert key_cos.input[1] == unsqueeze.output[0]
    model.graph.node.append(helper.make_node("Unsqueeze", list(unsqueeze.input), ["key_cos"], name="key_cos"))
    key_cos.input[1] = "key_cos"
    fused, plain = runnx.load(model), runnx.load(model, fuse=False)
    ops = [n.op_type for n in fused.plan()]
    assert ops.count("ProjectedRopeAppend") == 1 and ops.count("RopeAppend") == 1 and "SharedInputMatMul" in ops
    rng = np.random.default_rng(8)
    past = {n: rng.standard_normal((1, 2, 6, 16)).astype(np.float32) for n in fused.input_names if "past" in n}
    feeds = {"input_ids": np.array([[7, 9]]), "attention_mask": np.ones((1, 8), np.int64),
             "position_ids": np.array([[6, 7]]), **past}
    got, want = fused.run(feeds), plain.run(feeds)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_a_layers_rotary_embedding_and_cache_growth_become_one_node_appending_in_place(fixtures_dir):
    path = fixtures_dir / "tiny-llama" / "model.onnx"
    fused, plain = runnx.load(path), runnx.load(path, fuse=False)
    assert fused.fused["RopeAppend"] == 2  # one per layer, in the layer's ProjectedRopeAppend
    ops = [n.op_type for n in fused.plan()]
    assert ops.count("ProjectedRopeAppend") == 2 and "RotateHalf" not in ops
    # the head repeat proven from the cache's dims (an attribute), heads merged and the mask,
    # Where(Slice(mask, 0, end), 0, -inf), made by the node itself, its end proven the keys' count:
    # query, key, value, (no bias), merged target and mask; the output projection, the MLP and the
    # next norm one ResidualGatedMLP after it
    attentions = [n for n in fused.plan() if n.op_type == "RepeatedKVAttention"]
    assert [len(n.inputs) for n in attentions] == [6, 6] and [n.attrs["repeat"] for n in attentions] == [2, 2]
    assert ops.count("ResidualGatedMLP") == 2
    blocks = [n for n in fused.plan() if n.op_type == "ResidualGatedMLP"]  # the norms' numbers are attributes
    assert [len(n.inputs) for n in blocks] == [10, 10] and all(n.attrs["epsilon"].dtype == np.float32 for n in blocks)
    assert "Where" not in ops and "Slice" not in ops and "Where" in [n.op_type for n in plain.plan()]
    rng = np.random.default_rng(5)
    past = {n: rng.standard_normal((1, 2, 6, 16)).astype(np.float32) for n in fused.input_names if "past" in n}
    feeds = {"input_ids": np.array([[7]]), "attention_mask": np.ones((1, 7), np.int64), "position_ids": np.array([[6]])}
    owned = {n: runnx.with_capacity(v, 2, 16) for n, v in past.items()}
    buffers = {n: o.array.base for n, o in owned.items()}
    got = fused.run({**feeds, **owned})
    want = plain.run({**feeds, **past})
    np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-5, atol=1e-6)  # fused attention: rounding
    for name, value in want.items():
        if name.startswith("present."):
            np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6)
            np.testing.assert_array_equal(got[name][:, :, :6], past[name.replace("present.", "past_key_values.")])
            if name.startswith("present.0."):  # the first layer's rotated key and value: bitwise
                np.testing.assert_array_equal(got[name], value)
    for name, buffer in buffers.items():  # each present is the caller's buffer, one row longer
        present = got[name.replace("past_key_values.", "present.")]
        assert present.shape[2] == 7 and np.shares_memory(present, buffer)


def _spied_jobs(monkeypatch) -> list:
    """The native jobs `decode_pool.shared_call` runs from now on, in order."""
    from runnx.runtime import pool as decode_pool
    calls = []
    shared_call = decode_pool.shared_call
    monkeypatch.setattr(decode_pool, "shared_call", lambda job, *a: calls.append(job) or shared_call(job, *a))
    return calls


def _tiny_llama_with_and_without(fixtures_dir, pattern, monkeypatch, biased: bool = False):
    """tiny-llama loaded with every fusion pattern, and without `pattern`; biased: with random
    biases added to its query, key and value projections, as Optimum exports Qwen2
    (Add(bias, MatMul(x, w)))."""
    from runnx.interp import fusion
    path = fixtures_dir / "tiny-llama" / "model.onnx"
    model = _with_projection_biases(onnx.load(path)) if biased else path
    with monkeypatch.context() as patch:
        patch.setattr(fusion, "PATTERNS", [p for p in fusion.PATTERNS if p[1] is not pattern])
        apart = runnx.load(model)
    return runnx.load(model), apart


def _with_projection_biases(model):
    """`model` with Add(bias, product) after every q_proj, k_proj and v_proj MatMul (random biases)."""
    rng = np.random.default_rng(11)
    widths = {i.name: i.dims[1] for i in model.graph.initializer if len(i.dims) == 2}
    nodes = []
    for node in model.graph.node:
        nodes.append(node)
        if node.op_type == "MatMul" and any(f"/{p}_proj/" in node.name for p in "qkv"):
            bias, product = node.name + "_bias", node.output[0]
            model.graph.initializer.append(numpy_helper.from_array(
                rng.standard_normal(widths[node.input[1]]).astype(np.float32), bias))
            node.output[0] = product + "_unbiased"
            nodes.append(helper.make_node("Add", [bias, node.output[0]], [product], name=node.name + "_add"))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model


def _assert_equal_and_grown_in_place(got: dict, want: dict, buffers: dict) -> None:
    """got's outputs bitwise want's, and each present in the buffer its past was handed over in."""
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])
    for name, buffer in buffers.items():
        assert np.shares_memory(got[name.replace("past_key_values.", "present.")], buffer)


def _tiny_llama_step(model, rng, new: int) -> tuple[dict, dict]:
    """(past caches of 6 positions, the other feeds of a step of `new` tokens after them)."""
    past = {n: rng.standard_normal((1, 2, 6, 16)).astype(np.float32) for n in model.input_names if "past" in n}
    feeds = {"input_ids": rng.integers(0, 100, (1, new)), "attention_mask": np.ones((1, 6 + new), np.int64),
             "position_ids": np.arange(6, 6 + new)[None]}
    return past, feeds


@pytest.mark.parametrize("biased", [False, True])
@pytest.mark.parametrize("workers", [0, 1])
def test_a_layers_projections_join_its_rotary_embedding_and_cache_growth(fixtures_dir, workers, biased,
                                                                         monkeypatch):
    """ProjectedRopeAppend (tiny-llama: one per layer): with the caches handed over with room, a
    decode row's three products, rotary embedding and appends are one native call writing the new
    rows into the caches' buffers (the query and key heads' shapes, read by shape memos, come from
    SplitHeadsShape stand-ins), the projections' biases (Qwen2's) added in it; a prefill takes the
    nodes' kernels. Bitwise the two nodes apart."""
    from runnx.interp.fusion import products
    from runnx.ops import _decode_blocks
    from runnx.runtime import pool as decode_pool

    calls = _spied_jobs(monkeypatch)
    fused, apart = _tiny_llama_with_and_without(fixtures_dir, products._rope_projected, monkeypatch, biased)
    assert fused.fused["ProjectedRopeAppend"] == 2 and "ProjectedRopeAppend" not in apart.fused
    memoized = [m.op_type for n in fused.graph.nodes if n.op_type == "ShapeMemo" for m in n.kernel.fn.members]
    assert memoized.count("SplitHeadsShape") == 4  # the query's and the key's in each layer, joined to memos
    rng = np.random.default_rng(7)
    try:
        decode_pool.set_workers(workers)
        for new in (1, 3):
            past, feeds = _tiny_llama_step(fused, rng, new)
            owned = {n: runnx.with_capacity(v, 2, 16) for n, v in past.items()}
            buffers = {n: o.array.base for n, o in owned.items()}
            calls.clear()
            got = fused.run({**feeds, **owned})
            assert calls.count(_decode_blocks.projected_rope_append) == (2 if new == 1 else 0)
            want = apart.run({**feeds, **{n: runnx.with_capacity(v, 2, 16) for n, v in past.items()}})
            _assert_equal_and_grown_in_place(got, want, buffers)
    finally:
        decode_pool.set_workers(None)


@pytest.mark.parametrize("workers", [0, 1])
def test_a_llama_decode_step_runs_four_native_calls_a_layer(fixtures_dir, workers, monkeypatch):
    """A decode step of tiny-llama (two layers, caches handed over) runs each layer as four native
    calls: its projections, rotary embedding and cache growth (ProjectedRopeAppend), its attention
    (RepeatedKVAttention), its output projection and gated MLP's gate (ResidualGatedMLP's first
    call) and the down product to the next norm (its second); a prompt's rows take the nodes'
    kernels. The logits are those of the model without fusion, within the attention's rounding."""
    from runnx.ops import _decode_blocks
    from runnx.runtime import pool as decode_pool

    calls = _spied_jobs(monkeypatch)
    attention_job, attention = decode_pool.attention_job, decode_pool.DecodePool.attention
    monkeypatch.setattr(decode_pool, "attention_job", lambda *a: calls.append("attention") or attention_job(*a))
    monkeypatch.setattr(decode_pool.DecodePool, "attention",
                        lambda self, *a: calls.append("attention") or attention(self, *a))
    path = fixtures_dir / "tiny-llama" / "model.onnx"
    fused, plain = runnx.load(path), runnx.load(path, fuse=False)
    jobs = {_decode_blocks.projected_rope_append: 1, "attention": 1, _decode_blocks.projected_gate: 1,
            _decode_blocks.gated_down: 1}
    rng = np.random.default_rng(6)
    try:
        decode_pool.set_workers(workers)
        for new in (1, 3):
            past, feeds = _tiny_llama_step(fused, rng, new)
            calls.clear()
            got = fused.run({**feeds, **{n: runnx.with_capacity(v, 2, 16) for n, v in past.items()}})
            if new == 1:
                assert {job: calls.count(job) for job in jobs} == {job: 2 * n for job, n in jobs.items()}
                assert len(calls) == 8
            else:
                assert not set(calls) & {_decode_blocks.projected_rope_append, _decode_blocks.projected_gate}
            want = plain.run({**feeds, **past})
            np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-5, atol=1e-6)
    finally:
        decode_pool.set_workers(None)


@pytest.mark.parametrize("biased", [False, True])
@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize("room", [True, False])
def test_a_short_prompts_layer_blocks_are_native_calls_with_the_nodes_bits(fixtures_dir, workers, room, biased,
                                                                             monkeypatch):
    """A short prompt's rows (more than a products loop takes, fewer than the own kernels' short
    prompts) through a layer: its gated MLP is two native calls posting the products as pool jobs
    (`projected_gate_rows`, numpy's exp, `gated_down_rows`), its projections, split heads, rotary
    embedding and cache growth one (`projected_rope_append_rows`), the new rows written into the
    caches' buffers when they have room (else RopeAppend's kernel on the heads it made). Bitwise the
    blocks' nodes apart (the patterns removed), with and without the pool's workers, biased or not."""
    from runnx.interp.fusion import products
    from runnx.ops import _decode_blocks, _matmul
    from runnx.runtime import pool as decode_pool

    monkeypatch.setattr(_matmul, "_POOL_FROM", 0)  # tiny-llama's products are far smaller than a model's
    calls = _spied_jobs(monkeypatch)
    for pattern, ops in ((products._rope_projected, "ProjectedRopeAppend"),
                         (products._residual_gated_mlp, "ResidualGatedMLP")):
        fused, apart = _tiny_llama_with_and_without(fixtures_dir, pattern, monkeypatch, biased)
        assert ops not in apart.fused
        rng = np.random.default_rng(12)
        try:
            decode_pool.set_workers(workers)
            past, feeds = _tiny_llama_step(fused, rng, 20)
            capacity = 32 if room else 16
            owned = {n: runnx.with_capacity(v, 2, capacity) for n, v in past.items()}
            buffers = {n: o.array.base for n, o in owned.items()} if room else {}
            calls.clear()
            got = fused.run({**feeds, **owned})
            blocks = 2 if _matmul.own_product(20, True) else 0  # each layer's (own kernels: AVX-512 or AVX2)
            assert calls.count(_decode_blocks.projected_rope_append_rows) == blocks
            assert calls.count(_decode_blocks.projected_gate_rows) == calls.count(_decode_blocks.gated_down_rows) == blocks
            want = apart.run({**feeds, **{n: runnx.with_capacity(v, 2, capacity) for n, v in past.items()}})
            _assert_equal_and_grown_in_place(got, want, buffers)
        finally:
            decode_pool.set_workers(None)


def test_a_decoder_keeps_no_cache_alive_after_a_reset(fixtures_dir):
    """Nothing a decode step's fused nodes made holds the caches: once a generation lets them go (a
    reset), the next prefill takes their buffers again (it takes none that anything else holds:
    `SpareBuffers`), and without a next prefill they are freed."""
    import gc
    import weakref

    from runnx.generate.decoder import DecoderStep

    decoder = DecoderStep.from_folder(fixtures_dir / "tiny-llama", capacity=32)
    decoder.step(np.array([[3, 5, 7]]))
    for token in (11, 2, 9):
        decoder.step(np.array([[token]]))
    buffers = [weakref.ref(array.base) for array in decoder.cache.arrays.values()]
    assert buffers and all(buffer() is not None for buffer in buffers)
    decoder.reset()
    gc.collect()
    decoder.step(np.array([[3, 5, 7]]))
    assert [buffer() for buffer in buffers] == [array.base for array in decoder.cache.arrays.values()]
    decoder.reset()
    decoder._take_spare()  # (what the next prefill would take)
    gc.collect()
    assert all(buffer() is None for buffer in buffers)

@pytest.mark.parametrize("workers", [0, 1])
def test_products_whose_heads_are_split_give_the_split_heads_themselves(workers):
    """q, k and v of one input, each reshaped to heads and transposed (SplitHeads): one node gives
    the split heads; a product read elsewhere too keeps its own output."""
    from runnx.runtime import pool as decode_pool

    rng = np.random.default_rng(1)
    weights = {w: rng.standard_normal((256, 256)).astype(np.float32) for w in ("wq", "wk", "wv")}
    nodes = []
    for name in ("q", "k", "v"):
        nodes += [helper.make_node("MatMul", ["x", f"w{name}"], [f"y{name}"]),
                  helper.make_node("Reshape", [f"y{name}", "heads"], [f"r{name}"]),
                  helper.make_node("Transpose", [f"r{name}"], [f"t{name}"], perm=(0, 2, 1, 3))]
    outputs = [("tq", F), ("tk", F), ("tv", F), ("yv", F)]  # yv is also an output: v keeps its product
    model = _model(nodes, [("x", F)], outputs, {**weights, "heads": np.array([1, -1, 4, 64])})
    feeds = {"x": rng.standard_normal((1, 1, 256)).astype(np.float32)}
    try:
        decode_pool.set_workers(workers)
        fused, plain, ops = _both(model, feeds)
    finally:
        decode_pool.set_workers(None)
    assert sorted(ops) == ["SharedInputMatMul", "SplitHeads"]  # q and k split inside, v by its own node
    for name in plain:
        np.testing.assert_array_equal(fused[name], plain[name])
    assert fused["tq"].shape == (1, 4, 1, 64)


@pytest.mark.parametrize("bias_first", [False, True])
def test_a_product_and_its_bias_add_become_one_node(bias_first):
    rng = np.random.default_rng(2)
    constants = {"w": rng.standard_normal((256, 384)).astype(np.float32),
                 "b": rng.standard_normal(384).astype(np.float32),
                 "wide": rng.standard_normal((1, 384)).astype(np.float32)}  # not a 1-D bias: stays an Add
    nodes = [helper.make_node("MatMul", ["x", "w"], ["xw"]),
             helper.make_node("Add", ["b", "xw"] if bias_first else ["xw", "b"], ["y"]),
             helper.make_node("MatMul", ["x2", "w"], ["xw2"]),
             helper.make_node("Add", ["xw2", "wide"], ["z"])]
    model = _model(nodes, [("x", F), ("x2", F)], [("y", F), ("z", F)], constants)
    for rows in (1, 3):  # a decode step's one row (the decode pool's product), and a few
        feeds = {"x": rng.standard_normal((1, rows, 256)).astype(np.float32),
                 "x2": rng.standard_normal((1, rows, 256)).astype(np.float32)}
        fused, plain, ops = _both(model, feeds)
        assert sorted(ops) == ["Add", "BiasedMatMul", "MatMul"]
        for name in plain:
            np.testing.assert_array_equal(fused[name], plain[name])


def test_a_product_read_only_by_a_residual_add_and_rms_norm_joins_them():
    rng = np.random.default_rng(6)
    nodes = [helper.make_node("MatMul", ["h", "w"], ["p"]),
             helper.make_node("Add", ["r", "p"], ["s"]),
             helper.make_node("Pow", ["s", "two"], ["sq"]),
             helper.make_node("ReduceMean", ["sq", "axes"], ["mean"], keepdims=1),
             helper.make_node("Add", ["mean", "eps"], ["var"]),
             helper.make_node("Sqrt", ["var"], ["std"]),
             helper.make_node("Div", ["one", "std"], ["inv"]),
             helper.make_node("Mul", ["s", "inv"], ["normed"]),
             helper.make_node("Mul", ["g", "normed"], ["y"])]
    model = _model(nodes, [("h", F), ("r", F)], [("s", F), ("y", F)], {
        "w": rng.standard_normal((256, 384)).astype(np.float32), "two": np.float32(2), "axes": np.array([-1]),
        "eps": np.float32(1e-5), "one": np.float32(1), "g": rng.standard_normal(384).astype(np.float32)})
    for rows in (1, 4):
        feeds = {"h": rng.standard_normal((1, rows, 256)).astype(np.float32),
                 "r": rng.standard_normal((1, rows, 384)).astype(np.float32)}
        fused, plain, ops = _both(model, feeds)
        assert ops == ["MatMulAddRMSNorm"]
        for name in plain:  # the residual sum and the norm, bitwise
            np.testing.assert_array_equal(fused[name], plain[name])


@pytest.mark.parametrize("workers", [0, 1])
def test_gate_and_up_products_give_their_silu_gate_as_one_node(workers):
    from runnx.runtime import pool as decode_pool

    rng = np.random.default_rng(7)
    nodes = [helper.make_node("MatMul", ["x", "wg"], ["g"]),
             helper.make_node("MatMul", ["x", "wu"], ["u"]),
             helper.make_node("Sigmoid", ["g"], ["s"]),
             helper.make_node("Mul", ["g", "s"], ["silu"]),
             helper.make_node("Mul", ["silu", "u"], ["y"])]
    model = _model(nodes, [("x", F)], [("y", F)], {w: rng.standard_normal((256, 512)).astype(np.float32)
                                                   for w in ("wg", "wu")})
    try:
        decode_pool.set_workers(workers)
        for rows in (1, 3):
            fused, plain, ops = _both(model, {"x": rng.standard_normal((1, rows, 256)).astype(np.float32)})
            assert ops == ["SharedInputMatMul"]
            np.testing.assert_array_equal(fused["y"], plain["y"])
    finally:
        decode_pool.set_workers(None)


@pytest.mark.parametrize("workers", [0, 1])
def test_a_biased_product_read_only_by_a_residual_add_and_layer_norm_joins_them(workers):
    """A decoding row runs as one native call posting the product to the decode pool (or alone):
    bitwise the unfused nodes, as other rows are."""
    from runnx.runtime import pool as decode_pool

    rng = np.random.default_rng(8)
    nodes = [helper.make_node("MatMul", ["h", "w"], ["p"]),
             helper.make_node("Add", ["p", "b"], ["pb"]),
             helper.make_node("Add", ["r", "pb"], ["s"]),
             helper.make_node("LayerNormalization", ["s", "scale", "shift"], ["y"], axis=-1, epsilon=1e-5)]
    model = _model(nodes, [("h", F), ("r", F)], [("s", F), ("y", F)], {
        "w": rng.standard_normal((256, 384)).astype(np.float32), "b": rng.standard_normal(384).astype(np.float32),
        "scale": rng.standard_normal(384).astype(np.float32), "shift": rng.standard_normal(384).astype(np.float32)})
    try:
        decode_pool.set_workers(workers)
        for rows in (1, 4):
            feeds = {"h": rng.standard_normal((1, rows, 256)).astype(np.float32),
                     "r": rng.standard_normal((1, rows, 384)).astype(np.float32)}
            fused, plain, ops = _both(model, feeds)
            assert ops == ["MatMulAddLayerNorm"]
            for name in plain:
                np.testing.assert_array_equal(fused[name], plain[name])
    finally:
        decode_pool.set_workers(None)


def _norm_nodes(x: str, y: str, tag: str) -> list:
    """RMSNorm of x into y, as Optimum exports it (names suffixed by tag)."""
    return [helper.make_node("Pow", [x, "two"], [f"sq{tag}"]),
            helper.make_node("ReduceMean", [f"sq{tag}", "axes"], [f"mean{tag}"], keepdims=1),
            helper.make_node("Add", [f"mean{tag}", "eps"], [f"var{tag}"]),
            helper.make_node("Sqrt", [f"var{tag}"], [f"std{tag}"]),
            helper.make_node("Div", ["one", f"std{tag}"], [f"inv{tag}"]),
            helper.make_node("Mul", [x, f"inv{tag}"], [f"normed{tag}"]),
            helper.make_node("Mul", [f"g{tag}", f"normed{tag}"], [y])]


def _residual_gated_mlp_model(dtype=np.float32, extra_output=None):
    """A Llama layer from its attention's output a: o projection, residual add and norm, SiLU-gated
    MLP, down projection, residual add and the next layer's norm."""
    rng = np.random.default_rng(9)
    nodes = [helper.make_node("MatMul", ["a", "wo"], ["o"]), helper.make_node("Add", ["r", "o"], ["s1"]),
             *_norm_nodes("s1", "n1", "1"),
             helper.make_node("MatMul", ["n1", "wg"], ["gate"]), helper.make_node("MatMul", ["n1", "wu"], ["up"]),
             helper.make_node("Sigmoid", ["gate"], ["sig"]), helper.make_node("Mul", ["gate", "sig"], ["silu"]),
             helper.make_node("Mul", ["silu", "up"], ["m"]),
             helper.make_node("MatMul", ["m", "wd"], ["d"]), helper.make_node("Add", ["s1", "d"], ["s2"]),
             *_norm_nodes("s2", "n2", "2")]
    weights = {"wo": (256, 384), "wg": (384, 512), "wu": (384, 512), "wd": (512, 384), "g1": (384,), "g2": (384,)}
    constants = {name: rng.standard_normal(shape).astype(dtype) for name, shape in weights.items()}
    constants["wg"] *= 4  # gates far below -88: exp(-gate) overflows to inf, the SiLU is 0
    constants.update(two=dtype(2), axes=np.array([-1]), eps=dtype(1e-5), one=dtype(1))
    t = F if dtype == np.float32 else TensorProto.DOUBLE
    outputs = [(name, t) for name in ("s2", "n2", *([extra_output] if extra_output else []))]
    return _model(nodes, [("a", t), ("r", t)], outputs, constants)


@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_an_output_projection_and_gated_mlp_up_to_the_next_norm_become_one_node(workers, dtype, monkeypatch):
    """Decoding (one row, float32) runs it as native calls posting the decode pool's jobs, and so
    does a short prompt's float32 rows (products jobs of its columns); a few rows (the products
    loop's) and other dtypes run the nodes' kernels in turn: bitwise the unfused graph either way."""
    from runnx.ops import _decode_blocks, _matmul
    from runnx.runtime import pool as decode_pool

    calls = _spied_jobs(monkeypatch)

    rng = np.random.default_rng(10)
    try:
        decode_pool.set_workers(workers)
        for rows in (1, 3, 24, 100):
            feeds = {"a": rng.standard_normal((1, rows, 256)).astype(dtype),
                     "r": rng.standard_normal((1, rows, 384)).astype(dtype)}
            calls.clear()
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # exp(-gate) overflowing to inf is expected, not warned about
                fused, plain, ops = _both(_residual_gated_mlp_model(dtype), feeds)
            assert ops == ["ResidualGatedMLP"]
            native = ((_decode_blocks.projected_gate, _decode_blocks.gated_down) if rows == 1
                      else (_decode_blocks.projected_gate_rows, _decode_blocks.gated_down_rows)
                      if rows > 3 and _matmul.own_product(rows, True) else ())  # (own kernels: AVX-512 or AVX2)
            assert calls == (list(native) if dtype == np.float32 else [])
            for name in plain:
                assert fused[name].shape == plain[name].shape == (1, rows, 384)
                np.testing.assert_array_equal(fused[name], plain[name])
            gates = runnx.load(_residual_gated_mlp_model(dtype, extra_output="gate"), fuse=False).run(feeds)["gate"]
            assert (gates < -89).any() and (gates > 0).any()  # exp(-gate) overflows for some, not all
    finally:
        decode_pool.set_workers(None)


def test_a_gated_mlp_whose_first_residual_is_read_elsewhere_keeps_its_nodes():
    rng = np.random.default_rng(11)
    feeds = {"a": rng.standard_normal((1, 1, 256)).astype(np.float32),
             "r": rng.standard_normal((1, 1, 384)).astype(np.float32)}
    fused, plain, ops = _both(_residual_gated_mlp_model(extra_output="s1"), feeds)
    assert sorted(ops) == ["MatMulAddRMSNorm", "MatMulAddRMSNorm", "SharedInputMatMul"]
    for name in plain:
        np.testing.assert_array_equal(fused[name], plain[name])


def _skip_norm_mlp_model(extra_output=None, product_first=False, epsilon=1e-5):
    """The same block as onnxruntime-genai's model builder writes it: the residual adds and norms are
    SkipSimplifiedLayerNormalization nodes (their mean and inverse deviation outputs unused), the
    gate and up products separate MatMuls."""
    rng = np.random.default_rng(12)

    def skip_norm(residual, product, gamma, normed, summed):
        inputs = [product, residual] if product_first else [residual, product]
        return helper.make_node("SkipSimplifiedLayerNormalization", [*inputs, gamma], [normed, "", "", summed],
                                domain="com.microsoft", epsilon=epsilon)

    nodes = [helper.make_node("MatMul", ["a", "wo"], ["o"]), skip_norm("r", "o", "g1", "n1", "s1"),
             helper.make_node("MatMul", ["n1", "wg"], ["gate"]), helper.make_node("MatMul", ["n1", "wu"], ["up"]),
             helper.make_node("Sigmoid", ["gate"], ["sig"]), helper.make_node("Mul", ["gate", "sig"], ["silu"]),
             helper.make_node("Mul", ["silu", "up"], ["m"]),
             helper.make_node("MatMul", ["m", "wd"], ["d"]), skip_norm("s1", "d", "g2", "n2", "s2")]
    weights = {"wo": (256, 384), "wg": (384, 512), "wu": (384, 512), "wd": (512, 384), "g1": (384,), "g2": (384,)}
    constants = {name: (rng.standard_normal(shape) / np.sqrt(shape[0] if len(shape) > 1 else 1)).astype(np.float32)
                 for name, shape in weights.items()}  # products of the inputs' size
    outputs = [(name, F) for name in ("s2", "n2", *([extra_output] if extra_output else []))]
    model = _model(nodes, [("a", F), ("r", F)], outputs, constants)
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model


@pytest.mark.parametrize("workers", [0, 1])
def test_onnxruntime_skip_norms_around_a_gated_mlp_become_one_node_with_their_bits(workers, monkeypatch):
    """onnxruntime-genai's layer (SkipSimplifiedLayerNormalization for each residual add and norm)
    takes the same pattern as an Optimum export's: one ResidualGatedMLP whose norms keep the contrib
    op's own arithmetic (float64 statistics), so a decode row's and a short prompt's native calls and
    every other row's nodes give the unfused graph's bits; onnxruntime's (its own products) close."""
    import onnxruntime as ort

    from runnx.ops import _decode_blocks, _matmul
    from runnx.runtime import pool as decode_pool

    calls = _spied_jobs(monkeypatch)
    rng = np.random.default_rng(13)
    model = _skip_norm_mlp_model()
    reference = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    try:
        decode_pool.set_workers(workers)
        for rows in (1, 3, 24, 100, 300):
            feeds = {"a": rng.standard_normal((1, rows, 256)).astype(np.float32),
                     "r": rng.standard_normal((1, rows, 384)).astype(np.float32)}
            calls.clear()
            fused, plain, ops = _both(model, feeds)
            assert ops == ["ResidualGatedMLP"]
            native = ((_decode_blocks.projected_gate, _decode_blocks.gated_down) if rows == 1
                      else (_decode_blocks.projected_gate_rows, _decode_blocks.gated_down_rows)
                      if 3 < rows < 240 and _matmul.own_product(rows, True) else ())  # (own kernels: AVX-512 or AVX2)
            assert calls == list(native)
            for name, expected in zip(("s2", "n2"), reference.run(["s2", "n2"], feeds)):
                assert fused[name].shape == plain[name].shape == (1, rows, 384)
                np.testing.assert_array_equal(fused[name], plain[name])
                np.testing.assert_allclose(fused[name], expected, rtol=1e-4, atol=1e-4)
    finally:
        decode_pool.set_workers(None)


def test_skip_norms_whose_statistics_are_read_or_whose_product_is_not_the_skip_keep_their_nodes():
    """The fused norm gives its sum and normed output only; a product given as the norm's input
    (not its skip, which onnxruntime lets broadcast) stays apart too."""
    rng = np.random.default_rng(14)
    feeds = {"a": rng.standard_normal((1, 1, 256)).astype(np.float32),
             "r": rng.standard_normal((1, 1, 384)).astype(np.float32)}
    read = _skip_norm_mlp_model()
    read.graph.node[1].output[1] = "mean1"  # the first norm's mean, read as an output
    read.graph.output.append(helper.make_tensor_value_info("mean1", F, None))
    for model in (read, _skip_norm_mlp_model(product_first=True)):
        fused, plain, ops = _both(model, feeds)
        assert "ResidualGatedMLP" not in ops and "SkipSimplifiedLayerNormalization" in ops
        for name in plain:
            np.testing.assert_array_equal(fused[name], plain[name])
