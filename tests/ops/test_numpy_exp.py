"""numpy's own float32 exp called from numba kernels (runnx/ops/_kernels_numpy_exp.py): found and
checked at import, bitwise np.exp, refused when it is some other loop; the SiLU gates that call it
give the bits they gave with numpy's exp called from Python."""
import numba
import numpy as np
import pytest

import runnx
from runnx.ops import _kernels_numpy_exp, fused_norms
from runnx.ops._kernels_numpy_exp import EXP, exp_into
from runnx.runtime import pool as decode_pool
from runnx.runtime import settle


def _bits(x):
    return x.view(np.uint32)


def test_numpys_float32_exp_loop_is_found_and_checked_here():
    assert _kernels_numpy_exp.available() and EXP[0] != 0
    assert _kernels_numpy_exp._checked(_kernels_numpy_exp._float32_loop(np.exp)) == EXP


def test_exp_into_is_numpys_exp_on_a_spread_of_every_float32():
    """Every 997th float32 bit pattern (4.3 million values: both signs, zeros, subnormals, overflow,
    underflow, infinities and NaNs), into another array and in place: np.exp's bits."""
    values = np.arange(0, 1 << 32, 997, dtype=np.uint64).astype(np.uint32).view(np.float32)
    with np.errstate(all="ignore"):
        expected = np.exp(values)
    out = np.empty_like(values)
    exp_into(EXP, values, out)
    np.testing.assert_array_equal(_bits(out), _bits(expected))
    in_place = values.copy()
    exp_into(EXP, in_place, in_place)
    np.testing.assert_array_equal(_bits(in_place), _bits(expected))


@numba.njit
def _exp_of_slices(loop, x, width):
    for start in range(0, x.size, width):
        part = x[start:start + width]
        exp_into(loop, part, part)


@pytest.mark.parametrize("width", [1, 7, 16, 1000])
def test_exp_into_takes_slices_of_any_length_and_offset(width):
    x = (np.random.default_rng(width).standard_normal(4099) * 40).astype(np.float32)
    with np.errstate(all="ignore"):
        expected = np.exp(x)
    _exp_of_slices(EXP, x, width)
    np.testing.assert_array_equal(_bits(x), _bits(expected))


def test_exp_into_refuses_arrays_of_different_sizes():
    with pytest.raises(ValueError, match="differ in size"):
        exp_into(EXP, np.zeros(4, np.float32), np.zeros(3, np.float32))


def test_a_loop_that_is_not_numpys_float32_exp_is_refused():
    """Another ufunc's float32 loop computes other bits (`_checked` finds it out); a two-input
    ufunc has no such loop: both (0, 0)."""
    assert _kernels_numpy_exp._checked(_kernels_numpy_exp._float32_loop(np.exp2)) == (0, 0)
    assert _kernels_numpy_exp._checked(_kernels_numpy_exp._float32_loop(np.expm1)) == (0, 0)
    assert _kernels_numpy_exp._float32_loop(np.add) == (0, 0)


def test_no_stale_overflow_reaches_numpys_next_operation():
    """An overflow inside the loop sets the thread's floating-point flags; numpy's next operation
    must not report it."""
    exp_into(EXP, np.full(5, 100.0, np.float32), np.empty(5, np.float32))
    with np.errstate(all="raise"):
        assert (np.ones(3, np.float32) * 2).sum() == 6


def _counting_python_exp(monkeypatch) -> list:
    """Calls of numpy's exp from Python for a SiLU gate (`fused_norms.exp_in_place`), counted."""
    calls = []
    original = fused_norms.exp_in_place

    def counted(x, largest):
        calls.append(x.size)
        return original(x, largest)

    monkeypatch.setattr(fused_norms, "exp_in_place", counted)
    return calls


def test_a_long_prompts_silu_mul_is_the_same_bits_with_the_loop_or_without(monkeypatch):
    rng = np.random.default_rng(1)
    gate = (rng.standard_normal((300, 1536)) * 8).astype(np.float32)
    gate[7, :3] = [1000, -1000, np.nan]
    up = rng.standard_normal((300, 1536)).astype(np.float32)
    calls = _counting_python_exp(monkeypatch)
    native = fused_norms.SiluMul(gate, up)
    assert not calls
    monkeypatch.setattr(_kernels_numpy_exp, "EXP", (0, 0))
    np.testing.assert_array_equal(_bits(fused_norms.SiluMul(gate, up)), _bits(native))
    assert calls


def _prompts_and_steps(folder) -> list:
    """A 300-token prompt's last logits, then a 6-token prompt's and 4 greedy steps' (the three
    paths of a gated MLP: SiluMul's rows, a short prompt's blocks, a decode row's)."""
    from runnx.generate.decoder import DecoderStep

    load = lambda path: runnx.load(path, check_symbolic_dims=False, last_position=("logits",))  # noqa: E731
    decoder = DecoderStep.from_folder(folder, capacity=512, load=load)
    prompt = np.random.default_rng(2).integers(3, 40000, (1, 300)).astype(np.int64)
    logits = [decoder.step(prompt)]
    decoder.reset()
    logits.append(decoder.step(np.array([[1, 4093, 314, 2362, 30, 216]], np.int64)))
    for _ in range(4):
        logits.append(decoder.step(np.array([[int(logits[-1][0, -1].argmax())]], np.int64)))
    settle()
    return logits


@pytest.mark.parametrize("workers", [0, 1], ids=["one thread", "two threads"])
@pytest.mark.parametrize("folder", ["smollm2_genai_int4_dir", "smollm2_dir"])
def test_decoders_give_the_same_bits_with_numpys_exp_in_their_kernels(workers, folder, request, monkeypatch):
    """The Optimum SmolLM2 export (ResidualGatedMLP) and onnxruntime-genai's 4-bit folder
    (GatedMLPNBits): with the loop, no gate's exp goes through Python; without it, every one does;
    the logits are bitwise the same."""
    path = request.getfixturevalue(folder)
    decode_pool.set_workers(workers)
    try:
        calls = _counting_python_exp(monkeypatch)
        native = _prompts_and_steps(path)
        assert not calls
        monkeypatch.setattr(_kernels_numpy_exp, "EXP", (0, 0))
        through_python = _prompts_and_steps(path)
        assert len(calls) >= 6 * 30
        for got, expected in zip(native, through_python):
            np.testing.assert_array_equal(_bits(got), _bits(expected))
    finally:
        settle()
        decode_pool.set_workers(None)


def test_a_gates_decay_is_numpys_exp_of_minus_the_gate_its_maximum_sought_only_for_numpy():
    """`_decode_blocks._decay_into` with numpy's loop: exp(-gate) bitwise np.exp's (NaN, infinities
    and overflow included), and inf for its maximum, which no caller then reads; with (0, 0) it
    leaves -gate for numpy and returns its largest element (the caller's overflow check)."""
    from runnx.ops._decode_blocks import _decay_into

    gate = (np.random.default_rng(2).standard_normal((3, 1537)) * 40).astype(np.float32)
    gate[0, :5] = [np.nan, np.inf, -np.inf, 100, -100]
    decay = np.empty_like(gate)
    assert _decay_into(EXP, gate, decay) == np.inf
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(_bits(decay), _bits(np.exp(-gate)))
    finite = gate[1:]
    decay = np.empty_like(finite)
    assert _decay_into((0, 0), finite, decay) == float((-finite).max())
    np.testing.assert_array_equal(_bits(decay), _bits(-finite))
