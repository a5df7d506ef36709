"""Deferred calls run through the compiled entry point numba's dispatcher would pick
(runnx/runtime/entry_points.py): learnt from the dispatcher's first call, found again by the
arguments' fingerprint, and never for arguments of other types. Results are bitwise the dispatcher's."""
import numba
import numpy as np
import pytest

from runnx.ops._kernels_linalg import chunk_count, row_times_matrix
from runnx.runtime import defer, entry_points, jobs, settle
from runnx.runtime import pool as decode_pool

RNG = np.random.default_rng(5)


@numba.njit(nogil=True)
def _scaled_into(values, factor, out):
    for i in range(values.size):
        out[i] = values[i] * factor


@numba.njit(nogil=True)
def _plus_one_into(value, out):
    out[0] = value + 1


@numba.njit
def _length_into(text, out):
    out[0] = len(text)


def _resolved_functions(calls: list) -> list:
    return [function for function, _, _ in entry_points.resolved(calls)[0]]


def test_a_call_is_learnt_from_the_dispatcher_then_runs_its_entry_point():
    values = RNG.standard_normal(16).astype(np.float32)
    out = np.empty(16, np.float32)
    calls = [(_scaled_into, (values, 3.0, out), False)]
    entry_points.run(calls, None, 0)  # (may be the first such call: learnt after it)
    np.testing.assert_array_equal(out, values * np.float32(3.0))
    (function,) = _resolved_functions(calls)
    assert function is not _scaled_into and function is _scaled_into.overloads[
        tuple(numba.typeof(v) for v in (values, 3.0, out))].entry_point
    again = np.empty(16, np.float32)
    entry_points.run([(_scaled_into, (values, 3.0, again), False)], None, 0)
    np.testing.assert_array_equal(again, out)


def test_arguments_of_other_types_take_the_dispatcher():
    """A float where an int was learnt, a read-only or strided array where a writeable contiguous
    one was: another fingerprint, so the dispatcher (its own overload), never the learnt entry point."""
    out = np.zeros(1, np.float64)
    entry_points.run([(_plus_one_into, (2, out), False)] * 2, None, 0)
    assert out[0] == 3
    assert _resolved_functions([(_plus_one_into, (2.5, out), False)]) == [_plus_one_into]
    entry_points.run([(_plus_one_into, (2.5, out), False)], None, 0)
    assert out[0] == 3.5  # the float overload, not 2.5 truncated by the int64 one
    values = RNG.standard_normal(32).astype(np.float32)
    entry_points.run([(_scaled_into, (values, 2.0, np.empty(32, np.float32)), False)] * 2, None, 0)
    strided = np.empty(16, np.float32)
    assert _resolved_functions([(_scaled_into, (values[::2], 2.0, strided), False)]) == [_scaled_into]
    entry_points.run([(_scaled_into, (values[::2], 2.0, strided), False)], None, 0)
    np.testing.assert_array_equal(strided, values[::2] * np.float32(2.0))


@numba.njit(nogil=True)
def _plus_two_into(value, out):
    out[0] = value + 2


def test_no_entry_point_is_learnt_from_an_int_numba_types_uint64():
    """2**63 has every int's fingerprint but numba types it uint64: nothing is learnt from it. Once
    the int64 overload is learnt, the entry point refuses 2**63 as the dispatcher does."""
    out = np.zeros(1, np.float64)
    entry_points.run([(_plus_two_into, (2**63, out), False)] * 2, None, 0)
    assert _resolved_functions([(_plus_two_into, (1, out), False)]) == [_plus_two_into]
    entry_points.run([(_plus_two_into, (1, out), False)] * 2, None, 0)
    assert out[0] == 3 and _resolved_functions([(_plus_two_into, (1, out), False)]) != [_plus_two_into]
    with pytest.raises(OverflowError):
        _plus_two_into(2**63, out)
    with pytest.raises(OverflowError):
        entry_points.run([(_plus_two_into, (2**63, out), False)], None, 0)


