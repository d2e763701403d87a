"""Errors of the engine's front half: why a request or a command was refused. They carry no HTTP status; the API
maps each type to one (`engine.api.http`)."""

from __future__ import annotations


class EngineError(Exception):
    """A refusal with a message for the client and, where one field is at fault, its name."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequest(EngineError, ValueError):
    """The request itself is wrong (a retry cannot succeed)."""


class QueueFull(EngineError):
    """Too many requests wait already; the same request may succeed after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineUnavailable(EngineError):
    """The engine is not running, or the server is shutting down."""


class RequestFailed(EngineError):
    """The engine failed while serving the request (not the client's fault)."""


class LeaseConflict(EngineError):
    """A confirmation that names a generation that is not the one under lease."""
