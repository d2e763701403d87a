"""The ASGI app of `slotune serve`: the routes, the body limit and response counting, and a lifespan that starts
the engine loop and stops it at shutdown."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.routing import Route
from starlette.types import ASGIApp

from engine.api.admin import AdminRoutes
from engine.api.body_limit import BodyLimitMiddleware
from engine.api.generation import GenerationRoutes
from engine.api.http import guarded
from engine.api.status import StatusRoutes
from engine.engine_loop import EngineLoop
from engine.metrics import ServerMetrics

DEFAULT_MAX_BODY_BYTES = 4 << 20


@dataclass(frozen=True)
class ServerSettings:
    model_name: str
    admin_token: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES


def build_app(engine_loop: EngineLoop, settings: ServerSettings, metrics: ServerMetrics) -> ASGIApp:
    generation = GenerationRoutes(engine_loop, settings.model_name)
    status = StatusRoutes(engine_loop, metrics, settings.model_name)
    admin = AdminRoutes(engine_loop, settings.admin_token)
    routes = [
        Route("/v1/completions", guarded(generation.completions), methods=["POST"]),
        Route("/v1/chat/completions", guarded(generation.chat_completions), methods=["POST"]),
        Route("/v1/models", guarded(status.models), methods=["GET"]),
        Route("/health", guarded(status.health), methods=["GET"]),
        Route("/metrics", guarded(status.prometheus), methods=["GET"]),
        Route("/debug/steps", guarded(status.debug_steps), methods=["GET"]),
        Route("/admin/config", guarded(admin.config), methods=["GET", "PATCH"]),
        Route("/admin/config/confirm", guarded(admin.confirm), methods=["POST"]),
        Route("/admin/reset_prefix_cache", guarded(admin.reset_prefix_cache), methods=["POST"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        engine_loop.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await asyncio.to_thread(engine_loop.stop)

    app = Starlette(routes=routes, lifespan=lifespan)
    return BodyLimitMiddleware(app, settings.max_body_bytes, metrics, frozenset(r.path for r in routes))
