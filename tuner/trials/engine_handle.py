"""The tuner's view of an engine: its HTTP API only (GET/PATCH /admin/config, /debug/steps, /health, /metrics).

:class:`EngineHandle` talks to a running engine. :class:`ManagedEngine` starts the default engine as a
``slotune serve`` subprocess (free port, random admin token), restarts it when it dies, and always stops it:
on exit, on Ctrl-C/SIGTERM (the caller's ``finally``), and on ``kill -9`` of the tuner (the child gets
PR_SET_PDEATHSIG=SIGTERM, so the kernel stops it when its parent dies).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from engine.knobs import KNOB_BY_NAME, flag_words
from loadtest.runner import die_with_parent, free_port, stop_process
from tuner.trials.engine_metrics import SLOTUNE_SERIES, EngineSeries, histogram_buckets, queued

STARTUP_TIMEOUT_S = 240.0


class EngineError(RuntimeError):
    """The engine cannot be reached, is dead, or answered something unexpected."""


class NotSlotune(EngineError):
    """The server answers but is not slotune's engine: it has no admin API to change its knobs live."""


@dataclass(frozen=True)
class StepPage:
    """One read of GET /debug/steps."""

    records: list[dict[str, Any]]  # StepRecord.to_dict() of the steps after the one asked for, oldest first
    last_step: int  # the engine's last step
    dropped: int  # steps after the one asked for that the engine's buffer no longer held


class ConfigRejected(ValueError):
    """PATCH /admin/config answered 422: the knobs are not allowed (nothing was changed)."""

    def __init__(self, message: str, knob: str | None = None) -> None:
        super().__init__(message)
        self.knob = knob


