"""Executor: caller arrays are never written, Owned inputs are consumed in place, requested
intermediates survive, the checking mode, and the onnxruntime-compatible session."""
import dataclasses
import hashlib
import threading
from pathlib import Path

import numpy as np
import onnxruntime
import pytest
from onnx import helper

import runnx
from _graphs import chain, float_model
from runnx.errors import InPlaceMismatchError



def _checksum(array) -> str:
    return hashlib.sha256(array.tobytes()).hexdigest()


def test_caller_arrays_are_unchanged_after_every_run():
    model = runnx.load(chain())
    x, y = np.arange(8, dtype=np.float32).reshape(2, 4), np.full((2, 4), 3, np.float32)
    before = [_checksum(x), _checksum(y)]
    for _ in range(3):
        out, profile = model.run({"x": x, "y": y}, profile=True)
        assert [_checksum(x), _checksum(y)] == before
        np.testing.assert_array_equal(out["out"], (3 - x) * 3 - 3)
        assert profile.inplace["Neg"] == 0  # x is borrowed
        assert profile.inplace["Add"] == 1 and profile.inplace["Sub"] == 1


def test_an_owned_input_is_consumed_in_place():
    model = runnx.load(chain())
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    expected = (3 - x) * 3 - 3
    out, profile = model.run({"x": runnx.Owned(x), "y": np.full((2, 4), 3, np.float32)}, profile=True)
    assert profile.inplace["Neg"] == 1 and profile.inplace_total == 4
    assert np.shares_memory(out["out"], x)  # the whole chain ran in the caller's buffer
    np.testing.assert_array_equal(out["out"], expected)


def test_a_read_only_owned_input_is_treated_as_borrowed():
    model = runnx.load(chain())
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    x.flags.writeable = False
    out, profile = model.run({"x": runnx.Owned(x), "y": np.full((2, 4), 2, np.float32)}, profile=True)
    assert profile.inplace["Neg"] == 0
    np.testing.assert_array_equal(out["out"], (2 - x) * 2 - 2)
    np.testing.assert_array_equal(x, np.arange(8).reshape(2, 4))


@pytest.mark.parametrize("order", ["owned first", "borrowed first"])
def test_an_owned_input_sharing_storage_with_a_borrowed_one_is_not_written(order):
    model = runnx.load(chain())
    buffer = np.arange(16, dtype=np.float32)
    x, y = buffer[:8].reshape(2, 4), buffer[8:].reshape(2, 4)  # two views of one caller buffer
    before = buffer.copy()
    feeds = {"x": runnx.Owned(x), "y": y} if order == "owned first" else {"y": y, "x": runnx.Owned(x)}
    out, profile = model.run(feeds, profile=True)
    np.testing.assert_array_equal(buffer, before)
    assert profile.inplace["Neg"] == 0
    np.testing.assert_array_equal(out["out"], (before[8:] - before[:8]).reshape(2, 4) * y - y)


def test_requested_intermediate_outputs_are_never_overwritten():
    model = runnx.load(chain())
    x, y = np.arange(8, dtype=np.float32).reshape(2, 4), np.ones((2, 4), np.float32)
    out = model.run({"x": runnx.Owned(x.copy()), "y": y}, ["a", "b", "out"])
    np.testing.assert_array_equal(out["a"], -x)
    np.testing.assert_array_equal(out["b"], 1 - x)
    np.testing.assert_array_equal(out["out"], (1 - x) - 1)
    assert not np.shares_memory(out["a"], out["b"]) and not np.shares_memory(out["b"], out["out"])


def test_outputs_never_alias_constants_or_caller_arrays():
    model = runnx.load(float_model([helper.make_node("Identity", ["x"], ["y"], name="id")], ["x"], ["y"]))
    x = np.ones(3, np.float32)
    y = model.run({"x": x})["y"]
    assert not np.shares_memory(x, y) and y.flags.writeable


def test_concat_appends_into_the_capacity_of_an_owned_input():
    model = runnx.load(float_model([helper.make_node("Concat", ["past", "new"], ["present"], axis=1, name="cat")],
                              ["past", "new"], ["present"]))
    past, new = np.arange(6, dtype=np.float32).reshape(2, 3), np.full((2, 1), -1, np.float32)
    cache = runnx.with_capacity(past, axis=1, capacity=8)
    out, profile = model.run({"past": cache, "new": new}, profile=True)
    np.testing.assert_array_equal(out["present"], np.concatenate([past, new], axis=1))
    assert np.shares_memory(out["present"], cache.array)
    assert profile.counters["Concat.appends_in_place"] == 1
    # the same cache given borrowed is left alone
    borrowed = runnx.with_capacity(past, axis=1, capacity=8).array
    snapshot = borrowed.base.copy()
    out = model.run({"past": borrowed, "new": new})
    assert not np.shares_memory(out["present"], borrowed)
    np.testing.assert_array_equal(borrowed.base[:, :3], snapshot[:, :3])


