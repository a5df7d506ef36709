"""4-bit products of one input (interp/fusion/nbits_products.py): MatMulNBits nodes reading one
value become one SharedInputMatMulNBits node, a SiLU gate of two of them joins it, and the outputs
are bitwise the unfused graph's (and near onnxruntime's) for decode rows, a few rows and a prompt,
with the decode pool's workers or without; products that differ are left apart."""
import numpy as np
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

import runnx
from runnx.errors import RunnxError
from runnx.ops import contrib_quantized, nibble_tiles

F = TensorProto.FLOAT
MS = "com.microsoft"
RNG = np.random.default_rng(11)


def _weights(N, K, block_size, zero_points):
    blocks = (K + block_size - 1) // block_size
    b = RNG.integers(0, 256, (N, blocks, block_size // 2), dtype=np.uint8)
    scales = (RNG.random((N, blocks)) * 0.1 + 0.01).astype(np.float32)
    if zero_points == "packed":
        zeros = RNG.integers(0, 256, (N, (blocks + 1) // 2), dtype=np.uint8)
    elif zero_points == "typed":
        zeros = RNG.uniform(0, 15, (N, blocks)).astype(np.float32)
    else:
        zeros = None
    return b, scales, zeros


def _products_model(columns, K, block_size, zero_points, gated=False, block_sizes=None):
    """x -> MatMulNBits by each weight of `columns` (N each); gated: the first two also as
    Sigmoid/Mul/Mul (a SiLU gate), its output instead of theirs."""
    nodes, constants, outputs = [], {}, []
    for i, N in enumerate(columns):
        size = block_sizes[i] if block_sizes else block_size
        b, scales, zeros = _weights(N, K, size, zero_points)
        constants.update({f"b{i}": b, f"s{i}": scales})
        inputs = ["x", f"b{i}", f"s{i}"]
        if zeros is not None:
            constants[f"z{i}"] = zeros
            inputs.append(f"z{i}")
        nodes.append(helper.make_node("MatMulNBits", inputs, [f"y{i}"], domain=MS, K=K, N=N, bits=4,
                                      block_size=size))
        outputs.append(f"y{i}")
    if gated:
        nodes += [helper.make_node("Sigmoid", ["y0"], ["s"]), helper.make_node("Mul", ["y0", "s"], ["silu"]),
                  helper.make_node("Mul", ["silu", "y1"], ["gated"])]
        outputs = ["gated"] + outputs[2:]
    graph = helper.make_graph(nodes, "products", [helper.make_tensor_value_info("x", F, None)],
                              [helper.make_tensor_value_info(n, F, None) for n in outputs],
                              [numpy_helper.from_array(v, k) for k, v in constants.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)],
                             ir_version=10)


@pytest.fixture(params=[0, 1], ids=["alone", "workers"])
def workers(request):
    from runnx.runtime import pool as decode_pool

    decode_pool.set_workers(request.param)
    yield request.param
    decode_pool.set_workers(None)


@pytest.mark.parametrize("zero_points", [None, "packed", "typed"])
@pytest.mark.parametrize("columns,K,block_size,gated", [((40, 24, 24), 100, 32, False), ((64, 64), 576, 32, True),
                                                        ((33, 70, 16), 128, 64, False)])
def test_products_of_one_input_are_one_node_with_the_same_bits(workers, zero_points, columns, K, block_size, gated):
    model = _products_model(columns, K, block_size, zero_points, gated)
    fused = runnx.load(model, shape_cache=False)
    plain = runnx.load(model, shape_cache=False, fuse=False)
    assert [n.op_type for n in fused.plan()] == ["SharedInputMatMulNBits"]
    session = onnxruntime.InferenceSession(model.SerializeToString())
    for rows in (1, 3, 8, 20):  # decode, a few rows (views of one product), a prompt (product by product)
        feeds = {"x": RNG.standard_normal((1, rows, K)).astype(np.float32)}
        got, want = fused.run(feeds), plain.run(feeds)
        for name, value in want.items():
            np.testing.assert_array_equal(got[name], value)
        for name, value in zip([o.name for o in session.get_outputs()], session.run(None, feeds)):
            np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-4)


def test_products_that_differ_are_left_apart():
    """Another block size; a fourth product (at most three a node)."""
    model = _products_model((32, 32), 128, 32, "packed", block_sizes=(32, 64))
    assert [n.op_type for n in runnx.load(model).plan()] == ["MatMulNBits", "MatMulNBits"]
    model = _products_model((32, 32, 32, 32), 128, 32, None)
    assert sorted(n.op_type for n in runnx.load(model).plan()) == ["MatMulNBits", "SharedInputMatMulNBits"]


def test_the_joined_weights_are_checked_as_matmul_nbits_checks_them():
    b, scales, zeros = _weights(32, 64, 32, "packed")
    x = RNG.standard_normal((1, 64)).astype(np.float32)
    with pytest.raises(RunnxError, match="scales have 63 values, expected 64"):
        contrib_quantized.SharedInputMatMulNBits(x, b, scales, zeros, b, scales.reshape(-1)[:63], zeros, K=64,
                                                 columns=(32, 32), block_size=32)
    with pytest.raises(RunnxError, match="zero points of one type"):
        contrib_quantized.SharedInputMatMulNBits(x, b, scales, zeros, b, scales, None, K=64, columns=(32, 32),
                                                 block_size=32)


def test_matmul_nbits_second_call_takes_its_remembered_tiles_with_the_same_bits():
    """A 4-bit product's later calls find its tiles by its weights and skip the checks they passed
    (and a bias, a non-contiguous A and float64 A still come out as the first call's path makes them)."""
    b, scales, zeros = _weights(40, 100, 32, "packed")
    for array in (b, scales, zeros):
        array.flags.writeable = False
    attributes = dict(K=100, N=40, bits=4, block_size=32)
    a = RNG.standard_normal((2, 100)).astype(np.float32)
    bias = RNG.standard_normal(40).astype(np.float32)
    first = contrib_quantized.MatMulNBits(a, b, scales, zeros, **attributes)
    assert nibble_tiles.remembered_tiles.known_result(((), id(b), id(scales), id(zeros))) is not None
    np.testing.assert_array_equal(contrib_quantized.MatMulNBits(a, b, scales, zeros, **attributes), first)
    np.testing.assert_array_equal(contrib_quantized.MatMulNBits(a, b, scales, zeros, None, bias, **attributes),
                                  first + bias)
    wide = np.zeros((2, 200), np.float32)
    wide[:, ::2] = a
    np.testing.assert_array_equal(contrib_quantized.MatMulNBits(wide[:, ::2], b, scales, zeros, **attributes), first)
    with pytest.raises(RunnxError, match="A's last dimension must be K=100"):
        contrib_quantized.MatMulNBits(a[:, :99], b, scales, zeros, **attributes)


def _gated_mlp_model(form, zero_points, K=64, inner=96, block_size=32, read_inside=None, projected=0):
    """A decoder layer's MLP between two residual norms: (s, n) = the norm of a + b; gate and up
    4-bit products of n, their SiLU gate, its 4-bit down product d; (s', n') = the norm of s + d,
    both outputs. form "skip": onnxruntime's SkipSimplifiedLayerNormalization; "decomposed": Add
    and RMSNorm's nodes (a fused AddRMSNorm), "decomposed-casts" with Casts to float32 of the sum
    and the norm. read_inside: a value between them also an output. projected: b is the 4-bit
    product of an input x this wide (an attention's output projection)."""
    constants, nodes = {}, []
    shapes = (("gate", (inner, K)), ("up", (inner, K)), ("down", (K, inner)))
    for name, (N, depth) in shapes + ((("projection", (K, projected)),) if projected else ()):
        b, scales, zeros = _weights(N, depth, block_size, zero_points)
        constants.update({f"{name}_b": b, f"{name}_s": scales, **({f"{name}_z": zeros} if zeros is not None else {})})
    for name in ("g1", "g2"):
        constants[name] = (1 + 0.1 * RNG.standard_normal(K)).astype(np.float32)

    def norm(a, b, gamma, summed, normed):
        if form == "skip":
            return [helper.make_node("SkipSimplifiedLayerNormalization", [a, b, gamma], [normed, "", "", summed],
                                     domain=MS, epsilon=1e-5)]
        constants.update({"two": np.float32(2), "axes": np.array([-1]), "eps": np.float32(1e-5),
                          "one": np.float32(1)})
        casts = form == "decomposed-casts"  # (an Optimum export's Casts to float32 of the sum and the norm)
        added = [helper.make_node("Add", [a, b], [f"{summed}/add" if casts else summed])]
        if casts:
            added.append(helper.make_node("Cast", [f"{summed}/add"], [summed], to=F))
        scaled = f"{normed}/x"
        return added + [helper.make_node("Pow", [summed, "two"], [f"{normed}/sq"]),
                helper.make_node("ReduceMean", [f"{normed}/sq", "axes"], [f"{normed}/mean"], keepdims=1),
                helper.make_node("Add", [f"{normed}/mean", "eps"], [f"{normed}/var"]),
                helper.make_node("Sqrt", [f"{normed}/var"], [f"{normed}/std"]),
                helper.make_node("Div", ["one", f"{normed}/std"], [f"{normed}/inv"]),
                helper.make_node("Mul", [summed, f"{normed}/inv"], [scaled])] + (
                    [helper.make_node("Cast", [scaled], [f"{scaled}/cast"], to=F)] if casts else []) + [
                helper.make_node("Mul", [gamma, f"{scaled}/cast" if casts else scaled], [normed])]

    def product(name, x, N, depth):
        inputs = [x, f"{name}_b", f"{name}_s"] + ([f"{name}_z"] if f"{name}_z" in constants else [])
        return helper.make_node("MatMulNBits", inputs, [name], domain=MS, K=depth, N=N, bits=4, block_size=block_size)

    if projected:
        nodes.append(product("projection", "x", K, projected))
    nodes += norm("a", "projection" if projected else "b", "g1", "s", "n")
    nodes += [product("gate", "n", inner, K), product("up", "n", inner, K), helper.make_node("Sigmoid", ["gate"], ["sg"]),
              helper.make_node("Mul", ["gate", "sg"], ["silu"]), helper.make_node("Mul", ["silu", "up"], ["gated"]),
              product("down", "gated", K, inner)]
    nodes += norm("s", "down", "g2", "s2", "n2")
    outputs = ["n2", "s2"] + ([read_inside] if read_inside else [])
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info(n, F, None)
                                             for n in ("a", "x" if projected else "b")],
                              [helper.make_tensor_value_info(n, F, None) for n in outputs],
                              [numpy_helper.from_array(v, k) for k, v in constants.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)],
                             ir_version=10)


