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
from numba.extending import intrinsic, overload
from numba.np.arrayobj import populate_array


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


@intrinsic
def held_any_layout(typingctx, array):
    """array typed as any layout and writable, as the decode pool's jobs hold arrays read through
    their strides (`runtime/board.py`: one type for what a unit reads and what it writes; a unit
    writes only its job's outputs)."""
    if not isinstance(array, types.Array):
        return None
    return _retyped(array, array.copy(layout="A", readonly=False))


def _c_strides(builder, shape, itemsize):
    """The byte strides of a C-ordered array of `shape` (LLVM values)."""
    strides, stride = [], itemsize
    for dim in reversed(shape):
        strides.append(stride)
        stride = builder.mul(stride, dim)
    return strides[::-1]


def _view(context, builder, source_type, source, result_type, shape, owned=True):
    """`source`'s data seen as a C-ordered `result_type` array of `shape`: holding its own reference
    to the owner (`impl_ret_borrowed`), or (owned False) none: a borrowed view (`shaped`)."""
    array = context.make_array(source_type)(context, builder, source)
    itemsize = context.get_constant(types.intp, context.get_abi_sizeof(context.get_data_type(result_type.dtype)))
    data = builder.bitcast(array.data, context.get_value_type(types.CPointer(result_type.dtype)))
    view = context.make_array(result_type)(context, builder)
    populate_array(view, data=data, shape=list(shape), strides=_c_strides(builder, shape, itemsize),
                   itemsize=itemsize, meminfo=array.meminfo if owned else None)
    if not owned:
        return view._getvalue()
    return impl_ret_borrowed(context, builder, result_type, view._getvalue())


@intrinsic
def flat_vector(typingctx, array):
    """A C-contiguous array's elements as a writable vector (no copy, no check: the caller has
    checked that it is C-contiguous): how the decode pool's jobs hold an array
    (`runtime/board.py`)."""
    if not isinstance(array, types.Array):
        return None
    result = types.Array(array.dtype, 1, "C")

    def codegen(context, builder, signature, args):
        size = context.make_array(signature.args[0])(context, builder, args[0]).nitems
        return _view(context, builder, signature.args[0], args[0], result, [size])

    return result(array), codegen


@intrinsic
def flat_bytes(typingctx, array):
    """A C-contiguous array's bytes as a writable uint8 vector (`flat_vector`'s, for 8-bit matrices,
    4-bit tiles and int32 sums)."""
    if not isinstance(array, types.Array):
        return None
    result = types.Array(types.uint8, 1, "C")

    def codegen(context, builder, signature, args):
        source = context.make_array(signature.args[0])(context, builder, args[0])
        size = builder.mul(source.nitems, source.itemsize)
        return _view(context, builder, signature.args[0], args[0], result, [size])

    return result(array), codegen


@intrinsic
def _shaped(typingctx, vector, shape, dtype):
    """`vector` (1-D, C-contiguous) seen as a C-ordered array of `shape` and `dtype` (unchecked), borrowed."""
    if not (isinstance(vector, types.Array) and isinstance(shape, types.UniTuple)):
        return None
    result = types.Array(dtype.dtype, len(shape), "C")

    def codegen(context, builder, signature, args):
        dims = [builder.extract_value(args[1], i) for i in range(len(shape))]
        return _view(context, builder, signature.args[0], args[0], result, dims, owned=False)

    return result(vector, shape, dtype), codegen


def shaped(vector, shape, dtype):
    """`vector` (1-D, C-contiguous; a vector a decode pool job holds) seen as a C-ordered array of
    `shape` (a tuple) and `dtype` (np.float32, np.uint8, np.int32), borrowed (no reference to its owner:
    valid while the job holds the vector): numba's reshape and view call a C helper each, a hundredth of a
    small unit's time. IndexError when the array would reach past the vector's bytes."""


@overload(shaped)
def _shaped_compiled(vector, shape, dtype):
    itemsize = dtype.dtype.bitwidth // 8

    def view(vector, shape, dtype):
        size = itemsize
        for dim in shape:
            size *= dim
        if size > vector.size * vector.itemsize:
            raise IndexError("a view reaches past the vector it is taken of")
        return _shaped(vector, shape, dtype)
    return view
