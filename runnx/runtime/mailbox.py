"""The decode pool's native side (`pool.py` starts the threads and calls the jobs): the
mailbox, an int64 array every thread reads and writes with the atomic instructions of
`atomics.py` (its layout in `slots.py`), and the loop every thread runs over it: claim units of
the posted job, compute them (`units.py`), count them done. The jobs are posted by `jobs.py`.

Threads claim units with compare-and-swap on a counter tagged with the job's sequence number, so
the caller never waits for a worker that has not started (it takes the units itself) and a late
worker cannot claim a later job's unit with an earlier job's fields (the caller retags the counter
before it rewrites them). The caller waits only for units a worker has claimed, then returns.
Every thread, the caller as well as the workers, computes units through one compiled copy of the
unit loop (`_units_entry`, called by the address in the mailbox): a result never depends on which
thread took which unit.
Each job says how long a worker spins after it (`LINGER`): decode jobs come every few microseconds.
"""
from __future__ import annotations

import threading

import numba
import numpy as np

from runnx.ops import _jit_cache  # noqa: F401  (numba caches this module's kernels under RUNNX_CACHE)
from runnx.runtime.addresses import call_units
from runnx.runtime.atomics import add, compare_and_swap, load, pause, store
from runnx.runtime.slots import (CLAIM, CLAIM_SHIFT, COMPLETED, FIRST_PHASE, IDLE, INDEX_BITS, KIND, LINGER,
                                 MAILBOX_SIZE, NOTHING_TO_CLAIM, POSTED, SHARED, STOP, UNITS, UNITS_CODE)
from runnx.runtime.units import compute_unit

DEFAULT_CLAIM_SHIFT = 3  # a claim takes an eighth of the units left
SEQUENCES = (1 << 31) - 1  # job numbers wrap here, so that the tagged counter stays positive
PATIENCE = 1 << 16  # polls (each a `pause`) before a worker sleeps: about 2.5 ms here

_jit = numba.njit(cache=True, nogil=True, error_model="numpy")


@_jit
def _work(box, sequence):
    """Claim and compute units of job `sequence` until none are left (or a later job is posted);
    returns how many it computed. A claim takes an eighth of the units left (at least one): a
    large job's claims are a few dozen atomic swaps, not one a unit, and its last units still go
    one at a time to whichever thread is free. A job of two phases (`FIRST_PHASE`): no claim spans
    both, and a second-phase claim waits until the first phase is complete (its units are all
    claimed by then, and their threads wait for nothing)."""
    computed = 0
    while True:
        claim = load(box, CLAIM)
        first, units = claim & NOTHING_TO_CLAIM, load(box, UNITS)
        if claim >> INDEX_BITS != sequence or first >= units:
            return computed  # (a later job's unit count read here: its retag fails the swap below)
        take = max(1, (units - first) >> load(box, CLAIM_SHIFT))
        phase = load(box, FIRST_PHASE)
        if first < phase:
            take = min(take, phase - first)  # a claim never spans the two phases
        if compare_and_swap(box, CLAIM, claim, claim + take):  # the fields stay this job's until it is done
            if 0 < phase <= first:  # every first-phase unit is claimed: wait for the threads computing them
                while load(box, COMPLETED) < phase:
                    pause()
            kind = load(box, KIND)
            for unit in range(first, first + take):
                compute_unit(box, kind, unit)
            add(box, COMPLETED, take)
            computed += take


def _units_entry(box_data, sequence):
    """`_work` on the mailbox at box_data: compiled once, as a C function (`_units_address`)."""
    return _work(numba.carray(box_data, (MAILBOX_SIZE,)), sequence)


_units_compiled = None
_units_lock = threading.Lock()


