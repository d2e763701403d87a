"""The bearer-protected admin API: GET/PATCH /admin/config (with leases), POST /admin/config/confirm and
POST /admin/reset_prefix_cache."""

from __future__ import annotations

import hmac
import json
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from engine.api.http import HTTPError, json_response, read_json
from engine.config import EngineConfig
from engine.engine_loop import EngineLoop
from engine.metrics import knob_values


class AdminRoutes:
    def __init__(self, engine_loop: EngineLoop, admin_token: str | None) -> None:
        self.engine_loop = engine_loop
        self.admin_token = admin_token

    async def config(self, request: Request) -> Response:
        self._require_admin(request)
        if request.method == "GET":
            return json_response(self._payload(self.engine_loop.snapshot.config))
        body = await read_json(request)
        if not isinstance(body, dict):
            raise HTTPError(422, "the body must be a JSON object of knobs, e.g. {\"max_num_seqs\": 32}")
        lease_s = _lease_seconds(body)
        return json_response(self._payload(await self.engine_loop.update_config(body, lease_s)))  # ConfigError: 422

    async def confirm(self, request: Request) -> Response:
        self._require_admin(request)
        body = await read_json(request)
        generation = body.get("generation") if isinstance(body, dict) else None
        if isinstance(generation, bool) or not isinstance(generation, int):
            raise HTTPError(422, "the body must be {\"generation\": N}, the generation of the leased config",
                            param="generation")
        return json_response(self._payload(await self.engine_loop.confirm_config(generation)))

    async def reset_prefix_cache(self, request: Request) -> Response:
        self._require_admin(request)
        return json_response({"dropped_blocks": await self.engine_loop.reset_prefix_cache()})

    def _require_admin(self, request: Request) -> None:
        token = self.admin_token
        if not token:
            raise HTTPError(403, "the admin API is disabled: start the server with --admin-token or "
                                 "SLOTUNE_ADMIN_TOKEN", "permission_error")
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode("utf-8", "replace"),
                                                                  token.encode("utf-8")):
            raise HTTPError(401, "missing or wrong bearer token", "authentication_error",
                            headers={"www-authenticate": "Bearer"})

    def _payload(self, config: EngineConfig) -> dict[str, Any]:
        snapshot = self.engine_loop.snapshot
        current = snapshot.config is config
        resolved = knob_values(snapshot) if current else None
        lease = snapshot.lease if current else None
        return {"config": config.knobs(), "generation": config.generation,
                "resolved": {k: resolved[k] for k in ("chunk_size", "num_kv_blocks", "max_model_len")}
                if resolved else None,
                "lease": lease.as_dict() if lease is not None else None}


def _lease_seconds(body: dict[str, Any]) -> float | None:
    """Take `lease_s` out of a PATCH body: a finite number of seconds > 0, or absent/null."""
    value = body.pop("lease_s", None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise HTTPError(422, f"lease_s must be a number of seconds > 0, got {json.dumps(value)}",
                        "invalid_knob", "lease_s", knob="lease_s", allowed="a number of seconds > 0")
    return float(value)
