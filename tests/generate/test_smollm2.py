"""Real SmolLM2-135M-Instruct (built by `make models`; marked real_model through its fixture)."""
from __future__ import annotations

import pytest

import runnx
from runnx.generate.chat import Chat
from runnx.generate.generator import Generator
from runnx.generate.state import load_state, save_state

from _checks import assert_batch_matches_per_row
from generate_reference import ort_greedy

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def profile():
    return runnx.Profile()


@pytest.fixture(scope="module")
def smollm2(smollm2_dir, profile) -> Generator:
    return Generator.from_folder(smollm2_dir, profile=profile)


def test_greedy_20_tokens_equal_onnxruntime(smollm2_dir, smollm2, profile):
    prompt_ids = smollm2.tokenizer.encode(PROMPT)
    expected = ort_greedy(smollm2_dir / "model.onnx", smollm2_dir / "model.onnx", prompt_ids, 20)
    before = profile.counters["Concat.appends_in_place"]
    text = smollm2.generate(PROMPT, max_new_tokens=20, stop_token_ids=())
    assert smollm2.generated[0] == expected
    assert text == smollm2.tokenizer.decode(expected)
    assert text.startswith(" Paris.")
    # 30 layers x key and value, every step (the prefill appends into the reserved buffers too)
    assert profile.counters["Concat.appends_in_place"] - before == 20 * 60
    assert smollm2.decoder.cache.regrowths == 0


def test_saved_state_continues_exactly(smollm2_dir, smollm2, tmp_path):
    system = smollm2.tokenizer.encode("<|im_start|>system\nYou are a geography teacher. Answer in one sentence."
                                      "<|im_end|>\n", add_special_tokens=False)
    question = smollm2.tokenizer.encode("<|im_start|>user\nWhat is the capital of Italy?<|im_end|>\n"
                                        "<|im_start|>assistant\n", add_special_tokens=False)
    settings = dict(max_new_tokens=6, stop_token_ids=())
    smollm2.start(**settings)
    smollm2.append_tokens(system)
    smollm2.compute_logits()
    save_state(smollm2, tmp_path / "system.safetensors")
    smollm2.append_tokens(question)
    smollm2.run_until_done()
    uninterrupted = list(smollm2.generated[0])

    restored = Generator.from_folder(smollm2_dir)
    load_state(restored, tmp_path / "system.safetensors")
    restored.configure(**settings)
    restored.append_tokens(question)
    restored.run_until_done()
    assert restored.generated[0] == uninterrupted


def test_batch_matches_per_row(smollm2):
    prompts = [PROMPT, "Water boils at a temperature of"]
    assert_batch_matches_per_row(smollm2, prompts, max_new_tokens=8)


def test_chat_two_turns_reuse_the_cache(smollm2):
    chat = Chat(smollm2, max_new_tokens=12)
    assert "Paris" in chat.ask("What is the capital of France?")
    after_first_turn = smollm2.token_ids.shape[1]
    assert "Berlin" in chat.ask("And of Germany?")
    assert chat.reused_tokens == after_first_turn
    assert smollm2.stats.prompt_tokens < 20  # only the new turn ran, not the 40-token history
