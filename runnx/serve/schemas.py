"""OpenAI's request and response shapes: request bodies checked field by field into small frozen
records (a wrong field is a 400 naming it), and the JSON objects and stream chunks sent back.

Fields a local server cannot honour (`n` other than 1, `logprobs`, `echo`, several prompts) are
refused with a 400 rather than ignored; fields that only tune OpenAI's own service (`user`,
`metadata`, `store`, ...) are ignored."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from runnx.serve.errors import ApiError

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP_STRINGS = 4
TRANSCRIPTION_FORMATS = ("json", "text", "srt", "vtt", "verbose_json")


@dataclass(frozen=True)
class Sampling:
    """How one request is decoded. None: the model's generation_config.json decides (greedy unless
    it says do_sample); temperature 0 is greedy."""

    max_tokens: int | None = None  # None: the route's default
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class TextRequest:
    """A chat or completion request: `prompt` is the chat messages, a text, or token ids."""

    model: str
    prompt: object
    sampling: Sampling
    stream: bool = False
    include_usage: bool = False


@dataclass(frozen=True)
class TranscriptionRequest:
    model: str
    language: str | None
    response_format: str


# -- requests ------------------------------------------------------------------------------------
def parse_chat(body) -> TextRequest:
    body = _object(body)
    messages = _field(body, "messages", list, required=True)
    if not messages:
        raise ApiError("'messages' must hold at least one message", param="messages")
    rendered = [_message(message, index) for index, message in enumerate(messages)]
    limit = _max_tokens(body, ("max_completion_tokens", "max_tokens"))
    return _text_request(body, rendered, limit)


def parse_completion(body) -> TextRequest:
    body = _object(body)
    if "prompt" not in body:
        raise ApiError("'prompt' is required", param="prompt", code="missing_required_parameter")
    for name in ("echo", "logprobs", "suffix"):
        if body.get(name) not in (None, False, 0):
            raise ApiError(f"'{name}' is not supported by this server", param=name, code="unsupported_parameter")
    if body.get("best_of") not in (None, 1):
        raise ApiError("'best_of' must be 1", param="best_of", code="unsupported_parameter")
    return _text_request(body, _prompt(body["prompt"]), _max_tokens(body, ("max_tokens",)))


def parse_transcription(fields: dict) -> TranscriptionRequest:
    """The multipart form's text fields (the file is checked by the route)."""
    model = fields.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError("'model' is required", param="model", code="missing_required_parameter")
    response_format = fields.get("response_format") or "json"
    if response_format not in TRANSCRIPTION_FORMATS:
        raise ApiError(f"'response_format' must be one of {', '.join(TRANSCRIPTION_FORMATS)}, got "
                       f"'{response_format}'", param="response_format")
    language = fields.get("language") or None
    return TranscriptionRequest(model, language, response_format)


def _text_request(body: dict, prompt, max_tokens: int | None) -> TextRequest:
    model = _field(body, "model", str, required=True)
    n = _field(body, "n", int, 1)
    if n != 1:
        raise ApiError(f"'n' must be 1 (one choice per request), got {n}", param="n", code="unsupported_parameter")
    if _field(body, "logprobs", bool, False) or body.get("top_logprobs") is not None:
        raise ApiError("'logprobs' is not supported by this server", param="logprobs", code="unsupported_parameter")
    temperature = _number(body, "temperature", 0.0, 2.0)
    top_p = _number(body, "top_p", 0.0, 1.0)
    if top_p is not None and top_p <= 0:
        raise ApiError("'top_p' must be above 0", param="top_p")
    seed = _field(body, "seed", int)
    stream = _field(body, "stream", bool, False)
    options = _field(body, "stream_options", dict, {}) or {}
    include_usage = bool(options.get("include_usage", False))
    sampling = Sampling(max_tokens, temperature, top_p, seed, _stop(body.get("stop")))
    return TextRequest(model, prompt, sampling, stream, include_usage)


def _object(body) -> dict:
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _field(body: dict, name: str, kind, default=None, *, required: bool = False):
    value = body.get(name)
    if value is None:
        if required:
            raise ApiError(f"'{name}' is required", param=name, code="missing_required_parameter")
        return default
    # JSON true is not an integer here, though Python's bool is an int
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ApiError(f"'{name}' must be {_KIND_NAMES.get(kind, kind.__name__)}, got {_json_type(value)}", param=name)
    return value


_KIND_NAMES = {str: "a string", int: "an integer", bool: "a boolean", list: "an array", dict: "an object"}


def _json_type(value) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
             dict: "an object"}
    return names.get(type(value), type(value).__name__)


def _number(body: dict, name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(f"'{name}' must be a number, got {_json_type(value)}", param=name)
    if not low <= value <= high:
        raise ApiError(f"'{name}' must be between {low:g} and {high:g}, got {value}", param=name)
    return float(value)


def _max_tokens(body: dict, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = _field(body, name, int)
        if value is not None:
            if value < 1:
                raise ApiError(f"'{name}' must be at least 1, got {value}", param=name)
            return value
    return None


def _stop(value) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ApiError("'stop' must be a non-empty string or an array of them", param="stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise ApiError(f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}", param="stop")
    return tuple(stops)


def _message(message, index: int) -> dict:
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise ApiError(f"{param} must be an object with 'role' and 'content'", param=param)
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise ApiError(f"{param}.role must be one of {', '.join(CHAT_ROLES)}, got {role!r}", param=f"{param}.role")
    content = message.get("content")
    if isinstance(content, list):  # content parts: only text ones can be rendered
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise ApiError(f"{param}.content: only text parts are supported", param=f"{param}.content")
        content = "".join(part["text"] for part in content)
    elif content is None:
        content = ""
    elif not isinstance(content, str):
        raise ApiError(f"{param}.content must be a string or an array of text parts", param=f"{param}.content")
    # chat templates know system, user and assistant; OpenAI's newer 'developer' role is a system message
    return {"role": "system" if role == "developer" else role, "content": content}


def _prompt(prompt):
    """A text or a list of token ids (a list of one of them is the same)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise ApiError("'prompt' must be a string or an array of token ids (one prompt per request)", param="prompt")


# -- responses -----------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_completion(request_id: str, model: str, text: str, finish_reason: str, counts: dict) -> dict:
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": finish_reason, "logprobs": None}],
            "usage": counts}


def chat_chunk(request_id: str, model: str, delta: dict, finish_reason: str | None = None) -> dict:
    return {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]}


def completion(request_id: str, model: str, text: str, finish_reason: str | None, counts: dict | None = None,
               *, chunk: bool = False) -> dict:
    body = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}]}
    if not chunk:
        body["usage"] = counts
    return body


def usage_chunk(request_id: str, model: str, kind: str, counts: dict) -> dict:
    """The last chunk of a stream with stream_options.include_usage: no choices, the usage."""
    return {"id": request_id, "object": kind, "created": int(time.time()), "model": model, "choices": [],
            "usage": counts}


def model_list(model_ids) -> dict:
    return {"object": "list", "data": [model_card(name) for name in model_ids]}


def model_card(model_id: str) -> dict:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "runnx"}
