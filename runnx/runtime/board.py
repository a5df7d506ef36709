"""What the decode pool's threads share, as typed references: a job's arrays are held, never
posted as addresses.

A `Job` (a numba StructRef) is the description every thread reads: its mailbox (`words`: the int64
control words the threads claim units with and a job's numbers, laid out in `slots.py`) and three
groups of slots for the arrays a job's units read and write: C-contiguous float32 vectors
(`floats_at`: rows, matrices, partial sums, outputs), float32 arrays of 4 dimensions read through
their strides (`grid_at`: an attention's query, cache and output) and C-contiguous bytes
(`bytes_at`: 8-bit matrices, 4-bit tiles, int32 sums). Posting an array stores a reference to it
in its slot (numba's reference counts are atomic): the job holds every array its units touch until
it is released, so no unit ever reads memory its job does not keep alive, whatever its caller does
meanwhile. The slots are fields, one each, read and written through the accessors below (a switch
over the group's fields, folded when the slot is a constant): a field costs a few nanoseconds where
a numba typed list's C helpers cost 20-70. A slot holding nothing is null: an empty array to a unit.

A `Board` is a job and the unit loop every thread calls on it (`mailbox.py`): one compiled copy, a
first-class function (a C callback numba compiles once), so a result never depends on which
thread computed which unit.

Releasing a job drops its references. An array that came from Python holds its Python object, and
dropping the last reference to it needs the GIL: `release_finished` (no GIL) is for the posting
functions, whose callers still hold every array; a job left open past its posting call (`pool.py`)
is released by `mailbox.finish_and_release`, which runs with the GIL.
"""
from __future__ import annotations

import numba
import numpy as np
from numba.core import cgutils, types
from numba.experimental import structref
from numba.extending import intrinsic, overload
from numba.np.arrayobj import populate_array

from runnx.ops import _jit_cache  # noqa: F401  (numba caches this module's kernels under RUNNX_CACHE)
from runnx.ops._array_types import flat_bytes, flat_vector, held_any_layout
from runnx.runtime.slots import (BYTES_USED, BYTE_SLOTS, CLAIM_SHIFT, FLOATS_USED, FLOAT_SLOTS, GRIDS_USED, GRID_SLOTS,
                                 MAILBOX_SIZE)


@structref.register
class JobType(types.StructRef):
    """numba's type of a `Job`."""


@structref.register
class BoardType(types.StructRef):
    """numba's type of a `Board`."""


class Job(structref.StructRefProxy):
    """A pool job's description: its mailbox and the arrays it holds (module docstring)."""


class Board(structref.StructRefProxy):
    """A job and the unit loop that computes it (module docstring)."""


WORDS = types.Array(types.int64, 1, "C")
FLOATS = types.Array(types.float32, 1, "C")
GRID = types.Array(types.float32, 4, "A")
BYTES = types.Array(types.uint8, 1, "C")
# the job's fields by group: its mailbox, then a field a slot (`floats3`, `grid0`, ...); a slot not
# holding an array is null (no owner, no data, every dimension 0: an empty array to a unit)
_GROUPS = {"words": ("words",), "floats": tuple(f"floats{i}" for i in range(FLOAT_SLOTS)),
           "grid": tuple(f"grid{i}" for i in range(GRID_SLOTS)), "bytes": tuple(f"bytes{i}" for i in range(BYTE_SLOTS))}
_GROUP_KINDS = {"words": WORDS, "floats": FLOATS, "grid": GRID, "bytes": BYTES}
JOB = JobType([(name, _GROUP_KINDS[group]) for group, names in _GROUPS.items() for name in names])
structref.define_proxy(Job, JobType, list(JOB.field_dict))
structref.define_proxy(Board, BoardType, ["units", "job"])
UNITS = types.FunctionType(types.int64(JOB, types.int64))  # the unit loop: (job, sequence) -> units computed
BOARD = BoardType([("units", UNITS), ("job", JOB)])

