"""What anyone may read: GET /v1/models, /health, /metrics (Prometheus) and /debug/steps."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response

from engine.api.http import HTTPError, json_response
from engine.engine_loop import EngineLoop
from engine.metrics import CONTENT_TYPE_LATEST, ServerMetrics


class StatusRoutes:
    def __init__(self, engine_loop: EngineLoop, metrics: ServerMetrics, model_name: str) -> None:
        self.engine_loop = engine_loop
        self.metrics = metrics
        self.model_name = model_name
        self.started = int(time.time())

    async def models(self, request: Request) -> Response:
        return json_response({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.started, "owned_by": "slotune",
            "max_model_len": self.engine_loop.snapshot.max_model_len}]})

    async def health(self, request: Request) -> Response:
        loop = self.engine_loop
        s = loop.snapshot
        if not loop.alive:
            return json_response({"status": "dead" if loop.dead else "starting"}, 503)
        if loop.draining:
            return json_response({"status": "draining"}, 503)
        return json_response({"status": "ok", "model": self.model_name, "dtype": loop.engine.dtype_choice.name,
                              "config_generation": s.config.generation,
                              "num_running": s.num_running, "num_waiting": s.num_waiting,
                              "num_preempted": s.num_preempted, "kv_cache_usage": s.kv_cache_usage,
                              "last_step": s.last_step})

    async def prometheus(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def debug_steps(self, request: Request) -> Response:
        since = _int_param(request, "since", -1)
        limit = _int_param(request, "limit", 0)
        """The step records after step `since` that the ring buffer still holds (at most `limit`), oldest first.
        `first_step`: the oldest step it holds (null: none yet); `dropped`: how many steps after `since` it no
        longer holds (they came before `first_step`), so that a reader that fell behind knows its records have a
        gap; `capacity`: how many records it keeps."""
        engine = self.engine_loop.engine
        page = engine.step_page(since)  # the recorder's lock makes this thread-safe
        records = page.records[:limit] if limit > 0 else page.records
        return json_response({"since": since, "steps": [r.to_dict() for r in records],
                              "last_step": self.engine_loop.snapshot.last_step, "first_step": page.first_step,
                              "dropped": page.dropped, "capacity": engine.recorder.capacity})


def _int_param(request: Request, name: str, default: int) -> int:
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
