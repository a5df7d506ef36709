"""Pool jobs left open and calls deferred: a kernel may return while the decode pool's workers
still compute its output, so that the calling thread runs the plan's next steps meanwhile (the
Python between two kernels, which two threads would otherwise spend one waiting for the other).

A compiled plan (interp/compiled.py) gives a kernel declaring `overlaps_jobs` leave for its call
(`opening.allowed`); the kernel's post (`pool.DecodePool.products`, `open_nbits`) then returns at
once and the pool keeps the job's arrays and its lock (`holding.pool`) until this thread settles:
the plan settles before the next step that is not declared so (or that reads, from Python, data a
pending step may write: `reads_data`), and after its last step, and the pool's next post on this
thread finishes the job before it reads anything. Everything is this thread's: another thread
finds the pool busy and computes alone. No numpy here: `interp` imports these names through
`runnx.runtime`.

A kernel given leave may instead defer its native calls (`defer`): it allocates its outputs, decides
from its inputs' shapes and layouts alone that the calls will write them, queues the calls and
returns. The plan's next steps of such kernels queue theirs behind it, and everything runs in order
when the thread settles (or first thing in any post that computes now: nothing overtakes a queued
call). So the Python of a run of fused nodes runs back to back, ahead of their native calls,
instead of between them, where each layer's weights streamed through the caches evict the
interpreter's state (the same checks take several times longer there); and the native calls run
back to back after it.
"""
from __future__ import annotations

import threading


class _Opening(threading.local):
    """This thread's leave to return with a job open: `allowed` is set by a compiled plan around a
    call of a kernel declaring `overlaps_jobs`, for that call only."""
    allowed = False


class _Holding(threading.local):
    """The pool whose lock this thread holds through a job it left open (`pool`), or None."""
    pool = None


class _Deferred(threading.local):
    """This thread's calls deferred by kernels given leave (`defer`), in order, or None; and how
    many it has deferred so far."""
    calls = None
    count = 0


opening = _Opening()
holding = _Holding()
deferred = _Deferred()


def take_leave() -> bool:
    """This call's leave (`opening.allowed`), taken by a kernel for its own last job: no leave from
    now on, so that the kernels it calls before that finish their jobs."""
    allowed, opening.allowed = opening.allowed, False
    return allowed


def defer(function, arguments: tuple, job: bool = False) -> None:
    """Queue function(*arguments), or with `job` the pool job function(board, workers, *arguments)
    (`pool.shared_call`'s), to run when this thread next settles or computes now: for a kernel
    given leave (`take_leave`), whose outputs it writes; it reads only what the plan's earlier
    steps computed or queued, and raises only as a kernel's native code would on arrays the kernel
    checked before queueing it."""
    calls = deferred.calls
    if calls is None:
        deferred.calls = [(function, arguments, job)]
    else:
        calls.append((function, arguments, job))
    deferred.count += 1


def deferring() -> bool:
    """Whether this thread has deferred calls waiting: a kernel whose neighbours leave jobs open to
    the pool's workers rather than defer may join such a queue, where starting one would hold the
    workers idle through the Python after it."""
    return deferred.calls is not None


def run_deferred() -> None:
    """Run this thread's deferred calls, in order (`pool.run_calls`: the pool taken once for them),
    and any they defer in turn."""
    from runnx.runtime.pool import run_calls
    while (calls := deferred.calls) is not None:
        deferred.calls = None
        run_calls(calls)


def drop_deferred() -> None:
    """Forget this thread's deferred calls: for a run that failed, whose outputs (and the spare rows
    of caches beyond what it returns) they would have written."""
    deferred.calls = None


def settle() -> None:
    """Run this thread's deferred calls and finish the job it left open, if any: before anything
    reads what they write or writes what they read."""
    if deferred.calls is not None:
        run_deferred()
    pool = holding.pool
    if pool is not None:
        pool.settle()