_jit = numba.njit(cache=True, nogil=True, error_model="numpy")
_inlined = numba.njit(cache=True, nogil=True, error_model="numpy", inline="always")


def _borrowed(context, builder, kind, value):
    """The array `value` of type `kind` without its owner: using it counts no references."""
    held = context.make_array(kind)(context, builder, value)
    view = context.make_array(kind)(context, builder)
    populate_array(view, data=held.data, shape=held.shape, strides=held.strides, itemsize=held.itemsize,
                   meminfo=None)
    return view._getvalue()


def _slot_switch(context, builder, job_type, job, group, slot, case):
    """Emit `case(data, field)` for field `group` + str(slot) of `job` (`slot` a run-time int64):
    a switch over the group's fields (LLVM folds it when the slot is a constant); a slot past
    the group runs `case(data, None)`."""
    data = structref._Utils(context, builder, job_type).get_data_struct(job)
    names = _GROUPS[group]
    end = builder.append_basic_block(f"{group}.end")
    outside = builder.append_basic_block(f"{group}.outside")
    switch = builder.switch(slot, outside)
    for index, name in enumerate(names):
        block = builder.append_basic_block(f"{group}.{index}")
        switch.add_case(index, block)
        with builder.goto_block(block):
            case(data, name)
            builder.branch(end)
    with builder.goto_block(outside):
        case(data, None)
        builder.branch(end)
    builder.position_at_end(end)


@intrinsic
def _held(typingctx, job, group, slot):
    """The array the job holds in slot `slot` of field group `group`, borrowed: without a reference
    to its owner, so a unit using it counts no references. Valid while the job holds it, which it
    does until every unit is complete (the job is released after `finish`); the threads computing
    one job's units would otherwise contend for the same reference counts, an atomic add each way
    on one cache line, a few for every unit. A slot past the group reads as an empty array."""
    if not (isinstance(job, JobType) and isinstance(group, types.StringLiteral)):
        return None
    kind = _GROUP_KINDS[group.literal_value]

    def codegen(context, builder, signature, args):
        result = cgutils.alloca_once(builder, context.get_value_type(kind))

        def case(data, name):
            if name is None:
                builder.store(cgutils.get_null_value(result.type.pointee), result)
            else:
                builder.store(_borrowed(context, builder, kind, getattr(data, name)), result)

        _slot_switch(context, builder, signature.args[0], args[0], group.literal_value, args[2], case)
        return builder.load(result)

    return kind(job, group, types.int64), codegen


@intrinsic
def _hold(typingctx, job, group, slot, value):
    """`value` held in slot `slot` of field group `group` (a reference taken), what the slot held
    dropped (a slot past the group holds nothing)."""
    if not (isinstance(job, JobType) and isinstance(group, types.StringLiteral)):
        return None
    kind = _GROUP_KINDS[group.literal_value]

    def codegen(context, builder, signature, args):
        def case(data, name):
            if name is not None:
                context.nrt.incref(builder, kind, args[3])
                context.nrt.decref(builder, kind, getattr(data, name))
                setattr(data, name, args[3])

        _slot_switch(context, builder, signature.args[0], args[0], group.literal_value, args[2], case)
        return context.get_dummy_value()

    return types.void(job, group, types.int64, kind), codegen


@_inlined
def floats_at(job, slot):
    """The float32 vector the job holds at float slot `slot`, borrowed (`_held`)."""
    return _held(job, "floats", slot)


@_inlined
def grid_at(job, slot):
    """The float32 array of 4 dimensions the job holds at grid slot `slot`, borrowed (`_held`)."""
    return _held(job, "grid", slot)


@_inlined
def bytes_at(job, slot):
    """The bytes the job holds at byte slot `slot`, borrowed (`_held`)."""
    return _held(job, "bytes", slot)


@_inlined
def words_of(job):
    """The job's mailbox, borrowed (`_held`)."""
    return _held(job, "words", 0)


