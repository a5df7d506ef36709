"""onnxruntime's GroupQueryAttention (com.microsoft), with its KV cache as onnxruntime-genai hands
it over: past and present either share one buffer of the maximum length (the new rows written at
each sequence's own length, given by `seqlens_k`) or present is past plus the new rows. A granted
past (owned, dead after the node) is written in place: the shared buffer itself, or past grown
into its spare capacity as Concat grows a KV cache (`runnx/capture/capacity.py`), so a decode step
copies only the new rows.

float32 new rows are turned and written into the cache by one numba pass (`rotary_append`); a
decode step (one row a sequence) then takes the decode attention job over each sequence's own rows
(`decode_step`, one native call when the lengths are equal in a shared buffer), no mask. A causal
prompt of more than `_CAUSAL_BLOCKED_ROWS` rows ending the cache goes in blocks of query positions
(`causal_attention_in_blocks`), and in a granted shared buffer its rows pass and the blocks job are
one native call (`prompt_step`); shorter prompts go through `fused.attend` with an additive causal
mask; softcap, smooth softmax, sinks and a bias take the numpy attention of `contrib_attention.py`.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from runnx.capture.capacity import append_in_place, concatenate_with_headroom
from runnx.errors import RunnxError
from runnx.ops import _native
from runnx.ops._attention_blocks import POOLED
from runnx.ops._kernels_attention_blocks import block_positions
from runnx.ops._kernels_contrib_attention import decode_step, prompt_step, rotary_append, rows_fit
from runnx.ops._kernels_gemm import KC
from runnx.ops.contrib_attention import DOMAIN, _attention, _rotate
from runnx.ops.fused import attend
from runnx.ops.fused_layer_norm_blocks import causal_attention_in_blocks
from runnx.ops.registry import register
from runnx.runtime import defer, deferring, pool as decode_pool, take_leave
from runnx.runtime.pool import settle, shared_call
from runnx.runtime.rows import SHARED_FROM, share_rows

# query rows from which a causal prompt over the cache's end goes in blocks (`_attend_rows`): the
# blocks job skips the mask that the other path builds with numpy a layer a call (a 32-token prompt's
# attention 107 -> 64 us a layer on one thread, 82 -> 52 on two; 4 rows 20 -> 18, 2 and 3 even)
_CAUSAL_BLOCKED_ROWS = 3
# such a prompt in a granted shared buffer as one native call (`_prompt_step`); tests compare it off
_PROMPT_IN_ONE_CALL = True

_FLOAT32 = np.dtype(np.float32)


def _split_packed(query, key, value, heads: int, kv_heads: int):
    """(q, k, v) as (B, S, N*H) / (B, S, G*H): given separately, or packed in query when key is absent."""
    if key is not None:
        if value is None:
            raise RunnxError("GroupQueryAttention: key given without value")
        return query, key, value
    width = query.shape[2] // (heads + 2 * kv_heads)
    if width * (heads + 2 * kv_heads) != query.shape[2]:
        raise RunnxError(f"GroupQueryAttention: packed QKV width {query.shape[2]} is not (num_heads + 2 * "
                         f"kv_num_heads) * head_size for {heads} and {kv_heads} heads")
    return (query[:, :, :heads * width], query[:, :, heads * width:(heads + kv_heads) * width],
            query[:, :, (heads + kv_heads) * width:])


def _present(past, new, starts, length: int, granted: bool, ctx, what: str):
    """The present cache (B, G, length, H): past's first starts[b] rows of each sequence, then the
    new rows (B, G, S, H) at starts[b]. In past itself when past is that buffer (shared) and
    granted, grown into past's spare capacity when granted and every sequence continues at its end."""
    batch, groups, steps, size = new.shape
    if past is None:
        if length == steps:
            return new
        present = np.zeros((batch, groups, length, size), new.dtype)
        present[:, :, :steps] = new
        return present
    uniform = bool(np.all(starts == starts[0]))
    if past.shape[2] == length:  # one buffer for past and present
        present = past if granted else past.copy()
        if granted and ctx is not None:
            ctx.count("GroupQueryAttention.writes_in_place")
    elif uniform and int(starts[0]) == past.shape[2] and length == past.shape[2] + steps:
        grown = append_in_place(past, [new], 2) if granted else None
        if grown is not None:
            if ctx is not None:
                ctx.count("GroupQueryAttention.appends_in_place")
            return grown
        return concatenate_with_headroom([past, new], 2) if granted else np.concatenate([past, new], axis=2)
    else:
        present = np.zeros((batch, groups, length, size), new.dtype)
        for b in range(batch):
            present[b, :, :starts[b]] = past[b, :, :starts[b]]
    for b in range(batch):
        start = int(starts[b])
        if start + steps > length:
            raise RunnxError(f"GroupQueryAttention: {what} rows {start}..{start + steps} do not fit the present "
                             f"cache of {length}")
        present[b, :, start:start + steps] = new[b]
    return present


