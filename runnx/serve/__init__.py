"""An OpenAI-compatible server: `runnx serve MODEL_DIR ...` (the `serve` extra: starlette, uvicorn,
python-multipart).

Modules: `cli` (the subcommand), `app` (the Starlette app, API key and body-size checks, errors as
OpenAI JSON), `routes` (the endpoints, server-sent events), `schemas` (request checks, response
shapes), `errors`, `models` (folders recognised as language or Whisper models), `scheduler`
(continuous batching of decode steps across requests), `kv_rows` (rows joining and leaving a
batched KV cache).
"""
