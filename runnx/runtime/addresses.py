"""numba intrinsics that turn an integer posted in the decode pool's mailbox into memory: an
array viewed at an address, a pointer for numba.carray, the unit loop called at its address. Only
the pool's modules use them (`mailbox.py`, `slots.py`, `units.py`; `jobs.py` posts the addresses,
after checking the arrays): no other code makes a pointer from an integer."""
from __future__ import annotations

from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic
from numba.np.arrayobj import populate_array


@intrinsic
def float32_view(typingctx, address, shape, strides):
    """The float32 array at `address` with `shape` and byte `strides` (int64 tuples of one length):
    a caller's buffer, kept alive by the caller while the view is in use."""
    result = types.Array(types.float32, len(shape), "A")

    def codegen(context, builder, signature, args):
        array = context.make_array(result)(context, builder)
        data = builder.inttoptr(args[0], context.get_value_type(types.CPointer(types.float32)))
        populate_array(array, data=data, shape=args[1], strides=args[2],
                       itemsize=context.get_constant(types.intp, 4), meminfo=None)
        return array._getvalue()

    return result(types.int64, shape, strides), codegen


@intrinsic
def float32_pointer(typingctx, address):
    """`address` as a float32 pointer, for numba.carray (a C-contiguous view: unit strides that
    loops vectorise over)."""
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(types.CPointer(types.float32)))

    return types.CPointer(types.float32)(types.int64), codegen


@intrinsic
def byte_pointer(typingctx, address):
    """`address` as a uint8 pointer, for numba.carray (`float32_pointer`'s, for 8-bit matrices)."""
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(types.CPointer(types.uint8)))

    return types.CPointer(types.uint8)(types.int64), codegen


@intrinsic
def call_units(typingctx, address, box, sequence):
    """The function at `address`, `int64 (int64 *box, int64 sequence)`, called with box's data: the
    decode pool's unit loop, one compiled copy that every thread calls (`mailbox.py`)."""
    def codegen(context, builder, signature, args):
        word = ir.IntType(64)
        function = builder.inttoptr(args[0], ir.FunctionType(word, [word.as_pointer(), word]).as_pointer())
        array = context.make_array(signature.args[1])(context, builder, args[1])
        return builder.call(function, [array.data, args[2]])

    return types.int64(types.int64, box, types.int64), codegen
