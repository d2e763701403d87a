"""The HTTP front end of `slotune serve`: the OpenAI-compatible API, /metrics, /debug/steps and /admin/config,
on Starlette + uvicorn. All engine work happens in `EngineLoop`'s thread; handlers here only parse, queue and
write, so they stay light (they share the GIL with the engine thread).

Status codes: 400 malformed or invalid request (with the reason), 401 admin call without the right bearer token,
403 admin call on a server without a token, 404 unknown model or path, 413 body over --max-body-bytes,
422 bad knob value (naming the knob), 429 more waiting requests than --max-waiting-requests, 500 the engine
failed this request, 503 shutting down.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import signal
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import uvicorn
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine import openai_protocol as oai
from engine.async_engine import (EngineLoop, EngineLoopError, GenerationHandle, RequestFailed, TokenDelta)
from engine.config import ConfigError, EngineConfig
from engine.metrics import CONTENT_TYPE_LATEST, ServerMetrics, knob_values

logger = logging.getLogger("slotune.server")

DEFAULT_MAX_BODY_BYTES = 4 << 20
KNOWN_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
                         "/debug/steps", "/admin/config"})


@dataclass
class ServerSettings:
    model_name: str
    admin_token: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES


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


def json_response(payload: Any, status: int = 200, headers: dict[str, str] | None = None,
                  ascii_only: bool = False) -> Response:
    body = json.dumps(payload, ensure_ascii=ascii_only, separators=(",", ":"), default=repr)
    return Response(body.encode("utf-8", "backslashreplace"), status_code=status, headers=headers,
                    media_type="application/json")


def error_response(error: HTTPError) -> Response:
    return json_response(oai.error_body(error.message, error.error_type, error.param, error.status, **error.extra),
                         error.status, error.headers, ascii_only=True)


Handler = Callable[[Request], Awaitable[Response]]


def _guarded(handler: Handler) -> Handler:
    """Map HTTPError and EngineLoopError to their statuses; any other exception fails this request only (500)."""

    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except HTTPError as error:
            return error_response(error)
        except EngineLoopError as error:
            return error_response(HTTPError(error.status, error.message, error.error_type, error.param))
        except Exception as error:  # noqa: BLE001
            logger.exception("internal error serving %s %s", request.method, request.url.path)
            return error_response(HTTPError(500, f"internal error: {error!r}", "internal_error"))

    wrapped.__name__ = handler.__name__
    return wrapped


# Body limit and response counting (pure ASGI, so streaming is untouched) ------------------------------------------
class BodyLimitMiddleware:
    """Reads request bodies up front (refusing one larger than `max_body_bytes` with 413) and counts responses."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, metrics: ServerMetrics | None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        label = path if path in KNOWN_PATHS else "other"
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
            if self.metrics is not None and status:
                self.metrics.http_responses.labels(path=label, code=str(status[0])).inc()

    async def _read_body(self, scope: Scope, receive: Receive, send: Send) -> Receive | None:
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


# Streaming with disconnect detection --------------------------------------------------------------------------
async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def _watch_disconnect(receive: Receive, handle: GenerationHandle) -> asyncio.Task[None]:
    async def watch() -> None:
        with contextlib.suppress(Exception):
            await _wait_disconnect(receive)
            handle.abort()

    return asyncio.ensure_future(watch())


