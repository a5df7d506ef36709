"""The decoding core on the tiny fixtures: greedy ids equal onnxruntime's for every export shape,
and the KV cache grows in place (profile counters, shared buffers), doubling when it runs out."""
from __future__ import annotations

import weakref

import numpy as np
import pytest

import runnx
from runnx.generate.decoder import DecoderStep, load_decoder
from runnx.generate.generator import Generator
from runnx.generate.tokenizer import Tokenizer

from generate_reference import ort_greedy

PROMPTS = ["Once upon a time", "The quick brown fox jumps over the lazy dog.", "a"]
NEW_TOKENS = 16

# (fixture folder, first-step file, later-steps file)
EXPORTS = {
    "llama-single": ("tiny-llama", "model.onnx", "model.onnx"),
    "llama-merged": ("tiny-llama-merged", "decoder_model_merged.onnx", "decoder_model_merged.onnx"),
    "llama-split": ("tiny-llama-merged", "decoder_model.onnx", "decoder_with_past_model.onnx"),
    "gpt2-single": ("tiny-gpt2", "model.onnx", "model.onnx"),
}


def _decoder(folder, first, later, **kwargs) -> DecoderStep:
    with_past = load_decoder(str(folder / later)) if later != first else None
    return DecoderStep(load_decoder(str(folder / first)), with_past, **kwargs)


def _greedy(decoder: DecoderStep, prompt_ids, new_tokens: int) -> list[int]:
    decoder.reset(1)
    ids, out = np.array([prompt_ids], np.int64), []
    for _ in range(new_tokens):
        token = int(decoder.step(ids)[0, -1].argmax())
        out.append(token)
        ids = np.array([[token]], np.int64)
    return out


@pytest.mark.parametrize("export", EXPORTS)
def test_greedy_ids_equal_onnxruntime(fixtures_dir, export):
    name, first, later = EXPORTS[export]
    folder = fixtures_dir / name
    tokenizer = Tokenizer.from_folder(fixtures_dir / name)
    decoder = _decoder(folder, first, later)
    for prompt in PROMPTS:
        prompt_ids = tokenizer.encode(prompt)
        expected = ort_greedy(folder / first, folder / later, prompt_ids, NEW_TOKENS)
        assert _greedy(decoder, prompt_ids, NEW_TOKENS) == expected, prompt


@pytest.mark.parametrize("export", ["llama-single", "llama-merged", "gpt2-single"])
def test_generator_from_folder_equals_onnxruntime(fixtures_dir, export):
    name, first, later = EXPORTS[export]
    generator = Generator.from_folder(fixtures_dir / name)
    prompt_ids = generator.tokenizer.encode(PROMPTS[0])
    ids = list(generator.token_stream(prompt_ids, max_new_tokens=NEW_TOKENS, stop_token_ids=()))
    assert ids == ort_greedy(fixtures_dir / name / first, fixtures_dir / name / later, prompt_ids, NEW_TOKENS)


@pytest.mark.parametrize("export, planned", [("llama-single", [1]), ("llama-split", [1, 1]), ("gpt2-single", [1]),
                                             ("llama-merged", [0])])
def test_a_decoders_load_makes_the_plans_its_steps_run(fixtures_dir, export, planned, monkeypatch):
    """The first step finds its plan made (as onnxruntime's session creation plans), compiled and its
    shape memos' programs made, and so do the later steps: nothing is planned or generated twice,
    and nothing a step does not run. A merged decoder picks a branch per step: each is planned on
    its first run."""
    from runnx.interp import executor, shape_cache
    name, first, later = EXPORTS[export]
    decoder = _decoder(fixtures_dir / name, first, later)
    models = list({id(m): m for m in (decoder.first_model, decoder.past_model)}.values())
    assert [len(m._plans) for m in models] == planned
    made = [dict(m._plans) for m in models]
    assert all(plan.state["compiled"] for plans in made for plan in plans.values())
    generated = []
    for module, name in ((executor, "compile_plan"), (shape_cache, "_group_program")):
        monkeypatch.setattr(module, name, lambda *a, _f=getattr(module, name): generated.append(_f) or _f(*a))
    _greedy(decoder, [5, 6, 7], 3)
    if export != "llama-merged":
        assert [m._plans for m in models] == made
        assert generated == []
    assert all(plan is m._plans[key] for m, plans in zip(models, made) for key, plan in plans.items())


@pytest.mark.parametrize("export", ["llama-single", "llama-merged", "llama-split", "gpt2-single"])
def test_every_step_appends_the_kv_cache_in_place(fixtures_dir, export):
    name, first, later = EXPORTS[export]
    profile = runnx.Profile()
    decoder = _decoder(fixtures_dir / name, first, later, capacity=64, profile=profile)
    decoder.reset(1)
    decoder.step(np.array([[1, 5, 9, 13]]))
    buffers = {name: array.base for name, array in decoder.cache.arrays.items()}
    kv_tensors = len(buffers)
    appends_after_prefill = profile.counters["Concat.appends_in_place"]
    for token in range(10):
        decoder.step(np.array([[token + 20]]))
    # single model.onnx: the prefill appends into the reserved buffers too; merged/split: its
    # no-past branch returns fresh arrays, copied once into buffers with capacity
    assert appends_after_prefill == (kv_tensors if first == "model.onnx" else 0)
    assert profile.counters["Concat.appends_in_place"] - appends_after_prefill == 10 * kv_tensors
    # the nodes growing the cache ran in place (a fused RopeAppend, alone or with the layer's projections,
    # grows a layer's key and value)
    grown = profile.inplace["Concat"] + 2 * (profile.inplace["RopeAppend"] + profile.inplace["ProjectedRopeAppend"])
    assert grown >= profile.counters["Concat.appends_in_place"]
    assert decoder.cache.regrowths == 0
    assert decoder.length == 14
    for name, array in decoder.cache.arrays.items():
        assert array.shape[2] == 14
        assert array.base is buffers[name]  # still a prefix view of the buffer reserved at the prefill


