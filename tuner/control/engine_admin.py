"""The engine's admin API as the controller uses it: the full config payload, leased changes and their confirmation,
and the step records since a step."""

from __future__ import annotations

from typing import Any

from tuner.trials.engine_handle import ConfigRejected, EngineHandle


class LeasingEngine(EngineHandle):
    """EngineHandle with the lease calls (PATCH ``lease_s``, POST /admin/config/confirm)."""

    def apply(self, knobs: dict[str, Any], lease_s: float | None = None) -> dict[str, Any]:
        """PATCH the knobs (with a lease when ``lease_s``); the whole answer. Raises ConfigRejected on 422."""
        body = {**knobs, **({"lease_s": lease_s} if lease_s is not None else {})}
        r = self._request("PATCH", "/admin/config", json=body)
        if r.status_code == 422:
            err = r.json().get("error", {}) if r.headers.get("content-type", "").startswith("application/json") \
                else {}
            raise ConfigRejected(str(err.get("message") or r.text), err.get("param") or err.get("knob"))
        return self._admin_json(r)

    def confirm(self, generation: int) -> dict[str, Any]:
        """Keep the leased config of ``generation``. Raises ConfigRejected when it is no longer under lease."""
        r = self._request("POST", "/admin/config/confirm", json={"generation": generation})
        if r.status_code == 409 or r.status_code == 422:
            raise ConfigRejected(r.text[:300])
        return self._admin_json(r)


def resolved_knobs(payload: dict[str, Any]) -> dict[str, Any]:
    """The applied knobs with chunk_size resolved (None -> the step budget), from GET /admin/config's body."""
    knobs = dict(payload["config"])
    resolved = payload.get("resolved") or {}
    if knobs.get("chunk_size") is None and resolved.get("chunk_size") is not None:
        knobs["chunk_size"] = int(resolved["chunk_size"])
    return knobs
