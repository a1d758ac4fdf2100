"""Errors as OpenAI clients expect them: an HTTP status and the body ``{"error": {"message", "type",
"param", "code"}}``. ``ApiError`` is raised by the server's own checks; ``api_error`` maps every
other exception (conduit-rt's typed errors first) onto one."""
from __future__ import annotations

import logging

from ..errors import (
    ArenaFullError,
    ConduitError,
    ContextOverflowError,
    InvalidImageError,
    NonFiniteLogitsError,
    RequestError,
    RuntimeClosedError,
)

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1  # what a 503 asks the client to wait before trying again


class ApiError(Exception):
    """An error response: HTTP ``status``, the OpenAI error fields and extra response ``headers``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def overloaded(message: str) -> ApiError:
    """503 with ``Retry-After``: the server cannot take the request now; the same request later can."""
    return ApiError(503, message, "server_error", None, "server_overloaded", {"Retry-After": str(RETRY_AFTER_S)})


def api_error(error: BaseException, param: str | None = None) -> ApiError:
    """The response for ``error``: 400 for a bad request (``param`` names the field at fault, when
    known), 503 for a full KV arena or a closed runtime, 500 for the rest (logged with its traceback
    when it is not one of conduit-rt's typed errors)."""
    if isinstance(error, ApiError):
        return error
    message = " ".join(str(error).split()) or type(error).__name__
    if isinstance(error, ContextOverflowError):
        return ApiError(400, message, param=param or "messages", code="context_length_exceeded")
    if isinstance(error, InvalidImageError):
        return ApiError(400, message, param=param or "messages", code="invalid_image")
    if isinstance(error, RequestError):
        return ApiError(400, message, param=param, code="invalid_value")
    if isinstance(error, ArenaFullError):
        return overloaded(f"the KV cache has no room for this request now: {message}")
    if isinstance(error, RuntimeClosedError):
        return ApiError(503, "the server is shutting down", "server_error", code="shutting_down")
    if isinstance(error, NonFiniteLogitsError):
        return ApiError(500, message, "server_error", code="non_finite_logits")
    if not isinstance(error, ConduitError):
        logger.error("request failed", exc_info=error)
        message = f"internal server error ({type(error).__name__}); see the server's log"
    return ApiError(500, message, "server_error", code="internal_error")