@intrinsic
def _release(typingctx, job, group, count):
    """The references of the group's first `count` slots dropped, those slots null: straight-line
    code, a comparison and a decrement a slot (a job is released on every post: its code stays
    small, where a loop over `_hold` would copy the switch into every posting function)."""
    if not (isinstance(job, JobType) and isinstance(group, types.StringLiteral)):
        return None
    kind = _GROUP_KINDS[group.literal_value]

    def codegen(context, builder, signature, args):
        data = structref._Utils(context, builder, signature.args[0]).get_data_struct(args[0])
        for index, name in enumerate(_GROUPS[group.literal_value]):
            with builder.if_then(builder.icmp_signed("<", context.get_constant(types.int64, index), args[2])):
                context.nrt.decref(builder, kind, getattr(data, name))
                setattr(data, name, cgutils.get_null_value(context.get_value_type(kind)))
        return context.get_dummy_value()

    return types.void(job, group, types.int64), codegen


@_jit
def new_job(words):
    """A job over the mailbox `words`, every slot null (`structref.new` zeroes its fields)."""
    job = structref.new(JOB)
    job.words = words
    return job


@_jit
def new_board(units, words):
    """A board of a new job over `words`, its units computed by `units`."""
    board = structref.new(BOARD)
    board.units = units
    board.job = new_job(words)
    return board


@_jit
def own_board(board):
    """A board of a new job, with the unit loop of `board` (a job run alone inside another)."""
    words = np.zeros(MAILBOX_SIZE, np.int64)
    words[CLAIM_SHIFT] = words_of(board.job)[CLAIM_SHIFT]
    return new_board(board.units, words)


@_inlined
def _used(words, slot, counter):
    if slot >= words[counter]:
        words[counter] = slot + 1


def hold_floats(job, slot, array):
    """Hold float32 `array` (C-contiguous, checked by the caller; any shape) at float slot `slot`,
    as a vector."""


def hold_grid(job, slot, array):
    """Hold float32 `array` (4 dimensions, any strides) at grid slot `slot`."""


def hold_bytes(job, slot, array):
    """Hold `array` (C-contiguous, checked by the caller; bytes or wider words) at byte slot `slot`."""


def _refuse(job, slot, array):
    raise ValueError("a pool job holds float32 arrays only in its floats and grids")


@overload(hold_floats)
def _hold_floats(job, slot, array):
    if array.dtype != types.float32:  # (the caller's check raised first)
        return _refuse

    def hold(job, slot, array):
        _hold(job, "floats", slot, flat_vector(array))
        _used(words_of(job), slot, FLOATS_USED)
    return hold


@overload(hold_grid)
def _hold_grid(job, slot, array):
    if array.dtype != types.float32 or array.ndim != 4:
        return _refuse

    def hold(job, slot, array):
        _hold(job, "grid", slot, held_any_layout(array))
        _used(words_of(job), slot, GRIDS_USED)
    return hold


@overload(hold_bytes)
def _hold_bytes(job, slot, array):
    def hold(job, slot, array):
        _hold(job, "bytes", slot, flat_bytes(array))
        _used(words_of(job), slot, BYTES_USED)
    return hold


@_inlined
def hold_matrix(job, slot, matrix):
    """Hold a float32 `matrix` (2 dimensions, its rows contiguous) at grid slot `slot`, as (1, 1, M, N)."""
    hold_grid(job, slot, matrix[np.newaxis, np.newaxis])


@_inlined
def _drop(job):
    words = words_of(job)
    _release(job, "floats", words[FLOATS_USED])
    _release(job, "grid", words[GRIDS_USED])
    _release(job, "bytes", words[BYTES_USED])
    words[FLOATS_USED] = words[GRIDS_USED] = words[BYTES_USED] = 0


@_jit
def release_finished(job):
    """Drop the references of a finished job whose arrays its caller still holds (no GIL needed)."""
    _drop(job)
