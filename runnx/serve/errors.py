"""Errors a client causes, in the shape OpenAI's API returns them:
`{"error": {"message", "type", "param", "code"}}` with a 4xx status, so that OpenAI clients raise
their usual exceptions (BadRequestError, NotFoundError, AuthenticationError, ...)."""
from __future__ import annotations

from runnx.errors import RunnxError


class ApiError(RunnxError):
    """A request the server refuses; `status` is the HTTP status, `code` a stable machine name."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code
        self.kind = kind

    def body(self) -> dict:
        return error_body(str(self), self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def unknown_model(name, known) -> ApiError:
    return ApiError(f"the model '{name}' does not exist here; served models: {', '.join(sorted(known))}",
                    status=404, param="model", code="model_not_found")
