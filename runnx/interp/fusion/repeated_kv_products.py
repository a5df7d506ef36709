"""A KV cache's heads repeated for grouped-query attention and read by a product: MatMul(a, r),
r = Reshape(Expand(Unsqueeze(kv))) as transformers exports `repeat_kv` (the repeat proven from the
cache's dims: `Matcher.head_repeat`), maybe through the keys' Transpose (0, 1, 3, 2) and a scalar
Mul. One RepeatedKVMatMul reads the cache in place
(`ops/linalg.py`), bitwise the nodes' product: it applies where the attention pattern of
`rms_norm_blocks.py`, which rounds apart, does not (a graph quantizing computed values, an
attention that pattern does not know), and a decode step no longer copies every head of the cache
once per query head sharing it.
"""
from __future__ import annotations

from runnx.interp.fusion.matcher import Fused, Matcher
from runnx.interp.ir import MISSING, Node


def _repeated_kv_product(m: Matcher, matmul: Node) -> Fused | None:
    """MatMul(a, [Mul(scalar)] [Transpose(0, 1, 3, 2)] Reshape(Expand(Unsqueeze(kv))))."""
    operand, scale, between = matmul.inputs[1], MISSING, []
    mul = m.node(operand, "Mul")
    if mul is not None:
        scale = next((v for v in mul.inputs if m.scalar(v) is not None), None)
        if scale is None:
            return None
        operand = m.other(mul, scale)
        between.append(mul)
    transpose = m.node(operand, "Transpose")
    if transpose is not None:
        if transpose.attrs.get("perm") != (0, 1, 3, 2):
            return None
        operand = transpose.inputs[0]
        between.append(transpose)
    found = m.head_repeat(operand)
    if found is None or found[1] is None:
        return None
    (unsqueeze, expand, reshape), repeat = found
    chain = [unsqueeze, expand, reshape, *reversed(between), matmul]
    if not m.private(chain, matmul.outputs[0], shape_read=(reshape.outputs[0],)):
        return None
    inputs = (matmul.inputs[0], unsqueeze.inputs[0], scale)
    return Fused("RepeatedKVMatMul", chain, inputs, matmul.outputs,
                 {"repeat": repeat, "transposed": int(transpose is not None)})


def shape_stand_ins(m: Matcher, fused: Fused) -> list[Fused]:
    """A RepeatedKVShape for the repeated cache when nodes outside read its shape (a mask's bounds)."""
    if fused.op_type != "RepeatedKVMatMul":
        return []
    inside = {n.index for n in fused.members}
    reshape = fused.members[2]
    if all(r.index in inside for r in m.readers.get(reshape.outputs[0], ())):
        return []
    return [Fused("RepeatedKVShape", [], fused.inputs[1:2], reshape.outputs, {"repeat": fused.attrs["repeat"]})]


PATTERNS = (("MatMul", _repeated_kv_product),)
ROUNDS_APART = ()  # bitwise the nodes' product (ops/linalg.py)