def _causal_bias(query_positions, total_lengths, kv_length: int, window: int, dtype):
    """(B, 1, S, T) additive mask: key j visible to the query at position p when j <= p, j below
    the sequence's total length and, with a local window w, p - j < w."""
    keys = np.arange(kv_length).reshape(1, 1, -1)
    positions = query_positions[:, :, None]
    visible = (keys <= positions) & (keys < total_lengths.reshape(-1, 1, 1))
    if window > 0:
        visible &= positions - keys < window
    return np.where(visible, dtype.type(0), dtype.type(-np.inf))[:, None]


def _causal_blocks(steps: int, window: int, attention_bias, softcap: float, smooth_softmax: int, head_sink) -> bool:
    """Whether a causal prompt's attention of `steps` rows may go in blocks of query positions (compiled
    kernels on, more than `_CAUSAL_BLOCKED_ROWS` rows, no window, bias or softmax variant): for
    float32 rows that end the cache, `_attend_rows` and `_prompt_step` decide alike."""
    return (_native.enabled and steps > _CAUSAL_BLOCKED_ROWS and window <= 0 and attention_bias is None
            and not softcap and not smooth_softmax and head_sink is None)


def _attend_rows(queries, present_key, present_value, starts, lengths, reach: int, window: int, attention_bias,
                 factor: float, softcap: float, smooth_softmax: int, head_sink):
    """Attention of queries (B, N, S, H) over the first `reach` rows of the present cache, the rows
    every sequence of the batch has: the rows past a sequence's length are never read (a shared
    buffer's spare rows may hold anything, NaN included, which no mask could hide), and a decode
    step reads its filled rows, not the whole buffer. A float32 prompt of more than
    `_CAUSAL_BLOCKED_ROWS` rows that ends the cache with no window, bias or softmax variant goes in
    causal blocks (`causal_attention_in_blocks`: no mask is built, the keys past a block's rows are
    skipped)."""
    dtype = queries.dtype
    steps = queries.shape[2]
    if (dtype == np.float32 and _causal_blocks(steps, window, attention_bias, softcap, smooth_softmax, head_sink)
            and present_key.dtype == np.float32 and present_value.dtype == np.float32
            and np.all(starts == starts[0]) and starts[0] + steps == reach):
        scaled = np.multiply(queries, np.float32(factor))
        return causal_attention_in_blocks(scaled, present_key[:, :, :reach], present_value[:, :, :reach],
                                          int(starts[0])).transpose(0, 2, 1, 3)
    bias = _causal_bias(starts[:, None] + np.arange(steps), lengths, reach, window, dtype)
    if attention_bias is not None:
        bias = bias + attention_bias[..., :reach].astype(dtype)
    return _attention(queries, present_key[:, :, :reach], present_value[:, :, :reach], bias, factor, softcap,
                      bool(smooth_softmax), head_sink)


@register("GroupQueryAttention", since=1, domain=DOMAIN, inplace=(3, 4), overlaps_jobs=True,
          reads_data=(5, 6, 9))
