"""Request bodies read up front with a size limit (413 beyond it), and every response counted by path and status;
pure ASGI, so streaming responses pass through untouched."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.api.http import HTTPError, error_response
from engine.metrics import ServerMetrics


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int, metrics: ServerMetrics,
                 known_paths: frozenset[str]) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics
        self.known_paths = known_paths  # responses to other paths are counted as "other"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        label = path if path in self.known_paths else "other"
        status: list[int] = []

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            if scope.get("method") in ("POST", "PUT", "PATCH"):
                replay = await self._read_body(scope, receive, counting_send)
                if replay is None:
                    return
                receive = replay
            await self.app(scope, receive, counting_send)
        finally:
            if status:
                self.metrics.http_responses.labels(path=label, code=str(status[0])).inc()

    async def _read_body(self, scope: Scope, receive: Receive, send: Send) -> Receive | None:
        """A `receive` that replays the whole body, or None when the request was refused or the client left."""
        limit = self.max_body_bytes
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > limit:
                    await self._too_large(send, declared)
                    return None
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await self._too_large(send, size)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: waits for the client to disconnect

        return replay

    async def _too_large(self, send: Send, size: int) -> None:
        response = error_response(HTTPError(413, f"the request body has at least {size} bytes; this server "
                                                 f"accepts at most {self.max_body_bytes} (--max-body-bytes)"))
        await send({"type": "http.response.start", "status": 413,
                    "headers": [*response.raw_headers, (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": response.body, "more_body": False})
