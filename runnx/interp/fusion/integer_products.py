"""Integer products scaled back to float: onnxruntime's dynamic quantization writes each product as

    MatMulInteger(a, B, a_zero, B_zero) -> Cast(to float) -> Mul(., Mul(a_scale, B_scale))

(a, a_scale, a_zero from DynamicQuantizeLinear of the activation, B and its scale and zero point
constants): three or four nodes a product, two thousand a decode step of an int8 135M-parameter
decoder. Their standard fused op is onnxruntime's contrib MatMulIntegerToFloat(a, B, a_scale,
B_scale, a_zero, B_zero), whose kernel (ops/contrib_quantized.py) computes MatMulInteger's int32 product, then in
float32 the Cast, the scales' product and the Mul, in that order: bitwise what the nodes computed,
so the pattern also runs on graphs that quantize computed values (fusion/__init__.py). A quantizer
whose outputs only one such product reads joins it: DynamicQuantizeMatMul (the same two kernels).
"""
from __future__ import annotations

import numpy as np

from runnx.interp.fusion.matcher import Fused, Matcher
from runnx.interp.ir import MISSING, Node

CONTRIB = "com.microsoft"
_FLOAT = 1  # TensorProto.FLOAT


def integer_to_float(m: Matcher, mul: Node) -> Fused | None:
    """Mul(Cast(MatMulInteger(a, B, a_zero, B_zero), to=float), Mul(a_scale, B_scale)): the scales'
    Mul joins when only this product reads it; B_scale a float32 constant of one value or one a
    column, a_scale a float32 value of one element."""
    for vid in mul.inputs[:2]:
        cast = m.node(vid, "Cast")
        if cast is None or cast.attrs.get("to") != _FLOAT:
            continue
        product = m.node(cast.inputs[0], "MatMulInteger")
        if product is None:
            continue
        scales = m.node(m.other(mul, vid), "Mul")
        if scales is None:
            continue
        factors = _factors(m, scales)
        if factors is None:
            continue
        members = [product, cast, mul]
        if m.private(members + [scales], mul.outputs[0]):
            members.append(scales)
        elif not m.private(members, mul.outputs[0]):
            continue
        a, b, a_zero, b_zero = (tuple(product.inputs) + (MISSING, MISSING))[:4]
        return Fused("MatMulIntegerToFloat", members, (a, b, *factors, a_zero, b_zero), mul.outputs, {},
                     domain=CONTRIB)
    return None


def _factors(m: Matcher, scales: Node) -> tuple[int, int] | None:
    """(a_scale, B_scale) of the scales' Mul: one input a float32 constant of one value or a
    vector (B's, per column), the other the scale DynamicQuantizeLinear gives (a float32 scalar)."""
    first, second = scales.inputs[:2]
    for a_scale, b_scale in ((first, second), (second, first)):
        constant = m.graph.constants.get(b_scale)
        quantizer = m.graph.producer.get(a_scale)
        if (constant is not None and constant.dtype == np.float32 and constant.ndim <= 1 and quantizer is not None
                and quantizer.op_type == "DynamicQuantizeLinear" and quantizer.domain == ""
                and len(quantizer.outputs) > 1 and quantizer.outputs[1] == a_scale):
            return a_scale, b_scale
    return None


def quantized_product(m: Matcher, quantize: Node) -> Fused | None:
    """DynamicQuantizeLinear(x) whose three outputs only one MatMulIntegerToFloat reads (as
    `integer_to_float` made it: a layer's output or down projection) -> onnxruntime's
    DynamicQuantizeMatMul(x, B, B_scale, B_zero), whose kernel runs the two kernels in turn."""
    if quantize.domain != "" or len(quantize.outputs) != 3 or MISSING in quantize.outputs:
        return None
    readers = {reader.index: reader for vid in quantize.outputs for reader in m.readers.get(vid, ())}
    if len(readers) != 1:
        return None
    product = next(iter(readers.values()))
    if (product.op_type != "MatMulIntegerToFloat" or product.domain != CONTRIB or product.index in m.taken
            or tuple(product.inputs[0:6:2]) != tuple(quantize.outputs)  # (a, a_scale, a_zero)
            or len(product.inputs) > 6 and product.inputs[6] != MISSING):
        return None
    if not m.private([quantize, product], product.outputs[0]):
        return None
    return Fused("DynamicQuantizeMatMul", [quantize, product],
                 (quantize.inputs[0], product.inputs[1], product.inputs[3], product.inputs[5]), product.outputs, {},
                 domain=CONTRIB)


PATTERNS = (("Mul", integer_to_float), ("DynamicQuantizeLinear", quantized_product))
ROUNDS_APART = ()