def GroupQueryAttention(query, key, value, past_key, past_value, seqlens_k, total_sequence_length,
                        cos_cache=None, sin_cache=None, position_ids=None, attention_bias=None, head_sink=None, *,
                        do_rotary: int = 0, kv_num_heads: int, local_window_size: int = -1, num_heads: int,
                        qk_output: int = 0, rotary_interleaved: int = 0, scale: float = 0.0, smooth_softmax: int = 0,
                        softcap: float = 0.0, overwrite=(), ctx=None, output_count):
    """Grouped-query attention with its KV cache, onnxruntime's semantics: sequence b holds
    seqlens_k[b] + 1 tokens after this step, its new tokens from seqlens_k[b] + 1 - S on (from 0 on
    a first prompt, S == total_sequence_length)."""
    leave = take_leave()
    if qk_output:
        raise RunnxError("GroupQueryAttention: qk_output is not supported")
    if num_heads % kv_num_heads:
        raise RunnxError(f"GroupQueryAttention: num_heads {num_heads} is not a multiple of kv_num_heads "
                         f"{kv_num_heads}")
    if (past_key is None) != (past_value is None):
        raise RunnxError("GroupQueryAttention needs past_key and past_value together")
    if (key is None and past_key is not None and position_ids is None and attention_bias is None and head_sink is None
            and not softcap and not smooth_softmax and query.ndim == 3 and query.shape[0] == 1 == query.shape[1]
            and (not do_rotary or cos_cache is not None and sin_cache is not None)):
        step = _one_packed_row(query, past_key, past_value, seqlens_k, total_sequence_length,
                               cos_cache if do_rotary else None, sin_cache if do_rotary else None, num_heads,
                               kv_num_heads, local_window_size, scale, bool(rotary_interleaved), overwrite, ctx,
                               output_count, leave)
        if step is not None:
            return step
    q, k, v = _split_packed(query, key, value, num_heads, kv_num_heads)
    batch, steps = q.shape[:2]
    head_size = q.shape[2] // num_heads
    q = q.reshape(batch, steps, num_heads, head_size)
    k = k.reshape(batch, steps, kv_num_heads, head_size)
    v = v.reshape(batch, steps, kv_num_heads, head_size)
    total = int(np.asarray(total_sequence_length).reshape(-1)[0])
    seqlens = np.asarray(seqlens_k).reshape(-1)
    if seqlens.shape != (batch,):
        raise RunnxError(f"GroupQueryAttention: seqlens_k must hold one length per sequence ({batch}), got "
                         f"{list(np.shape(seqlens_k))}")
    counts = [int(n) + 1 for n in seqlens.tolist()]
    first_prompt = steps == total
    if not first_prompt and min(counts) < steps:
        raise RunnxError(f"GroupQueryAttention: seqlens_k + 1 ({counts}) is shorter than the {steps} new tokens")
    lengths = np.array(counts, np.int64)
    starts = np.zeros(batch, np.int64) if first_prompt else lengths - steps
    if position_ids is None:
        positions = starts[:, None] + np.arange(steps) if steps > 1 else starts.reshape(batch, 1)
    elif position_ids.size != batch * steps:
        raise RunnxError(f"GroupQueryAttention: position_ids must be (batch, sequence) = {[batch, steps]}, got "
                         f"{list(position_ids.shape)}")
    else:
        positions = position_ids.reshape(batch, steps).astype(np.int64, copy=False)
    if do_rotary and (cos_cache is None or sin_cache is None):
        raise RunnxError("GroupQueryAttention: do_rotary=1 needs cos_cache and sin_cache")
    length = max(total, past_key.shape[2]) if past_key is not None else total
    factor = scale or 1 / math.sqrt(head_size)
    # (the float inputs may be the output of a pool job left open: only integers were read above;
    # the decode step's native call finishes that job before it reads them, other paths settle)
    if _rows_kernel_applies(q, k, v, past_key, past_value, cos_cache, sin_cache, do_rotary, head_size):
        decoding = steps == 1 and not softcap and not smooth_softmax and head_sink is None and attention_bias is None
        stops = [1] * batch if first_prompt else counts  # the rows each query sees: up to its own
        if (decoding and past_key is not None and past_key.shape[2] == length == past_value.shape[2]
                and all(n == stops[0] for n in stops)):
            return _decode_step(q, k, v, past_key, past_value, positions, starts, stops[0], local_window_size, factor,
                                cos_cache if do_rotary else None, sin_cache if do_rotary else None,
                                bool(rotary_interleaved), overwrite, ctx, output_count, leave)
        if not decoding and (merged := _prompt_step(q, k, v, past_key, past_value, positions, starts, lengths,
                                                    length, local_window_size, attention_bias, softcap,
                                                    smooth_softmax, head_sink, factor,
                                                    cos_cache if do_rotary else None,
                                                    sin_cache if do_rotary else None, bool(rotary_interleaved),
                                                    overwrite, ctx)) is not None:
            return _outputs(merged.reshape(batch, steps, num_heads * head_size), past_key, past_value, output_count)
        settle()
        queries, present_key, present_value = _rotate_and_append(
            q, k, v, past_key, past_value, positions, starts, length, cos_cache if do_rotary else None,
            sin_cache if do_rotary else None, bool(rotary_interleaved), overwrite, ctx)
        if decoding:
            output = _decode_attention(queries, present_key, present_value, stops, local_window_size, factor)
            return _outputs(output.reshape(batch, 1, num_heads * head_size), present_key, present_value,
                            output_count)
    else:
        settle()
        if do_rotary:
            rotary_dim = 2 * cos_cache.shape[-1]
            q = _rotate(q, positions.astype(np.intp), cos_cache, sin_cache, bool(rotary_interleaved), rotary_dim)
            k = _rotate(k, positions.astype(np.intp), cos_cache, sin_cache, bool(rotary_interleaved), rotary_dim)
        new_key, new_value = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        present_key = _present(past_key, new_key, starts, length, 3 in overwrite, ctx, "key")
        present_value = _present(past_value, new_value, starts, length, 4 in overwrite, ctx, "value")
        queries = np.ascontiguousarray(q.transpose(0, 2, 1, 3))
    if np.all(lengths == lengths[0]):
        output = _attend_rows(queries, present_key, present_value, starts, lengths, int(lengths[0]), local_window_size,
                              attention_bias, factor, softcap, smooth_softmax, head_sink)
    else:  # each sequence over its own rows
        output = np.concatenate([
            _attend_rows(queries[b:b + 1], present_key[b:b + 1], present_value[b:b + 1], starts[b:b + 1],
                         lengths[b:b + 1], int(lengths[b]), local_window_size,
                         None if attention_bias is None else attention_bias[b:b + 1] if attention_bias.shape[0] > 1
                         else attention_bias, factor, softcap, smooth_softmax, head_sink) for b in range(batch)])
    output = output.transpose(0, 2, 1, 3).reshape(batch, steps, num_heads * head_size)
    return _outputs(output, present_key, present_value, output_count)


