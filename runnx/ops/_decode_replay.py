"""Decode rows replayed: a fused layer node's native arguments kept from one decode step to the next.

A decode step hands a layer's fused node (`decoder_layers.py`) the same weights and kept shape-memo
results as the step before, and a few arrays of its own: the query row, the residual, the grown
caches, the mask, the rotary tables. Checking all of its inputs and making the native call's
arguments from them cost tens of microseconds of Python a node in a decode step (nodes prepared
back to back after a cold start cost as much as apart: the cost is the Python itself). So
a node keeps, in its `state` (the registry's per-node, per-thread slot), a replay of its last decode
row: the native arguments and the inputs they came from. A later step whose other inputs are the
same objects (their checks hold) makes anew only what a step changes, checked as the first step
checked it (by the same helpers), and the buffers the call writes and reads back (query rows,
attention outputs, split heads) are the thread's own, used again. A run of layer boundaries
(GatedLayersRun) replays its nodes' rows as one native loop (`RunReplay`). `enabled` False (A/B)
makes every row afresh.
"""
from __future__ import annotations

import inspect
import weakref
from operator import is_, itemgetter

import numba
import numpy as np

from runnx.ops import _native
from runnx.ops._decode_blocks import RUN_CHUNK, attended_gated_mlp_rope_append
from runnx.ops._kernels_fused import rope_append_into
from runnx.ops.fused import repeated_kv_cache
from runnx.ops.fused_rotary import rope_cache_fits

enabled = True
_FLOAT32 = np.dtype(np.float32)


class _Replay:
    """Native arguments with the inputs they came from: those not in `changing` are kept, to be
    found the same objects again. Of the arguments, those a step makes (positions `made`) are not
    kept, and the cache buffers (positions `buffers`) are kept weakly: a replay holds nothing a step
    gave it, and no cache a finished generation let go."""

    __slots__ = ("count", "statics", "kept", "arguments", "buffers")

    def __init__(self, inputs: tuple, arguments: tuple, changing: tuple, made: tuple, buffers: tuple = ()):
        self.count = len(inputs)
        self.statics = itemgetter(*[p for p in range(len(inputs)) if p not in changing])
        self.kept = self.statics(inputs)
        self.buffers = tuple([weakref.ref(arguments[p]) for p in buffers])
        self.arguments = tuple([None if p in made or p in buffers else a for p, a in enumerate(arguments)])

    def same(self, inputs: tuple) -> bool:
        """Whether `inputs` are the kept ones but for those a step changes."""
        return len(inputs) == self.count and all(map(is_, self.statics(inputs), self.kept))


def replay_enabled() -> bool:
    """Whether replays are made and used (`enabled`, and compiled kernels on)."""
    return enabled and _native.enabled


def replayed(state, inputs: tuple, ctx=None):
    """This thread's replay of the node (`state`) for `inputs`, when it fits, else None."""
    replay = getattr(state, "replay", None) if state is not None and replay_enabled() else None
    return None if replay is None else replay.arguments_for(inputs, ctx)


def remember(state, replay) -> None:
    """Keep this thread's replay of the node (None: none)."""
    if state is not None and enabled:
        state.replay = replay


# -- an RMSNorm layer boundary (AttentionGatedMLPRopeAppend) -----------------------------------------
# where `attended_gated_mlp_rope_append`'s arguments (its mailbox and workers aside; its last, `rope`,
# `rope_append_into`'s, flattened here: `nested` makes the call's) hold what a step changes (the
# query, keys and values first): the attention's bias and output, the MLP's residual row, the caches
# and their buffers, the rotary tables, found by the kernels' parameter names
_CHAINED = list(inspect.signature(attended_gated_mlp_rope_append.py_func).parameters)[2:]
_ROPE_ARGUMENTS = list(inspect.signature(rope_append_into.py_func).parameters)
_ROPE = _CHAINED.index("rope")
_AT = {**{name: p for p, name in enumerate(_CHAINED[:-1])},
       **{name: _ROPE + p for p, name in enumerate(_ROPE_ARGUMENTS)}}
_BIAS, _OUT, _ROW, _PAST, _TABLES = _AT["bias"], _AT["out"], _AT["residual"], _AT["past_key"], _AT["query_cos"]
# the inputs that `repeated_kv_cache` reads (by its parameters' names), and the next layer's caches and rotary
# tables
_CACHE_NAMES = tuple([n for n in inspect.signature(repeated_kv_cache).parameters if n != "ctx"])
_ROPE_NAMES = ("past_key", "past_value", "query_cos", "query_sin", "key_cos", "key_sin")


