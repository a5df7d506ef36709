"""Deferred calls run through the compiled entry point numba's dispatcher would pick for them, found
while their arguments are still in cache.

A decode step's deferred calls (`open_jobs.defer`) run back to back when the thread settles, each
right after the one before streamed megabytes of weights through the caches. numba's dispatcher
then computes each argument's type and looks the types up among the function's compiled overloads,
its code and tables evicted by those weights: about 10 us a call, through which the pool's workers
wait (a two-thread SmolLM2 step is some ninety calls). `resolved` does that lookup for all of a
flush's calls first, while the step's Python has just left their arguments in cache: one C call per
call (numba's own `compute_fingerprint` of the argument tuple) and a dict lookup, to the entry point
that dispatcher call would reach. The same compiled code runs on the same arguments, so the results
are the same bits.

An entry point is learnt from the dispatcher itself (`learn`): the first call with a fingerprint runs
through the dispatcher (compiling or loading what it needs), and the overload whose signature is
exactly its arguments' types is remembered under the function, whether it is a pool job, and the
fingerprint (the function itself where there is none: a plain Python one is then called as given,
not looked up again). numba keys its own type cache on the same fingerprints, so equal fingerprints
mean the overload the dispatcher picks. A Python int of 2**63 or more has every int's fingerprint: numba types
it uint64, but its dispatcher picks an int64 overload for it where there is one (whose unboxing
raises OverflowError), as the learnt entry point does; no entry point is learnt from such a call.
Arguments numba cannot fingerprint (strings, typed containers) are never resolved: such calls
always take the dispatcher. Pool jobs take the board and worker count first: every board is
`mailbox.make_board`'s one type, and the worker count an int.
"""
from __future__ import annotations

from numba._dispatcher import compute_fingerprint

_entries: dict = {}  # (function, whether a pool job, fingerprint of its arguments) -> entry point (or function)
_LIMIT = 4096  # entries, all dropped at once beyond: a model's deferred calls have a few dozen


def resolved(calls: list) -> tuple[list, list]:
    """Each deferred call (function, arguments, whether a pool job) with its entry point in place of
    the function where one is known; and the calls to `learn` from once they ran: (key, job,
    arguments)."""
    out, unknown = [], []
    for call in calls:
        function, arguments, job = call
        try:
            key = (function, job, compute_fingerprint(arguments))
        except (NotImplementedError, ValueError):  # not fingerprinted: always the dispatcher
            out.append(call)
            continue
        entry = _entries.get(key)
        if entry is None:
            out.append(call)
            unknown.append((key, job, arguments))
        else:
            out.append((entry, arguments, job))
    return out, unknown


def learn(key: tuple, leading: tuple, arguments: tuple) -> None:
    """Remember the entry point of the overload of `key`'s function whose signature is exactly the
    types of leading + arguments (a call made through the dispatcher), or the function itself when
    there is none (plain Python, or an overload the dispatcher converted to): learnt once, called
    as given. Nothing from a call with an int typed uint64 (under the fingerprint of every int,
    which the dispatcher gives int64's overload where there is one)."""
    if key in _entries or _has_large_int(arguments):
        return
    function = key[0]
    overloads = getattr(function, "overloads", None)  # a dispatcher's
    compiled = None
    if overloads is not None:
        compiled = overloads.get(tuple(function.typeof_pyval(value) for value in (*leading, *arguments)))
    if len(_entries) >= _LIMIT:  # (functions made per call, closures, would otherwise pile up)
        _entries.clear()
    _entries[key] = function if compiled is None else compiled.entry_point


def _has_large_int(values: tuple) -> bool:
    """Whether an int in `values` (or in tuples within) is 2**63 or more: numba types it uint64."""
    return any(_has_large_int(value) if type(value) is tuple else type(value) is int and value >= 1 << 63
               for value in values)


def run(calls: list, board, workers: int, wake=None) -> None:
    """Run deferred calls in order, pool jobs as job(board, workers, *arguments); `wake()` (if given)
    before the first job and before each job after a call that is not one."""
    direct, unknown = resolved(calls)
    woken = False
    for function, arguments, job in direct:
        if job:
            if not woken and wake is not None:
                wake()
                woken = True
            function(board, workers, *arguments)
        else:
            function(*arguments)
            woken = False
    for key, job, arguments in unknown:
        learn(key, (board, workers) if job else (), arguments)