class EventStreamResponse(Response):
    """Server-sent events from an async iterator of bytes; a client that disconnects aborts its request at once
    (not only when the next token would be written)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], handle: GenerationHandle, headers: dict[str, str]) -> None:
        self.events = events
        self.handle = handle
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no", **headers})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watcher = _watch_disconnect(receive, self.handle)
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


# The app ----------------------------------------------------------------------------------------------------
def build_app(engine_loop: EngineLoop, settings: ServerSettings, metrics: ServerMetrics | None = None) -> ASGIApp:
    """The ASGI app; its lifespan starts the engine loop and stops it (aborting what is left) at shutdown."""
    model_name = settings.model_name
    started = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        engine_loop.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await asyncio.to_thread(engine_loop.stop)

    async def read_json(request: Request) -> Any:
        body = await request.body()
        if not body:
            raise HTTPError(400, "the request body is empty; expected a JSON object")
        try:
            return json.loads(body)
        except (ValueError, RecursionError) as error:
            raise HTTPError(400, f"the request body is not valid JSON: {error}") from None

    def parse(model: type[oai.CompletionRequest] | type[oai.ChatCompletionRequest], body: Any) -> Any:
        if not isinstance(body, dict):
            raise HTTPError(400, "the request body must be a JSON object")
        try:
            request = model.model_validate(body)
        except ValidationError as error:
            message, param = oai.format_validation_error(error)
            raise HTTPError(400, message, param=param) from None
        except (ValueError, TypeError, RecursionError) as error:
            raise HTTPError(400, str(error)) from None
        if request.model is not None and request.model != model_name:
            raise HTTPError(404, f"the model {request.model!r} does not exist; this server serves {model_name!r}",
                            "not_found_error", "model")
        return request

    async def start(request: Request, parsed: Any, request_id: str, arrival: float,
                    arrival_time: float) -> GenerationHandle:
        try:
            params = parsed.sampling_params()
        except ValueError as error:
            raise HTTPError(400, str(error)) from None
        vocab = engine_loop.vocab_size
        prompts = parsed.prompts()
        for prompt in prompts:
            if prompt.token_ids is not None and any(t >= vocab for t in prompt.token_ids):
                raise HTTPError(400, f"prompt token ids must be in 0..{vocab - 1}", param="prompt")
        if any(t >= vocab for t in params.stop_token_ids):
            raise HTTPError(400, f"stop_token_ids must be in 0..{vocab - 1}", param="stop_token_ids")
        generate = asyncio.ensure_future(engine_loop.generate(
            prompts, params, max_tokens=parsed.requested_max_tokens(), priority=parsed.priority,
            arrival=arrival, arrival_time=arrival_time, request_id=request_id))
        watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
        try:
            await asyncio.wait({generate, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if not generate.done():  # the client left while the request was being queued
            generate.cancel()
            raise HTTPError(499, "client disconnected")
        return generate.result()

    async def collect(request: Request, handle: GenerationHandle
                      ) -> tuple[list[str], list[str | None], list[int]] | None:
        n = len(handle.request_ids)
        texts = [""] * n
        reasons: list[str | None] = [None] * n
        counts = [0] * n
        watcher = _watch_disconnect(request.receive, handle)
        try:
            while True:
                batch = await handle.next_batch()
                if not batch:
                    break
                for delta in batch:
                    texts[delta.index] += delta.text
                    counts[delta.index] = delta.num_output_tokens
                    if delta.finished:
                        reasons[delta.index] = delta.finish_reason
        except RequestFailed as error:
            raise HTTPError(500, error.message, error.error_type) from None
        finally:
            watcher.cancel()
            handle.abort()
        return None if handle.aborted else (texts, reasons, counts)

    async def stream(handle: GenerationHandle, chunk: Callable[[TokenDelta, bool], dict[str, Any]],
                     usage: Callable[[int], dict[str, Any]] | None) -> AsyncIterator[bytes]:
        counts = [0] * len(handle.request_ids)
        seen = [False] * len(handle.request_ids)
        while True:
            try:
                batch = await handle.next_batch()
            except RequestFailed as error:
                yield oai.sse_event(oai.error_body(error.message, error.error_type, code=500))
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

    @_guarded
    async def completions(request: Request) -> Response:
        arrival, arrival_time = time.monotonic(), time.time()
        parsed = parse(oai.CompletionRequest, await read_json(request))
        request_id = oai.new_id("cmpl")
        created = oai.now_s()
        handle = await start(request, parsed, request_id, arrival, arrival_time)
        headers = {"x-request-id": request_id}
        prompt_tokens = sum(handle.prompt_lens)
        if parsed.streaming:
            def chunk(delta: TokenDelta, first: bool) -> dict[str, Any]:
                return oai.completion_chunk(request_id, created, model_name, delta.index, delta.text,
                                            delta.finish_reason if delta.finished else None)

            def usage(completion_tokens: int) -> dict[str, Any]:
                return oai.usage_chunk(request_id, created, model_name, "text_completion", prompt_tokens,
                                       completion_tokens)

            return EventStreamResponse(stream(handle, chunk, usage if parsed.include_usage else None), handle,
                                       headers)
        result = await collect(request, handle)
        if result is None:
            return Response(status_code=499)
        texts, reasons, counts = result
        return json_response(oai.completion_response(request_id, created, model_name, texts, reasons,
                                                     prompt_tokens, sum(counts)), headers=headers)

    @_guarded
    async def chat_completions(request: Request) -> Response:
        arrival, arrival_time = time.monotonic(), time.time()
        parsed = parse(oai.ChatCompletionRequest, await read_json(request))
        request_id = oai.new_id("chatcmpl")
        created = oai.now_s()
        handle = await start(request, parsed, request_id, arrival, arrival_time)
        headers = {"x-request-id": request_id}
        prompt_tokens = sum(handle.prompt_lens)
        if parsed.streaming:
            def chunk(delta: TokenDelta, first: bool) -> dict[str, Any]:
                return oai.chat_chunk(request_id, created, model_name, delta.index, delta.text,
                                      delta.finish_reason if delta.finished else None, first)

            def usage(completion_tokens: int) -> dict[str, Any]:
                return oai.usage_chunk(request_id, created, model_name, "chat.completion.chunk", prompt_tokens,
                                       completion_tokens)

            return EventStreamResponse(stream(handle, chunk, usage if parsed.include_usage else None), handle,
                                       headers)
        result = await collect(request, handle)
        if result is None:
            return Response(status_code=499)
        texts, reasons, counts = result
        return json_response(oai.chat_response(request_id, created, model_name, texts[0], reasons[0],
                                               prompt_tokens, counts[0]), headers=headers)

    @_guarded
    async def models(request: Request) -> Response:
        return json_response({"object": "list", "data": [{
            "id": model_name, "object": "model", "created": started, "owned_by": "slotune",
            "max_model_len": engine_loop.snapshot.max_model_len}]})

    @_guarded
    async def health(request: Request) -> Response:
        s = engine_loop.snapshot
        if not engine_loop.alive:
            return json_response({"status": "dead" if engine_loop.dead else "starting"}, 503)
        if engine_loop.draining:
            return json_response({"status": "draining"}, 503)
        return json_response({"status": "ok", "model": model_name, "dtype": engine_loop.engine.dtype_choice.name,
                              "config_generation": s.config.generation,
                              "num_running": s.num_running, "num_waiting": s.num_waiting,
                              "num_preempted": s.num_preempted, "kv_cache_usage": s.kv_cache_usage,
                              "last_step": s.last_step})

    @_guarded
    async def prometheus(request: Request) -> Response:
        if metrics is None:
            raise HTTPError(404, "metrics are disabled", "not_found_error")
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @_guarded
    async def debug_steps(request: Request) -> Response:
        def int_param(name: str, default: int) -> int:
            raw = request.query_params.get(name)
            if raw is None:
                return default
            try:
                value = int(raw)
            except ValueError:
                raise HTTPError(400, f"{name} must be an integer, got {raw!r}", param=name) from None
            if abs(value) > 2**62:
                raise HTTPError(400, f"{name} is out of range", param=name)
            return value

        since = int_param("since", -1)
        limit = int_param("limit", 0)
        records = engine_loop.engine.step_records(since)
        if limit > 0:
            records = records[:limit]
        return json_response({"since": since, "steps": [r.to_dict() for r in records],
                              "last_step": engine_loop.snapshot.last_step})

    def require_admin(request: Request) -> None:
        token = settings.admin_token
        if not token:
            raise HTTPError(403, "the admin API is disabled: start the server with --admin-token or "
                                 "SLOTUNE_ADMIN_TOKEN", "permission_error")
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode("utf-8", "replace"),
                                                                  token.encode("utf-8")):
            raise HTTPError(401, "missing or wrong bearer token", "authentication_error",
                            headers={"www-authenticate": "Bearer"})

    def config_payload(config: EngineConfig) -> dict[str, Any]:
        snapshot = engine_loop.snapshot
        resolved = knob_values(snapshot) if snapshot.config is config else None
        return {"config": config.knobs(), "generation": config.generation,
                "resolved": {k: resolved[k] for k in ("chunk_size", "num_kv_blocks", "max_model_len")}
                if resolved else None}

    @_guarded
    async def admin_config(request: Request) -> Response:
        require_admin(request)
        if request.method == "GET":
            return json_response(config_payload(engine_loop.snapshot.config))
        body = await read_json(request)
        if not isinstance(body, dict):
            raise HTTPError(422, "the body must be a JSON object of knobs, e.g. {\"max_num_seqs\": 32}")
        try:
            config = await engine_loop.update_config(body)
        except ConfigError as error:
            raise HTTPError(422, str(error), "invalid_knob", error.knob, knob=error.knob, value=error.value,
                            allowed=error.allowed) from None
        return json_response(config_payload(config))

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
        Route("/debug/steps", debug_steps, methods=["GET"]),
        Route("/admin/config", admin_config, methods=["GET", "PATCH"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    return BodyLimitMiddleware(app, settings.max_body_bytes, metrics)


# Running it ---------------------------------------------------------------------------------------------------
class SlotuneServer(uvicorn.Server):
    """uvicorn's server, with SIGTERM/SIGINT starting a drain (new requests get 503, in-flight ones finish
    until --shutdown-timeout, then they are aborted) and a clean exit code afterwards."""

    def __init__(self, config: uvicorn.Config, engine_loop: EngineLoop) -> None:
        super().__init__(config)
        self.engine_loop = engine_loop

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.engine_loop.draining = True
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)


def create_server(engine: Any, *, host: str = "127.0.0.1", port: int = 8000, model_name: str | None = None,
                  admin_token: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                  max_waiting_requests: int = 1024, max_kv_memory_bytes: int | None = None,
                  shutdown_timeout: float = 30.0, log_level: str = "info", access_log: bool = False
                  ) -> SlotuneServer:
    """A ready-to-run server around an `LLMEngine` (`.run()` blocks; `.should_exit = True` stops it)."""
    holder: dict[str, EngineLoop] = {}
    metrics = ServerMetrics(lambda: holder["loop"].snapshot)
    engine_loop = EngineLoop(engine, metrics, max_waiting_requests=max_waiting_requests,
                             max_kv_memory_bytes=max_kv_memory_bytes)
    holder["loop"] = engine_loop
    settings = ServerSettings(model_name=model_name or engine.model_name, admin_token=admin_token or None,
                              max_body_bytes=max_body_bytes)
    app = build_app(engine_loop, settings, metrics)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                            timeout_graceful_shutdown=shutdown_timeout, lifespan="on")
    server = SlotuneServer(config, engine_loop)
    server.metrics = metrics  # type: ignore[attr-defined]
    return server
