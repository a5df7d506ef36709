"""The KV cache of Optimum decoders grows in place: past KV handed over as `runnx.Owned` buffers
with capacity comes back as present KV in the same memory, one in-place append per KV tensor per
step, and the bytes copied per step do not depend on the past length."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnxruntime
import pytest

import runnx

FIXTURES = Path(os.environ.get("RUNNX_FIXTURES", Path(__file__).parents[1] / "fixtures"))
MODELS = {
    "single": FIXTURES / "tiny-llama" / "model.onnx",
    "merged": FIXTURES / "tiny-llama-merged" / "decoder_model_merged.onnx",
    "merged-if": FIXTURES / "tiny-llama-merged" / "decoder_model_merged.onnx",
}
# the merged decoder runs its chosen branch as a graph of its own (interp/branches.py), or its If as
# a node, the past KV then reaching the Concat through the If's captures
OPTIONS = {"merged-if": {"specialize_branches": False}}
CAPACITY = 2048


def _feeds(model, ids, past_length, past):
    names = model.input_names
    feeds = {"input_ids": ids, "attention_mask": np.ones((1, past_length + ids.shape[1]), np.int64)}
    if "position_ids" in names:
        feeds["position_ids"] = np.arange(past_length, past_length + ids.shape[1], dtype=np.int64)[None]
    if "use_cache_branch" in names:
        feeds["use_cache_branch"] = np.array([past_length > 0])
    feeds.update(past)
    return feeds


def _kv_names(model):
    return [n for n in model.input_names if n.startswith("past_key_values.")]


def _empty_past(model):
    past = {}
    for info in model.inputs:
        if info.name.startswith("past_key_values."):
            past[info.name] = np.zeros((1, info.shape[1], 0, info.shape[3]), np.float32)
    return past


def _decode(kind, steps, prompt_length=5, seed=0):
    """Prefill, then `steps` decode steps with capacity buffers; returns per-step records."""
    path = MODELS[kind]
    model = runnx.load(path, **OPTIONS.get(kind, {}))
    reference = onnxruntime.InferenceSession(str(path))
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, 1000, size=(1, prompt_length), dtype=np.int64)
    past = _empty_past(model)
    result = model.run(_feeds(model, ids, 0, {k: runnx.Owned(v.copy()) for k, v in past.items()}))
    expected = reference.run(None, _feeds(model, ids, 0, past))
    np.testing.assert_allclose(result["logits"], expected[0], atol=1e-5)
    presents = {k: result[k.replace("past_key_values", "present")] for k in past}
    length = prompt_length
    records = []
    for _ in range(steps):
        token = np.array([[int(result["logits"][0, -1].argmax())]], np.int64)
        buffers = {k: runnx.with_capacity(v, axis=2, capacity=CAPACITY) for k, v in presents.items()}
        plain = {k: b.array.copy() for k, b in buffers.items()}
        profile = runnx.Profile()
        result = model.run(_feeds(model, token, length, buffers), profile=profile)
        expected = dict(zip([o.name for o in reference.get_outputs()],
                            reference.run(None, _feeds(model, token, length, plain))))
        records.append((buffers, result, expected, profile))
        presents = {k: result[k.replace("past_key_values", "present")] for k in past}
        length += 1
    return model, records


@pytest.mark.parametrize("kind", ["single", "merged", "merged-if"])
def test_decode_steps_append_in_place_and_match_onnxruntime(kind):
    model, records = _decode(kind, steps=3)
    kv_names = _kv_names(model)
    for buffers, result, expected, profile in records:
        np.testing.assert_allclose(result["logits"], expected["logits"], atol=1e-5)
        for name in kv_names:
            present = name.replace("past_key_values", "present")
            assert np.shares_memory(result[present], buffers[name].array), present
            np.testing.assert_allclose(result[present], expected[present], atol=1e-5)
        assert profile.counters["Concat.appends_in_place"] == len(kv_names)
        # the nodes growing the cache ran in place (a fused RopeAppend, alone or with the layer's
        # projections, grows a layer's key and value)
        assert (profile.inplace["Concat"] + 2 * profile.inplace["RopeAppend"]
                + 2 * profile.inplace["ProjectedRopeAppend"]) >= len(kv_names)
        if kind == "merged":
            assert profile.op_calls["If"] == 0 and profile.moves == 0  # the branch ran as the graph
        if kind == "merged-if":
            assert profile.moves >= len(kv_names)  # past KV reaches the Concat only through the If


@pytest.mark.parametrize("kind", ["single", "merged", "merged-if"])
def test_bytes_copied_per_step_do_not_grow_with_the_past(kind):
    copied = {}
    for past_length in (16, 1024):
        _, records = _decode(kind, steps=1, prompt_length=past_length)
        copied[past_length] = records[0][3].counters["Concat.bytes_copied"]
    assert copied[16] == copied[1024]


@pytest.mark.parametrize("kind", ["single", "merged"])
def test_in_place_off_gives_bitwise_identical_logits(kind):
    path = MODELS[kind]
    on, off = runnx.load(path), runnx.load(path, inplace=False)
    past = _empty_past(on)
    ids = np.arange(3, 10, dtype=np.int64)[None]
    first_on = on.run(_feeds(on, ids, 0, {k: runnx.Owned(v.copy()) for k, v in past.items()}))
    first_off = off.run(_feeds(off, ids, 0, past))
    assert first_on["logits"].tobytes() == first_off["logits"].tobytes()
    token = np.array([[5]], np.int64)
    grown = {k: runnx.with_capacity(first_on[k.replace("past_key_values", "present")], 2, 64) for k in past}
    copied = {k: first_off[k.replace("past_key_values", "present")] for k in past}
    second_on = on.run(_feeds(on, token, ids.shape[1], grown))
    second_off = off.run(_feeds(off, token, ids.shape[1], copied))
    for name in second_on:
        assert second_on[name].tobytes() == second_off[name].tobytes(), name
