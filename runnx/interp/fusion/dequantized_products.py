"""Products by an 8-bit weight kept in its bytes: MatMul(x, DequantizeLinear(B, scale, zero point))
of a constant 2-D uint8/int8 B with one float32 scale and zero point (a transformers.js int8
export's tied LM head, onnxruntime's QDQ weights) becomes one DequantizedMatMul node (kernel in
`runnx/ops/linalg_integer.py`), bitwise the product with the dequantized matrix. Constant folding leaves
such a DequantizeLinear to this pattern when fusion is on (`folding.py`): the float matrix, four
times B's bytes, is never made for a decode step, whose rows read B's bytes.
"""
from __future__ import annotations

from runnx.interp.folding import dequantized_weight, read_as_weight
from runnx.interp.fusion.matcher import Fused, Matcher
from runnx.interp.ir import MISSING, Node


def dequantized_product(m: Matcher, matmul: Node) -> Fused | None:
    """MatMul(x, DequantizeLinear(B, scale, zero point)), the DequantizeLinear `folding.py` left
    for it (read only by this MatMul): DequantizedMatMul(x, B, scale, zero point)."""
    if matmul.op_type != "MatMul" or matmul.domain != "" or len(matmul.inputs) != 2:
        return None
    dequantize = m.graph.producer.get(matmul.inputs[1])
    if (dequantize is None or dequantize.index in m.taken or not dequantized_weight(m.graph, dequantize)
            or not read_as_weight(m.graph, dequantize, m.readers.get(matmul.inputs[1], []))):
        return None
    inputs = (tuple(dequantize.inputs) + (MISSING,))[:3]
    return Fused("DequantizedMatMul", [dequantize, matmul], (matmul.inputs[0], *inputs), matmul.outputs, {})


PATTERNS = (("MatMul", dequantized_product),)
ROUNDS_APART = ()
