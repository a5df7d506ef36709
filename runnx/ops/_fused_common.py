"""What the interpreter needs of the fused kernels (`fused*.py`) without loading them and numba:
their private domain, and the stand-in arrays their shape-only runs hand out; and what the fused op
modules share."""
from __future__ import annotations

import functools

import numpy as np

DOMAIN = "runnx.fused"
KERNEL_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))  # the numba kernels' (others: numpy)


def fits(operand, result) -> bool:
    """Whether `result op= operand` is `result op operand` (same dtype, operand broadcasts into it)."""
    return (operand.dtype == result.dtype and operand.ndim <= result.ndim
            and all(o == 1 or o == r for o, r in zip(operand.shape[::-1], result.shape[::-1])))


def absent(shape: tuple, dtype=np.float32) -> np.ndarray:
    """An empty read-only array standing for an absent weight or bias in a native kernel's
    arguments: read-only as the constants it stands for, so that a layer with the input and one
    without call the kernel with one type (numba compiles a kernel for each)."""
    array = np.zeros(shape, dtype)
    array.flags.writeable = False
    return array


@functools.lru_cache(maxsize=256)
def stand_in(dtype, shape: tuple) -> np.ndarray:
    """A read-only array of this dtype and shape on one element (zero strides): safe to hand out
    again. A decode step asks for a new length each time: np.broadcast_to's Python cost 3.6 us,
    the array made directly 0.9."""
    zero = np.zeros((), dtype)
    if zero.dtype.hasobject:
        return np.broadcast_to(zero, shape)
    array = np.ndarray(shape, zero.dtype, zero, 0, (0,) * len(shape))
    array.flags.writeable = False
    return array
