"""Decoder layers' fused nodes that span several blocks (`runnx/interp/fusion/products.py`): an
RMSNorm layer's projections, rotary embedding and KV cache growth (ProjectedRopeAppend), its
attention to the next layer's norm (AttentionGatedMLP), and the two across a layer boundary
(AttentionGatedMLPRopeAppend). A decode step's row runs each as one native call of
`_decode_blocks.py`, and a short prompt's ProjectedRopeAppend one too (`_rope_rows`); anything else
(a long prefill, caches not granted, biases of other shapes) runs the kernels of the nodes they
replaced. A run of AttentionGatedMLPRopeAppend nodes is one GatedLayersRun node
(`interp/fusion/layer_runs.py`), a decode step's one native call for all of them.
"""
from __future__ import annotations

import functools
import inspect
from types import SimpleNamespace

import numpy as np

from runnx.errors import RunnxError
from runnx.ops import _native
from runnx.ops._decode_blocks import (attended_gated_mlp, attended_gated_mlp_rope_append,
                                      attended_gated_mlp_rope_append_run, projected_rope_append,
                                      projected_rope_append_rows)
from runnx.ops._decode_replay import GatedPositions, GatedRopeReplay, RunReplay, nested, remember, replay_enabled, replayed
from runnx.ops._fused_common import stand_in
from runnx.ops._matmul import pooled_prompt
from runnx.ops.cache import count_appends
from runnx.ops.fused import DOMAIN, RepeatedKVAttention, repeated_kv_row
from runnx.ops.fused_rotary import RopeAppend, appended_caches, rope_append_arguments
from runnx.ops.fused_layer_norm_blocks import split_shape
from runnx.ops.fused_products import _NO_BIAS, SharedInputMatMul, _split_shapes, _vector
from runnx.ops.fused_residual_blocks import ResidualGatedMLP, _gated_mlp_row
from runnx.ops.registry import register
from runnx.runtime import pool as decode_pool
from runnx.runtime.rows import SHARED_FROM

_ROPE_ATTRIBUTES = ("query_dims", "query_axes", "key_dims", "key_axes", "value_dims", "value_axes", "query_axis",
                    "key_axis", "key_cache_axis", "value_cache_axis")


@register("ProjectedRopeAppend", since=1, domain=DOMAIN, inplace=(13, 14), shape_only=(6, 9, 12))
def ProjectedRopeAppend(x, query_weight, key_weight, value_weight, query_bias, query_target, query_source, key_bias,
                        key_target, key_source, value_bias, value_target, value_source, past_key, past_value,
                        query_cos, query_sin, query_start, query_end, key_cos, key_sin, key_start, key_end, *,
                        query_dims: tuple[int, ...] = (), query_axes: tuple[int, ...] = (),
                        key_dims: tuple[int, ...] = (), key_axes: tuple[int, ...] = (),
                        value_dims: tuple[int, ...] = (), value_axes: tuple[int, ...] = (), query_axis: int = -1,
                        key_axis: int = -1, key_cache_axis: int, value_cache_axis: int, overwrite=(), ctx=None):
    """RopeAppend(*SharedInputMatMul(x, query_weight, key_weight, value_weight, ...; each split into
    heads), past_key, past_value, ...): an RMSNorm layer's projections, rotary embedding and KV
    cache growth. A decode step's float32 row with both caches granted is one native call
    (`projected_rope_append`, the projections' biases added in it) writing the new rows in place."""
    rope = (query_weight, key_weight, value_weight, query_bias, query_target, query_source, key_bias, key_target,
            key_source, value_bias, value_target, value_source, past_key, past_value, query_cos, query_sin,
            query_start, query_end, key_cos, key_sin, key_start, key_end)
    attributes = (query_dims, query_axes, key_dims, key_axes, value_dims, value_axes, query_axis, key_axis,
                  key_cache_axis, value_cache_axis)
    planned = _rope_row(x, rope, attributes, overwrite)
    if planned is None:
        prompt = _rope_rows(x, rope, attributes, overwrite)
        if prompt is None:
            return _rope_appended(False, None, None, x, rope, attributes, overwrite, ctx)
        heads, biases, unit, arguments = prompt
        done, rotated = decode_pool.shared_call(projected_rope_append_rows, x.reshape(-1, x.shape[-1]), rope[:3],
                                                biases, heads, unit, arguments)
        return _rope_appended(done, rotated, heads, x, rope, attributes, overwrite, ctx)
    heads, biases, arguments = planned
    done, rotated = decode_pool.shared_call(projected_rope_append, np.ascontiguousarray(x.reshape(-1)), rope[:3],
                                            biases, tuple([h.reshape(-1) for h in heads]), arguments)
    return _rope_appended(done, rotated, heads, x, rope, attributes, overwrite, ctx)


