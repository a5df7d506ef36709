"""Products by an 8-bit weight kept in its bytes (interp/fusion/dequantized_products.py): a
per-tensor DequantizeLinear of a constant matrix read only by a MatMul is left unfolded and both
become one DequantizedMatMul, bitwise the product with the folded float matrix (fuse=False) for
decode rows, a few rows and a prompt, with the decode pool's workers or without; the float matrix
is never made for few rows, an LM head still reads the last position only, and a weight read
elsewhere too is folded as before."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import runnx
from runnx.ops import linalg_integer as linalg
from runnx.ops._kernels_linalg import rows_times_bytes, rows_times_matrix
from runnx.ops.quantization import dequantize

F = TensorProto.FLOAT
RNG = np.random.default_rng(5)


def _head_model(dtype, zero_point: bool, transposed: bool, K=64, N=300, extra_reader=False):
    """logits = x @ DequantizeLinear(B) (B the Transpose of a table when `transposed`, as a tied LM
    head); extra_reader: the dequantized matrix read by a second MatMul too."""
    info = np.iinfo(dtype)
    table = RNG.integers(info.min, info.max + 1, (N, K) if transposed else (K, N)).astype(dtype)
    constants = {"table": table, "scale": np.float32(0.0173)}
    nodes = [helper.make_node("Transpose", ["table"], ["b"])] if transposed else []
    inputs = ["b" if transposed else "table", "scale"]
    if zero_point:
        constants["zero"] = np.array(7, dtype)
        inputs.append("zero")
    nodes += [helper.make_node("DequantizeLinear", inputs, ["w"]), helper.make_node("MatMul", ["x", "w"], ["logits"])]
    outputs = ["logits"]
    if extra_reader:
        nodes.append(helper.make_node("MatMul", ["x", "w"], ["again"]))
        outputs.append("again")
    graph = helper.make_graph(nodes, "head", [helper.make_tensor_value_info("x", F, [1, None, K])],
                              [helper.make_tensor_value_info("logits", F, [1, None, N])]
                              + [helper.make_tensor_value_info(n, F, None) for n in outputs[1:]],
                              [numpy_helper.from_array(np.asarray(v), k) for k, v in constants.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


@pytest.fixture(params=[0, 1], ids=["alone", "workers"])
def workers(request):
    from runnx.runtime import pool as decode_pool

    decode_pool.set_workers(request.param)
    yield request.param
    decode_pool.set_workers(None)


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("zero_point", [True, False])
@pytest.mark.parametrize("transposed", [True, False])
def test_a_dequantized_weight_is_read_in_its_bytes_with_the_same_bits(workers, dtype, zero_point, transposed):
    model = _head_model(dtype, zero_point, transposed, K=576, N=300)  # a pooled product: 172,800 entries
    fused = runnx.load(model, shape_cache=False)
    plain = runnx.load(model, shape_cache=False, fuse=False)
    assert [n.op_type for n in fused.plan()] == ["DequantizedMatMul"]
    assert not any(v.dtype == np.float32 and v.size == 576 * 300 for v in fused.graph.constants.values())
    for rows in (1, 3, 16, 40):  # decoding, few rows, the most the rows loop takes, a prompt (floats)
        x = RNG.standard_normal((1, rows, 576)).astype(np.float32)
        np.testing.assert_array_equal(fused.run({"x": x})["logits"], plain.run({"x": x})["logits"])


def test_an_lm_head_in_bytes_still_reads_the_last_position_only():
    model = _head_model(np.uint8, True, True)
    head = runnx.load(model, last_position=("logits",))
    assert sorted(n.op_type for n in head.plan()) == ["DequantizedMatMul", "LastPosition"]
    x = RNG.standard_normal((1, 9, 64)).astype(np.float32)
    whole = runnx.load(model, fuse=False).run({"x": x})["logits"]
    np.testing.assert_array_equal(head.run({"x": x})["logits"], whole[:, -1:])


def test_a_dequantized_weight_read_elsewhere_too_is_folded():
    model = _head_model(np.uint8, True, True, extra_reader=True)
    model = runnx.load(model)
    assert "DequantizedMatMul" not in [n.op_type for n in model.plan()]
    assert any(v.dtype == np.float32 and v.size == 64 * 300 for v in model.graph.constants.values())


def test_the_bytes_loop_is_bitwise_the_float_loop_over_the_dequantized_matrix():
    for dtype in (np.uint8, np.int8):
        for depth, width, rows in ((13, 7, 2), (576, 1536, 1), (1537, 96, 16)):
            b = RNG.integers(np.iinfo(dtype).min, np.iinfo(dtype).max + 1, (depth, width)).astype(dtype)
            zero, scale = np.array(-3 if dtype == np.int8 else 130, dtype), np.array(0.0123, np.float32)
            x = RNG.standard_normal((rows, depth)).astype(np.float32)
            floats = rows_times_matrix(x, dequantize(b, scale, zero))
            np.testing.assert_array_equal(rows_times_bytes(x, b, np.float32(zero), np.float32(scale)), floats)
            np.testing.assert_array_equal(linalg.DequantizedMatMul(x, b, scale, zero), floats)


def test_a_products_job_refuses_a_matrix_of_another_integer_type():
    from runnx.runtime import jobs, mailbox, slots

    board, box = mailbox.make_board()
    with pytest.raises(ValueError, match="8-bit"):
        jobs.post_products(board, 0, np.ones(8, np.float32), (np.ones((8, 6), np.int16),), (np.empty(6, np.float32),),
                           np.empty(48, np.float32), 0.0, 1.0)
    assert box[slots.POSTED] == 0
