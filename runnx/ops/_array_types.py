"""numba intrinsics that retype an array without touching it, so a kernel compiles once.

numba compiles a kernel anew for every combination of its arguments' types, and an array's type
holds its layout (C, F or any) and whether it may be written: the blocked product compiled three
times on a first run (seconds each), for a weight (read-only), a computed value (writable) and a
strided output. Its callers hand it one type instead: `read_only` for what the kernel only reads,
`any_layout` for what may be a strided view. The other way, `typed_contiguous` lets a loop over a
view its caller knows to be C-contiguous vectorise. An array's data model is the same for every
layout and mutability, so the new type is the same value: no copy, no code."""
from __future__ import annotations

from numba.core import types
from numba.core.imputils import impl_ret_borrowed
from numba.extending import intrinsic


def _retyped(array: types.Array, result: types.Array):
    def codegen(context, builder, signature, args):
        return impl_ret_borrowed(context, builder, result, args[0])

    return result(array), codegen


@intrinsic
def read_only(typingctx, array):
    """array typed read-only (the kernel never writes it)."""
    if not isinstance(array, types.Array):
        return None
    return _retyped(array, array.copy(readonly=True))


@intrinsic
def any_layout(typingctx, array):
    """array typed as any layout ('A': strides read at run time)."""
    if not isinstance(array, types.Array):
        return None
    return _retyped(array, array.copy(layout="A"))


@intrinsic
def typed_contiguous(typingctx, array):
    """array typed C-contiguous, so that loops over it vectorise (numba's 'A' layout indexes through
    the strides); the caller has checked that it is C-contiguous."""
    if not isinstance(array, types.Array):
        return None
    return _retyped(array, array.copy(layout="C"))