def nested(arguments: tuple) -> tuple:
    """`attended_gated_mlp_rope_append`'s arguments (after its mailbox and workers) from their flat
    form here: `rope_append_into`'s, at the end, as its one `rope` tuple."""
    return (*arguments[:_ROPE], arguments[_ROPE:])


class GatedPositions:
    """Where an AttentionGatedMLPRopeAppend's inputs are, found by name (`block`: AttentionGatedMLP's
    input names, `rope`: ProjectedRopeAppend's after them, `decoder_layers.py`): those a decode step
    changes (the query heads, the caches, the bias and all the repeat and the mask are made from,
    the residual; the next layer's caches and rotary tables), and getters of them."""

    __slots__ = ("changing", "residual", "cache", "rope", "width", "chained", "shared", "grown")

    def __init__(self, block: tuple, rope: tuple):
        at = {name: position for position, name in enumerate(block)}
        at_rope = {name: len(block) + position for position, name in enumerate(rope)}
        self.residual = at["residual"]
        cache, tables = [at[n] for n in _CACHE_NAMES], [at_rope[n] for n in _ROPE_NAMES]
        self.changing = tuple(sorted({*cache, self.residual, *tables}))
        self.cache, self.rope = itemgetter(*cache), itemgetter(*tables)
        # for a run of boundaries (GatedLayersRun): the node's input count; the inputs the boundary
        # before computes (query, caches, residual); those every boundary of a step reads alike (the
        # rest of the attention's cache inputs: the mask and the head repeat's shapes; the rotary
        # tables); the caches the node grows
        self.width = len(block) + len(rope)
        self.chained = (at["query"], at["key"], at["value"], self.residual)
        self.shared = tuple([p for p in cache if p not in self.chained] + tables[2:])
        self.grown = (tables[0], tables[1])


class GatedRopeReplay(_Replay):
    """An RMSNorm layer boundary's decode row (`attended_gated_mlp_rope_append`'s arguments): made
    anew are the attention's query, caches and bias (`repeated_kv_cache`: a plain head repeat, the
    mask's bias), the residual row (of the shape it had) and the next layer's caches and rotary
    tables (`rope_cache_fits`; views of the same buffers). `heads` are the split heads the call
    writes, for RopeAppend's kernel when the call finds no room to append; `at` where the node's
    inputs are."""

    __slots__ = ("heads", "at", "query_shape", "residual_shape")

    def __init__(self, inputs: tuple, arguments: tuple, heads: tuple, at: GatedPositions):
        super().__init__(inputs, arguments, at.changing,
                         (0, 1, 2, _BIAS, _ROW, _PAST, _PAST + 2, *range(_TABLES, _TABLES + 4)), (_PAST + 1, _PAST + 3))
        self.heads, self.at = heads, at
        self.query_shape, self.residual_shape = inputs[0].shape, inputs[at.residual].shape

    def arguments_for(self, inputs: tuple, ctx=None) -> tuple | None:
        """The native arguments for this step's inputs, or None when they are not such a step."""
        if not self.same(inputs):
            return None
        query, key, value = inputs[:3]
        residual, arguments = inputs[self.at.residual], self.arguments
        if (query.dtype != _FLOAT32 or query.shape != self.query_shape or value.ndim != 4
                or value.shape[3] != arguments[_OUT].shape[3] or residual.dtype != _FLOAT32
                or residual.shape != self.residual_shape or not residual.flags.c_contiguous):
            return None
        cache = repeated_kv_cache(*self.at.cache(inputs), ctx)
        past_key, past_value, query_cos, query_sin, key_cos, key_sin = self.at.rope(inputs)
        key_buffer, value_buffer = self.buffers[0](), self.buffers[1]()
        if (cache is None or past_key.base is not key_buffer or past_value.base is not value_buffer
                or key_buffer is None or not rope_cache_fits(key_buffer.dtype, past_key, past_value, query_cos,
                                                             query_sin, key_cos, key_sin)):
            return None
        return (query, key, value, *cache, *arguments[_BIAS + 1:_ROW], residual.reshape(-1),
                *arguments[_ROW + 1:_PAST], past_key, key_buffer, past_value, value_buffer,
                query_cos, query_sin, key_cos, key_sin, *arguments[_TABLES + 4:])


