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
from runnx.ops import contrib_quantized

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
    assert contrib_quantized._remembered_tiles.known_result(((), id(b), id(scales), id(zeros))) is not None
    np.testing.assert_array_equal(contrib_quantized.MatMulNBits(a, b, scales, zeros, **attributes), first)
    np.testing.assert_array_equal(contrib_quantized.MatMulNBits(a, b, scales, zeros, None, bias, **attributes),
                                  first + bias)
    wide = np.zeros((2, 200), np.float32)
    wide[:, ::2] = a
    np.testing.assert_array_equal(contrib_quantized.MatMulNBits(wide[:, ::2], b, scales, zeros, **attributes), first)
    with pytest.raises(RunnxError, match="A's last dimension must be K=100"):
        contrib_quantized.MatMulNBits(a[:, :99], b, scales, zeros, **attributes)
