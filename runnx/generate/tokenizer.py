"""Tokenizer glue: a `tokenizers.Tokenizer` with its tokenizer_config (special tokens, chat template),
and `TextStream`, which turns token ids into text pieces as soon as they decode to valid UTF-8."""
from __future__ import annotations

import json
from pathlib import Path

import tokenizers

from runnx.errors import RunnxError

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
_INCOMPLETE = "\ufffd"  # what a decoder yields for the first bytes of a character split across tokens


class Tokenizer:
    """encode/decode plus the tokenizer_config.json facts generation needs."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, config: dict | None = None, chat_template: str | None = None):
        self.tokenizer = tokenizer
        self.config = dict(config or {})
        template = chat_template or self.config.get("chat_template")
        if isinstance(template, list):  # several named templates: transformers uses "default"
            template = {t["name"]: t["template"] for t in template}.get("default")
        self.chat_template: str | None = template

    @classmethod
    def from_folder(cls, folder) -> "Tokenizer":
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise RunnxError(f"{folder} has no tokenizer.json")
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        template_path = folder / "chat_template.jinja"  # transformers >= 4.43 saves the template here
        template = template_path.read_text(encoding="utf-8") if template_path.is_file() else None
        return cls(tokenizers.Tokenizer.from_file(str(path)), config, template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    @property
    def special_tokens(self) -> dict[str, str]:
        """bos_token, eos_token, ... as strings (the chat template reads them)."""
        tokens = {}
        for key in SPECIAL_TOKEN_KEYS:
            value = self.config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if value is not None:
                tokens[key] = value
        return tokens

    def stream(self) -> "TextStream":
        return TextStream(self)


def as_tokenizer(tokenizer) -> Tokenizer:
    """Accept our Tokenizer, a tokenizers.Tokenizer, or a folder path."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    if isinstance(tokenizer, tokenizers.Tokenizer):
        return Tokenizer(tokenizer)
    if isinstance(tokenizer, (str, Path)):
        return Tokenizer.from_folder(tokenizer)
    raise TypeError(f"expected a runnx Tokenizer, a tokenizers.Tokenizer or a folder, got {type(tokenizer).__name__}")


class TextStream:
    """Feed token ids one at a time; get back the text they add, once it is complete UTF-8.

    Decodes a short window: the tokens since the last emitted piece plus the ones before it
    (`prefix`), so a decoder that strips a leading space from its first token cannot eat it."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # start of the decoding window
        self._read = 0  # tokens already turned into text

    def put(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        decode = self.tokenizer.decode
        before = decode(self.ids[self._prefix:self._read], self.skip_special_tokens)
        text = decode(self.ids[self._prefix:], self.skip_special_tokens)
        if len(text) <= len(before) or text.endswith(_INCOMPLETE):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return text[len(before):]

    def flush(self) -> str:
        """The text of tokens still held back (an incomplete character at the very end)."""
        if self._read == len(self.ids):
            return ""
        decode = self.tokenizer.decode
        before = decode(self.ids[self._prefix:self._read], self.skip_special_tokens)
        text = decode(self.ids[self._prefix:], self.skip_special_tokens)
        self._prefix = self._read = len(self.ids)
        return text[len(before):]