def _rope_row(x, rope: tuple, attributes: tuple, overwrite) -> tuple | None:
    """(the split heads, allocated, the projections' biases (`_NO_BIAS`: none) and
    `rope_append_into`'s arguments) when ProjectedRopeAppend(x, *rope) is a decode step's float32
    row, its biases absent or float32 vectors of their products' widths, both caches granted, prefix
    views with room: x is read for its shape and dtype only (a stand-in serves); else None."""
    if not (13 in overwrite and 14 in overwrite):
        return None
    query_dims, query_axes, key_dims, key_axes, value_dims, value_axes = attributes[:6]
    shapes = _split_shapes(x, rope[:3], ((rope[4], rope[5], query_dims, query_axes),
                                         (rope[7], rope[8], key_dims, key_axes),
                                         (rope[10], rope[11], value_dims, value_axes)))
    if not shapes:
        return None
    biases = tuple([_NO_BIAS if bias is None else bias for bias in rope[3:12:3]])
    if not all(bias is _NO_BIAS or _vector(bias, shape[1] * shape[3]) for bias, shape in zip(biases, shapes)):
        return None
    heads = tuple([np.empty(shape, np.float32) for shape in shapes])
    past_key, past_value, query_cos, query_sin = rope[12:16]
    arguments = rope_append_arguments(*heads, past_key, past_value, query_cos, query_sin, rope[18], rope[19],
                                      rope[16:18] + rope[20:22], *attributes[6:])
    return (heads, biases, arguments) if arguments else None


def _rope_rows(x, rope: tuple, attributes: tuple, overwrite) -> tuple | None:
    """(the split heads, allocated, the projections' biases, the products job's unit and
    `rope_append_into`'s arguments) when ProjectedRopeAppend(x, *rope) is a short prompt's: float32
    rows (batch, length, hidden) of more than one position, C-contiguous, through C-contiguous float32
    matrices whose products the own kernels share with the decode pool (`pooled_prompt`), each split
    into (batch, heads, length, depth), biases absent or vectors, both caches granted, and few enough
    positions for one thread's rotation (`rope_append_into`; more are shared among threads:
    `fused_rotary.py`); else None."""
    if not (13 in overwrite and 14 in overwrite and _native.enabled and x.dtype == np.float32 and x.ndim == 3
            and x.shape[1] > 1 and x.flags.c_contiguous):
        return None
    batch, length, depth = x.shape
    weights = rope[:3]
    if not all(w.dtype == np.float32 and w.ndim == 2 and w.shape[0] == depth and w.flags.c_contiguous
               for w in weights) or not pooled_prompt(batch * length, depth, tuple([w.shape[1] for w in weights])):
        return None
    shapes = []
    for weight, (target, source), dims, axes in zip(weights, (rope[4:6], rope[7:9], rope[10:12]), attributes[0:6:2],
                                                    attributes[1:6:2]):
        shape = split_shape(stand_in(x.dtype, (batch, length, weight.shape[1])), target, source, dims, axes)
        if len(shape) != 4 or (shape[0], shape[2], shape[1] * shape[3]) != (batch, length, weight.shape[1]):
            return None
        shapes.append(shape)
    biases = tuple([_NO_BIAS if bias is None else bias for bias in rope[3:12:3]])
    if (not all(bias is _NO_BIAS or _vector(bias, shape[1] * shape[3]) for bias, shape in zip(biases, shapes))
            or length * shapes[0][1] * shapes[0][3] >= SHARED_FROM):
        return None
    heads = tuple([np.empty(shape, np.float32) for shape in shapes])
    arguments = rope_append_arguments(*heads, *rope[12:16], rope[18], rope[19], rope[16:18] + rope[20:22],
                                      *attributes[6:])
    unit = decode_pool.gemm_unit(sum(w.shape[1] for w in weights))
    return (heads, biases, unit, arguments) if arguments else None


