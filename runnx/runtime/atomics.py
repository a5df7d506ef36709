"""numba intrinsics for threads sharing memory without locks (`pool.py`, a prepack's claimed
parts): atomic loads, stores, compare-and-swap and add on an int64 array, the spin-wait hint, a
short sleep, a sleep until a word changes and its wake-up (Linux's futex), and a float64's bits as
an int64 word and back. None makes a pointer from an integer: of the runtime's modules only the
arena's allocator does (`arena_functions.py`)."""
from __future__ import annotations

import os
import platform
import sys

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")
# futex(2)'s system call number where runnx knows it (Linux on 64-bit x86 and Arm), else None
_FUTEX_CALL = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine().lower())
FUTEX = sys.platform.startswith("linux") and _FUTEX_CALL is not None and sys.byteorder == "little"
_FUTEX_WAIT, _FUTEX_WAKE = 128, 129  # FUTEX_WAIT_PRIVATE, FUTEX_WAKE_PRIVATE: this process's threads only
_FUTEX_TIMEOUT_NS = 100_000_000  # a sleeper looks again at least this often (a wake-up lost would cost no more)


def _slot_pointer(context, builder, signature, args):
    array = context.make_array(signature.args[0])(context, builder, args[0])
    return cgutils.get_item_pointer(context, builder, signature.args[0], array, [args[1]])


@intrinsic
def load(typingctx, box, index):
    """box[index], a sequentially consistent atomic load."""
    def codegen(context, builder, signature, args):
        return builder.load_atomic(_slot_pointer(context, builder, signature, args), "seq_cst", 8)

    return types.int64(box, index), codegen


@intrinsic
def store(typingctx, box, index, value):
    """box[index] = value, a sequentially consistent atomic store."""
    def codegen(context, builder, signature, args):
        builder.store_atomic(args[2], _slot_pointer(context, builder, signature, args), "seq_cst", 8)
        return context.get_dummy_value()

    return types.void(box, index, types.int64), codegen


@intrinsic
def compare_and_swap(typingctx, box, index, expected, new):
    """Whether box[index] was `expected` and is now `new` (atomically)."""
    def codegen(context, builder, signature, args):
        pair = builder.cmpxchg(_slot_pointer(context, builder, signature, args), args[2], args[3],
                               "seq_cst", "seq_cst")
        return builder.extract_value(pair, 1)

    return types.boolean(box, index, types.int64, types.int64), codegen


@intrinsic
def add(typingctx, box, index, value):
    """box[index] += value (atomically)."""
    def codegen(context, builder, signature, args):
        builder.atomic_rmw("add", _slot_pointer(context, builder, signature, args), args[2], "seq_cst")
        return context.get_dummy_value()

    return types.void(box, index, types.int64), codegen


def _emit_pause(builder) -> None:
    if _X86:
        hint = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                              "llvm.x86.sse2.pause")
        builder.call(hint, [])


@intrinsic
def pause(typingctx):
    """The spin-wait hint: frees the core's shared resources while polling."""
    def codegen(context, builder, signature, args):
        _emit_pause(builder)
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def nap(typingctx):
    """Sleep about 20 microseconds (usleep; a pause elsewhere): a thread waiting for another's work
    gives up its core, where spinning could keep the other from running (more threads than cores)."""
    def codegen(context, builder, signature, args):
        if os.name == "posix":
            word = ir.IntType(32)
            sleep = cgutils.get_or_insert_function(builder.module, ir.FunctionType(word, [word]), "usleep")
            builder.call(sleep, [ir.Constant(word, 20)])
        else:
            _emit_pause(builder)
        return context.get_dummy_value()

    return types.void(), codegen


def _futex(builder, pointer, operation: int, value) -> None:
    """syscall(SYS_futex, the word at `pointer` (its low 32 bits: little-endian), operation, value,
    timeout) for `FUTEX` platforms; nothing elsewhere."""
    if not FUTEX:
        return
    i32, i64, i8_pointer = ir.IntType(32), ir.IntType(64), ir.IntType(8).as_pointer()
    syscall = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i64, [i64], var_arg=True), "syscall")
    timeout = ir.Constant(i8_pointer, None)
    if operation == _FUTEX_WAIT:  # a relative struct timespec {seconds, nanoseconds}
        spec_type = ir.LiteralStructType([i64, i64])
        spec = cgutils.alloca_once(builder, spec_type)
        builder.store(ir.Constant(spec_type, [0, _FUTEX_TIMEOUT_NS]), spec)
        timeout = builder.bitcast(spec, i8_pointer)
    builder.call(syscall, [ir.Constant(i64, _FUTEX_CALL), builder.bitcast(pointer, i8_pointer),
                           ir.Constant(i32, operation), value, timeout, ir.Constant(i8_pointer, None),
                           ir.Constant(i32, 0)])


@intrinsic
def sleep_while(typingctx, box, index, value):
    """Sleep while box[index] is `value` (a non-negative int32's worth), in the kernel (futex(2)):
    back at once when it is not, on `wake_sleepers`, after `_FUTEX_TIMEOUT_NS` at most, or
    spuriously, so the caller checks again. Where there is no futex (`FUTEX` False), a pause."""
    def codegen(context, builder, signature, args):
        if FUTEX:
            _futex(builder, _slot_pointer(context, builder, signature, args), _FUTEX_WAIT,
                   builder.trunc(args[2], ir.IntType(32)))
        else:
            _emit_pause(builder)
        return context.get_dummy_value()

    return types.void(box, index, types.int64), codegen


@intrinsic
def wake_sleepers(typingctx, box, index):
    """Wake every thread in `sleep_while` on box[index] (futex(2); nothing where there is none)."""
    def codegen(context, builder, signature, args):
        _futex(builder, _slot_pointer(context, builder, signature, args), _FUTEX_WAKE,
               ir.Constant(ir.IntType(32), 0x7FFFFFFF))
        return context.get_dummy_value()

    return types.void(box, index), codegen


@intrinsic
def float64_from_bits(typingctx, bits):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.DoubleType())

    return types.float64(types.int64), codegen


@intrinsic
def bits_of_float64(typingctx, value):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(64))

    return types.int64(types.float64), codegen
