"""Pool jobs left open: a kernel may return while the decode pool's workers still compute its
output, so that the calling thread runs the plan's next steps meanwhile (the Python between two
kernels, which two threads would otherwise spend one waiting for the other).

A compiled plan (interp/compiled.py) gives a kernel declaring `overlaps_jobs` leave for its call
(`opening.allowed`); the kernel's post (`pool.DecodePool.products`, `open_nbits`) then returns at
once and the pool keeps the job's arrays and its lock (`holding.pool`) until this thread settles:
the plan settles before the next step that is not declared so, and after its last step, and the
pool's next post on this thread finishes the job before it reads anything. Everything is this
thread's: another thread finds the pool busy and computes alone. No numpy here: `interp` imports
these names through `runnx.runtime`.
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


opening = _Opening()
holding = _Holding()


def take_leave() -> bool:
    """This call's leave (`opening.allowed`), taken by a kernel for its own last job: no leave from
    now on, so that the kernels it calls before that finish their jobs."""
    allowed, opening.allowed = opening.allowed, False
    return allowed


def settle() -> None:
    """Finish the job this thread left open, if any: before anything reads what it writes or
    writes what it reads."""
    pool = holding.pool
    if pool is not None:
        pool.settle()
