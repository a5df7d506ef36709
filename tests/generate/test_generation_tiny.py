"""The Generator on the tiny fixtures: step API, seeded sampling, stop strings, batches, saved state,
multi-turn chat with KV reuse, and the `runnx generate` / `runnx chat` subcommands."""
from __future__ import annotations

import argparse

import numpy as np
import pytest
import tokenizers

import runnx

from runnx.generate import cli
from runnx.generate.chat import Chat
from runnx.generate.generator import Generator
from runnx.generate.io_names import DecoderIOError
from runnx.generate.state import load_state, save_state

from _checks import assert_batch_matches_per_row


@pytest.fixture(scope="module")
def llama(fixtures_dir) -> Generator:
    return Generator.from_folder(fixtures_dir / "tiny-llama")


def test_step_api(llama):
    llama.start(max_new_tokens=5, stop_token_ids=())
    llama.append_tokens(llama.encode("Once upon a time"))
    produced = []
    while not llama.is_done():
        llama.generate_next_token()
        produced.append(int(llama.get_next_tokens()[0]))
    assert produced == llama.generated[0] and len(produced) == 5
    assert llama.token_ids.shape[1] == len(llama.encode("Once upon a time")) + 5
    assert llama.decoder.length == llama.token_ids.shape[1] - 1  # the last token is not run yet
    assert llama.stats.new_tokens == 5 and llama.stats.first_token_seconds > 0


def test_max_length_counts_the_prompt(llama):
    prompt = llama.encode("Once upon a time")
    ids = list(llama.token_stream(prompt, max_new_tokens=None, max_length=len(prompt) + 3, stop_token_ids=()))
    assert len(ids) == 3
    assert llama.decoder.cache.capacity >= len(prompt) + 3  # reserved for the whole generation at the prefill


def test_from_loaded_model_and_tokenizer(fixtures_dir, llama):
    folder = fixtures_dir / "tiny-llama-merged"
    inner = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    generator = Generator.from_model(runnx.load(folder / "decoder_model_merged.onnx", check_symbolic_dims=False),
                                     inner, generation_config={"eos_token_id": 2})
    assert generator.stop_token_ids == {2}
    expected = llama.generate("Once upon a time", max_new_tokens=8, stop_token_ids=())
    assert generator.generate("Once upon a time", max_new_tokens=8, stop_token_ids=()) == expected


def test_stop_token_ends_generation(llama):
    free = list(llama.token_stream("Once upon a time", max_new_tokens=12, stop_token_ids=()))
    stop = free[4]
    first = free.index(stop)
    assert list(llama.token_stream("Once upon a time", max_new_tokens=12, stop_token_ids=(stop,))) == free[:first]
    assert llama.generated[0] == free[:first + 1]


def test_seeded_sampling_is_reproducible(llama):
    settings = dict(max_new_tokens=16, temperature=0.9, top_k=50, top_p=0.95, seed=1234, stop_token_ids=())
    first = list(llama.token_stream("Once upon a time", **settings))
    again = list(llama.token_stream("Once upon a time", **settings))
    other = list(llama.token_stream("Once upon a time", **{**settings, "seed": 4321}))
    greedy = list(llama.token_stream("Once upon a time", max_new_tokens=16, stop_token_ids=()))
    assert first == again
    assert first != other and first != greedy


def test_generation_config_supplies_default_settings(fixtures_dir, llama):
    sampling = Generator.from_folder(fixtures_dir / "tiny-llama")
    sampling.generation_config.update(do_sample=True, temperature=0.7, top_k=5)
    ids = list(sampling.token_stream("Once upon a time", max_new_tokens=12, seed=3, stop_token_ids=()))
    explicit = dict(do_sample=True, temperature=0.7, top_k=5, seed=3, max_new_tokens=12, stop_token_ids=())
    assert ids == list(llama.token_stream("Once upon a time", **explicit))
    assert sampling.options.top_k == 5 and sampling.options.sampling
    # a temperature without do_sample stays greedy, as in transformers; the caller's settings win
    sampling.generation_config.pop("do_sample")
    greedy = list(llama.token_stream("Once upon a time", max_new_tokens=12, stop_token_ids=()))
    assert list(sampling.token_stream("Once upon a time", max_new_tokens=12, stop_token_ids=())) == greedy
    assert list(sampling.token_stream("Once upon a time", max_new_tokens=12, stop_token_ids=(),
                                      do_sample=False, top_k=9)) == greedy


def test_stop_strings_stop_exactly(llama):
    free = llama.generate("The quick brown fox", max_new_tokens=24, stop_token_ids=())
    assert len(free) > 12
    stop = free[7:10]
    cut = free.index(stop)
    pieces = list(llama.stream("The quick brown fox", max_new_tokens=24, stop_token_ids=(), stop_strings=(stop,)))
    assert "".join(pieces) == free[:cut]
    assert llama.is_done() and len(llama.generated[0]) < 24
    # a stop string that never appears changes nothing
    assert llama.generate("The quick brown fox", max_new_tokens=24, stop_token_ids=(),
                          stop_strings=("\x00never",)) == free


def test_stream_pieces_join_to_generate(llama):
    pieces = list(llama.stream("Once upon a time", max_new_tokens=20, stop_token_ids=()))
    assert len(pieces) > 1
    assert "".join(pieces) == llama.generate("Once upon a time", max_new_tokens=20, stop_token_ids=())
    assert "".join(pieces) == llama.tokenizer.decode(llama.generated[0])


def test_batch_matches_per_row(llama):
    prompts = ["Once upon a time", "a", "The quick brown fox jumps over the lazy dog."]
    assert_batch_matches_per_row(llama, prompts, max_new_tokens=10)


