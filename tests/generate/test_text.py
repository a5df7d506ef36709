"""Tokenizer text stream (pieces only once they are valid UTF-8) and chat-template rendering."""
from __future__ import annotations

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from runnx.generate.chat import render_chat
from runnx.generate.tokenizer import Tokenizer

# SmolLM2-135M-Instruct's chat_template (tokenizer_config.json / chat_template.jinja of the model)
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SMOLLM2_SPECIAL = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
                   "unk_token": "<|endoftext|>"}

# Expected strings produced with transformers 4.57.6 in the export venv:
#   AutoTokenizer.from_pretrained(<SmolLM2 HF folder>).apply_chat_template(messages, tokenize=False,
#                                                                        add_generation_prompt=...)
ONE_QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ONE_QUESTION_RENDERED = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
MULTI_TURN = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"},
              {"role": "assistant", "content": "Hello. Ünïcödé ✓"}, {"role": "user", "content": "Two\nlines"}]
MULTI_TURN_RENDERED = (
    "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    "Hello. Ünïcödé ✓<|im_end|>\n<|im_start|>user\nTwo\nlines<|im_end|>\n")

# Same transformers call with chat_template=TEMPLATE_FEATURES (trim/lstrip blocks, loop controls,
# tojson, {% generation %}, special-token variables) on FEATURE_MESSAGES, add_generation_prompt=True.
TEMPLATE_FEATURES = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] == 'tool' %}{% continue %}{% endif %}
    {% generation %}[{{ message['role'] | upper }}] {{ message['content'] | tojson }}{% endgeneration %}
{% endfor %}
{% if add_generation_prompt %}[ASSISTANT]{{ eos_token }}{% endif %}"""
FEATURE_MESSAGES = [{"role": "user", "content": "Hé \"quoted\""}, {"role": "tool", "content": "skip"},
                    {"role": "assistant", "content": "ok"}]
FEATURES_RENDERED = '<|im_start|>\n[USER] "Hé \\"quoted\\""[ASSISTANT] "ok"[ASSISTANT]<|im_end|>'


@pytest.mark.parametrize("messages, add_generation_prompt, expected", [
    (ONE_QUESTION, True, ONE_QUESTION_RENDERED),
    (MULTI_TURN, False, MULTI_TURN_RENDERED),
    (MULTI_TURN, True, MULTI_TURN_RENDERED + "<|im_start|>assistant\n"),
])
def test_smollm2_chat_template_renders_as_transformers(messages, add_generation_prompt, expected):
    rendered = render_chat(SMOLLM2_TEMPLATE, messages, add_generation_prompt=add_generation_prompt,
                           special_tokens=SMOLLM2_SPECIAL)
    assert rendered == expected


def test_template_environment_matches_transformers():
    rendered = render_chat(TEMPLATE_FEATURES, FEATURE_MESSAGES, special_tokens=SMOLLM2_SPECIAL)
    assert rendered == FEATURES_RENDERED


def _byte_tokenizer() -> Tokenizer:
    """Byte-level BPE with no merges: one token per UTF-8 byte, so characters span several tokens."""
    vocab = {c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    inner = tokenizers.Tokenizer(models.BPE(vocab, []))
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = decoders.ByteLevel()
    return Tokenizer(inner)


def test_text_stream_waits_for_complete_characters():
    tokenizer = _byte_tokenizer()
    text = "héllo 😀 ok"
    ids = tokenizer.encode(text)
    assert len(ids) == len(text.encode("utf-8"))
    stream = tokenizer.stream()
    pieces = [stream.put(i) for i in ids]
    assert "".join(pieces) + stream.flush() == text
    assert all("\ufffd" not in p for p in pieces)
    emoji_start = len("héllo ".encode("utf-8"))
    assert pieces[emoji_start:emoji_start + 4] == ["", "", "", "😀"]


def test_text_stream_flushes_an_incomplete_tail():
    tokenizer = _byte_tokenizer()
    stream = tokenizer.stream()
    ids = tokenizer.encode("a😀")
    assert [stream.put(i) for i in ids[:3]] == ["a", "", ""]
    assert stream.flush() == "\ufffd"