def _one_packed_row(query, past_key, past_value, seqlens_k, total_sequence_length, cos_cache, sin_cache, heads: int,
                    kv_heads: int, window: int, scale: float, interleaved: bool, overwrite, ctx, output_count: int,
                    leave: bool = False):
    """A decode step's common case, one sequence's one new row of packed q, k and v into a shared
    buffer, sent to `_decode_step` as the general path sends it, its checks made on the few
    numbers it reads (a decode step runs it once a layer); None when any of them differs, the
    general path then deciding (and raising) as always."""
    if seqlens_k.size != 1 or total_sequence_length.size != 1:
        return None
    q, k, v = _split_packed(query, None, None, heads, kv_heads)
    width = q.shape[2] // heads
    count, total, length = int(seqlens_k.item()) + 1, int(total_sequence_length.item()), past_key.shape[2]
    if (total == 1 or count < 1 or total > length or past_value.shape[2] != length  # (a first prompt's row, rows
            or not _rows_kernel_applies(q, k, v, past_key, past_value, cos_cache, sin_cache,  # past the buffer)
                                        cos_cache is not None, width)):
        return None
    starts = np.array([count - 1], np.int64)
    return _decode_step(q.reshape(1, 1, heads, width), k.reshape(1, 1, kv_heads, width),
                        v.reshape(1, 1, kv_heads, width), past_key, past_value, starts.reshape(1, 1), starts, count,
                        window, scale or 1 / math.sqrt(width), cos_cache, sin_cache, interleaved, overwrite, ctx,
                        output_count, leave)


def _outputs(output, present_key, present_value, output_count: int):
    return (output, present_key, present_value)[:output_count] if output_count > 1 else output


def _rows_kernel_applies(q, k, v, past_key, past_value, cos_cache, sin_cache, do_rotary: int, head_size: int) -> bool:
    """Whether `rotary_append` takes the new rows: float32 throughout (compiled kernels on), rotary
    caches of at most head_size / 2 columns."""
    if not _native.enabled or q.dtype != _FLOAT32 or k.dtype != _FLOAT32 or v.dtype != _FLOAT32:
        return False
    if past_key is not None and (past_key.dtype != _FLOAT32 or past_value.dtype != _FLOAT32
                                 or past_key.shape[3] != head_size or past_value.shape[3] != head_size):
        return False
    return not do_rotary or (cos_cache.dtype == _FLOAT32 and sin_cache.dtype == _FLOAT32 and cos_cache.ndim == 2
                             and sin_cache.shape == cos_cache.shape and 2 * cos_cache.shape[1] <= head_size)


_NO_ANGLES = np.ones((1, 1), _FLOAT32)  # the caches `rotary_append` is given without rotation (never read)


