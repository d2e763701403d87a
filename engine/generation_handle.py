"""The front end's side of one HTTP request: one engine request per prompt, their tokens on one asyncio queue.
Lives in the event loop's thread; the engine thread only puts onto its queue (through the event loop)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from engine.errors import EngineError


@dataclass(frozen=True)
class TokenDelta:
    index: int  # which prompt of the HTTP request
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int


class _Aborted:
    """The sentinel put on the queue when the front end aborts the handle."""


_ABORTED = _Aborted()
QueueItem = TokenDelta | EngineError | _Aborted


class GenerationHandle:
    def __init__(self, request_ids: list[str], prompt_lens: list[int],
                 abort_requests: Callable[[list[str]], None]) -> None:
        self.request_ids = request_ids
        self.prompt_lens = prompt_lens
        self.queue: asyncio.Queue[QueueItem] = asyncio.Queue()
        self._abort_requests = abort_requests
        self._unfinished = set(range(len(request_ids)))
        self.aborted = False

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def abort(self) -> None:
        """Abort what is still running (idempotent; from the event loop's thread only)."""
        if self.aborted or self.finished:
            return
        self.aborted = True
        self._abort_requests([self.request_ids[i] for i in self._unfinished])
        self.queue.put_nowait(_ABORTED)

    async def next_batch(self) -> list[TokenDelta]:
        """Every delta that is ready (waiting for at least one); [] once all prompts finished or the front end
        aborted the handle. Raises the engine's error (RequestFailed, EngineUnavailable) if it failed the
        request."""
        if self.finished or self.aborted:
            return []
        items = [await self.queue.get()]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        batch = []
        for item in items:
            if isinstance(item, _Aborted):
                return []
            if isinstance(item, EngineError):
                self._unfinished.clear()
                raise item
            batch.append(item)
            if item.finished:
                self._unfinished.discard(item.index)
        return batch