@pytest.mark.parametrize("export", ["llama-single", "llama-merged", "gpt2-single"])
def test_each_prefill_takes_buffers_made_before_and_gives_the_same_ids(fixtures_dir, export):
    name, first, later = EXPORTS[export]
    folder = fixtures_dir / name
    decoder = _decoder(folder, first, later, capacity=32)
    made = decoder._spare  # made and faulted in at the load
    assert _greedy(decoder, [1, 5, 9], 8) == _greedy(_decoder(folder, first, later, capacity=32), [1, 5, 9], 8)
    assert made.taken == len(decoder.cache.arrays) > 0
    buffers = [weakref.ref(buffer) for buffer in decoder.cache._buffers.values()]
    ids = _greedy(decoder, [7, 3], 8)  # reset: the next prefill writes into the same buffers
    assert [buffer() for buffer in buffers] == list(decoder.cache._buffers.values())
    assert ids == _greedy(_decoder(folder, first, later, capacity=32), [7, 3], 8)


def test_a_reset_never_writes_into_cache_rows_a_caller_still_holds(fixtures_dir):
    folder = fixtures_dir / "tiny-llama"
    decoder = _decoder(folder, "model.onnx", "model.onnx", capacity=32)
    _greedy(decoder, [1, 5, 9], 4)
    held = dict(decoder.cache.arrays)  # views of the cache's buffers, kept past the reset
    values = {name: array.copy() for name, array in held.items()}
    _greedy(decoder, [7, 3, 11, 2], 6)
    assert all(array.base is not buffer for array, buffer in zip(held.values(), decoder.cache._buffers.values()))
    for name, array in held.items():
        np.testing.assert_array_equal(array, values[name])


def test_cache_doubles_when_capacity_runs_out(fixtures_dir):
    folder = fixtures_dir / "tiny-llama"
    small = _decoder(folder, "model.onnx", "model.onnx", capacity=4)
    roomy = _decoder(folder, "model.onnx", "model.onnx", capacity=64)
    prompt = [1, 5, 9]
    assert _greedy(small, prompt, 12) == _greedy(roomy, prompt, 12)
    per_tensor = small.cache.regrowths / len(small.cache.arrays)
    assert per_tensor == 2  # 4 -> 8 -> 16 rows for 14 tokens
    assert small.cache.capacity == 16
    assert roomy.cache.regrowths == 0


def test_without_in_place_execution_the_results_are_the_same_and_nothing_is_regrown(fixtures_dir):
    folder = fixtures_dir / "tiny-llama"
    profile = runnx.Profile()
    copying = DecoderStep(runnx.load(folder / "model.onnx", inplace=False), capacity=4, profile=profile)
    in_place = _decoder(folder, "model.onnx", "model.onnx", capacity=4)
    assert _greedy(copying, [1, 5, 9], 12) == _greedy(in_place, [1, 5, 9], 12)
    assert profile.counters["Concat.appends_in_place"] == 0
    assert not copying.cache.appended_in_place and copying.cache.regrowths == 0  # no copies it would not use


def test_truncate_keeps_capacity_and_continues_like_a_fresh_run(fixtures_dir):
    folder = fixtures_dir / "tiny-llama"
    decoder = _decoder(folder, "model.onnx", "model.onnx", capacity=32)
    decoder.reset(1)
    decoder.step(np.array([[1, 5, 9, 13, 17]]))
    decoder.truncate(3)
    assert decoder.length == 3 and decoder.cache.capacity == 32
    continued = decoder.step(np.array([[40]]))
    fresh = _decoder(folder, "model.onnx", "model.onnx")
    fresh.reset(1)
    fresh.step(np.array([[1, 5, 9]]))
    # the kept rows came from a 5-token prefill, the fresh ones from a 3-token one: BLAS may round differently
    np.testing.assert_allclose(continued, fresh.step(np.array([[40]])), rtol=1e-4, atol=1e-5)


def test_cross_attention_keys_are_fed_read_only_and_the_same_arrays_every_step(fixtures_dir):
    """The first step's encoder keys and values become read-only arrays fed unchanged to every later
    step (Model.run holds a read-only feed as it is: no new view a step); saved state copies them."""
    folder = fixtures_dir / "tiny-whisper"
    decoder = DecoderStep.from_folder(folder, capacity=16)
    width = next(i.shape[2] for i in decoder.first_model.inputs if i.name == "encoder_hidden_states")
    hidden = np.random.default_rng(0).standard_normal((1, 30, width)).astype(np.float32)
    decoder.reset(fixed_feeds={"encoder_hidden_states": hidden})
    fed, run = [], decoder.past_model.run

    def recording(feeds, *args, **kwargs):
        fed.append({name: array for name, array in feeds.items() if ".encoder." in name})
        return run(feeds, *args, **kwargs)

    decoder.past_model.run = recording
    for ids in ([[1, 2, 3]], [[4]], [[5]]):
        decoder.step(np.array(ids))
    _, second, third = fed
    assert sorted(second) == sorted(decoder.cross) and len(second) > 0
    for name, array in second.items():
        assert array is third[name] is decoder.cross[name] and not array.flags.writeable
    saved = decoder.kv_arrays()
    for name, array in decoder.cross.items():
        assert saved[name].flags.writeable and not np.shares_memory(saved[name], array)
        np.testing.assert_array_equal(saved[name], array)