def _rope_appended(done: bool, rotated, heads, x, rope: tuple, attributes: tuple, overwrite, ctx) -> tuple:
    """ProjectedRopeAppend's outputs: the caches grown in place by `projected_rope_append` (done),
    or RopeAppend's kernel on the heads it computed, or (heads None) on SharedInputMatMul's of x."""
    past_key, past_value = rope[12:14]
    if done:
        count_appends(ctx, heads[1], heads[2])
        return appended_caches(rotated, past_key, past_value, heads[1], heads[2])
    query_dims, query_axes, key_dims, key_axes, value_dims, value_axes, query_axis, key_axis, key_cache_axis, \
        value_cache_axis = attributes
    if heads is None:
        heads = SharedInputMatMul(x, *rope[:12], splits=((0, query_dims, query_axes), (1, key_dims, key_axes),
                                                         (2, value_dims, value_axes)))
    return RopeAppend(*heads, *rope[12:], query_axis=query_axis, key_axis=key_axis, key_cache_axis=key_cache_axis,
                      value_cache_axis=value_cache_axis, overwrite=tuple([p - 10 for p in overwrite]),
                      ctx=ctx)  # RopeAppend's own cache positions


@register("AttentionGatedMLP", since=1, domain=DOMAIN)
def AttentionGatedMLP(query, key, value, bias, query_scale, key_scale, nan_fill, key_axes, key_expand, key_target,
                      value_axes, value_expand, value_target, merged_target, mask, mask_starts, mask_ends, mask_axes,
                      mask_steps, masked_then, masked_else, weight, out_bias, residual, epsilon, one, norm_weight,
                      gate_weight, up_weight, down_weight, down_bias, down_epsilon, down_one, down_norm_weight, *,
                      axis: int = -1, norm: tuple = (-1, 0, 0), down_norm: tuple = (-1, 0, 0), ctx=None):
    """ResidualGatedMLP(a, weight, out_bias, residual, ...) of the attention a =
    RepeatedKVAttention(query, ...) with its heads merged: a decoder layer from its attention to the
    next layer's norm. A decode step's row is one native call (`attended_gated_mlp`: its SiLU
    gate's exp is not numpy's, within a few ulp)."""
    block = (query, key, value, bias, query_scale, key_scale, nan_fill, key_axes, key_expand, key_target, value_axes,
             value_expand, value_target, merged_target, mask, mask_starts, mask_ends, mask_axes, mask_steps,
             masked_then, masked_else, weight, out_bias, residual, epsilon, one, norm_weight, gate_weight, up_weight,
             down_weight, down_bias, down_epsilon, down_one, down_norm_weight)
    return _attended_gated(block, _attended_gated_row(block, axis, norm, down_norm, ctx), axis, norm, down_norm, ctx)


def _attended_gated(block: tuple, arguments, axis: int, norm: tuple, down_norm: tuple, ctx) -> tuple:
    """AttentionGatedMLP(*block)'s outputs: one native call with `arguments` (`_attended_gated_row`'s),
    or (None) the kernels of the nodes it replaced."""
    if arguments:
        residual = block[23]
        summed, normed = decode_pool.shared_call(attended_gated_mlp, *arguments)
        return summed.reshape(residual.shape), normed.reshape(residual.shape)
    return ResidualGatedMLP(RepeatedKVAttention(*block[:21], axis=axis, ctx=ctx), *block[21:], norm=norm,
                            down_norm=down_norm)


def _attended_gated_row(block: tuple, axis: int, norm: tuple, down_norm: tuple, ctx) -> tuple | None:
    """`attended_gated_mlp`'s arguments after the mailbox and workers when AttentionGatedMLP(*block)
    is a decode row (`repeated_kv_row`, `_gated_mlp_row`), else None."""
    row = repeated_kv_row(*block[:21], axis=axis, ctx=ctx)
    mlp = row and _gated_mlp_row(row[1], *block[21:], norm, down_norm)
    return mlp and (*row[0], *mlp[0], block[29], *mlp[1], block[33])


