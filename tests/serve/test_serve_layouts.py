"""The server on the folders people download: an onnxruntime-genai folder (its genai_config.json's
stop ids and context) and transformers.js folders with `variant=`. Each reply equals what the
generation API gives on the same folder, which layouts.py reads the same way."""
from __future__ import annotations

import pytest

from _server import run_concurrently, serve

httpx = pytest.importorskip("httpx")

PROMPT = "The capital of France is"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def layout_server(smollm2_genai_fp32_dir, smollm2_tjs_dir, whisper_tjs_dir):
    from runnx.serve.app import create_app
    from runnx.serve.models import load_models
    from _server import RunningServer
    models = load_models([smollm2_genai_fp32_dir, smollm2_tjs_dir, whisper_tjs_dir], variant="int8")
    server = RunningServer(create_app(models), models).start()
    yield server
    server.stop()


def _post(server, path: str, body: dict) -> dict:
    with httpx.Client(base_url=server.url, timeout=600) as http:
        reply = http.post(path, json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_genai_folder_stops_as_its_config_says(layout_server, smollm2_genai_fp32_dir):
    from runnx.generate.chat import Chat
    from runnx.generate.generator import Generator
    model = layout_server.models[smollm2_genai_fp32_dir.name]
    assert model.layout.kind == "onnxruntime-genai"
    assert model.context == model.layout.genai.context_length
    assert set(model.layout.genai.eos_token_ids) <= model._stop_ids()
    expected = Chat(Generator.from_folder(smollm2_genai_fp32_dir)).ask(QUESTION[0]["content"], max_new_tokens=48)
    reply = _post(layout_server, "/v1/chat/completions", {"model": model.id, "messages": QUESTION, "max_tokens": 48,
                                                          "temperature": 0})
    assert reply["choices"][0]["message"]["content"] == expected and "Paris" in expected
    assert reply["choices"][0]["finish_reason"] == "stop"  # a genai eos id ended it, well before 48 tokens
    with httpx.Client(base_url=layout_server.url, timeout=600) as http:
        refused = http.post("/v1/completions", json={"model": model.id, "prompt": PROMPT,
                                                     "max_tokens": model.context})
    assert refused.status_code == 400 and f"model's {model.context}-token context" in refused.text


def test_genai_folder_takes_concurrent_requests_one_at_a_time(layout_server, smollm2_genai_fp32_dir):
    model = layout_server.models[smollm2_genai_fp32_dir.name]
    assert model.max_batch == 1  # GroupQueryAttention finds a row's length from its mask: no left padding
    prompts = ["The capital of France is", "Once upon a time", "1, 2, 3,"]
    sequential = [_post(layout_server, "/v1/completions", {"model": model.id, "prompt": p, "max_tokens": 6,
                                                           "temperature": 0})["choices"][0]["text"] for p in prompts]

    async def complete(http, prompt):
        reply = await http.post("/v1/completions", json={"model": model.id, "prompt": prompt, "max_tokens": 6,
                                                         "temperature": 0})
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["text"]

    assert run_concurrently(layout_server.url, complete, [(p,) for p in prompts], 600) == sequential


def test_transformers_js_variant_is_the_generation_api_result(layout_server, smollm2_tjs_dir):
    from runnx.generate.generator import Generator
    model = layout_server.models[smollm2_tjs_dir.name]
    assert model.layout.variant == "int8" and model.layout.files.first.name == "model_quantized.onnx"
    expected = Generator.from_folder(smollm2_tjs_dir, variant="int8").generate(PROMPT, max_new_tokens=8)
    reply = _post(layout_server, "/v1/completions", {"model": model.id, "prompt": PROMPT, "max_tokens": 8,
                                                     "temperature": 0})
    assert reply["choices"][0]["text"] == expected


def test_whisper_transformers_js_variant_transcribes(layout_server, whisper_tjs_dir, audio_dir):
    model = layout_server.models[whisper_tjs_dir.name]
    assert model.whisper.variant == "int8"
    with httpx.Client(base_url=layout_server.url, timeout=600) as http, open(audio_dir / "john.wav", "rb") as file:
        reply = http.post("/v1/audio/transcriptions", data={"model": model.id},
                          files={"file": ("john.wav", file, "audio/wav")})
    assert reply.status_code == 200, reply.text
    assert reply.json()["text"].strip() == "Hello, my name is John and I live in London."


def test_unknown_variant_is_refused_at_load(smollm2_tjs_dir):
    from runnx.errors import RunnxError
    from runnx.serve.models import load_models
    with pytest.raises(RunnxError, match="no q3 variant.*variants present: fp32"):
        load_models([smollm2_tjs_dir], variant="q3")
