"""`full_width()` (runnx/ops/_vector_width.py): a kernel asking for the CPU's full vector width gets
512-bit loops on an AVX-512 CPU, and the row kernels that ask give the bits they gave at LLVM's
preferred 256 bits."""
import types

import numba
import numpy as np
import pytest

from runnx.ops import _kernels_gemm, _kernels_nn, _kernels_rows
from runnx.ops._vector_width import full_width

RNG = np.random.default_rng(0)


@numba.njit
def _wide_scale(x, out):
    full_width()
    for i in range(x.shape[0]):
        out[i] = x[i] * np.float32(3)


@numba.njit
def _narrow_scale(x, out):
    for i in range(x.shape[0]):
        out[i] = x[i] * np.float32(3)


def test_a_kernel_asking_for_full_width_gets_it():
    x = np.ones(64, np.float32)
    for kernel in (_wide_scale, _narrow_scale):
        kernel(x, np.empty_like(x))
    wide_ir = _wide_scale.inspect_llvm(_wide_scale.signatures[0])
    assert '"prefer-vector-width"="512"' in wide_ir
    assert "prefer-vector-width" not in _narrow_scale.inspect_llvm(_narrow_scale.signatures[0])
    if _kernels_gemm.WIDE:  # (AVX-512)
        assert "zmm" in _wide_scale.inspect_asm(_wide_scale.signatures[0])
        assert "zmm" not in _narrow_scale.inspect_asm(_narrow_scale.signatures[0])


def _narrow_copies() -> dict:
    """The row kernels that ask for full width, compiled anew (not cached) with the request a no-op
    (their helpers too): what LLVM's own preference made of them."""
    nothing = numba.njit(lambda: None)
    compiled = {}

    def copy(module, name, **options):
        function = getattr(module, name).py_func
        scope = dict(vars(module), full_width=nothing, **compiled)
        compiled[name] = numba.njit(error_model="numpy", **options)(
            types.FunctionType(function.__code__, scope, name, function.__defaults__, function.__closure__))
        return compiled[name]

    copy(_kernels_nn, "pairwise_total")
    for name, flags in (("_row_peak", None), ("_exponentials", _kernels_rows._REORDER), ("_row_total", None),
                        ("softmax_rows_float32", None), ("gelu_rows_float32", _kernels_rows._REORDER_SIGNED)):
        copy(_kernels_rows, name, **({"fastmath": flags} if flags else {}))
    for name, flags in (("_float64_sum", None), ("_normalised", {"contract", "nsz", "arcp"}),
                        ("_normalised_row", None), ("layer_norm_rows", None)):
        copy(_kernels_nn, name, **({"fastmath": flags} if flags else {}))
    return compiled


@pytest.fixture(scope="module")
def narrow():
    return _narrow_copies()


@pytest.mark.parametrize("columns", [1, 7, 33, 1000, 1501])
def test_softmax_rows_are_the_same_bits_at_full_width(columns, narrow):
    scores = (RNG.standard_normal((24, columns)) * 8).astype(np.float32)
    scores[0, 0], scores[1] = -np.inf, -np.inf
    scores[2, columns // 2] = np.nan
    wide, expected = scores.copy(), scores.copy()
    _kernels_rows.softmax_rows_float32(wide, np.float32(0))
    narrow["softmax_rows_float32"](expected, np.float32(0))
    np.testing.assert_array_equal(wide.view(np.uint32), expected.view(np.uint32))


def test_gelu_and_layer_norm_rows_are_the_same_bits_at_full_width(narrow):
    x = (RNG.standard_normal((50, 1537)) * 3).astype(np.float32)
    bias = RNG.standard_normal(1537).astype(np.float32)
    numbers = (np.float32(1.4142135), np.float32(1), np.float32(0.5))
    wide, expected = np.empty_like(x), np.empty_like(x)
    _kernels_rows.gelu_rows_float32(x, bias, *numbers, wide)
    narrow["gelu_rows_float32"](x, bias, *numbers, expected)
    np.testing.assert_array_equal(wide.view(np.uint32), expected.view(np.uint32))
    rows = (RNG.standard_normal((40, 385)) * 3).astype(np.float32)
    scale, shift = RNG.standard_normal(385).astype(np.float32), RNG.standard_normal(385).astype(np.float32)
    results = []
    for kernel in (_kernels_nn.layer_norm_rows, narrow["layer_norm_rows"]):
        out, mean, inv = np.empty_like(rows), np.empty(40, np.float32), np.empty(40, np.float32)
        kernel(rows, scale, shift, 1e-5, out, mean, inv)
        results.append(np.concatenate([out.ravel(), mean, inv]))
    np.testing.assert_array_equal(results[0].view(np.uint32), results[1].view(np.uint32))