def test_batch_rows_stop_on_their_own(llama):
    prompts = ["Once upon a time", "a"]
    free = [list(llama.token_stream(p, max_new_tokens=10, stop_token_ids=())) for p in prompts]
    stop = free[0][3]
    llama.generate_batch(prompts, max_new_tokens=10, stop_token_ids=(stop,))
    for row, ids in enumerate(free):
        expected = ids[:ids.index(stop) + 1] if stop in ids else ids
        assert llama.generated[row] == expected


def test_saved_state_continues_exactly(fixtures_dir, llama, tmp_path):
    system = llama.encode("You are a storyteller. Tell short stories about foxes and dogs.")
    question = llama.encode(" Once upon a time")
    settings = dict(max_new_tokens=12, stop_token_ids=())
    # uninterrupted: the system prompt, then the question, then generation
    llama.start(**settings)
    llama.append_tokens(system)
    llama.compute_logits()
    save_state(llama, tmp_path / "system.safetensors")
    llama.append_tokens(question)
    llama.run_until_done()
    uninterrupted = list(llama.generated[0])
    # restored in a fresh generator
    fresh = Generator.from_folder(fixtures_dir / "tiny-llama")
    load_state(fresh, tmp_path / "system.safetensors")
    assert fresh.decoder.length == len(system)
    fresh.configure(**settings)
    fresh.append_tokens(question)
    fresh.run_until_done()
    assert fresh.generated[0] == uninterrupted


def test_state_saved_mid_generation_continues_exactly(fixtures_dir, llama, tmp_path):
    llama.start(max_new_tokens=6, stop_token_ids=())
    llama.append_tokens(llama.encode("The quick brown fox"))
    llama.run_until_done()
    save_state(llama, tmp_path / "mid.safetensors")
    llama.configure(max_new_tokens=6, stop_token_ids=())
    llama.run_until_done()
    fresh = Generator.from_folder(fixtures_dir / "tiny-llama")
    load_state(fresh, tmp_path / "mid.safetensors")
    fresh.configure(max_new_tokens=6, stop_token_ids=())
    fresh.run_until_done()
    assert fresh.generated[0] == llama.generated[0]
    np.testing.assert_array_equal(fresh.token_ids, llama.token_ids)


def test_state_of_another_model_is_refused(fixtures_dir, llama, tmp_path):
    llama.start()
    llama.append_tokens(llama.encode("Once upon a time"))
    llama.compute_logits()
    save_state(llama, tmp_path / "llama.safetensors")
    gpt2 = Generator.from_folder(fixtures_dir / "tiny-gpt2")
    with pytest.raises(DecoderIOError, match=r"'past_key_values.0.key' is float32\[1, 2, \d+, 16\], the model takes "
                                             r"float32\[batch, 4, length, 16\]"):
        load_state(gpt2, tmp_path / "llama.safetensors")


def test_chat_reuses_the_cache_of_earlier_turns(llama):
    chat = Chat(llama, max_new_tokens=8)
    first = chat.ask("Tell me about the fox.")
    assert chat.reused_tokens == 0
    tokens_after_first = llama.token_ids.shape[1]
    second = chat.ask("And the dog?")
    assert chat.reused_tokens == tokens_after_first  # the whole first turn, reply included
    assert [m["role"] for m in chat.messages] == ["user", "assistant", "user", "assistant"]
    assert chat.messages[1]["content"] == first and chat.messages[3]["content"] == second
    # the tokens stand for the rendered conversation, and a run from scratch on them gives the same reply
    prompt = llama.token_ids[0, :-len(llama.generated[0])]
    assert llama.tokenizer.decode(prompt, skip_special_tokens=False) == chat.render(chat.messages[:3])
    assert llama.generate(prompt.tolist(), max_new_tokens=8) == second


def test_chat_recomputes_after_a_reply_cut_by_a_stop_string(llama):
    chat = Chat(llama, max_new_tokens=8)
    reply = chat.ask("Tell me about the fox.")
    chat.messages[-1]["content"] = reply[:2]  # history rewritten: the cached reply no longer matches
    chat.ask("And the dog?")
    prompt = llama.tokenizer.encode(chat.render(chat.messages[:3]), add_special_tokens=False)
    assert 0 < chat.reused_tokens < len(prompt)
    assert llama.token_ids[0, :len(prompt)].tolist() == prompt


def _parser():
    parser = argparse.ArgumentParser(prog="runnx")
    cli.register(parser.add_subparsers(dest="command", required=True))
    return parser


def test_cli_generate(fixtures_dir, llama, capsys):
    args = _parser().parse_args(["generate", str(fixtures_dir / "tiny-llama"), "Once upon a time",
                                 "--max-new-tokens", "6"])
    assert args.func(args) == 0
    out, err = capsys.readouterr()
    assert out == llama.generate("Once upon a time", max_new_tokens=6) + "\n"
    assert "tokens/s" in err and "time to first token" in err
    args = _parser().parse_args(["generate", str(fixtures_dir / "tiny-llama"), "Hello", "--chat",
                                 "--max-new-tokens", "4", "--temperature", "0.8", "--top-k", "20",
                                 "--top-p", "0.9", "--seed", "3"])
    assert args.func(args) == 0
    again = capsys.readouterr().out
    assert args.func(args) == 0
    assert capsys.readouterr().out == again  # seeded


def test_cli_chat_keeps_history_until_eof(fixtures_dir, monkeypatch, capsys):
    lines = iter(["Hello", "", "More"])

    def fake_input(prompt):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", fake_input)
    args = _parser().parse_args(["chat", str(fixtures_dir / "tiny-llama"), "--max-new-tokens", "3"])
    assert args.func(args) == 0
    out, err = capsys.readouterr()
    assert out.count("\n") == 2  # two replies
    assert err.count("time to first token") == 2
