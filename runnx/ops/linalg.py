"""Linear algebra: MatMul (BLAS through numpy)."""
from __future__ import annotations

import numpy as np

from runnx.ops.registry import register


@register("MatMul", since=1)
def MatMul(a, b):
    return np.matmul(a, b)
