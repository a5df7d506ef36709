"""Facts about constants remembered by identity (runnx/ops/_remembered.py) and the decode paths using them."""
import numpy as np
import pytest

from runnx.ops import _remembered, fused_residual_blocks
from runnx.ops._remembered import Remembered


def _read_only(array):
    array.flags.writeable = False
    return array


def _counting():
    calls = []

    def fact(values, *arrays):
        calls.append(values)
        return (values, sum(a.size for a in arrays if a is not None))

    return Remembered(fact), calls


def test_a_fact_is_computed_once_for_the_same_read_only_arrays_and_values():
    fact, calls = _counting()
    a, b = _read_only(np.zeros(3)), _read_only(np.zeros(4))
    assert fact((1,), a, None, b) == fact((1,), a, None, b) == ((1,), 7)
    assert len(calls) == 1
    assert fact((2,), a, None, b) == ((2,), 7)  # other values: another fact
    assert len(calls) == 2


def test_an_equal_array_of_another_identity_or_a_writeable_one_is_checked_again():
    fact, calls = _counting()
    a = _read_only(np.zeros(3))
    fact((), a)
    fact((), _read_only(np.zeros(3)))  # equal, not the same object
    assert len(calls) == 2
    writeable = np.zeros(5)
    fact((), writeable)
    fact((), writeable)  # its contents (and through them nothing else) may change: never kept
    assert len(calls) == 4
    assert len(fact.known) == 1  # a's entry; the equal array's went with it


def test_an_entry_goes_with_its_arrays_and_keeps_none_alive():
    """Facts about a model's weights must not keep them alive, and an id freed by an array may
    come back as another object's: its entry is gone by then."""
    import gc
    import weakref

    fact, calls = _counting()
    weight = _read_only(np.zeros(1000))
    alive = weakref.ref(weight)
    fact((), weight)
    assert len(fact.known) == 1
    del weight
    gc.collect()
    assert alive() is None and not fact.known
    for _ in range(3):  # fresh arrays, often at a freed address: each is checked, never a stale hit
        fact((), _read_only(np.zeros(1000)))
    assert len(calls) == 4


def test_a_promised_fact_is_joined_not_computed_and_kept_once():
    """A promise (a prepack's work under way) is called by the first lookup missing it, instead of
    the function; a promise giving None leaves the function to compute; `keep` fulfils a promise,
    keeping the first result; `withdraw` drops one."""
    fact, calls = _counting()
    a, b, c = _read_only(np.zeros(3)), _read_only(np.zeros(4)), _read_only(np.zeros(5))
    joined = []
    fact.promise((1,), (a,), lambda: joined.append(1) or "made elsewhere")
    assert fact((1,), a) == fact((1,), a) == "made elsewhere"
    assert joined == [1] and calls == []  # joined once, computed never
    fact.promise((1,), (b,), lambda: None)  # refused: the function computes
    assert fact((1,), b) == ((1,), 4) and calls == [(1,)]
    fact.promise((1,), (c,), lambda: pytest.fail("a kept promise is not joined"))
    assert fact.keep((1,), (c,), "kept") == "kept"
    assert fact((1,), c) == "kept" and fact.keep((1,), (c,), "again") == "kept"  # the first stays
    fact.promise((2,), (c,), lambda: pytest.fail("a withdrawn promise is not joined"))
    fact.withdraw((2,), (c,))
    assert fact((2,), c) == ((2,), 5)


def test_switched_off_every_call_computes(monkeypatch):
    fact, calls = _counting()
    a = _read_only(np.zeros(3))
    fact((), a)
    monkeypatch.setattr(_remembered, "enabled", False)
    fact((), a)
    fact((), a)
    assert len(calls) == 3


def _gated_weights(order="C"):
    rng = np.random.default_rng(0)
    shapes = {"weight": (8, 6), "gate": (6, 10), "up": (6, 10), "down": (10, 6)}
    weights = {k: _read_only(np.asarray(rng.standard_normal(s), np.float32, order=order)) for k, s in shapes.items()}
    norm = [np.float32(1e-5), np.float32(1.0), _read_only(np.ones(6, np.float32))]  # (epsilon and one: attributes)
    return weights, norm


@pytest.mark.parametrize("order", ["F", "C"])
def test_a_gated_mlp_row_is_checked_for_each_set_of_weights(order):
    """The decode block's facts are per weights: a Fortran-ordered matrix (same shapes) is refused
    even after C-ordered ones of the same shapes were accepted, and the other way round."""
    x = np.ones((1, 1, 8), np.float32)
    residual = np.ones((1, 1, 6), np.float32)
    other = "C" if order == "F" else "F"
    for weights, norm in (_gated_weights(order), _gated_weights(other), _gated_weights(order)):
        block = fused_residual_blocks._gated_mlp_row(x, weights["weight"], None, residual, *norm, weights["gate"], weights["up"],
                                      weights["down"], None, *norm, (-1, 0, 0), (-1, 0, 0))
        if weights["weight"].flags.c_contiguous:
            arguments, numbers = block
            assert arguments[1] is weights["weight"]
            assert numbers == pytest.approx((1e-5, 1.0))
        else:
            assert block is None
    strided = np.ones((1, 1, 12), np.float32)[..., ::2]  # the step's own arrays are checked every call
    weights, norm = _gated_weights("C")
    assert fused_residual_blocks._gated_mlp_row(x, weights["weight"], None, strided, *norm, weights["gate"], weights["up"],
                                 weights["down"], None, *norm, (-1, 0, 0), (-1, 0, 0)) is None