def test_arguments_numba_cannot_fingerprint_and_plain_functions_are_called_as_given():
    out = np.zeros(1, np.int64)
    calls = [(_length_into, ("four", out), False)]
    entry_points.run(calls * 2, None, 0)
    assert out[0] == 4 and _resolved_functions(calls) == [_length_into]
    seen = []
    plain = [(lambda value: seen.append(value), (7,), False)]
    entry_points.run(plain * 2, None, 0)
    assert seen == [7, 7] and _resolved_functions(plain) == [plain[0][0]]
    assert entry_points.resolved(plain)[1] == []  # learnt as itself: not looked up again


def test_the_entries_stay_bounded_whatever_functions_come(monkeypatch):
    """Functions made per call (closures) would each add an entry: past the limit all are dropped."""
    monkeypatch.setattr(entry_points, "_entries", {})
    monkeypatch.setattr(entry_points, "_LIMIT", 4)
    for value in range(10):
        entry_points.run([((lambda v: None), (value,), False)], None, 0)
        assert len(entry_points._entries) <= 4


@pytest.mark.parametrize("workers", [0, 1], ids=["alone", "pool"])
def test_deferred_pool_jobs_run_their_entry_points_with_the_same_bits(workers):
    """A products job deferred (`jobs.post_products`, board and worker count first) on this thread's
    board or the pool's: learnt from its first flush, its entry point from the next, the product
    bitwise the one-thread loop's."""
    decode_pool.set_workers(workers)
    try:
        matrix = RNG.standard_normal((256, 96)).astype(np.float32)
        row = RNG.standard_normal(256).astype(np.float32)
        expected = row_times_matrix(row, matrix)
        for _ in range(2):
            out = np.full(96, np.nan, np.float32)
            arguments = (row, (matrix,), (out,), np.empty(chunk_count(row.size) * 96, np.float32), 0.0, 1.0)
            defer(jobs.post_products, arguments, job=True)
            settle()
            np.testing.assert_array_equal(out, expected)
        assert _resolved_functions([(jobs.post_products, arguments, True)]) != [jobs.post_products]
    finally:
        settle()
        decode_pool.set_workers(None)


def _greedy_logits(folder, steps: int) -> list:
    """The logits of a 6-token prompt and `steps` greedy decode steps of the decoder in `folder`."""
    from runnx.generate.decoder import DecoderStep

    decoder = DecoderStep.from_folder(folder, capacity=64)
    logits = [decoder.step(np.array([[1, 4093, 314, 2362, 30, 216]], np.int64))]
    for _ in range(steps):
        logits.append(decoder.step(np.array([[int(logits[-1][0, -1].argmax())]], np.int64)))
    return logits


@pytest.mark.parametrize("workers", [0, 1], ids=["one thread", "two threads"])
@pytest.mark.parametrize("folder", ["smollm2_genai_fp32_dir", "smollm2_dir"])
def test_real_decoders_give_the_same_bits_through_entry_points(workers, folder, request, monkeypatch):
    """onnxruntime-genai's fp32 folder and Optimum's export, decoded with their deferred calls run
    through entry points (each decode step's calls but the first step's) and through numba's
    dispatcher: bitwise the same logits, one thread and two."""
    path = request.getfixturevalue(folder)
    resolve, direct = entry_points.resolved, []

    def counting(calls):
        resolved = resolve(calls)
        direct.append(sum(function is not call[0] for (function, _, _), call in zip(resolved[0], calls)))
        return resolved

    decode_pool.set_workers(workers)
    try:
        monkeypatch.setattr(entry_points, "resolved", counting)
        through_entries = _greedy_logits(path, 8)
        assert sum(direct) >= 7 * 3 * 30
        monkeypatch.setattr(entry_points, "resolved", lambda calls: (calls, []))
        for got, expected in zip(through_entries, _greedy_logits(path, 8)):
            np.testing.assert_array_equal(got, expected)
    finally:
        settle()
        decode_pool.set_workers(None)
