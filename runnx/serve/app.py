"""The ASGI app: Starlette routes (routes.py), two small checks in front of them (API key, body
size), and every error answered in OpenAI's JSON shape. Models' decode loops start and stop with
the app's lifespan."""
from __future__ import annotations

import contextlib
import hmac
import logging

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from runnx.serve import routes
from runnx.serve.errors import ApiError, error_body

log = logging.getLogger("runnx.serve")

DEFAULT_MAX_BODY_BYTES = 25 * 1024 * 1024  # OpenAI's limit on an audio upload
PUBLIC_PATHS = ("/health",)


def create_app(models: dict, *, api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> Starlette:
    """An app serving `models` (id -> LanguageModel or SpeechModel, see models.load_models)."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        for model in models.values():
            model.start()
        try:
            yield
        finally:
            for model in models.values():
                model.close()

    app = Starlette(
        routes=[
            Route("/health", routes.health, methods=["GET"]),
            Route("/v1/models", routes.list_models, methods=["GET"]),
            Route("/v1/models/{model:path}", routes.get_model, methods=["GET"]),
            Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
            Route("/v1/completions", routes.completions, methods=["POST"]),
            Route("/v1/audio/transcriptions", routes.transcriptions, methods=["POST"]),
        ],
        middleware=[Middleware(RequireApiKey, api_key=api_key), Middleware(LimitBody, max_bytes=max_body_bytes)],
        exception_handlers={ApiError: _api_error, HTTPException: _http_error, Exception: _server_error},
        lifespan=lifespan,
    )
    app.state.models = models
    return app


# -- errors ----------------------------------------------------------------------------------------
async def _api_error(request: Request, error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
    """Starlette's own refusals (unknown path, wrong method, a malformed multipart body)."""
    codes = {404: "not_found", 405: "method_not_allowed"}
    return JSONResponse(error_body(str(error.detail), "invalid_request_error", None, codes.get(error.status_code)),
                        status_code=error.status_code, headers=getattr(error, "headers", None))


async def _server_error(request: Request, error: Exception) -> JSONResponse:
    log.exception("request failed")
    return JSONResponse(error_body(f"internal error: {error}", "server_error"), status_code=500)


# -- checks in front of the routes -----------------------------------------------------------------
class RequireApiKey:
    """With a key set, every route but /health needs `Authorization: Bearer KEY` (401 otherwise)."""

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if self.expected is None or scope["type"] != "http" or scope["path"] in PUBLIC_PATHS:
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(given, self.expected):
            error = ApiError("a valid API key is required: send 'Authorization: Bearer <key>'", status=401,
                             code="invalid_api_key")
            return await JSONResponse(error.body(), status_code=401)(scope, receive, send)
        return await self.app(scope, receive, send)


class LimitBody:
    """Refuses bodies over `max_bytes` with 413: at once when Content-Length says so, else while the
    body is read (a chunked upload), by failing the route's read."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await JSONResponse(self._error().body(), status_code=413)(scope, receive, send)
        received = 0

        async def counted_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self._error()
            return message

        return await self.app(scope, counted_receive, send)

    def _error(self) -> ApiError:
        return ApiError(f"the request body is larger than this server's limit of {self.max_bytes} bytes",
                        status=413, code="request_too_large")