@register("AttentionGatedMLPRopeAppend", since=1, domain=DOMAIN, inplace=(46, 47), shape_only=(39, 42, 45))
def AttentionGatedMLPRopeAppend(*inputs, axis: int = -1, norm: tuple = (-1, 0, 0), down_norm: tuple = (-1, 0, 0),
                                query_dims: tuple[int, ...] = (), query_axes: tuple[int, ...] = (),
                                key_dims: tuple[int, ...] = (), key_axes: tuple[int, ...] = (),
                                value_dims: tuple[int, ...] = (), value_axes: tuple[int, ...] = (),
                                query_axis: int = -1, key_axis: int = -1, key_cache_axis: int, value_cache_axis: int,
                                overwrite=(), ctx=None, state=None):
    """(s, *ProjectedRopeAppend(n, *inputs[34:])) for (s, n) = AttentionGatedMLP(*inputs[:34]): a
    decoder layer from its attention to the next layer's norm, and the next layer's projections,
    rotary embedding and KV cache growth. The norm n has the residual's shape and dtype (its readers
    elsewhere read an RMSNormShape stand-in). A decode step's row is one native call
    (`attended_gated_mlp_rope_append`): the two nodes' native calls with no Python between them, its
    arguments the last step's but what a step changes when its `_decode_replay.GatedRopeReplay` fits."""
    block, rope = inputs[:_BLOCK_INPUTS], inputs[_BLOCK_INPUTS:]
    attributes = (query_dims, query_axes, key_dims, key_axes, value_dims, value_axes, query_axis, key_axis,
                  key_cache_axis, value_cache_axis)
    rope_overwrite = tuple([p - _BLOCK_INPUTS + 1 for p in overwrite])  # ProjectedRopeAppend's positions
    residual = block[23]
    native = replayed(state, inputs, ctx) if 13 in rope_overwrite and 14 in rope_overwrite else None
    if native is not None:
        heads = state.replay.heads
    else:
        arguments = _attended_gated_row(block, axis, norm, down_norm, ctx)
        planned = arguments and _rope_row(residual, rope, attributes, rope_overwrite)  # the norm's shape and dtype
        if not planned:
            summed, normed = _attended_gated(block, arguments, axis, norm, down_norm, ctx)  # its checks not made again
            return (summed, *ProjectedRopeAppend(normed, *rope, **dict(zip(_ROPE_ATTRIBUTES, attributes)),
                                                 overwrite=rope_overwrite, ctx=ctx))
        heads, biases, rope_arguments = planned
        native = (*arguments, rope[:3], biases, tuple([h.reshape(-1) for h in heads]), *rope_arguments)
        remember(state, GatedRopeReplay(inputs, native, heads, _GATED))
    summed, done, rotated = decode_pool.shared_call(attended_gated_mlp_rope_append, *nested(native))
    return (summed.reshape(residual.shape),
            *_rope_appended(done, rotated, heads, None, rope, attributes, rope_overwrite, ctx))


@register("GatedLayersRun", since=1, domain=DOMAIN, inplace_from=0)
def GatedLayersRun(*inputs, members: int, axis: int = -1, norm: tuple = (-1, 0, 0), down_norm: tuple = (-1, 0, 0),
                   query_dims: tuple[int, ...] = (), query_axes: tuple[int, ...] = (), key_dims: tuple[int, ...] = (),
                   key_axes: tuple[int, ...] = (), value_dims: tuple[int, ...] = (),
                   value_axes: tuple[int, ...] = (), query_axis: int = -1, key_axis: int = -1, key_cache_axis: int,
                   value_cache_axis: int, overwrite=(), ctx=None, state=None):
    """`members` AttentionGatedMLPRopeAppend nodes in a row, each reading the one before's rotated
    query, grown caches and sum (`runnx/interp/fusion/layer_runs.py`): inputs each node's in turn
    (those the node before computes absent), outputs each node's grown caches, then the last one's
    sum and rotated query. A decode step whose every node replays its row
    (`_decode_replay.RunReplay`) is the first node's native call and native loops over the others
    (`attended_gated_mlp_rope_append_run`: the calls the nodes would make, so their bits); anything
    else runs the nodes' kernel in turn. Only the caches the nodes grow are written in place."""
    attributes = {"axis": axis, "norm": norm, "down_norm": down_norm, "query_dims": query_dims,
                  "query_axes": query_axes, "key_dims": key_dims, "key_axes": key_axes, "value_dims": value_dims,
                  "value_axes": value_axes, "query_axis": query_axis, "key_axis": key_axis,
                  "key_cache_axis": key_cache_axis, "value_cache_axis": value_cache_axis}
    width, grown = _GATED.width, _GATED.grown
    granted = _grown_positions(members).issubset(overwrite)
    run = getattr(state, "run", None) if granted else None
    native = run.arguments_for(inputs, ctx) if run is not None and replay_enabled() else None
    if native is not None:
        return _run_natively(native, run, inputs[_GATED.residual].shape, ctx)
    parts = getattr(state, "members", None) if state is not None else None
    if parts is None or len(parts) != members:
        parts = [SimpleNamespace() for _ in range(members)]  # each node's state (this thread's, as the run's)
        if state is not None:
            state.members = parts
    outputs, last = [], None
    positions = inputs[0].shape[2] if inputs[0].ndim == 4 else -1
    for j in range(members):
        member = inputs[j * width:(j + 1) * width]
        if last is not None:
            member = _fed_by(last, member)
        last = AttentionGatedMLPRopeAppend(*member, **attributes, ctx=ctx, state=parts[j],
                                           overwrite=tuple([p - j * width for p in overwrite if p - j * width in grown]))
        for cache, past in zip(last[2:], grown):
            if cache.ndim != 4 or cache.shape[2] != member[past].shape[2] + positions:
                raise RunnxError(f"a run of decoder layers grew a cache to {list(cache.shape)} from "
                                 f"{list(member[past].shape)} for {positions} positions: the shape memos reading it "
                                 "assumed a growth along axis 2 by the query's positions")
        outputs += last[2:]
    if state is not None and granted:
        state.run = RunReplay.of([getattr(part, "replay", None) for part in parts], _GATED)
    return (*outputs, *last[:2])


