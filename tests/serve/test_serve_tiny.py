"""The server on the tiny fixtures (random weights, real tokenizers): OpenAI shapes, streaming,
continuous batching giving each request its solo result, errors, API key."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest

from _server import run_concurrently, serve

httpx = pytest.importorskip("httpx")


def chat(client, content: str, **fields):
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": content}], "temperature": 0, **fields}
    return client.post("/v1/chat/completions", json=body)


def stream_lines(client, path: str, body: dict) -> list[str]:
    with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return [line for line in response.iter_lines() if line]


def test_models_and_health(client):
    ids = [card["id"] for card in client.get("/v1/models").json()["data"]]
    assert ids == ["tiny-llama", "tiny-gpt2", "tiny-whisper"]
    assert client.get("/v1/models/tiny-gpt2").json()["id"] == "tiny-gpt2"
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["models"]["tiny-whisper"]["kind"] == "audio"


def test_completion_is_the_generators_greedy_text(client, fixtures_dir):
    from runnx.generate.generator import Generator
    expected = Generator.from_folder(fixtures_dir / "tiny-gpt2").generate("the cat sat on", max_new_tokens=12)
    body = client.post("/v1/completions", json={"model": "tiny-gpt2", "prompt": "the cat sat on", "max_tokens": 12}).json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == expected
    assert body["usage"]["completion_tokens"] == 12 and body["choices"][0]["finish_reason"] == "length"


def test_chat_renders_the_template_as_chat_does(client, fixtures_dir):
    from runnx.generate.chat import Chat
    from runnx.generate.generator import Generator
    generator = Generator.from_folder(fixtures_dir / "tiny-llama")
    expected = Chat(generator).ask("where is the dog", max_new_tokens=10)
    body = chat(client, "where is the dog", max_tokens=10).json()
    message = body["choices"][0]["message"]
    assert message == {"role": "assistant", "content": expected}
    prompt = generator.tokenizer.encode(Chat(generator).render([{"role": "user", "content": "where is the dog"}]),
                                        add_special_tokens=False)
    assert body["usage"]["prompt_tokens"] == len(prompt)


def test_stream_gives_the_same_text_then_done(client):
    whole = chat(client, "a story", max_tokens=9).json()
    lines = stream_lines(client, "/v1/chat/completions",
                         {"model": "tiny-llama", "messages": [{"role": "user", "content": "a story"}],
                          "max_tokens": 9, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}})
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    assert chunks[-2]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert chunks[-1]["usage"] == whole["usage"]


def test_completion_stream_and_stop_string(client):
    plain = client.post("/v1/completions", json={"model": "tiny-gpt2", "prompt": "the cat", "max_tokens": 12}).json()
    text = plain["choices"][0]["text"]
    stop = text.split()[2]  # a word in the middle of the greedy text
    stopped = client.post("/v1/completions", json={"model": "tiny-gpt2", "prompt": "the cat", "max_tokens": 12,
                                                   "stop": [stop]}).json()
    assert stopped["choices"][0]["text"] == text[:text.index(stop)]
    assert stopped["choices"][0]["finish_reason"] == "stop"
    lines = stream_lines(client, "/v1/completions", {"model": "tiny-gpt2", "prompt": "the cat", "max_tokens": 12,
                                                     "stop": stop, "stream": True})
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == stopped["choices"][0]["text"]
    assert lines[-1] == "data: [DONE]"


def test_seeded_sampling_repeats(client):
    first, second = (chat(client, "hello", max_tokens=10, temperature=1.0, top_p=0.9, seed=7).json()
                     for _ in range(2))
    assert first["choices"][0]["message"] == second["choices"][0]["message"]


PROMPTS = ["the cat", "a dog ran into the house and", "hello", "where is the red ball that the boy lost",
           "one two three", "the", "water is wet and the sky", "birds sing"]


async def _stream_text(http, prompt: str, max_tokens: int) -> str:
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    pieces = []
    async with http.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                pieces.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(pieces)


def test_concurrent_requests_share_steps_and_match_their_solo_results(tiny_server, client):
    lengths = [6 + 3 * i for i in range(len(PROMPTS))]  # rows leave at different steps
    solo = [client.post("/v1/completions", json={"model": "tiny-llama", "prompt": p, "max_tokens": n}).json()
            ["choices"][0]["text"] for p, n in zip(PROMPTS, lengths)]
    scheduler = tiny_server.models["tiny-llama"].scheduler
    scheduler.widest = 0

    assert run_concurrently(tiny_server.url, _stream_text, zip(PROMPTS, lengths), 300) == solo
    assert scheduler.widest > 1  # decode steps ran several requests' rows at once


def _wav_bytes(seconds: float = 1.0) -> bytes:
    import soundfile
    t = np.arange(int(16000 * seconds)) / 16000
    buffer = io.BytesIO()
    soundfile.write(buffer, (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), 16000, format="WAV")
    return buffer.getvalue()


def test_transcription_formats(client, fixtures_dir, tmp_path):
    from runnx.generate.whisper import transcribe
    path = tmp_path / "tone.wav"
    path.write_bytes(_wav_bytes())
    expected = transcribe(path, fixtures_dir / "tiny-whisper")
    timed = expected  # tiny-whisper has no timestamp tokens: its segments are the 30 s windows

    def post(response_format: str):
        response = client.post("/v1/audio/transcriptions", files={"file": ("tone.wav", path.read_bytes(), "audio/wav")},
                               data={"model": "tiny-whisper", "response_format": response_format})
        assert response.status_code == 200, response.text
        return response

    assert post("json").json() == {"text": expected.text}
    assert post("text").text == expected.text
    verbose = post("verbose_json").json()
    assert verbose["text"] == timed.text and verbose["language"] == "en"
    assert [(s["start"], s["end"], s["text"]) for s in verbose["segments"]] == \
        [(s.start, s.end, s.text) for s in timed.segments]
    assert post("vtt").text.startswith("WEBVTT")
    assert post("srt").text.count(" --> ") == len(timed.segments)


@pytest.mark.parametrize("request_args, status, code", [
    ({"content": b'{"model": "tiny-llama", "messages": ['}, 400, "invalid_json"),
    ({"json": {"model": "nope", "messages": [{"role": "user", "content": "x"}]}}, 404, "model_not_found"),
    ({"json": {"model": "tiny-llama"}}, 400, "missing_required_parameter"),
    ({"json": {"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "n": 2}}, 400,
     "unsupported_parameter"),
    ({"json": {"model": "tiny-llama", "messages": [{"role": "user", "content": "word " * 300}]}}, 400,
     "context_length_exceeded"),
    ({"json": {"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1000}}, 400,
     "context_length_exceeded"),
    ({"json": {"model": "tiny-llama", "messages": [{"role": "robot", "content": "x"}]}}, 400, None),
    ({"json": {"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}}, 400,
     None),
    ({"json": {"model": "tiny-whisper", "messages": [{"role": "user", "content": "x"}]}}, 400,
     "model_not_supported"),
    ({"json": {"model": "tiny-llama", "messages": [{"role": "user", "content": "x" * 3_000_000}]}}, 413,
     "request_too_large"),
])
def test_bad_chat_requests_get_openai_errors(client, request_args, status, code):
    response = client.post("/v1/chat/completions", **request_args)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["code"] == code and error["message"] and error["type"] == "invalid_request_error"
    assert client.get("/health").status_code == 200


def test_bad_transcriptions_get_openai_errors(client):
    garbage = client.post("/v1/audio/transcriptions", files={"file": ("speech.wav", b"not audio at all", "audio/wav")},
                          data={"model": "tiny-whisper"})
    assert garbage.status_code == 400 and garbage.json()["error"]["code"] == "invalid_audio"
    assert "speech.wav" in garbage.json()["error"]["message"]
    no_file = client.post("/v1/audio/transcriptions", data={"model": "tiny-whisper"},
                          files={"other": ("x.txt", b"x", "text/plain")})
    assert no_file.status_code == 400 and no_file.json()["error"]["param"] == "file"
    wrong_model = client.post("/v1/audio/transcriptions", files={"file": ("a.wav", _wav_bytes(0.1), "audio/wav")},
                              data={"model": "tiny-llama"})
    assert wrong_model.status_code == 400 and wrong_model.json()["error"]["code"] == "model_not_supported"
    assert client.get("/v1/nowhere").json()["error"]["code"] == "not_found"


def test_api_key(fixtures_dir):
    server = serve([fixtures_dir / "tiny-gpt2"], api_key="sesame")
    try:
        with httpx.Client(base_url=server.url, timeout=300) as http:
            assert http.get("/health").status_code == 200
            refused = http.get("/v1/models")
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
            assert http.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert http.get("/v1/models", headers={"Authorization": "Bearer sesame"}).status_code == 200
    finally:
        server.stop()
