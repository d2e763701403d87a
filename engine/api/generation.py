"""POST /v1/completions and /v1/chat/completions: one generation path; `protocol.Endpoint` says what differs."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response

from engine.api import protocol as oai
from engine.api.http import HTTPError, json_response, read_json
from engine.api.streaming import EventStreamResponse, sse_events, wait_disconnect, watch_disconnect
from engine.engine_loop import EngineLoop
from engine.generation_handle import GenerationHandle, TokenDelta

GenerationRequest = oai.CompletionRequest | oai.ChatCompletionRequest


class GenerationRoutes:
    def __init__(self, engine_loop: EngineLoop, model_name: str) -> None:
        self.engine_loop = engine_loop
        self.model_name = model_name

    async def completions(self, request: Request) -> Response:
        return await self.generate(request, oai.COMPLETIONS)

    async def chat_completions(self, request: Request) -> Response:
        return await self.generate(request, oai.CHAT_COMPLETIONS)

    async def generate(self, request: Request, endpoint: oai.Endpoint) -> Response:
        arrival, arrival_time = time.monotonic(), time.time()
        parsed = self._parse(endpoint, await read_json(request))
        meta = oai.ResponseMeta(oai.new_id(endpoint.id_prefix), oai.now_s(), self.model_name)
        handle = await self._start(request, parsed, meta.request_id, arrival, arrival_time)
        headers = {"x-request-id": meta.request_id}
        prompt_tokens = sum(handle.prompt_lens)
        if parsed.streaming:
            events = self._events(handle, endpoint, meta, prompt_tokens, parsed.include_usage)
            return EventStreamResponse(events, handle, headers)
        result = await self._collect(request, handle)
        if result is None:
            return Response(status_code=499)  # the client left
        texts, reasons, counts = result
        return json_response(endpoint.response(meta, texts, reasons, prompt_tokens, sum(counts)), headers=headers)

    def _parse(self, endpoint: oai.Endpoint, body: Any) -> GenerationRequest:
        if not isinstance(body, dict):
            raise HTTPError(400, "the request body must be a JSON object")
        try:
            parsed = endpoint.request_model.model_validate(body)
        except ValidationError as error:
            message, param = oai.format_validation_error(error)
            raise HTTPError(400, message, param=param) from None
        except (ValueError, TypeError, RecursionError) as error:
            raise HTTPError(400, str(error)) from None
        if parsed.model is not None and parsed.model != self.model_name:
            raise HTTPError(404, f"the model {parsed.model!r} does not exist; this server serves "
                                 f"{self.model_name!r}", "not_found_error", "model")
        return parsed

    async def _start(self, request: Request, parsed: GenerationRequest, request_id: str, arrival: float,
                     arrival_time: float) -> GenerationHandle:
        """Queue the request in the engine; the engine checks it (InvalidRequest, QueueFull)."""
        try:
            params = parsed.sampling_params()
        except ValueError as error:
            raise HTTPError(400, str(error)) from None
        generate = asyncio.ensure_future(self.engine_loop.generate(
            parsed.prompts(), params, max_tokens=parsed.requested_max_tokens(), priority=parsed.priority,
            arrival=arrival, arrival_time=arrival_time, request_id=request_id))
        watcher = asyncio.ensure_future(wait_disconnect(request.receive))
        try:
            await asyncio.wait({generate, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if not generate.done():  # the client left while the request was being queued
            generate.cancel()
            raise HTTPError(499, "client disconnected")
        return generate.result()

    @staticmethod
    def _events(handle: GenerationHandle, endpoint: oai.Endpoint, meta: oai.ResponseMeta, prompt_tokens: int,
                include_usage: bool) -> AsyncIterator[bytes]:
        def chunk(delta: TokenDelta, first: bool) -> dict[str, Any]:
            return endpoint.chunk(meta, delta.index, delta.text, delta.finish_reason if delta.finished else None,
                                  first)

        def usage(completion_tokens: int) -> dict[str, Any]:
            return oai.usage_chunk(meta, endpoint.chunk_object, prompt_tokens, completion_tokens)

        return sse_events(handle, chunk, usage if include_usage else None)

    @staticmethod
    async def _collect(request: Request, handle: GenerationHandle
                       ) -> tuple[list[str], list[str | None], list[int]] | None:
        """Texts, finish reasons and token counts of every prompt; None if the client left. Raises the engine's
        error if it failed the request."""
        n = len(handle.request_ids)
        texts = [""] * n
        reasons: list[str | None] = [None] * n
        counts = [0] * n
        watcher = watch_disconnect(request.receive, handle)
        try:
            while batch := await handle.next_batch():
                for delta in batch:
                    texts[delta.index] += delta.text
                    counts[delta.index] = delta.num_output_tokens
                    if delta.finished:
                        reasons[delta.index] = delta.finish_reason
        finally:
            watcher.cancel()
            handle.abort()
        return None if handle.aborted else (texts, reasons, counts)
