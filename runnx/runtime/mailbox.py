"""The decode pool's native side (`pool.py` starts the threads and calls the jobs): the
mailbox, an int64 array every thread reads and writes with the atomic instructions of
`atomics.py` (its layout in `slots.py`; it is a job's `words`, `board.py`), and the loop every
thread runs over it: claim units of the posted job, compute them (`units.py`), count them done.
The jobs are posted by `jobs.py`.

Threads claim units with compare-and-swap on a counter tagged with the job's sequence number, so
the caller never waits for a worker that has not started (it takes the units itself) and a late
worker cannot claim a later job's unit with an earlier job's fields (the caller retags the counter
before it rewrites them). The caller waits only for units a worker has claimed, then returns.
Every thread, the caller as well as the workers, computes units through one compiled copy of the
unit loop (`_units_entry`, the board's `units`): a result never depends on which thread took which
unit.
Each job says how long a worker spins after it (`LINGER`): decode jobs come every few microseconds.
A worker that stops spinning sleeps inside `serve`, in the kernel, until the mailbox's job number
changes (`atomics.sleep_while`, Linux's futex), and whoever posts the next job wakes it from native
code (`open_job`): it never returns to Python, so it never waits for the GIL (a worker sleeping on a
Python Event needed it to wake, and while it waited, each of the caller's GIL releases, a nogil
kernel's call, cost a futex wake of about 13 us here). Where there is no futex (`NATIVE_SLEEP`
False) `serve` returns and `pool.py` puts the worker to sleep on its Event. A decode step's jobs
(one-row products, the decode attention, 4-bit and 8-bit rows) linger through the Python between a
step's last job and the next step's first (`STEP_PATIENCE`), so the next step's first job finds them
spinning. A prompt's jobs (`post_gemms`, the attention in blocks) keep the shorter `PATIENCE`: while
workers spin, a prompt's row kernels run on one thread (`runtime/rows.py`).
"""
from __future__ import annotations

import threading

import numba
import numba.experimental.function_type  # noqa: F401  (numba types a C callback as a first-class function)
import numpy as np

from runnx.ops import _jit_cache  # noqa: F401  (numba caches this module's kernels under RUNNX_CACHE)
from runnx.runtime.atomics import FUTEX, add, compare_and_swap, load, pause, sleep_while, store, wake_sleepers
from runnx.runtime.board import JOB, new_board, release_finished, words_of
from runnx.runtime.slots import (CLAIM, CLAIM_SHIFT, COMPLETED, FIRST_PHASE, IDLE, INDEX_BITS, KIND, LINGER,
                                 MAILBOX_SIZE, NOTHING_TO_CLAIM, POSTED, SHARED, STOP, UNITS)
from runnx.runtime.units import compute_unit

DEFAULT_CLAIM_SHIFT = 3  # a claim takes an eighth of the units left
SEQUENCES = (1 << 31) - 1  # job numbers wrap here, so that the tagged counter stays positive
PATIENCE = 1 << 16  # polls (each a `pause`) before a worker sleeps: about 2.5 ms here
STEP_PATIENCE = 1 << 18  # after a decode step's jobs: about 10 ms here, past a step's Python (3-5 ms)
NATIVE_SLEEP = FUTEX  # idle workers sleep inside `serve` and posts wake them (else on their Events, `pool.py`)

_jit = numba.njit(cache=True, nogil=True, error_model="numpy")


@_jit
def _work(job, sequence):
    """Claim and compute units of job `sequence` until none are left (or a later job is posted);
    returns how many it computed. A claim takes an eighth of the units left (at least one): a
    large job's claims are a few dozen atomic swaps, not one a unit, and its last units still go
    one at a time to whichever thread is free. A job of two phases (`FIRST_PHASE`): no claim spans
    both, and a second-phase claim waits until the first phase is complete (its units are all
    claimed by then, and their threads wait for nothing)."""
    box = words_of(job)
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
                compute_unit(job, kind, unit)
            add(box, COMPLETED, take)
            computed += take


def _units_entry(job, sequence):
    """`_work` on `job`: compiled once, as a C callback (`_units`), which every board calls."""
    return _work(job, sequence)


_units_compiled = None
_units_lock = threading.Lock()


def _units():
    """`_units_entry` compiled (or loaded from numba's cache) on first use, by one thread: a first
    prompt's first job waits for the pool's background start loading it (0.1-0.4 s) rather than
    load it again beside it. Every thread computes a job's units through it, the caller as well as
    the workers: numba inlines a kernel into each function that calls it, and LLVM may vectorise
    the copies differently (with the kernels' reassociating float flags, 1 ulp apart on some rows,
    depending on the CPU and on what was compiled first), so which thread took a unit would change
    the result."""
    global _units_compiled
    if _units_compiled is None:
        with _units_lock:
            if _units_compiled is None:
                signature = numba.types.int64(JOB, numba.types.int64)
                _units_compiled = numba.cfunc(signature, cache=True, error_model="numpy")(_units_entry)
    return _units_compiled