def _rotate_and_append(q, k, v, past_key, past_value, positions, starts, length: int, cos_cache, sin_cache,
                       interleaved: bool, overwrite, ctx):
    """(queries (B, N, S, H), present key, present value): the new rows turned (cos_cache None: as
    they are) and written into the present caches by one `rotary_append` pass. A shared buffer
    (past as long as the present) takes them at each sequence's start, in place when granted; else
    they go to new arrays that `_present` appends to past."""
    batch, steps, heads, size = q.shape
    groups = k.shape[2]
    queries = np.empty((batch, heads, steps, size), _FLOAT32)
    shared = past_key is not None and past_key.shape[2] == length and past_value.shape[2] == length
    if shared:
        present_key = past_key if 3 in overwrite else past_key.copy()
        present_value = past_value if 4 in overwrite else past_value.copy()
        if ctx is not None:
            ctx.count("GroupQueryAttention.writes_in_place", (3 in overwrite) + (4 in overwrite))
        rows_at = starts
    else:
        present_key = np.empty((batch, groups, steps, size), _FLOAT32)
        present_value = np.empty((batch, groups, steps, size), _FLOAT32)
        rows_at = np.zeros(batch, np.int64)
    half = cos_cache.shape[1] if cos_cache is not None else 0
    angles = (cos_cache, sin_cache) if cos_cache is not None else (_NO_ANGLES, _NO_ANGLES)
    if steps and batch:  # (checked ahead, so that refused rows leave everything unwritten)
        if (half and (positions.min() < 0 or positions.max() >= cos_cache.shape[0]) or rows_at.min() < 0
                or rows_at.max() + steps > present_key.shape[2]):
            _refuse_rows(positions, starts, cos_cache, steps, length)
        share_rows(functools.partial(_rotate_positions, q, k, v, positions, *angles, half, interleaved, queries,
                                     present_key, present_value, rows_at), steps, batch * (heads + 2 * groups) * size)
    if not shared:
        present_key = _present(past_key, present_key, starts, length, 3 in overwrite, ctx, "key")
        present_value = _present(past_value, present_value, starts, length, 4 in overwrite, ctx, "value")
    return queries, present_key, present_value


def _decode_step(q, k, v, past_key, past_value, positions, starts, count: int, window: int, factor: float, cos_cache,
                 sin_cache, interleaved: bool, overwrite, ctx, output_count: int, leave: bool = False):
    """One new row per sequence, all `count` long, into a shared buffer (in place when granted):
    `decode_step`, the rows kernel and the decode attention job in one native call, deferred given
    leave (`runtime.defer`) when its rows fit (`rows_fit`, the call's own check) and either calls
    before it are deferred or the process has no pool workers: between products left open to the
    workers (4-bit ones), a queue of one would only hold them idle."""
    batch, _, heads, size = q.shape
    if 3 not in overwrite or 4 not in overwrite:
        settle()  # (copying reads the caches)
    present_key = past_key if 3 in overwrite else past_key.copy()
    present_value = past_value if 4 in overwrite else past_value.copy()
    if ctx is not None:
        ctx.count("GroupQueryAttention.writes_in_place", (3 in overwrite) + (4 in overwrite))
    queries = np.empty((batch, heads, 1, size), _FLOAT32)
    output = np.empty((batch, heads, 1, size), _FLOAT32)
    half = cos_cache.shape[1] if cos_cache is not None else 0
    angles = (cos_cache, sin_cache) if cos_cache is not None else (_NO_ANGLES, _NO_ANGLES)
    begin = max(0, count - window) if window > 0 else 0
    arguments = (q, k, v, positions, *angles, half, interleaved, queries, present_key, present_value, starts, begin,
                 count, factor, output)
    if (leave and (deferring() or decode_pool.pool() is None)
            and rows_fit(positions, starts, batch, 1, half, angles[0].shape[0], present_key.shape[2])):
        defer(decode_step, arguments, job=True)
    elif not shared_call(decode_step, *arguments):
        _refuse_rows(positions, starts, cos_cache, 1, present_key.shape[2])
    return _outputs(output.reshape(batch, 1, heads * size), present_key, present_value, output_count)