def _units_address() -> int:
    """The address of `_units_entry`, compiled (or loaded from numba's cache) on first use, by one
    thread: a first prompt's first job waits for the pool's background start loading it (0.1-0.4 s)
    rather than load it again beside it. Every thread computes a job's units through it, the caller
    as well as the workers: numba inlines a kernel into each function that calls it, and LLVM may
    vectorise the copies differently (with the kernels' reassociating float flags, 1 ulp apart on
    some rows, depending on the CPU and on what was compiled first), so which thread took a unit
    would change the result."""
    global _units_compiled
    if _units_compiled is None:
        with _units_lock:
            if _units_compiled is None:
                signature = numba.types.int64(numba.types.CPointer(numba.types.int64), numba.types.int64)
                _units_compiled = numba.cfunc(signature, cache=True, error_model="numpy")(_units_entry)
    return _units_compiled.address


def new_box() -> np.ndarray:
    """A mailbox for a pool of workers or for a job run alone."""
    box = np.zeros(MAILBOX_SIZE, np.int64)
    box[UNITS_CODE] = _units_address()
    box[CLAIM_SHIFT] = DEFAULT_CLAIM_SHIFT
    return box


@_jit
def own_box(box):
    """A new mailbox that calls the same unit code as `box` (a job run alone inside another)."""
    alone = np.zeros(MAILBOX_SIZE, np.int64)
    alone[UNITS_CODE] = box[UNITS_CODE]
    alone[CLAIM_SHIFT] = box[CLAIM_SHIFT]
    return alone


@_jit
def serve(box, worker):
    """Worker `worker`'s loop: returns True when told to stop, False when it has been idle for as
    many polls as its last job said (`LINGER`)."""
    store(box, IDLE + worker, 0)
    handled, polls, patience = -1, 0, 0
    while not load(box, STOP):
        posted = load(box, POSTED)
        if posted != handled:
            computed = call_units(load(box, UNITS_CODE), box, posted)
            if computed:
                add(box, SHARED, computed)
            handled, polls, patience = posted, 0, load(box, LINGER)
        elif polls < patience:
            polls += 1
            pause()
        else:
            store(box, IDLE + worker, 1)
            if load(box, POSTED) == handled:  # nothing posted in between: the caller will wake us
                return False
            store(box, IDLE + worker, 0)
    return True


@_jit
def finish(box):
    """Take the units left of the last job posted (`open_job`) and wait for those workers claimed:
    on return every unit of every job posted on `box` is complete. Called by the box's poster only."""
    call_units(load(box, UNITS_CODE), box, load(box, POSTED))
    while load(box, COMPLETED) < load(box, UNITS):
        pause()


@_jit
def begin_job(box, linger):
    """The next job's sequence number, its counter retagged so that no unit of it can be claimed
    (nor one of an earlier job) while the caller writes its fields (`linger` the first); the last
    job first finished (`finish`: retagged, its unclaimed units could never complete)."""
    finish(box)
    sequence = (load(box, POSTED) + 1) & SEQUENCES
    store(box, CLAIM, (sequence << INDEX_BITS) | NOTHING_TO_CLAIM)
    store(box, LINGER, linger)
    store(box, FIRST_PHASE, 0)
    return sequence


@_jit
def open_job(box, workers, sequence, units):
    """Open job `sequence` of `units` units to the workers and return at once, before any unit is
    computed: whether a worker was idle (asleep or falling asleep) when it was posted. The job's
    arrays must live until `finish` (or the next `begin_job`) returns."""
    store(box, UNITS, units)
    store(box, COMPLETED, 0)
    store(box, CLAIM, sequence << INDEX_BITS)
    store(box, POSTED, sequence)
    idle = False
    for worker in range(workers):
        idle |= load(box, IDLE + worker) != 0
    return idle


@_jit
def run_job(box, workers, sequence, units):
    """Open job `sequence` of `units` units, take units of it, wait for those workers claimed;
    returns whether a worker was idle (asleep or falling asleep) when the job was posted."""
    idle = open_job(box, workers, sequence, units)
    finish(box)
    return idle


@_jit
def rest(box):
    """An empty job after which workers sleep at once."""
    run_job(box, 0, begin_job(box, 0), 0)


@_jit
def stop(box):
    store(box, STOP, 1)
