"""One compiled body per kernel (`runnx/ops/_array_types.py`): the retyping intrinsics change an
array's numba type, never its data, and the kernels called with arrays of several layouts and
mutabilities compile their body for one type."""
from __future__ import annotations

import importlib
import inspect

import numba
import numpy as np
import pytest
from numba.core.registry import CPUDispatcher

from runnx.ops import _jit_cache
from runnx.ops import _kernels_fused as fused
from runnx.ops import _kernels_gemm as gemm
from runnx.ops._array_types import any_layout, read_only, typed_contiguous


@numba.njit
def _first(x):
    return x[0, 0]


@numba.njit
def _retyped_calls(x):
    return _first(read_only(x)) + _first(any_layout(x)) + _first(typed_contiguous(x))


@numba.njit
def _write_through_any_layout(x):
    view = any_layout(x)
    view[0, 1] = 7.0
    return view[1, 0]


def test_the_intrinsics_retype_without_copying():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert _retyped_calls(x) == 0.0
    mutable = numba.typeof(x)
    assert set(_first.signatures) == {(mutable.copy(readonly=True),), (mutable.copy(layout="A"),), (mutable,)}
    assert _write_through_any_layout(x) == 3.0 and x[0, 1] == 7.0  # the same memory, written through


def _signatures_added(kernel, call):
    before = set(kernel.signatures)
    call()
    return set(kernel.signatures) - before


@pytest.mark.skipif(not gemm.AVAILABLE, reason="this CPU has neither AVX-512 nor AVX2 with FMA: numpy's BLAS multiplies")
def test_the_product_compiles_one_body_for_weights_values_and_strided_outputs():
    """`product_columns` with a read-only or writable a and b, a whole or a strided c: the same bits
    each way, and its body (`_columns_product`) compiled for one type only."""
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((20, 70)).astype(np.float32), rng.standard_normal((70, 150)).astype(np.float32)
    weights = b.copy()
    weights.flags.writeable = False
    results = []

    def products():
        for left, right in ((a, b), (a, weights)):
            for whole in (True, False):
                out = np.empty((20, 150), np.float32) if whole else np.empty((20, 2, 150), np.float32)[:, 1]
                sums = np.empty((gemm.streamed_rows(20), gemm.STREAMED_COLUMNS), np.float32)
                gemm.product_columns(left, right, out, 0, 150, np.empty(gemm.MC * gemm.KC, np.float32),
                                     np.empty(gemm.KC * gemm.NR, np.float32), np.empty((gemm.MR, gemm.NR), np.float32),
                                     False, np.empty(gemm.KC * gemm.BLOCK_COLUMNS, np.float32), sums)
                results.append(out.copy())

    added = _signatures_added(gemm._columns_product, products)
    assert all(np.array_equal(results[0], r) for r in results[1:])
    np.testing.assert_allclose(results[0], a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)
    assert len(added) <= 1  # (none when another test compiled or loaded it first)
    for signature in gemm._columns_product.signatures:
        left, right, out = signature[:3]
        assert not left.mutable and not right.mutable and out.layout == "A", signature


def test_the_rotary_append_compiles_one_body_for_a_prompts_and_a_steps_tables():
    """`rope_append_into` with transposed (F-ordered) tables and empty caches, as a prompt's, and
    with C-ordered tables and prefix views, as a decode step's: the same values as numpy's rotation,
    and one body (`_rope_append_into`) for both."""
    rng = np.random.default_rng(5)
    heads, width, half = 2, 8, 4

    def tables(positions):
        return [np.ascontiguousarray(rng.standard_normal((width, positions)).astype(np.float32)).T[None, None]
                for _ in range(4)]  # (1, 1, positions, width), F-ordered for more than one position

    def rotated(x, cos, sin):
        return x * cos + np.concatenate([-x[..., half:], x[..., :half]], axis=-1) * sin

    key_buffer, value_buffer = np.zeros((1, heads, 8, width), np.float32), np.zeros((1, heads, 8, width), np.float32)
    calls = []
    for past, positions in ((0, 3), (3, 1)):
        query, key, value = (rng.standard_normal((1, heads, positions, width)).astype(np.float32) for _ in range(3))
        query_cos, query_sin, key_cos, key_sin = tables(positions)
        calls.append((query, key, value, key_buffer[:, :, :past], key_buffer, value_buffer[:, :, :past], value_buffer,
                      query_cos, query_sin, key_cos, key_sin, half, half))
    assert numba.typeof(calls[0][7]).layout == "F" and numba.typeof(calls[1][7]).layout == "C"
    assert numba.typeof(calls[0][3]).layout == "C" and numba.typeof(calls[1][3]).layout == "A"

    def run():
        for arguments in calls:
            done, out = fused.rope_append_into(*arguments)
            query, key, value, past = arguments[0], arguments[1], arguments[2], arguments[3].shape[2]
            assert done
            np.testing.assert_array_equal(out, rotated(query, arguments[7], arguments[8]))
            np.testing.assert_array_equal(key_buffer[:, :, past:past + key.shape[2]],
                                          rotated(key, arguments[9], arguments[10]))
            np.testing.assert_array_equal(value_buffer[:, :, past:past + key.shape[2]], value)

    added = _signatures_added(fused._rope_append_into, run)
    assert len(added) <= 1
    for signature in fused._rope_append_into.signatures:
        assert all(t.layout == "A" for t in (*signature[:4], signature[5], *signature[7:11])), signature


def test_no_compiled_kernel_takes_star_arguments():
    """numba types a kernel's *args as a tuple when Python calls it and as a star-argument tuple
    when a compiled kernel does: a kernel called both ways compiled twice (seconds each for a
    layer block). Every cached kernel takes fixed arguments instead (a tuple where it needs many)."""
    starred = []
    for module in _jit_cache.CACHED_MODULES:
        name = "runnx." + module.removesuffix(".py").replace("/", ".")
        for attribute, value in vars(importlib.import_module(name)).items():
            if isinstance(value, CPUDispatcher) and value.py_func.__module__ == name:
                kinds = [p.kind for p in inspect.signature(value.py_func).parameters.values()]
                if inspect.Parameter.VAR_POSITIONAL in kinds:
                    starred.append(f"{name}.{attribute}")
    assert starred == []


def test_absent_inputs_are_typed_as_the_constants_they_stand_for():
    """An absent bias or query projection (`_fused_common.absent`) is read-only as a loaded weight
    is: a layer with the input and one without call a native block with one numba type."""
    from runnx.ops import fused_layer_norm_blocks, fused_products

    weight = np.zeros((4, 4), np.float32)
    weight.flags.writeable = False
    assert numba.typeof(fused_layer_norm_blocks._NO_WEIGHT) == numba.typeof(weight)
    assert numba.typeof(fused_products._NO_BIAS) == numba.typeof(weight[0])
    for dtype, bias in fused_layer_norm_blocks._NO_BIAS.items():
        vector = np.zeros(4, dtype)
        vector.flags.writeable = False
        assert numba.typeof(bias) == numba.typeof(vector)