class RunReplay:
    """A run of RMSNorm layer boundaries' decode rows (GatedLayersRun's members, each node's inputs
    `at.width` after the one before's): the first boundary's arguments are its replay's
    (`GatedRopeReplay.arguments_for`); each later one's are its replay's but what the boundary before
    computes (its query row, caches and residual), made natively by
    `attended_gated_mlp_rope_append_run` in chunks of RUN_CHUNK, and the bias and rotary tables, the
    first's: its other inputs must be the same objects as when its replay was made, and those every
    boundary reads alike (`GatedPositions.shared`) the first's, the caches it grows prefix views of
    the buffers its replay holds (weakly), of the first's length with room for a row. `chunks`:
    (the later boundaries' other arguments, RUN_CHUNK of them, the last repeated to fill a chunk;
    how many are the chunk's), all of one numba type (made only then)."""

    __slots__ = ("replays", "at", "chunks", "count", "statics", "kept", "shared", "first_shared", "grown", "buffers")

    def __init__(self, replays: list, at: GatedPositions, chunks: list):
        self.replays, self.at, self.chunks = replays, at, chunks
        width, later = at.width, range(1, len(replays))
        self.count = width * len(replays)
        # every later boundary's checks as one pass over the run's inputs (a per-node pass cost
        # ~7 us a node in a step)
        self.statics = itemgetter(*[j * width + p for j in later for p in range(width) if p not in at.changing])
        self.kept = tuple([a for r in replays[1:] for a in r.kept])
        self.shared = itemgetter(*[j * width + p for j in later for p in at.shared])
        self.first_shared = itemgetter(*at.shared)
        self.grown = itemgetter(*[j * width + p for j in later for p in at.grown])
        self.buffers = tuple([ref for r in replays[1:] for ref in r.buffers])

    @classmethod
    def of(cls, replays: list, at: GatedPositions) -> RunReplay | None:
        """The run of these boundaries' replays, or None when a replay is missing or the boundaries'
        arguments differ in numba types (their native loop takes one)."""
        if len(replays) < 2 or any(not isinstance(r, GatedRopeReplay) for r in replays):
            return None
        statics = [(r.arguments[_BIAS + 1:_ROW], r.arguments[_ROW + 1:_ROPE], r.arguments[_ROPE:_PAST],
                    r.arguments[_TABLES + 4:]) for r in replays[1:]]
        chunks = [statics[start:start + RUN_CHUNK] for start in range(0, len(statics), RUN_CHUNK)]
        chunks = [(tuple(chunk + chunk[-1:] * (RUN_CHUNK - len(chunk))), len(chunk)) for chunk in chunks]
        types = {numba.typeof(chunk) for chunk, _ in chunks}
        if len(types) != 1 or not isinstance(types.pop(), numba.types.UniTuple):
            return None
        return cls(replays, at, chunks)

    def arguments_for(self, inputs: tuple, ctx=None) -> tuple | None:
        """(the first boundary's `attended_gated_mlp_rope_append` arguments; for each chunk of the
        later ones, `attended_gated_mlp_rope_append_run`'s after its rotated query and sum; every
        boundary's grown key and value buffers; the caches' length before the step) for this
        step's inputs, or None."""
        if len(inputs) != self.count or not all(map(is_, self.statics(inputs), self.kept)):
            return None
        first_inputs = inputs[:self.at.width]
        shared = self.first_shared(first_inputs)
        if not all(map(is_, self.shared(inputs), shared * (len(self.replays) - 1))):
            return None
        first = self.replays[0].arguments_for(first_inputs, ctx)
        if first is None:
            return None
        length = first[_PAST].shape[2]
        buffers = [first[_PAST + 1], first[_PAST + 3]]
        for past, ref in zip(self.grown(inputs), self.buffers):
            buffer = ref()
            if buffer is None or past.base is not buffer or past.shape[2] != length:
                return None
            buffers.append(buffer)
        if any(buffer.shape[2] <= length for buffer in buffers):
            return None
        key_buffers, value_buffers = buffers[0::2], buffers[1::2]
        bias, tables = first[_BIAS], first[_TABLES:_TABLES + 4]
        calls, start = [], 0
        for statics, count in self.chunks:
            keys, values = key_buffers[start:start + count + 1], value_buffers[start:start + count + 1]
            pad = RUN_CHUNK + 1 - len(keys)
            calls.append((statics, tuple(keys + keys[-1:] * pad), tuple(values + values[-1:] * pad), count, length,
                          bias, tables))
            start += count
        return first, calls, key_buffers, value_buffers, length
