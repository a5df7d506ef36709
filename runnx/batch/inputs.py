"""The inputs of a batch job as items: JSON-able dicts with a unique "id", read in full before any
work starts, so a malformed file fails at once with its line number (nothing half done).

prompts.jsonl: one JSON object per line, `{"id": "q1", "prompt": "..."}` or
`{"id": "q2", "messages": [{"role": "user", "content": "..."}]}` (rendered with the chat template),
optionally with decoding settings of its own (`max_new_tokens`, `temperature`, `top_k`, `top_p`,
`min_p`, `repetition_penalty`, `seed`, `stop`); a bare JSON string is a prompt. Without "id" a line
is known by its line number. Audio lists: one path per line (blank lines and `# comments` skipped);
the id is the path as written, the path is resolved against the current directory.
"""
from __future__ import annotations

import json
from pathlib import Path

from runnx.errors import BatchFileError

SETTINGS = {"max_new_tokens": int, "temperature": float, "top_k": int, "top_p": float, "min_p": float,
            "repetition_penalty": float, "seed": int, "stop": list}
PROMPT_KEYS = ("id", "prompt", "messages", *SETTINGS)
RANGES = {"max_new_tokens": ("at least 1", lambda v: v >= 1), "temperature": ("above 0", lambda v: v > 0),
          "top_k": ("at least 1", lambda v: v >= 1), "top_p": ("in (0, 1]", lambda v: 0 < v <= 1),
          "min_p": ("in [0, 1]", lambda v: 0 <= v <= 1), "repetition_penalty": ("above 0", lambda v: v > 0),
          "seed": ("at least 0", lambda v: v >= 0)}


def _lines(path) -> list[str]:
    path = Path(path)
    if not path.is_file():
        raise BatchFileError(f"input file not found: {path}")
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise BatchFileError(f"cannot read {path} as UTF-8 text: {error}") from None


def _check_unique(seen: dict, identifier, where: str) -> None:
    if identifier in seen:
        raise BatchFileError(f"{where}: id {identifier!r} is already used at line {seen[identifier]}; "
                             "ids must be unique (results are matched to inputs by id)")


def read_prompts(path) -> list[dict]:
    """Items {"id", "prompt" or "messages", "settings"} of a prompts.jsonl file."""
    items, seen = [], {}
    for number, line in enumerate(_lines(path), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            value = json.loads(line)
        except json.JSONDecodeError as error:
            raise BatchFileError(f"{where}: not valid JSON ({error.msg} at column {error.colno}); expected one "
                                 'object per line, like {"id": "q1", "prompt": "..."}') from None
        item = _prompt_item({"prompt": value} if isinstance(value, str) else value, number, where)
        _check_unique(seen, item["id"], where)
        seen[item["id"]] = number
        items.append(item)
    return items


def _prompt_item(value, number: int, where: str) -> dict:
    if not isinstance(value, dict):
        raise BatchFileError(f"{where}: expected a JSON object with \"prompt\" or \"messages\", got "
                             f"{type(value).__name__}")
    unknown = sorted(set(value) - set(PROMPT_KEYS))
    if unknown:
        raise BatchFileError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(PROMPT_KEYS)}")
    identifier = value.get("id", number)
    if isinstance(identifier, bool) or not isinstance(identifier, (str, int)):
        raise BatchFileError(f"{where}: \"id\" must be a string or an integer, got {identifier!r}")
    if ("prompt" in value) == ("messages" in value):
        raise BatchFileError(f"{where}: give exactly one of \"prompt\" (text) and \"messages\" (a chat)")
    item = {"id": identifier}
    if "prompt" in value:
        if not isinstance(value["prompt"], str):
            raise BatchFileError(f"{where}: \"prompt\" must be a string")
        item["prompt"] = value["prompt"]
    else:
        item["messages"] = _messages(value["messages"], where)
    item["settings"] = {name: _setting(name, value[name], where) for name in SETTINGS if name in value}
    return item


def _messages(messages, where: str) -> list[dict]:
    if (not isinstance(messages, list) or not messages
            or not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                       for m in messages)):
        raise BatchFileError(f"{where}: \"messages\" must be a non-empty list of "
                             '{"role": "...", "content": "..."} objects')
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _setting(name: str, value, where: str):
    if name == "stop":
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise BatchFileError(f"{where}: \"stop\" must be a string or a list of non-empty strings")
        return stops
    kind = SETTINGS[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise BatchFileError(f"{where}: \"{name}\" must be {'an integer' if kind is int else 'a number'}, "
                             f"got {value!r}")
    expected, holds = RANGES[name]
    if not holds(value):
        raise BatchFileError(f"{where}: \"{name}\" must be {expected}, got {value!r}")
    return kind(value)


def read_audio_list(path) -> list[dict]:
    """Items {"id": the line, "path": absolute path} of a list of audio files."""
    items, seen = [], {}
    for number, line in enumerate(_lines(path), 1):
        entry = line.strip()
        if not entry or entry.startswith("#"):
            continue
        _check_unique(seen, entry, f"{path}:{number}")
        seen[entry] = number
        items.append({"id": entry, "path": str(Path(entry).expanduser().resolve())})
    return items
