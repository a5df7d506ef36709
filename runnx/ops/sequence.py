"""Sequences and optionals: Sequence*, SplitToSequence, ConcatFromSequence, SequenceMap, Optional*.

A sequence value is a Python list of arrays and an empty optional is None (registry contract).
Lists are values too: every op builds a new list and never edits the one it was given, which
the caller or another node may still hold. The arrays inside are shared, not copied; the
executor tracks their storage like any other alias.
"""
from __future__ import annotations

import numpy as np
from onnx import TypeProto

from runnx.capture.env import Subgraph
from runnx.errors import RunnxError
from runnx.ops._shape_util import int_values, normalize_axis, scalar_value, split_parts
from runnx.ops.registry import register


def _position(position, length: int, what: str, inclusive_end: bool = False) -> int:
    """A position in [-length, length) ([-length, length] when inserting), made non-negative."""
    index = int(scalar_value(position, f"{what} position"))
    high = length + 1 if inclusive_end else length
    if not -length <= index < high:
        raise RunnxError(f"{what} position {index} is out of range for a sequence of {length}")
    return index + length if index < 0 else index


@register("SequenceEmpty", since=11)
def SequenceEmpty(*, dtype: int = 1):
    return []


@register("SequenceConstruct", since=11)
def SequenceConstruct(*tensors):
    return list(tensors)


@register("SequenceLength", since=11)
def SequenceLength(sequence):
    return np.array(len(sequence), dtype=np.int64)


@register("SequenceAt", since=11)
def SequenceAt(sequence, position):
    return sequence[_position(position, len(sequence), "SequenceAt")]


@register("SequenceInsert", since=11)
def SequenceInsert(sequence, tensor, position=None):
    index = len(sequence) if position is None else _position(position, len(sequence), "SequenceInsert", True)
    return [*sequence[:index], tensor, *sequence[index:]]


@register("SequenceErase", since=11)
def SequenceErase(sequence, position=None):
    index = len(sequence) - 1 if position is None else _position(position, len(sequence), "SequenceErase")
    if not sequence:
        raise RunnxError("SequenceErase on an empty sequence")
    return [*sequence[:index], *sequence[index + 1:]]


@register("SplitToSequence", since=11)
def SplitToSequence(data, split=None, *, axis: int = 0, keepdims: int = 1):
    axis = normalize_axis(axis, data.ndim)
    length = data.shape[axis]
    if split is None:  # pieces of one; only then may keepdims drop the axis
        parts = split_parts(data, axis, [1] * length, length)
        return [np.squeeze(p, axis=axis) for p in parts] if not keepdims else list(parts)
    if split.ndim == 0:  # a chunk size; the last chunk takes the remainder
        chunk = int(split)
        if chunk < 1:
            raise RunnxError(f"SplitToSequence chunk size {chunk} must be positive")
        sizes = [chunk] * (length // chunk) + ([length % chunk] if length % chunk else [])
        return list(split_parts(data, axis, sizes, len(sizes)))
    sizes = int_values(split)
    return list(split_parts(data, axis, sizes, len(sizes)))


@register("ConcatFromSequence", since=11)
def ConcatFromSequence(sequence, *, axis: int, new_axis: int = 0):
    if not sequence:
        raise RunnxError("ConcatFromSequence of an empty sequence")
    rank = sequence[0].ndim
    if new_axis:
        return np.stack(sequence, axis=normalize_axis(axis, rank + 1))
    return np.concatenate(sequence, axis=normalize_axis(axis, rank))


@register("SequenceMap", since=17)
def SequenceMap(sequence, *additional, body: Subgraph):
    """Runs `body` once per element; a sequence input contributes its i-th element, a tensor itself."""
    count = len(sequence)
    for extra in additional:
        if isinstance(extra, list) and len(extra) != count:
            raise RunnxError(f"SequenceMap sequences differ in length: {count} and {len(extra)}")
    results = [[] for _ in body.output_names]
    for i in range(count):
        inputs = [sequence[i], *(extra[i] if isinstance(extra, list) else extra for extra in additional)]
        outputs, _ = body.iterate(inputs)
        for collected, value in zip(results, outputs):
            collected.append(value)
    return tuple(results)


@register("Optional", since=15)
def Optional(value=None, *, type: TypeProto | None = None):
    return value  # no input: the empty optional (None)


@register("OptionalHasElement", since=15)
def OptionalHasElement(optional=None):
    return np.array(optional is not None)


@register("OptionalGetElement", since=15)
def OptionalGetElement(optional):
    if optional is None:
        raise RunnxError("OptionalGetElement of an empty optional")
    return optional
