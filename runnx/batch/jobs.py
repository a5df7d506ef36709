"""The work on one item, the same in-process and on a Ray actor: a job loads its model once when
made, then turns items into result records. A failure the item causes (audio that does not decode,
a prompt over the context, a chat the template rejects) becomes an error record, {"id", "error"},
and the job goes on; anything else is a bug and propagates."""
from __future__ import annotations

import time

from runnx.errors import RunnxError

STOP_SETTING = {"stop": "stop_strings"}


def run_item(job, item: dict) -> dict:
    """The record of one item: {"id", ...the job's fields, "seconds"} or {"id", "error"}."""
    started = time.perf_counter()
    try:
        fields = job(item)
    except RunnxError as error:
        return {"id": item["id"], "error": " ".join(str(error).split()) or type(error).__name__}
    return {"id": item["id"], **fields, "seconds": round(time.perf_counter() - started, 3)}


class GenerateJob:
    """Text generation: `settings` as `Generator.generate` takes them (an item's own override them).
    With `chat`, a "prompt" is sent as a user message (after `system`) through the chat template,
    as `runnx generate --chat` does; "messages" always are."""

    def __init__(self, model_dir, settings: dict | None = None, *, chat: bool = False, system: str | None = None,
                 variant: str | None = None):
        from runnx.generate.generator import Generator
        self.generator = Generator.from_folder(model_dir, variant=variant)
        self.settings = dict(settings or {})
        self.chat = chat
        self.system = system
        self._template = None

    def __call__(self, item: dict) -> dict:
        settings = {**self.settings, **{STOP_SETTING.get(k, k): (tuple(v) if k == "stop" else v)
                                         for k, v in item.get("settings", {}).items()}}
        if "messages" in item:
            prompt = self._chat_ids(item["messages"])
        elif self.chat:
            system = [{"role": "system", "content": self.system}] if self.system else []
            prompt = self._chat_ids([*system, {"role": "user", "content": item["prompt"]}])
        else:
            prompt = item["prompt"]
        text = self.generator.generate(prompt, **settings)
        stats = self.generator.stats
        return {"text": text, "prompt_tokens": stats.prompt_tokens, "new_tokens": stats.new_tokens}

    def _chat_ids(self, messages: list[dict]) -> list[int]:
        """The conversation rendered as runnx.generate.Chat renders it, as token ids."""
        import jinja2

        from runnx.generate.chat import compile_template
        tokenizer = self.generator.tokenizer
        if tokenizer is None or not tokenizer.chat_template:
            raise RunnxError("chat prompts need a tokenizer with a chat_template (tokenizer_config.json or "
                             "chat_template.jinja)")
        if self._template is None:
            self._template = compile_template(tokenizer.chat_template)
        try:
            text = self._template.render(messages=messages, add_generation_prompt=True, **tokenizer.special_tokens)
        except jinja2.TemplateError as error:
            raise RunnxError(f"the chat template rejects these messages: {error}") from None
        return tokenizer.encode(text, add_special_tokens=False)


class WhisperJob:
    """Speech to text: each item's "path" transcribed as `runnx whisper --format json` does."""

    def __init__(self, model_dir, *, language: str | None = None, task: str = "transcribe",
                 timestamps: bool | None = None, variant: str | None = None):
        from runnx.generate.whisper import Whisper
        self.model = Whisper(model_dir, variant=variant)
        self.options = {"language": language, "task": task, "timestamps": timestamps}

    def __call__(self, item: dict) -> dict:
        from runnx.generate.whisper_cli import transcript_fields
        transcript = self.model.transcribe(item["path"], **self.options)
        return {**transcript_fields(transcript, item["path"]), "audio_seconds": round(transcript.timings.audio, 3)}
