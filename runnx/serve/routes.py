"""The HTTP routes: OpenAI's chat completions, completions, models and audio transcriptions, and
/health. Text requests become `Job`s of a model's `BatchScheduler`; their events come back through
an asyncio queue and are sent as one JSON object or as server-sent events."""
from __future__ import annotations

import asyncio
import json
import os
import tempfile
from dataclasses import replace
from pathlib import Path

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from runnx.serve import schemas
from runnx.serve.errors import ApiError, error_body, unknown_model
from runnx.serve.scheduler import Failed, Finished, Job, Piece

COMPLETION_DEFAULT_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions; chat runs to the context
MAX_FORM_FIELDS = 32
DISCONNECT_POLL_SECONDS = 0.5  # how often a waiting non-streaming request checks its client


# -- requests to the decode loop --------------------------------------------------------------------
class JobStream:
    """A job submitted to a scheduler, its events readable from the event loop. Leaving `events()`
    early (a client that went away) cancels the job, which frees its batch row."""

    def __init__(self, scheduler, prompt_ids: list[int], sampling: schemas.Sampling):
        loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

        def deliver(event) -> None:  # on the scheduler's thread
            try:
                loop.call_soon_threadsafe(self.queue.put_nowait, event)
            except RuntimeError:  # the event loop is closed (server shutting down)
                self.job.cancel()

        self.job = Job(prompt_ids, sampling, deliver)
        scheduler.submit(self.job)

    async def events(self):
        try:
            while True:
                event = await self.queue.get()
                yield event
                if isinstance(event, (Finished, Failed)):
                    return
        finally:
            self.job.cancel()  # no-op once finished

    async def collect(self) -> tuple[str, Finished]:
        pieces = []
        async for event in self.events():
            if isinstance(event, Piece):
                pieces.append(event.text)
            elif isinstance(event, Failed):
                raise ApiError(event.message, status=500, kind="server_error")
            else:
                return "".join(pieces), event
        raise ApiError("generation ended without a result", status=500, kind="server_error")


async def _collect_while_connected(request: Request, stream: JobStream) -> tuple[str, Finished]:
    """The whole result; a client that hangs up before it is ready cancels the job (a streaming
    response notices that by itself)."""
    result = asyncio.ensure_future(stream.collect())
    while not result.done():
        await asyncio.wait({result}, timeout=DISCONNECT_POLL_SECONDS)
        if not result.done() and await request.is_disconnected():
            stream.job.cancel()
            result.cancel()
            raise ApiError("the client disconnected", status=499, code="client_disconnected")
    return result.result()


def sse(data) -> str:
    """One server-sent event carrying JSON (or the literal [DONE])."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


# -- helpers ---------------------------------------------------------------------------------------
async def read_json(request: Request):
    body = await request.body()
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ApiError(f"the request body is not valid JSON: {error}", code="invalid_json") from None


def find_model(request: Request, model_id: str, kind: str):
    models = request.app.state.models
    model = models.get(model_id)
    if model is None:
        raise unknown_model(model_id, models)
    if model.kind != kind:
        what = {"text": "a language model", "audio": "a Whisper model"}[kind]
        raise ApiError(f"the model '{model_id}' is not {what}: this route needs one", param="model",
                       code="model_not_supported")
    return model


# -- routes ----------------------------------------------------------------------------------------
async def health(request: Request) -> Response:
    models = request.app.state.models
    status = {name: {"kind": m.kind, **({"active": m.scheduler.active, "waiting": m.scheduler.waiting}
                                          if m.kind == "text" else {})}
              for name, m in models.items()}
    return JSONResponse({"status": "ok", "models": status})


async def list_models(request: Request) -> Response:
    return JSONResponse(schemas.model_list(request.app.state.models))


async def get_model(request: Request) -> Response:
    model_id = request.path_params["model"]
    if model_id not in request.app.state.models:
        raise unknown_model(model_id, request.app.state.models)
    return JSONResponse(schemas.model_card(model_id))


async def chat_completions(request: Request) -> Response:
    text_request = schemas.parse_chat(await read_json(request))
    model = find_model(request, text_request.model, "text")
    return await _generate(request, model, text_request, model.chat_prompt(text_request.prompt), chat=True)


async def completions(request: Request) -> Response:
    text_request = schemas.parse_completion(await read_json(request))
    model = find_model(request, text_request.model, "text")
    return await _generate(request, model, text_request, model.text_prompt(text_request.prompt), chat=False)


async def _generate(request: Request, model, text_request: schemas.TextRequest, prompt_ids: list[int], *,
                    chat: bool) -> Response:
    """Queue the request on the model's decode loop; answer with one JSON body or a stream of events."""
    max_tokens = model.budget(prompt_ids, text_request.sampling.max_tokens,
                              None if chat else COMPLETION_DEFAULT_TOKENS,
                              limit_param="max_tokens", prompt_param="messages" if chat else "prompt")
    stream = JobStream(model.scheduler, prompt_ids, replace(text_request.sampling, max_tokens=max_tokens))
    request_id = schemas.new_id("chatcmpl" if chat else "cmpl")
    if text_request.stream:
        events = _chat_events if chat else _completion_events
        return _event_stream(events(stream, request_id, model.id, text_request.include_usage))
    text, finished = await _collect_while_connected(request, stream)
    body = schemas.chat_completion if chat else schemas.completion
    return JSONResponse(body(request_id, model.id, text, finished.reason, _usage(finished)))