@dataclass
class EngineHandle:
    """An engine's HTTP API. slotune's engine has it all; another OpenAI-compatible server (vLLM) answers /health
    (with an empty body), /metrics under its own series names (``series``) and perhaps a prefix-cache reset route
    (``prefix_reset``), and has no admin or step-record routes: its step records read as none."""

    url: str
    admin_token: str | None = None
    timeout: float = 30.0
    series: EngineSeries = SLOTUNE_SERIES
    prefix_reset: str | None = "/admin/reset_prefix_cache"  # POST route that drops the prefix cache (None: none)

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")

    def _headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.admin_token}"} if self.admin_token else {}

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            return httpx.request(method, self.url + path, headers=self._headers(),
                                 timeout=kwargs.pop("timeout", self.timeout), **kwargs)
        except httpx.HTTPError as error:
            raise EngineError(f"{method} {self.url}{path}: {error or type(error).__name__}") from None

    def health(self) -> dict[str, Any] | None:
        """The /health body when the engine answers 200 ({} for a body that is not a JSON object, as vLLM's empty
        one), else None."""
        try:
            r = httpx.get(self.url + "/health", timeout=5.0)
        except httpx.HTTPError:
            return None
        if r.status_code != 200:
            return None
        try:
            body = r.json()
        except ValueError:
            return {}
        return body if isinstance(body, dict) else {}

    def alive(self) -> bool:
        return self.health() is not None

    def get_config(self) -> dict[str, Any]:
        """The applied knobs (GET /admin/config -> its "config")."""
        return self.admin_config()["config"]

    def admin_config(self) -> dict[str, Any]:
        """GET /admin/config's whole answer: the applied knobs ("config"), "generation", the sizes they resolve to
        ("resolved") and any "lease"."""
        return self._admin_json(self._request("GET", "/admin/config"))

    def patch_config(self, knobs: dict[str, Any]) -> dict[str, Any]:
        """Apply knobs live; returns the applied config. Raises ConfigRejected on 422."""
        r = self._request("PATCH", "/admin/config", json=knobs)
        if r.status_code == 422:
            try:
                err = r.json().get("error", {})
                raise ConfigRejected(str(err.get("message") or r.text), err.get("param") or err.get("knob"))
            except ValueError:
                raise ConfigRejected(r.text) from None
        return self._admin_json(r)["config"]

    def _admin_json(self, r: httpx.Response) -> dict[str, Any]:
        if r.status_code == 404:
            raise NotSlotune(f"the server at {self.url} is not slotune's engine (it has no /admin/config, so its "
                             "knobs cannot change live): tune vLLM with --engine vllm, any other "
                             "OpenAI-compatible server with --engine command --engine-command TEMPLATE (a server "
                             "per configuration; docs/engines.md)")
        if r.status_code in (401, 403):
            raise EngineError(f"{self.url}/admin/config refused the admin token ({r.status_code}): pass the "
                              "engine's token with --admin-token")
        if r.status_code != 200:
            raise EngineError(f"{self.url}/admin/config answered {r.status_code}: {r.text[:200]}")
        return r.json()

    def reset_prefix_cache(self) -> int | None:
        """Drop every cached prefix block no running request holds (POST to ``prefix_reset``), so a trial does not
        ride on an earlier one's cache; returns how many blocks were dropped (-1: the server does not say), None
        when the server has no such route."""
        if self.prefix_reset is None:
            return None
        r = self._request("POST", self.prefix_reset)
        if self.prefix_reset.startswith("/admin/"):
            return int(self._admin_json(r).get("dropped_blocks", 0))
        ok = r.status_code == 200
        try:
            ok = ok and r.json().get("success", True) is not False
        except ValueError:
            pass
        if not ok:  # vLLM: blocks still held (a request running), or no such route
            raise EngineError(f"{self.url}{self.prefix_reset} answered {r.status_code}: {r.text[:200]}")
        return -1

    def steps(self, since: int = -1) -> tuple[list[dict[str, Any]], int]:
        """Step records after step ``since`` (oldest first) and the engine's last step number."""
        page = self.step_page(since)
        return page.records, page.last_step

    def step_page(self, since: int = -1) -> StepPage:
        """Step records after step ``since`` that the engine still holds, its last step number, and how many steps
        after ``since`` its ring buffer dropped before this read (from its ``dropped``; an engine that does not say
        is judged by the first record's step number, the steps being numbered without a gap)."""
        r = self._request("GET", "/debug/steps", params={"since": since})
        if r.status_code == 404:  # not slotune's engine: no step records
            return StepPage([], since, 0)
        if r.status_code != 200:
            raise EngineError(f"{self.url}/debug/steps answered {r.status_code}")
        body = r.json()
        records = body["steps"]
        dropped = body.get("dropped")
        if dropped is None:
            dropped = max(0, int(records[0]["step"]) - max(since + 1, 0)) if records else 0
        return StepPage(records, int(body["last_step"]), int(dropped))

    def metrics_text(self) -> str:
        r = self._request("GET", "/metrics")
        if r.status_code != 200:
            raise EngineError(f"{self.url}/metrics answered {r.status_code}")
        return r.text

    def itl_buckets(self) -> dict[float, float]:
        """The engine's inter-token-latency histogram ({upper bound s: cumulative count}; empty: not reported)."""
        return histogram_buckets(self.metrics_text(), self.series.inter_token_latency)

    def model(self) -> str | None:
        try:
            r = self._request("GET", "/v1/models")
            return r.json()["data"][0]["id"] if r.status_code == 200 else None
        except (EngineError, ValueError, KeyError, IndexError):
            return None

    def finishing_rate(self, sequences: int, output_tokens: int) -> float:
        """Requests/s the engine finishes, under the config in force, while ``sequences`` requests of
        ``output_tokens`` tokens each run at once: one batch sent together, timed from the sends to the last finish
        (a machine's own figure, e.g. to size a load test for it)."""
        body = {"model": self.model(), "prompt": "Count the words of this sentence, then of the next one.",
                "max_tokens": output_tokens, "min_tokens": output_tokens, "ignore_eos": True}

        def one(_: int) -> None:
            r = self._request("POST", "/v1/completions", json=body, timeout=600.0)
            if r.status_code != 200:
                raise EngineError(f"{self.url}/v1/completions answered {r.status_code}: {r.text[:200]}")

        start = time.perf_counter()
        with ThreadPoolExecutor(sequences) as pool:
            list(pool.map(one, range(sequences)))
        return sequences / (time.perf_counter() - start)

    def wait_idle(self, timeout: float = 60.0, poll: float = 0.2) -> bool:
        """Wait until nothing runs, waits or is preempted (slotune's /health says; another server's gauges of
        running and waiting requests); False on timeout or a dead engine."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._idle():
                return True
            time.sleep(poll)
        return False

    def _idle(self) -> bool:
        h = self.health()
        if h is None:
            return False
        if "num_running" in h:
            return not (h.get("num_running") or h.get("num_waiting") or h.get("num_preempted"))
        try:
            busy = queued(self.metrics_text(), self.series)
        except EngineError:
            return False
        return not busy  # None: the server reports neither gauge, and the load test's drain is all there is


def _new_log_file() -> str:
    return tempfile.NamedTemporaryFile(prefix="slotune-tune-engine-", suffix=".log", delete=False).name


@dataclass
class ManagedEngine:
    """A ``slotune serve`` subprocess this tuner owns. Use as a context manager, or call start()/stop()."""

    model: str | None = None
    knobs: dict[str, Any] = field(default_factory=dict)
    log_path: str = field(default_factory=_new_log_file)  # the engine's stdout and stderr (default: a new temp file)
    extra_args: list[str] = field(default_factory=list)
    startup_timeout: float = STARTUP_TIMEOUT_S

    def __post_init__(self) -> None:
        self.token = secrets.token_urlsafe(24)
        self.process: subprocess.Popen[bytes] | None = None
        self.handle: EngineHandle | None = None
        self.restarts = 0

    def command(self, port: int) -> list[str]:
        cmd = [sys.executable, "-m", "slotune.cli", "serve", "--port", str(port), "--log-level", "warning",
               "--max-waiting-requests", "100000"]
        if self.model:
            cmd += ["--model", self.model]
        for k, v in self.knobs.items():
            cmd += flag_words(KNOB_BY_NAME[k].flag, v, negate_bools=False)
        return cmd + self.extra_args

    def start(self) -> EngineHandle:
        port = free_port()
        env = {**os.environ, "SLOTUNE_ADMIN_TOKEN": self.token, "TOKENIZERS_PARALLELISM": "false"}
        with open(self.log_path, "ab") as log:
            # the token goes by environment, not argv (other users can read argv)
            self.process = subprocess.Popen(self.command(port), stdout=log, stderr=subprocess.STDOUT, env=env,
                                            stdin=subprocess.DEVNULL, preexec_fn=die_with_parent,
                                            start_new_session=True)  # Ctrl-C reaches the tuner, which stops it
        self.handle = EngineHandle(f"http://127.0.0.1:{port}", self.token)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise EngineError(f"the engine exited with {self.process.returncode} while starting: "
                                  f"{self.log_tail()}")
            if self.handle.alive():
                return self.handle
            time.sleep(0.3)
        self.stop()
        raise EngineError(f"the engine did not become healthy in {self.startup_timeout:.0f}s: {self.log_tail()}")

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None and self.handle is not None \
            and self.handle.alive()

    def restart(self) -> EngineHandle:
        self.stop()
        self.restarts += 1
        return self.start()

    def stop(self, grace: float = 10.0) -> None:
        if self.process is not None:
            stop_process(self.process, grace)

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def __enter__(self) -> EngineHandle:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
