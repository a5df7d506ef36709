"""Tensor creation: Constant (folded at load time)."""
from __future__ import annotations

import numpy as np

from runnx.errors import InvalidModelError
from runnx.ops.registry import register


@register("Constant", since=1)
def Constant(*, value: np.ndarray | None = None, value_float: float | None = None,
             value_floats: tuple[float, ...] | None = None, value_int: int | None = None,
             value_ints: tuple[int, ...] | None = None, value_string: str | None = None,
             value_strings: tuple[str, ...] | None = None, sparse_value: np.ndarray | None = None):
    given = [(k, v) for k, v in (("value", value), ("value_float", value_float), ("value_floats", value_floats),
                                ("value_int", value_int), ("value_ints", value_ints),
                                ("value_string", value_string), ("value_strings", value_strings),
                                ("sparse_value", sparse_value)) if v is not None]
    if len(given) != 1:
        raise InvalidModelError(f"Constant needs exactly one value attribute, got {[k for k, _ in given] or 'none'}")
    name, data = given[0]
    if name in ("value", "sparse_value"):
        return data
    if name in ("value_float", "value_floats"):
        return np.array(data, dtype=np.float32)
    if name in ("value_int", "value_ints"):
        return np.array(data, dtype=np.int64)
    return np.array(data, dtype=object)
