"""HTTP plumbing of the API: JSON bodies in and out, errors as OpenAI error bodies, and the one table that maps
the engine's refusals to statuses."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from engine.api import protocol as oai
from engine.config import ConfigError
from engine.errors import EngineError, EngineUnavailable, InvalidRequest, LeaseConflict, QueueFull, RequestFailed

logger = logging.getLogger("slotune.server")

# The engine's refusals: HTTP status and OpenAI error type.
ENGINE_ERROR_STATUS: dict[type[EngineError], tuple[int, str]] = {
    InvalidRequest: (400, "invalid_request_error"),
    LeaseConflict: (409, "conflict"),
    QueueFull: (429, "rate_limit_error"),
    RequestFailed: (500, "internal_error"),
    EngineUnavailable: (503, "service_unavailable"),
}


class HTTPError(Exception):
    def __init__(self, status: int, message: str, error_type: str = "invalid_request_error",
                 param: str | None = None, headers: dict[str, str] | None = None, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param
        self.headers = headers
        self.extra = extra

    @classmethod
    def from_engine(cls, error: EngineError) -> HTTPError:
        status, error_type = ENGINE_ERROR_STATUS.get(type(error), (500, "internal_error"))
        headers = {"retry-after": str(error.retry_after_s)} if isinstance(error, QueueFull) else None
        return cls(status, error.message, error_type, error.param, headers)

    @classmethod
    def from_config(cls, error: ConfigError) -> HTTPError:
        """422 naming the knob, its value (as JSON can carry it) and what is allowed."""
        return cls(422, str(error), "invalid_knob", error.knob, knob=error.knob, value=json_safe(error.value),
                   allowed=error.allowed)


def json_safe(value: Any) -> Any:
    """`value` with the floats JSON has no literal for (NaN, infinities) written as strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    return value


def json_response(payload: Any, status: int = 200, headers: dict[str, str] | None = None,
                  ascii_only: bool = False) -> Response:
    body = json.dumps(payload, ensure_ascii=ascii_only, separators=(",", ":"), default=repr, allow_nan=False)
    return Response(body.encode("utf-8", "backslashreplace"), status_code=status, headers=headers,
                    media_type="application/json")


def error_response(error: HTTPError) -> Response:
    return json_response(oai.error_body(error.message, error.error_type, error.param, error.status, **error.extra),
                         error.status, error.headers, ascii_only=True)


async def read_json(request: Request) -> Any:
    body = await request.body()
    if not body:
        raise HTTPError(400, "the request body is empty; expected a JSON object")
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as error:
        raise HTTPError(400, f"the request body is not valid JSON: {error}") from None


Handler = Callable[[Request], Awaitable[Response]]


def guarded(handler: Handler) -> Handler:
    """Map HTTPError, the engine's refusals and ConfigError to their statuses; any other exception fails this
    request only (500)."""

    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except HTTPError as error:
            return error_response(error)
        except EngineError as error:
            return error_response(HTTPError.from_engine(error))
        except ConfigError as error:
            return error_response(HTTPError.from_config(error))
        except Exception as error:  # a bug fails this request only
            logger.exception("internal error serving %s %s", request.method, request.url.path)
            return error_response(HTTPError(500, f"internal error: {error!r}", "internal_error"))

    wrapped.__name__ = getattr(handler, "__name__", "handler")
    return wrapped
