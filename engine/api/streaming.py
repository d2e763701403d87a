"""Server-sent events of one generation, and disconnect detection: a client that leaves aborts its request at
once (not only when the next token would be written)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from engine.api import protocol as oai
from engine.api.http import HTTPError
from engine.errors import EngineError
from engine.generation_handle import GenerationHandle, TokenDelta


async def wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def watch_disconnect(receive: Receive, handle: GenerationHandle) -> asyncio.Task[None]:
    """A task that aborts `handle` when the client disconnects (cancel it once the response is done)."""

    async def watch() -> None:
        with contextlib.suppress(Exception):
            await wait_disconnect(receive)
            handle.abort()

    return asyncio.ensure_future(watch())


async def sse_events(handle: GenerationHandle, chunk: Callable[[TokenDelta, bool], dict[str, Any]],
                     usage: Callable[[int], dict[str, Any]] | None) -> AsyncIterator[bytes]:
    """One event per token (the deltas of one step in one write), `usage` at the end, then [DONE]; an engine
    failure becomes an error event before [DONE]. Nothing more once the client left."""
    counts = [0] * len(handle.request_ids)
    seen = [False] * len(handle.request_ids)
    while True:
        try:
            batch = await handle.next_batch()
        except EngineError as error:
            failure = HTTPError.from_engine(error)
            yield oai.sse_event(oai.error_body(failure.message, failure.error_type, code=failure.status))
            yield oai.SSE_DONE
            return
        if not batch:
            break
        parts = []
        for delta in batch:
            parts.append(oai.sse_event(chunk(delta, not seen[delta.index])))
            seen[delta.index] = True
            counts[delta.index] = delta.num_output_tokens
        yield b"".join(parts)
    if handle.aborted:
        return
    if usage is not None:
        yield oai.sse_event(usage(sum(counts)))
    yield oai.SSE_DONE


class EventStreamResponse(Response):
    """Server-sent events from an async iterator of bytes; aborts the handle when the client disconnects."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], handle: GenerationHandle, headers: dict[str, str]) -> None:
        self.events = events
        self.handle = handle
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no", **headers})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watcher = watch_disconnect(receive, self.handle)
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            pass  # the client is gone
        finally:
            watcher.cancel()
            self.handle.abort()  # no-op once finished
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