@pytest.mark.parametrize("form", ["skip", "decomposed", "decomposed-casts"])
@pytest.mark.parametrize("zero_points", [None, "packed", "typed"])
@pytest.mark.parametrize("projected", [0, 96])
def test_a_4bit_gated_mlp_between_residual_norms_is_one_node_with_the_same_bits(workers, form, zero_points, projected):
    """Decode rows and a short prompt take the two native calls, a long prompt the nodes' kernels:
    bitwise the unfused graph's every time (and near onnxruntime's), with an output projection
    before it (its own node) or without; thirteen inputs."""
    model = _gated_mlp_model(form, zero_points, projected=projected)
    fused = runnx.load(model, shape_cache=False)
    plain = runnx.load(model, shape_cache=False, fuse=False)
    assert [n.op_type for n in fused.plan()] == ["MatMulNBits"] * bool(projected) + ["GatedMLPNBits"]
    assert len(fused.plan()[-1].inputs) == 13
    session = onnxruntime.InferenceSession(model.SerializeToString()) if form == "skip" else None
    for rows in (1, 3, 32, 80):
        feeds = {name: RNG.standard_normal((1, rows, projected if name == "x" else 64)).astype(np.float32)
                 for name in ("a", "x" if projected else "b")}
        kept = {name: value.copy() for name, value in feeds.items()}
        got, want = fused.run(feeds), plain.run(feeds)
        for name, value in want.items():
            np.testing.assert_array_equal(got[name], value)
        for name, value in kept.items():
            np.testing.assert_array_equal(feeds[name], value)  # (the inputs are not written)
        if session is not None:
            for name, value in zip(["n2", "s2"], session.run(["n2", "s2"], feeds)):
                np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("read_inside", ["s", "n", "gated", "down", "projection"])