def _prompt_step(q, k, v, past_key, past_value, positions, starts, lengths, length: int, window: int, attention_bias,
                 softcap: float, smooth_softmax: int, head_sink, factor: float, cos_cache, sin_cache, interleaved: bool,
                 overwrite, ctx):
    """The attention output (B, S, N, H) of a causal float32 prompt whose sequences all continue a shared
    buffer granted in place (past as long as the present) at one row and end their caches there, no
    window, bias, softcap or softmax variant, where the prompt-attention job runs (`POOLED`):
    `prompt_step`, the rows kernel and the job in one native call, given the arrays `_rotate_and_append`
    and `_attend_rows` would give them (the same bits) without their dozen numpy calls and checks
    from Python (a 32-token prompt's layer spent more there than in its attention); None for any
    other prompt, which those take, and for rows enough to share out (`SHARED_FROM` elements), whose
    rows pass `_rotate_and_append` splits among runnx's threads. q, k, v (B, S, N or G, H) as
    `_rotate_positions` takes them."""
    batch, steps, heads, size = q.shape
    if (not _PROMPT_IN_ONE_CALL or not POOLED
            or not _causal_blocks(steps, window, attention_bias, softcap, smooth_softmax, head_sink)
            or batch * steps * (heads + 2 * k.shape[2]) * size >= SHARED_FROM or past_key is None or 3 not in overwrite
            or 4 not in overwrite or past_key.shape[2] != length or past_value.shape[2] != length or size > KC
            or past_value.strides[3] != 4 or past_value.strides[2] != 4 * size
            or not (batch == 1 or (starts == starts[0]).all() and (lengths == lengths[0]).all())
            or int(starts[0]) + steps != int(lengths[0])):
        return None
    if ctx is not None:
        ctx.count("GroupQueryAttention.writes_in_place", 2)
    half = cos_cache.shape[1] if cos_cache is not None else 0
    angles = (cos_cache, sin_cache) if cos_cache is not None else (_NO_ANGLES, _NO_ANGLES)
    merged = np.empty((batch, steps, heads, size), _FLOAT32)
    if not shared_call(prompt_step, q, k, v, positions, *angles, half, interleaved, past_key, past_value, starts,
                       np.float32(factor), block_positions(heads // past_key.shape[1]), merged.transpose(0, 2, 1, 3)):
        _refuse_rows(positions, starts, cos_cache, steps, length)
    return merged


def _rotate_positions(q, k, v, positions, cos_cache, sin_cache, half: int, interleaved: bool, queries, present_key,
                      present_value, rows_at, start: int, stop: int) -> None:
    """`rotary_append` of the new rows start .. stop (each alone: a prompt's rows may be shared among
    runnx's threads), their positions and cache rows checked beforehand."""
    at = slice(start, stop)
    if not rotary_append(q[:, at], k[:, at], v[:, at], positions[:, at], cos_cache, sin_cache, half, interleaved,
                         queries[:, :, at], present_key, present_value, rows_at + start):
        raise RunnxError("GroupQueryAttention: rows refused after their check")  # (unreachable: checked ahead)


def _refuse_rows(positions, starts, cos_cache, steps: int, length: int):
    """The RunnxError for rows `rotary_append` refused: a position outside the rotary caches, or
    rows past the present cache."""
    if cos_cache is not None and (positions.min() < 0 or positions.max() >= cos_cache.shape[0]):
        raise RunnxError(f"rotary position ids must be in [0, {cos_cache.shape[0]}) (the cos/sin cache's rows); "
                         f"got {int(positions.min())}..{int(positions.max())}")
    raise RunnxError(f"GroupQueryAttention: new rows at {starts.tolist()} + {steps} do not fit the present "
                     f"cache of {length}")


def _decode_attention(queries, present_key, present_value, counts: list, window: int, factor: float):
    """Attention of one query row per sequence (B, N, 1, H) over its own filled cache rows (counts[b];
    the last `window` of them with a local window), no mask: the float32 decode attention job of
    `fused.attend`, the batch in one job when the lengths are equal, else a job a sequence."""
    if all(n == counts[0] for n in counts):
        stop = counts[0]
        begin = max(0, stop - window) if window > 0 else 0
        return attend(queries, present_key[:, :, begin:stop], present_value[:, :, begin:stop], None, factor, 0.0)
    output = np.empty(queries.shape, queries.dtype)
    for b, stop in enumerate(counts):
        begin = max(0, stop - window) if window > 0 else 0
        output[b:b + 1] = attend(queries[b:b + 1], present_key[b:b + 1, :, begin:stop],
                                 present_value[b:b + 1, :, begin:stop], None, factor, 0.0)
    return output
