"""Shape memos read ahead: a decode step's growing shapes computed for the next steps at once.

A decode step's past length is a new key for every memo whose roots grow with the cache (the causal
mask, the cache's reshape targets): a few memos a step. A miss runs its members cold, between
kernels that stream megabytes of weights through the caches, several times slower than when run
again right away. So when a memo misses on roots grown since its last miss by one position (in each
dimension that changed), or by one more than it read ahead then, its members also run, while hot,
for the next READ_AHEAD steps of one position each: the roots stand-ins of those shapes (a memo
reads its roots for their shapes only; the stand-ins keep their dtypes), each external value
(another memo's output) that memo's result for the same step: the one it read ahead, or its current
one when that memo's key did not change since an earlier run or the value is the very array the
reading memo had at its last miss (a memo that finds its result kept, from another generation,
misses no more and its state keeps naming an older key: a causal mask's memo would otherwise miss
cold at every step of a second generation). A memo reading any other value does not read ahead.
Results are kept under the keys they were computed for, so a wrong guess costs only its computation;
a memo that misses within what it read ahead reads ahead no more. A memo that missed right after
everything it read ahead reads twice as far the next time, up to MAX_READ_AHEAD: fewer misses, each
a cold start, in a long decode, little computed for a short one.
Each step read ahead is also known by its externals' identity (they are the arrays the step will be
handed), so that step need not hash their bytes to find its result.
"""
from __future__ import annotations

import weakref

import numpy as np

from runnx.ops._fused_common import stand_in

READ_AHEAD = 8  # decode steps a memo's first miss computes ahead
MAX_READ_AHEAD = 16  # and its later misses at most, doubling
# id(kept array) -> (weak references to it and its memo, the memo's key, output index): where an
# external comes from (weak: the map keeps neither a model's memos nor their results alive)
ORIGINS: dict[int, tuple] = {}


class AheadState:
    """What a memo's read-ahead knows: its roots' shapes at its last miss, the run of that miss,
    the key it missed and the keys it read ahead from there, its externals then (weakly), how many
    steps its next miss reads ahead (`span`); `off` once a guess failed."""

    __slots__ = ("shapes", "run", "key", "keys", "externals", "span", "off")

    def __init__(self):
        self.shapes, self.run, self.key, self.keys, self.span, self.off = None, None, None, (), READ_AHEAD, False
        self.externals = ()


def _register(group, key: tuple, result: tuple) -> None:
    """Remember `result`'s arrays as `group`'s outputs for `key`, while they live."""
    for index, value in enumerate(result):
        if type(value) is np.ndarray:
            ORIGINS[id(value)] = (weakref.ref(value, _forget(id(value))), weakref.ref(group), key, index)


def _forget(identity: int):
    return lambda _: ORIGINS.pop(identity, None)


def read_ahead(group, key: tuple, result: tuple, args: tuple, ctx) -> None:
    """After `group` missed `key` (its roots' shapes, then its externals' value keys) on `args` and
    kept `result`: compute and keep the next steps' when its roots grew as decoding grows them."""
    _register(group, key, result)
    state = group.ahead
    count = len(group.roots)
    shapes, last, covered, seen = key[:count], state.shapes, len(state.keys), state.externals
    state.shapes, state.run, state.key, state.keys = shapes, ctx.serial, key, ()
    state.externals = tuple([_weak(value) for value in args[count:]])
    if state.off or last is None:
        return
    growing, grown_by = _growing(last, shapes)
    if growing is None:
        return
    if grown_by <= covered:  # a key it read ahead came with other externals: its guesses fail
        state.off = True
        ctx.count("ShapeMemo.read_ahead_off")
        return
    if grown_by not in (1, covered + 1):  # neither a decode step nor the next after those read ahead
        return
    if covered and grown_by == covered + 1:  # every step it read ahead came: read further
        state.span = min(2 * state.span, MAX_READ_AHEAD)
    futures = _future_externals(args[count:], ctx.serial, state.span, seen)
    if futures is None:
        return
    steps = min([len(future) for future in futures], default=state.span)
    keys = []
    for step in range(steps):
        externals = [future[step] for future in futures]
        roots = [stand_in(root.dtype, _grown(root.shape, growing.get(index, ()), step + 1))
                 for index, root in enumerate(args[:count])]
        shapes = tuple([root.shape for root in roots])
        future_key = shapes + tuple([value_key(e) for e in externals])
        result = group.results.get(future_key)
        if result is None:
            try:
                result = group.compute((*roots, *externals), ctx)
            except Exception:  # a guess no step may make (a length past a limit): it is no miss either
                break
            if not group.keep(future_key, result):
                break
            _register(group, future_key, result)
            ctx.count("ShapeMemo.read_ahead")
        if externals:  # that step's lookup by the externals' identity, not by hashing their bytes then
            group.know(shapes, tuple(externals), result)
        keys.append(future_key)
    state.keys = tuple(keys)


def value_key(value):
    """A hashable key equal exactly for equal values (object arrays and sequences: a list, so the
    result is computed and not kept)."""
    if type(value) is np.ndarray and value.dtype.kind != "O":
        return value.dtype.str, value.shape, value.tobytes()
    return [value]


def _growing(last: tuple, shapes: tuple) -> tuple:
    """({root index: its growing axes}, by how much) when `shapes` are `last` with some dimensions
    larger by one same amount and the others equal, else (None, 0)."""
    if len(last) != len(shapes):
        return None, 0
    growing, steps = {}, set()
    for index, (before, now) in enumerate(zip(last, shapes)):
        if type(before) is not tuple or type(now) is not tuple or len(before) != len(now):
            return None, 0
        axes = tuple([axis for axis, (b, n) in enumerate(zip(before, now)) if b != n])
        if axes:
            growing[index] = axes
            steps.update(now[axis] - before[axis] for axis in axes)
    if len(steps) != 1 or min(steps) < 1:
        return None, 0
    return growing, steps.pop()


def _grown(shape: tuple, axes: tuple, step: int) -> tuple:
    return tuple([size + step if axis in axes else size for axis, size in enumerate(shape)])


def _weak(value):
    try:
        return weakref.ref(value)
    except TypeError:  # a value no weak reference can hold (None, a sequence): never the same again
        return _dead


def _dead():
    """A dead weak reference's stand-in."""
    return None


def _future_externals(externals: tuple, run: int, span: int, seen: tuple = ()) -> list | None:
    """For each external value, its values in the next steps (as many as known, at least one):
    what its memo read ahead past its current key, or the value itself (`span` times) when its
    memo's key has not changed since an earlier run, or when it is the very array the reading memo
    had at its last miss (`seen`, weakly: a memo found by its kept result missed no more, and its
    own state still names an older key, a prefill's, or another generation's); None when an
    external is no memo's output or unknown."""
    futures = []
    for position, value in enumerate(externals):
        origin = ORIGINS.get(id(value))
        if origin is None or origin[0]() is not value or value.dtype.kind == "O":
            return None
        _, producer, key, index = origin
        producer = producer()
        if producer is None:
            return None
        state = producer.ahead
        if state.key == key:
            keys = state.keys
        elif key in state.keys:
            keys = state.keys[state.keys.index(key) + 1:]
        else:  # the producer found this result kept: its state names an older key
            keys = ()
        if keys:
            results = [producer.results.get(k) for k in keys]
            if None in results:
                return None
            futures.append([result[index] for result in results])
        elif (state.key == key and state.run != run) or (position < len(seen) and seen[position]() is value):
            futures.append([value] * span)  # steady
        else:
            return None
    return futures