def test_a_gated_mlp_whose_inner_value_is_read_outside_stays_apart(read_inside):
    """... and the projection alone stays apart when its output is read outside."""
    model = _gated_mlp_model("skip", "packed", read_inside=read_inside, projected=96)
    fused = runnx.load(model, shape_cache=False)
    ops = sorted(n.op_type for n in fused.plan())
    assert ops == (["GatedMLPNBits", "MatMulNBits"] if read_inside == "projection" else
                   ["MatMulNBits", "MatMulNBits", "SharedInputMatMulNBits", "SkipSimplifiedLayerNormalization",
                    "SkipSimplifiedLayerNormalization"])
    feeds = {"a": RNG.standard_normal((1, 1, 64)).astype(np.float32),
             "x": RNG.standard_normal((1, 1, 96)).astype(np.float32)}
    want = runnx.load(model, shape_cache=False, fuse=False).run(feeds)
    for name, value in fused.run(feeds).items():
        np.testing.assert_array_equal(value, want[name])


def test_the_gated_mlp_checks_its_down_weight_as_matmul_nbits_does():
    from runnx.ops.fused_nbits_blocks import GatedMLPNBits

    gate, up = _weights(96, 64, 32, None), _weights(96, 64, 32, None)
    down_b, down_scales, _ = _weights(64, 96, 32, None)
    a = RNG.standard_normal((1, 64)).astype(np.float32)
    gamma = np.ones(64, np.float32)
    attributes = dict(K=64, block_size=32, columns=(96, 96), gated=(0, 1), epsilon=1e-5, down_epsilon=1e-5, skip=1)
    with pytest.raises(RunnxError, match="scales have 191 values, expected 192"):
        GatedMLPNBits(a, a, gamma, *gate, *up, down_b, down_scales.reshape(-1)[:191], None, gamma, **attributes)
    with pytest.raises(RunnxError, match=r"B must be uint8 of shape \[64, 3, 16\]"):
        GatedMLPNBits(a, a, gamma, *gate, *up, down_b[:, :2], down_scales, None, gamma, **attributes)