@pytest.mark.parametrize("enable", ["option", "environment"])
def test_checking_mode_compares_every_in_place_step(monkeypatch, enable):
    if enable == "environment":
        monkeypatch.setenv("RUNNX_CHECK_INPLACE", "1")
        model = runnx.load(chain())
    else:
        model = runnx.load(chain(), check_inplace=True)
    assert model.options.check_inplace
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    out, profile = model.run({"x": runnx.Owned(x.copy()), "y": np.ones((2, 4), np.float32)}, profile=True)
    assert profile.inplace_total == 4
    np.testing.assert_array_equal(out["out"], (1 - x) - 1)


def test_copy_mode_runs_nothing_in_place_and_gives_the_same_bits():
    x, y = np.linspace(-3, 3, 8, dtype=np.float32).reshape(2, 4), np.full((2, 4), 0.1, np.float32)
    fast, fast_profile = runnx.load(chain()).run({"x": runnx.Owned(x.copy()), "y": y}, profile=True)
    slow, slow_profile = runnx.load(chain(), inplace=False).run({"x": runnx.Owned(x.copy()), "y": y}, profile=True)
    assert fast_profile.inplace_total == 4 and slow_profile.inplace_total == 0
    assert fast["out"].tobytes() == slow["out"].tobytes()


def test_inference_session_matches_onnxruntime():
    data = chain().SerializeToString()
    ours, theirs = runnx.InferenceSession(data), onnxruntime.InferenceSession(data)
    for mine, reference in [(ours.get_inputs(), theirs.get_inputs()), (ours.get_outputs(), theirs.get_outputs())]:
        assert [(a.name, list(a.shape), a.type) for a in mine] == \
               [(b.name, list(b.shape), b.type) for b in reference]
    feeds = {"x": np.linspace(-2, 2, 12, dtype=np.float32).reshape(3, 4), "y": np.ones((3, 4), np.float32)}
    for names in [None, ["out"]]:
        got, expected = ours.run(names, feeds), theirs.run(names, feeds)
        assert isinstance(got, list) and len(got) == len(expected) == 1
        np.testing.assert_allclose(got[0], expected[0], rtol=1e-6)
    assert ours.get_providers() == ["CPUExecutionProvider"]
    with pytest.raises(KeyError):  # onnxruntime code catching builtin errors keeps working
        ours.run(None, {"x": feeds["x"], "y": feeds["y"], "z": feeds["y"]})


def test_one_session_used_by_several_threads_returns_each_its_own_result():
    session = runnx.InferenceSession(chain().SerializeToString())
    errors, barrier = [], threading.Barrier(6)

    def work(seed):
        rng = np.random.default_rng(seed)
        barrier.wait()
        for _ in range(50):
            x = rng.standard_normal((int(rng.integers(1, 6)), 4)).astype(np.float32)
            y = rng.standard_normal(x.shape).astype(np.float32)
            feeds = {"x": runnx.Owned(x.copy()) if rng.integers(2) else x, "y": y}
            (got,) = session.run(None, feeds)
            if not np.array_equal(got, (y - x) * y - y):
                errors.append(seed)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []


FIXTURE_MODELS = sorted((Path(__file__).resolve().parents[1] / "fixtures").rglob("*.onnx"))


@pytest.mark.parametrize("path", FIXTURE_MODELS, ids=[p.parent.name + "/" + p.name for p in FIXTURE_MODELS])
def test_session_inputs_and_outputs_match_onnxruntime_on_fixture_models(path):
    ours, theirs = runnx.InferenceSession(str(path)), onnxruntime.InferenceSession(str(path))
    assert [(a.name, list(a.shape), a.type) for a in ours.get_inputs()] == \
           [(b.name, list(b.shape), b.type) for b in theirs.get_inputs()]
    # output shapes: runnx reports the declared ones, onnxruntime its own inferred ones
    assert [(a.name, a.type) for a in ours.get_outputs()] == [(b.name, b.type) for b in theirs.get_outputs()]



def _wrong_in_place_neg(x, *, overwrite=()):
    """A deliberately broken kernel: right out of place, wrong when it may write into x."""
    if overwrite:
        x *= -2
        return x
    return -x


def test_checking_mode_catches_a_kernel_whose_in_place_result_differs():
    def load(**options):
        model = runnx.load(float_model([helper.make_node("Neg", ["x"], ["y"], name="broken")], ["x"], ["y"]), **options)
        node = model.graph.nodes[0]
        node.kernel = dataclasses.replace(node.kernel, fn=_wrong_in_place_neg)
        return model

    x = np.ones(3, np.float32)
    np.testing.assert_array_equal(load().run({"x": x})["y"], -x)  # borrowed: out of place, right
    np.testing.assert_array_equal(load().run({"x": runnx.Owned(x.copy())})["y"], -2 * x)  # the bug
    with pytest.raises(InPlaceMismatchError, match="Neg node 'broken': output 0 differs when computed in place"):
        load(check_inplace=True).run({"x": runnx.Owned(x.copy())})
