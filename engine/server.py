"""Running `slotune serve`: uvicorn around the API app (`engine.api`) and the engine loop, with a shutdown that
lets requests in flight finish until --shutdown-timeout and then ends each with a final "abort" event."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
from collections.abc import Iterator
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

from engine.api.app import DEFAULT_MAX_BODY_BYTES, ServerSettings, build_app
from engine.engine_loop import EngineLoop
from engine.metrics import ServerMetrics

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

# After the shutdown timeout aborts the requests in flight, this long for their final events to be written before
# uvicorn cancels what is still running.
ABORT_GRACE_S = 5.0


class SlotuneServer(uvicorn.Server):
    """uvicorn's server, with SIGTERM/SIGINT starting a drain (new requests get 503; requests in flight finish
    until `shutdown_timeout`, then each ends with finish_reason "abort" and [DONE]) and a clean exit code."""

    def __init__(self, config: uvicorn.Config, engine_loop: EngineLoop, metrics: ServerMetrics,
                 shutdown_timeout: float) -> None:
        super().__init__(config)
        self.engine_loop = engine_loop
        self.metrics = metrics
        self.shutdown_timeout = shutdown_timeout

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.engine_loop.draining = True
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # The engine aborts what is left at the deadline, so that every stream ends with its final event before
        # uvicorn's own (later) timeout would cancel the request tasks mid-stream.
        self.engine_loop.draining = True
        deadline = asyncio.get_running_loop().call_later(self.shutdown_timeout, self.engine_loop.abort_all)
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()

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


def create_server(engine: LLMEngine, *, host: str = "127.0.0.1", port: int = 8000, model_name: str | None = None,
                  admin_token: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                  max_waiting_requests: int = 1024, max_kv_memory_bytes: int | None = None,
                  shutdown_timeout: float = 30.0, log_level: str = "info", access_log: bool = False
                  ) -> SlotuneServer:
    """A ready-to-run server around an `LLMEngine` (`.run()` blocks; `.should_exit = True` stops it)."""
    metrics = ServerMetrics()
    engine_loop = EngineLoop(engine, metrics, max_waiting_requests=max_waiting_requests,
                             max_kv_memory_bytes=max_kv_memory_bytes)
    settings = ServerSettings(model_name=model_name or engine.model_name, admin_token=admin_token or None,
                              max_body_bytes=max_body_bytes)
    app = build_app(engine_loop, settings, metrics)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                            timeout_graceful_shutdown=int(shutdown_timeout + ABORT_GRACE_S), lifespan="on")
    return SlotuneServer(config, engine_loop, metrics, shutdown_timeout)
