"""Chat: the tokenizer's `chat_template` rendered as transformers renders it, and multi-turn
conversations that keep the KV cache of earlier turns (only the new tokens of a turn are run)."""
from __future__ import annotations

import json
from datetime import datetime

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from runnx.errors import RunnxError


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
    transformers; rendering only needs its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def compile_template(template: str) -> jinja2.Template:
    """The same Jinja environment transformers' apply_chat_template uses."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def render_chat(template: str, messages: list[dict], *, add_generation_prompt: bool = True,
                special_tokens: dict | None = None, **variables) -> str:
    """Render `messages` ([{"role": ..., "content": ...}]) with a chat template."""
    return compile_template(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                             **(special_tokens or {}), **variables)


class Chat:
    """A conversation with a Generator: `send` streams the reply to one user message.

    Each turn renders the whole conversation. When it extends the text the generator's tokens stand
    for (the previous prompt and reply), only the new text is tokenised and run: the KV cache of
    earlier turns is kept as it is. Otherwise (a reply cut by a stop string, a template that rewrites
    history) the tokens after the longest common prefix are recomputed."""

    def __init__(self, generator, system: str | None = None, **settings):
        tokenizer = generator.tokenizer
        if tokenizer is None or not tokenizer.chat_template:
            raise RunnxError("chat needs a tokenizer with a chat_template (tokenizer_config.json or chat_template.jinja)")
        self.generator = generator
        self.template = compile_template(tokenizer.chat_template)
        self.settings = settings
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        self.reused_tokens = 0  # tokens of the last turn's prompt that were already there
        self._text = ""  # the text that generator.token_ids stand for
        generator.reset()

    def render(self, messages=None, add_generation_prompt: bool = True) -> str:
        return self.template.render(messages=self.messages if messages is None else messages,
                                    add_generation_prompt=add_generation_prompt,
                                    **self.generator.tokenizer.special_tokens)

    def send(self, text: str, **settings):
        """Stream the assistant's reply to `text`; the reply joins the history when it is done."""
        generator, tokenizer = self.generator, self.generator.tokenizer
        self.messages.append({"role": "user", "content": text})
        rendered = self.render()
        if self._text and rendered.startswith(self._text):
            self.reused_tokens = generator.token_ids.shape[1]
            generator.append_tokens(tokenizer.encode(rendered[len(self._text):], add_special_tokens=False))
        else:
            self._rerun_from_common_prefix(tokenizer.encode(rendered, add_special_tokens=False))
        self._text = rendered
        generator.configure(**{**self.settings, **settings})
        pieces = []
        for piece in generator.continue_stream():
            pieces.append(piece)
            yield piece
        self._text += tokenizer.decode(generator.generated[0], skip_special_tokens=False)
        self.messages.append({"role": "assistant", "content": "".join(pieces)})

    def _rerun_from_common_prefix(self, prompt: list[int]) -> None:
        known = self.generator.token_ids[0].tolist()
        common = 0
        for a, b in zip(known, prompt[:-1]):  # at least one token must run to get logits
            if a != b:
                break
            common += 1
        self.generator.rewind(common)
        self.generator.append_tokens(prompt[common:])
        self.reused_tokens = common

    def ask(self, text: str, **settings) -> str:
        return "".join(self.send(text, **settings))