async def transcriptions(request: Request) -> Response:
    async with request.form(max_files=1, max_fields=MAX_FORM_FIELDS) as form:
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise ApiError("'file' is required: the audio as a multipart file field", param="file",
                           code="missing_required_parameter")
        fields = {name: value for name, value in form.items() if isinstance(value, str)}
        transcription = schemas.parse_transcription(fields)
        model = find_model(request, transcription.model, "audio")
        data = await upload.read()
        name = upload.filename or "upload"
    timestamps = True if transcription.response_format in ("verbose_json", "srt", "vtt") else None
    transcript = await run_in_threadpool(_transcribe, model, data, name, transcription.language, timestamps)
    return _transcription_response(transcript, transcription.response_format)


# -- bodies ----------------------------------------------------------------------------------------
def _usage(finished: Finished) -> dict:
    return schemas.usage(finished.prompt_tokens, finished.completion_tokens)


def _event_stream(events) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _chat_events(stream: JobStream, request_id: str, model_id: str, include_usage: bool):
    yield sse(schemas.chat_chunk(request_id, model_id, {"role": "assistant", "content": ""}))
    async for event in stream.events():
        if isinstance(event, Piece):
            yield sse(schemas.chat_chunk(request_id, model_id, {"content": event.text}))
        elif isinstance(event, Finished):
            yield sse(schemas.chat_chunk(request_id, model_id, {}, event.reason))
            if include_usage:
                yield sse(schemas.usage_chunk(request_id, model_id, "chat.completion.chunk", _usage(event)))
        else:
            yield sse(error_body(event.message, "server_error"))
    yield sse("[DONE]")


async def _completion_events(stream: JobStream, request_id: str, model_id: str, include_usage: bool):
    async for event in stream.events():
        if isinstance(event, Piece):
            yield sse(schemas.completion(request_id, model_id, event.text, None, chunk=True))
        elif isinstance(event, Finished):
            yield sse(schemas.completion(request_id, model_id, "", event.reason, chunk=True))
            if include_usage:
                yield sse(schemas.usage_chunk(request_id, model_id, "text_completion", _usage(event)))
        else:
            yield sse(error_body(event.message, "server_error"))
    yield sse("[DONE]")


def _transcribe(model, data: bytes, name: str, language: str | None, timestamps: bool | None):
    """Runs on a worker thread: the upload goes through a temporary file, as audio.load_audio reads files."""
    from runnx.generate.audio import AudioError
    from runnx.generate.whisper import WhisperError
    descriptor, path = tempfile.mkstemp(suffix=Path(name).suffix, prefix="runnx-upload-")
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(data)
        return model.transcribe(path, language=language, timestamps=timestamps)
    except AudioError as error:
        message = str(error).replace(path, repr(name))
        raise ApiError(f"the uploaded audio cannot be used: {message}", param="file", code="invalid_audio") from None
    except WhisperError as error:
        raise ApiError(str(error), param="language") from None
    finally:
        os.unlink(path)


def _transcription_response(transcript, response_format: str) -> Response:
    from runnx.generate.whisper_cli import render
    if response_format == "json":
        return JSONResponse({"text": transcript.text})
    if response_format == "text":
        return PlainTextResponse(transcript.text)
    if response_format in ("srt", "vtt"):
        return PlainTextResponse(render(transcript, response_format))
    segments = [{"id": index, "start": s.start, "end": s.end, "text": s.text, "tokens": list(s.tokens)}
                for index, s in enumerate(transcript.segments)]
    return JSONResponse({"task": "transcribe", "language": transcript.language, "duration": transcript.timings.audio,
                         "text": transcript.text, "segments": segments})
