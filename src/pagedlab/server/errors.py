"""OpenAI's error bodies and the exception the server answers them with.

Handlers raise ``APIError`` (``bad_request`` for a 400, ``engine_dead`` and ``unavailable`` for a
503); the app turns it into ``{"error": {"message", "type", "param", "code"}}`` with its status.
"""

from __future__ import annotations

from pydantic import BaseModel


class ErrorInfo(BaseModel):
    """The inside of an error body: what went wrong, its kind, the field at fault, a machine code."""

    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


class APIError(Exception):
    """An error answered with OpenAI's error body and an HTTP status (and extra response
    ``headers``, such as ``Retry-After`` on a 503)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = headers or {}

    def response(self) -> ErrorResponse:
        """The body to answer with."""
        return ErrorResponse(error=self.info)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 ``invalid_request_error``."""
    return APIError(400, message, "invalid_request_error", param, code)


def engine_dead(message: str) -> APIError:
    """A 503: the engine thread is not running."""
    return APIError(503, message, "server_error", None, "engine_dead")


def unavailable(message: str, code: str, retry_after_s: int = 1) -> APIError:
    """A 503 the client may retry after ``retry_after_s`` seconds (the server is busy or draining)."""
    return APIError(503, message, "server_error", None, code, {"Retry-After": str(retry_after_s)})


def param_of(error: ValueError) -> str | None:
    """SamplingParams' and the engine's errors start with "name=value is invalid"; that name is the param."""
    head = str(error).split("=", 1)[0]
    return head if head.isidentifier() else None