def make_board() -> tuple:
    """A board (`board.py`) for a pool of workers or for a job run alone, and its mailbox's words
    (which Python reads: the workers' idle flags, the units they computed)."""
    words = np.zeros(MAILBOX_SIZE, np.int64)
    words[CLAIM_SHIFT] = DEFAULT_CLAIM_SHIFT
    return new_board(_units(), words), words


@_jit
def serve(board, worker):
    """Worker `worker`'s loop: returns True when told to stop; once idle for as many polls as its
    last job said (`LINGER`), it sleeps until the next job is posted (`NATIVE_SLEEP`), or returns
    False for its thread to sleep (elsewhere). Its idle flag is set while it sleeps: a poster
    that reads it set wakes it (`open_job`), and one that reads it clear posted before the worker
    looked at the job number again (both sequentially consistent), so no wake-up is lost."""
    units, job = board.units, board.job
    box = words_of(job)
    store(box, IDLE + worker, 0)
    handled, polls, patience = -1, 0, 0
    while not load(box, STOP):
        posted = load(box, POSTED)
        if posted != handled:
            computed = units(job, posted)
            if computed:
                add(box, SHARED, computed)
            handled, polls, patience = posted, 0, load(box, LINGER)
        elif polls < patience:
            polls += 1
            pause()
        else:
            store(box, IDLE + worker, 1)
            if load(box, POSTED) == handled and not load(box, STOP):  # nothing posted in between
                if not NATIVE_SLEEP:
                    return False  # (the caller will wake its thread)
                sleep_while(box, POSTED, handled)
            store(box, IDLE + worker, 0)
            polls = patience  # (woken for nothing new: asleep again at once)
    return True


@_jit
def finish(board):
    """Take the units left of the last job posted (`open_job`) and wait for those workers claimed:
    on return every unit of every job posted on `board` is complete. Called by the board's poster
    only."""
    box = words_of(board.job)
    board.units(board.job, load(box, POSTED))
    while load(box, COMPLETED) < load(box, UNITS):
        pause()


@numba.njit(cache=True, error_model="numpy")
def finish_and_release(board):
    """`finish`, then the job's arrays released, with the GIL (`board.py`: a job left open past its
    posting call). It waits holding the GIL: by the time its poster finishes it, a job left
    open is done or nearly."""
    finish(board)
    release_finished(board.job)


@_jit
def begin_job(board, linger):
    """The next job's sequence number, its counter retagged so that no unit of it can be claimed
    (nor one of an earlier job) while the caller writes its fields (`linger` the first); the last
    job first finished (`finish`: retagged, its unclaimed units could never complete). Its poster
    released its arrays (`board.py`)."""
    finish(board)
    box = words_of(board.job)
    sequence = (load(box, POSTED) + 1) & SEQUENCES
    store(box, CLAIM, (sequence << INDEX_BITS) | NOTHING_TO_CLAIM)
    store(box, LINGER, linger)
    store(box, FIRST_PHASE, 0)
    return sequence


@_jit
def open_job(board, workers, sequence, units):
    """Open job `sequence` of `units` units to the workers and return at once, before any unit is
    computed: whether a worker was idle (asleep or falling asleep) when it was posted (woken now:
    `wake_idle`). The job's arrays are held (`board.py`) until it is released."""
    box = words_of(board.job)
    store(box, UNITS, units)
    store(box, COMPLETED, 0)
    store(box, CLAIM, sequence << INDEX_BITS)
    store(box, POSTED, sequence)
    return wake_idle(box, workers)


@_jit
def wake_idle(box, workers):
    """Wake the first `workers` workers of mailbox `box` that are asleep or falling asleep (their idle
    flags set; `NATIVE_SLEEP`); whether there was one (where workers sleep on Events, the
    caller wakes them)."""
    idle = False
    for worker in range(workers):
        idle |= load(box, IDLE + worker) != 0
    if idle and NATIVE_SLEEP:
        wake_sleepers(box, POSTED)
    return idle


@_jit
def run_job(board, workers, sequence, units):
    """Open job `sequence` of `units` units, take units of it, wait for those workers claimed;
    returns whether a worker was idle (asleep or falling asleep) when the job was posted."""
    idle = open_job(board, workers, sequence, units)
    finish(board)
    return idle


@_jit
def rest(board):
    """An empty job after which workers sleep at once."""
    run_job(board, 0, begin_job(board, 0), 0)


@_jit
def stop(board):
    box = words_of(board.job)
    store(box, STOP, 1)
    wake_sleepers(box, POSTED)