@pytest.mark.parametrize("rows", [1, 3, 80])
def test_4bit_products_whose_heads_are_split_give_the_split_heads_themselves(workers, rows):
    """q, k and v in 4 bits, each reshaped to heads and transposed (SplitHeads): one node gives the
    split heads, bitwise the unfused graph's; a product read elsewhere too keeps its own output."""
    constants, nodes = {}, []
    for name in ("q", "k", "v"):
        b, scales, zeros = _weights(128, 128, 32, "packed")
        constants.update({f"b{name}": b, f"s{name}": scales, f"z{name}": zeros})
        nodes += [helper.make_node("MatMulNBits", ["x", f"b{name}", f"s{name}", f"z{name}"], [f"y{name}"], domain=MS,
                                   K=128, N=128, bits=4, block_size=32),
                  helper.make_node("Reshape", [f"y{name}", "heads"], [f"r{name}"]),
                  helper.make_node("Transpose", [f"r{name}"], [f"t{name}"], perm=(0, 2, 1, 3))]
    constants["heads"] = np.array([1, -1, 4, 32])
    outputs = ["tq", "tk", "tv", "yv"]  # yv is also an output: v keeps its product
    graph = helper.make_graph(nodes, "split", [helper.make_tensor_value_info("x", F, None)],
                              [helper.make_tensor_value_info(n, F, None) for n in outputs],
                              [numpy_helper.from_array(v, k) for k, v in constants.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)],
                              ir_version=10)
    fused = runnx.load(model, shape_cache=False)
    assert sorted(n.op_type for n in fused.plan()) == ["SharedInputMatMulNBits", "SplitHeads"]
    feeds = {"x": RNG.standard_normal((1, rows, 128)).astype(np.float32)}
    got, want = fused.run(feeds), runnx.load(model, shape_cache=False, fuse=False).run(feeds)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value)
    assert got["tq"].shape == (1, 4, rows, 32)
