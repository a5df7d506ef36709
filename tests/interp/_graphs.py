"""Small float graphs shared by the executor and compiled-plan tests."""
from onnx import TensorProto, helper

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
