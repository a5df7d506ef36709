"""numpy's own float32 exp, called from numba code: the same machine code numpy runs for `np.exp`
on float32 arrays, so the same bits, without the GIL.

A SiLU gate's exp must be numpy's (numba's differs from it by up to 2 ulp on a third of float32
inputs: the fused ops promise the unfused Sigmoid's bits). Called from Python between numba calls,
it cut a prompt's SiLU pass into three calls a block, each taking the GIL: two threads sharing the
rows then waited for each other's GIL more than they computed (a 2,000 x 1,536 gate took as long
on two threads as on one). Here a kernel calls numpy's inner loop itself.

numpy keeps each ufunc's loops in its C object (`PyUFuncObject`, part of numpy's stable C API):
`functions[i]` for the i-th entry of `types`, called as loop(args, dimensions, steps, data). The
float32 one is the CPU-dispatched loop numpy itself calls for contiguous float32 arrays. `EXP` is
(its address, its data), found at import and checked against `np.exp` on probe values (every
special value and a spread of finite ones, tails of odd lengths included); (0, 0) where numpy has
no such loop or it disagrees: callers then take numpy's Python path (`available`). The address is
an integer from numpy's table; the kernels pass it to the intrinsic that calls it, with arrays
the kernel holds.
"""
from __future__ import annotations

import ctypes

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from runnx.ops import _jit_cache  # noqa: F401  (numba caches this module's kernels under RUNNX_CACHE)

_jit = numba.njit(cache=True, nogil=True, error_model="numpy")


class _UFunc(ctypes.Structure):
    """The head of numpy's PyUFuncObject (numpy/ufuncobject.h) up to its loops' type codes."""
    _fields_ = [("refcount", ctypes.c_ssize_t), ("type", ctypes.c_void_p), ("nin", ctypes.c_int),
                ("nout", ctypes.c_int), ("nargs", ctypes.c_int), ("identity", ctypes.c_int),
                ("functions", ctypes.POINTER(ctypes.c_void_p)), ("data", ctypes.POINTER(ctypes.c_void_p)),
                ("ntypes", ctypes.c_int), ("reserved", ctypes.c_int), ("name", ctypes.c_char_p),
                ("types", ctypes.POINTER(ctypes.c_char))]


_LOOP = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_ssize_t),
                         ctypes.POINTER(ctypes.c_ssize_t), ctypes.c_void_p)


def _float32_loop(ufunc) -> tuple[int, int]:
    """(address, data) of a one-input ufunc's float32 -> float32 loop, or (0, 0)."""
    head = _UFunc.from_address(id(ufunc))
    code = np.dtype(np.float32).num
    if (head.nin, head.nout, head.nargs) != (1, 1, 2) or not 0 < head.ntypes < 256:
        return 0, 0
    for i in range(head.ntypes):
        if ord(head.types[2 * i]) == code and ord(head.types[2 * i + 1]) == code:
            return int(head.functions[i] or 0), int(head.data[i] or 0)
    return 0, 0


def probe_values() -> np.ndarray:
    """float32 values an exp loop is checked on: the special ones, the edges of overflow and
    underflow, and a spread across the whole range (an odd count: the loop's tail too)."""
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 1.1754942e-38, 88.72283, 88.72284,
                        -87.33654, -103.27893, -103.97208, -104.0, 1.0, -1.0, 0.5, 1e-8, -1e-8], np.float32)
    spread = np.arange(0, 1 << 32, 524_287, dtype=np.uint64).astype(np.uint32).view(np.float32)
    rng = np.random.default_rng(0)
    near = (rng.standard_normal(3001) * np.float32(12)).astype(np.float32)
    return np.concatenate([special, spread, near])


def _checked(loop: tuple[int, int]) -> tuple[int, int]:
    """loop when it computes np.exp's bits on `probe_values` (through ctypes), else (0, 0)."""
    if not loop[0]:
        return 0, 0
    values = probe_values()
    out = np.empty_like(values)
    arguments = (ctypes.c_void_p * 2)(values.ctypes.data, out.ctypes.data)
    dimensions, steps = (ctypes.c_ssize_t * 1)(values.size), (ctypes.c_ssize_t * 2)(4, 4)
    _LOOP(loop[0])(arguments, dimensions, steps, loop[1] or None)
    with np.errstate(all="ignore"):
        expected = np.exp(values)
    return loop if np.array_equal(out.view(np.uint32), expected.view(np.uint32)) else (0, 0)


try:
    EXP = _checked(_float32_loop(np.exp))
except (ValueError, OSError, AttributeError):  # (a numpy whose ufuncs are laid out otherwise)
    EXP = (0, 0)


def available() -> bool:
    """Whether kernels here may run numpy's float32 exp (`EXP` found and checked)."""
    return EXP[0] != 0


@intrinsic
def _call_loop(typingctx, address, data, source, target, count):
    """The ufunc loop at `address` over count elements of 1-D C-contiguous float32 source into
    target (args {source, target}, dimensions {count}, steps {4, 4}, `data`); typed for those
    arrays only."""
    for array in (source, target):
        if not (isinstance(array, types.Array) and array.dtype == types.float32 and array.ndim == 1
                and array.layout == "C"):
            return None

    def codegen(context, builder, signature, arguments):
        address_value, data_value, source_value, target_value, count_value = arguments
        source_array = context.make_array(signature.args[2])(context, builder, source_value)
        target_array = context.make_array(signature.args[3])(context, builder, target_value)
        byte_pointer = ir.IntType(8).as_pointer()
        intp = context.get_value_type(types.intp)
        loop_type = ir.FunctionType(ir.VoidType(), [byte_pointer.as_pointer(), intp.as_pointer(), intp.as_pointer(),
                                                    byte_pointer])
        pointers = cgutils.alloca_once(builder, byte_pointer, size=2)
        builder.store(builder.bitcast(source_array.data, byte_pointer), pointers)
        builder.store(builder.bitcast(target_array.data, byte_pointer), builder.gep(pointers, [cgutils.int32_t(1)]))
        dimensions = cgutils.alloca_once_value(builder, count_value)
        steps = cgutils.alloca_once(builder, intp, size=2)
        itemsize = ir.Constant(intp, 4)
        builder.store(itemsize, steps)
        builder.store(itemsize, builder.gep(steps, [cgutils.int32_t(1)]))
        loop = builder.inttoptr(address_value, loop_type.as_pointer())
        builder.call(loop, [pointers, dimensions, steps, builder.inttoptr(data_value, byte_pointer)])
        return context.get_dummy_value()

    return types.void(types.intp, types.intp, source, target, types.intp), codegen


@_jit
def exp_into(loop, x, out):
    """out = numpy's exp(x) for 1-D C-contiguous float32 arrays of one size (out may be x), loop
    `EXP` (available). ValueError for arrays the loop cannot take."""
    if x.size != out.size:
        raise ValueError("exp_into: x and out differ in size")
    if x.size:
        _call_loop(np.intp(loop[0]), np.intp(loop[1]), x, out, x.size)