@functools.cache
def _grown_positions(members: int) -> frozenset:
    """The input positions of the caches a run of `members` nodes grows."""
    return frozenset([j * _GATED.width + p for j in range(members) for p in _GATED.grown])


def _fed_by(before: tuple, member: tuple) -> tuple:
    """A run's node's inputs with those the node before computes (`before`: its sum, rotated query
    and grown caches) in their places."""
    query, key, value, residual = _GATED.chained
    chained = list(member)
    chained[query], chained[key], chained[value], chained[residual] = before[1], before[2], before[3], before[0]
    return tuple(chained)


def _run_natively(native: tuple, run, residual_shape: tuple, ctx) -> tuple:
    """GatedLayersRun's outputs from `RunReplay.arguments_for`'s `native`: the first boundary's call,
    then one `attended_gated_mlp_rope_append_run` call a chunk of the others; every node's grown
    caches as views of their buffers."""
    first, calls, key_buffers, value_buffers, length = native
    summed, done, rotated = decode_pool.shared_call(attended_gated_mlp_rope_append, *nested(first))
    for call in calls:
        summed, rotated, appended = decode_pool.shared_call(attended_gated_mlp_rope_append_run, rotated, summed,
                                                            *call)
        done = done and appended
    if not done:  # (the arguments were checked to fit: each cache has room for the step's row)
        raise RunnxError("a run of decoder layers found no room to grow a cache it was checked to have")
    outputs = []
    for key_buffer, value_buffer, replay in zip(key_buffers, value_buffers, run.replays):
        count_appends(ctx, replay.heads[1], replay.heads[2])
        outputs += (key_buffer[:, :, :length + 1], value_buffer[:, :, :length + 1])
    return (*outputs, summed.reshape(residual_shape), rotated)


@register("GrownCacheShape", since=1, domain=DOMAIN, shape_only=(0, 1))
def GrownCacheShape(past, query):
    """A stand-in with the shape and dtype of the cache `past` (batch, heads, length, depth) grown
    along axis 2 by the positions of `query` (batch, heads, positions, depth), for nodes that only
    read the shape of a cache a GatedLayersRun grows inside itself (`interp/fusion/layer_runs.py`)."""
    if past.ndim != 4 or query.ndim != 4:
        raise RunnxError(f"a grown cache's shape takes a 4-d cache and query, got {list(past.shape)} and "
                         f"{list(query.shape)}")
    return stand_in(past.dtype, past.shape[:2] + (past.shape[2] + query.shape[2],) + past.shape[3:])


def _input_names(kernel) -> tuple:
    """A kernel's input names: its positional parameters."""
    return tuple([name for name, parameter in inspect.signature(kernel).parameters.items()
                  if parameter.kind == parameter.POSITIONAL_OR_KEYWORD])


# AttentionGatedMLPRopeAppend's inputs: AttentionGatedMLP's, then ProjectedRopeAppend's but its x
_GATED = GatedPositions(_input_names(AttentionGatedMLP), _input_names(ProjectedRopeAppend)[1:])
BOUNDARY = _GATED  # (for the fusion of runs of them: `interp/fusion/layer_runs.py`)
_BLOCK_INPUTS = len(_input_names(AttentionGatedMLP))
