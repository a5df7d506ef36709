"""Small float graphs shared by the executor and compiled-plan tests."""
import numpy as np
from onnx import TensorProto, helper, numpy_helper

F = TensorProto.FLOAT


def float_model(nodes, inputs, outputs, shape=None, initializers=()):
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(n, F, shape) for n in inputs],
        [helper.make_tensor_value_info(n, F, shape) for n in outputs], list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def chain():
    """out = (y - x) * y - y in four steps, each of which may run in place."""
    return float_model([
        helper.make_node("Neg", ["x"], ["a"], name="neg"),
        helper.make_node("Add", ["a", "y"], ["b"], name="add"),
        helper.make_node("Mul", ["b", "y"], ["c"], name="mul"),
        helper.make_node("Sub", ["c", "y"], ["out"], name="sub"),
    ], ["x", "y"], ["out"], ["n", 4])


def broadcast_chain(count: int):
    """(model, its [64] and 0-d constants): Add/Mul/Sub in turn on x [1, 8, 64], each node's second
    input in turn the [64] constant, input y [1, 8, 64], input b [1, 1, 64], y, the 0-d constant, y
    (scripts/bench_dispatch.py times the same chain)."""
    rng = np.random.default_rng(1)
    constants = (rng.uniform(0.5, 1, 64).astype(np.float32), np.array(0.75, np.float32))
    seconds = ("c", "y", "b", "y", "s", "y")
    nodes, previous = [], "x"
    for index in range(count):
        output = "out" if index == count - 1 else f"v{index}"
        nodes.append(helper.make_node(("Add", "Mul", "Sub")[index % 3], [previous, seconds[index % 6]], [output]))
        previous = output
    graph = helper.make_graph(nodes, "broadcast", [helper.make_tensor_value_info("x", F, [1, 8, 64]),
                                                   helper.make_tensor_value_info("y", F, [1, 8, 64]),
                                                   helper.make_tensor_value_info("b", F, [1, 1, 64])],
                              [helper.make_tensor_value_info("out", F, [1, 8, 64])],
                              [numpy_helper.from_array(constants[0], "c"), numpy_helper.from_array(constants[1], "s")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10), constants
