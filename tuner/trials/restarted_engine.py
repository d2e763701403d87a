"""An engine whose knobs are start-up flags: a server process per configuration (vLLM, any OpenAI-compatible
server from a command template, or slotune's own server started that way).

:meth:`RestartedEngine.apply` keeps the running server when the config is the one it was started with (all the rates
of one configuration are measured on one server), else stops it and starts one with the config's flags. A knob at
the engine's own default is left to the engine, so the default config is the server started with no knob flags,
exactly as the engine resolves it; :meth:`RestartedEngine.defaults` reads that resolution back from the server.

Every start has a time limit and a log of its own (``server-NNN.log`` in ``logs_dir``). A server that exits while
starting, or does not answer in time, is a config the engine rejected (:class:`StartFailed`, with the engine's own
words from its log); the next start is clean. Each server runs in a process group of its own and is ended by that
group's id, never by name: on every stop, when this process exits, and, when it is killed, by the guard the server
runs under (tuner/trials/server_guard.py), which ends the group when the kernel tells it that its parent died.
"""

from __future__ import annotations

import dataclasses
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from loadtest.runner import die_with_parent, free_port
from slotune.units import format_duration
from tuner.trials.engine_handle import ConfigRejected, EngineHandle
from tuner.trials.engine_kinds import ServerKind, vllm_resolved

STARTUP_TIMEOUT_S = 600.0  # vLLM's compiled mode takes ~1.5 min to start on a 2-core CPU
_ERROR_LINE = re.compile(r"(Error|Exception|error:|ERROR)")
_RAISED = re.compile(r"\b[A-Z]\w*(Error|Exception): \S")
_VALIDATION = re.compile(r"\d+ validation errors? for \w+$")
_PYDANTIC_TAG = re.compile(r"\s*\[type=.*$")


class StartFailed(ConfigRejected):
    """The server exited while starting, or did not answer in time: the config is infeasible on this engine."""


@dataclass(frozen=True)
class ServerStart:
    """One start of a server, as the run's record keeps it."""

    knobs: dict[str, Any]  # the knob flags it was started with ({}: the engine's defaults)
    seconds: float  # from launch until it answered (or failed)
    log: str
    ok: bool
    reason: str | None = None
    warm_s: float = 0.0  # the warm-up load after it answered (TrialRunner.server_warmup), not measured


@dataclass
class RestartedEngine:
    kind: ServerKind
    logs_dir: Path
    startup_timeout: float = STARTUP_TIMEOUT_S
    stop_grace: float = 20.0
    starts: list[ServerStart] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.logs_dir = Path(self.logs_dir)
        self.token = secrets.token_urlsafe(24)  # slotune's server started this way keeps its admin API
        self.process: Any = None  # subprocess.Popen of the running server
        self.handle: EngineHandle | None = None
        self.flags: dict[str, Any] | None = None  # the knob flags of the running server
        self.resolved: dict[str, Any] | None = None  # the engine's defaults as it resolved them
        self.log_path: str = ""
        self.prefix_reset = self.kind.prefix_reset  # found on the server when the kind does not name one
        self.cold = False  # the running server has served nothing yet (TrialRunner warms it before it measures)

    # ------------------------------------------------------------------------------------------------ config

    def defaults(self) -> dict[str, Any]:
        """The knobs of the engine started with none of them given, as it resolved them (read back from it; only
        the knobs it has a flag for). Starts that server when none runs yet."""
        if self.resolved is None:
            if self.flags != {} or not self.alive():
                self._restart({})
            self.resolved = self.read_back()
        return dict(self.resolved)

    def read_back(self) -> dict[str, Any]:
        """What the running server says its knobs are: slotune's admin config, vLLM's printed configuration."""
        if self.handle is None:
            raise RuntimeError("no server is running: start one before reading its knobs back")
        h = self.handle
        try:
            r = httpx.get(h.url + "/admin/config", headers={"authorization": f"Bearer {self.token}"}, timeout=10)
            if r.status_code == 200:  # slotune's own server: its prefix-cache reset route too
                self.prefix_reset = self.prefix_reset or "/admin/reset_prefix_cache"
                h.prefix_reset = self.prefix_reset
                return {k: v for k, v in r.json()["config"].items() if k in self.kind.flags}
            r = httpx.get(h.url + "/server_info", params={"config_format": "json"}, timeout=30)
            if r.status_code == 200:
                return vllm_resolved(r.json().get("vllm_config") or {})
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        return {}

    def flags_for(self, knobs: dict[str, Any]) -> dict[str, Any]:
        """The knob flags of ``knobs``: those that differ from the engine's resolved defaults. A knob the engine
        has no flag for may only keep its default."""
        defaults = self.defaults()
        flags: dict[str, Any] = {}
        for name, value in knobs.items():
            if name in defaults and defaults[name] == value:
                continue
            if name not in self.kind.flags:
                if name in defaults or value is None:
                    continue
                raise ConfigRejected(f"{self.kind.name} has no flag for {name}", name)
            flags[name] = value
        return flags

    def apply(self, knobs: dict[str, Any]) -> dict[str, Any]:
        """The server for ``knobs`` (the running one when it was started with them, else a new one); returns the
        knobs as applied (the defaults with ``knobs`` laid over them). Raises ConfigRejected / StartFailed."""
        flags = self.flags_for(knobs)
        if flags != self.flags or not self.alive():
            self._restart(flags)
        return {**(self.resolved or {}), **flags}

    # ------------------------------------------------------------------------------------------------ process

    def _restart(self, flags: dict[str, Any]) -> None:
        self.stop()
        self.flags = None
        port = free_port()
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = str(self.logs_dir / f"server-{len(self.starts):03d}.log")
        env = {**os.environ, **self.kind.env, "SLOTUNE_ADMIN_TOKEN": self.token}
        command = self.kind.command(port, flags)
        # the guard ends the server's whole process group when this process dies, however it dies
        guarded = [sys.executable, "-m", "tuner.trials.server_guard", f"{0.75 * self.stop_grace:g}", "--", *command]
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            log.write(("$ " + " ".join(command) + "\n").encode())
            log.flush()
            self.process = subprocess.Popen(guarded, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            stdin=subprocess.DEVNULL, preexec_fn=die_with_parent,
                                            start_new_session=True)  # a group of its own, ended by its id
        self.handle = EngineHandle(f"http://127.0.0.1:{port}", self.token, series=self.kind.series,
                                   prefix_reset=self.prefix_reset)
        try:
            self._wait_ready()
        except StartFailed as failed:
            self.stop()
            self.starts.append(ServerStart(dict(flags), time.monotonic() - t0, self.log_path, False, str(failed)))
            raise
        self.flags = dict(flags)
        self.cold = True
        self.starts.append(ServerStart(dict(flags), time.monotonic() - t0, self.log_path, True))

    def warmed(self, seconds: float) -> None:
        """The running server has had its warm-up load (``seconds`` of it, counted with its start)."""
        self.cold = False
        self.starts[-1] = dataclasses.replace(self.starts[-1], warm_s=seconds)

    def _wait_ready(self) -> None:
        """Until the server answers /health and lists its model; StartFailed when it exits or the time runs out."""
        assert self.handle is not None and self.process is not None
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise StartFailed(f"the server exited with {self.process.returncode} while starting: "
                                  f"{engine_reason(self.log_path)} (log: {self.log_path})")
            if self.handle.alive() and self.handle.model() is not None:
                return
            time.sleep(0.5)
        raise StartFailed(f"the server did not answer within {self.startup_timeout:.0f}s of starting "
                          f"(log: {self.log_path})")

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None and self.handle is not None \
            and self.handle.alive()

    def restart(self) -> EngineHandle:
        """The same config on a fresh server (after a crash)."""
        self._restart(dict(self.flags or {}))
        assert self.handle is not None
        return self.handle

    def stop(self) -> None:
        """End the server's process group: SIGTERM, then SIGKILL to whatever is left after the grace period."""
        if self.process is None:
            return
        pgid = self.process.pid  # start_new_session: the group's id is the leader's pid
        _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace
        while time.monotonic() < deadline and (self.process.poll() is None or _group_alive(pgid)):
            time.sleep(0.1)
        _signal_group(pgid, signal.SIGKILL)
        try:
            self.process.wait(5)
        except Exception:  # noqa: BLE001 - a zombie the kernel reaps with us
            pass
        self.process = None
        self.flags = None

    def starts_note(self) -> str:
        """``, 9m12s of it starting 3 servers (0 did not come up)`` (empty before any start)."""
        if not self.starts:
            return ""
        return (f", {format_duration(self.restart_seconds())} of it starting {len(self.starts)} servers "
                f"({sum(not s.ok for s in self.starts)} did not come up)")

    def restart_seconds(self) -> float:
        """What the starts cost: starting each server and warming it."""
        return sum(s.seconds + s.warm_s for s in self.starts)

    def __enter__(self) -> "RestartedEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def engine_reason(log_path: str, lines: int = 200) -> str:
    """The engine's own words for a failed start: the last error line of its log (else its last line)."""
    try:
        tail = [line.strip() for line in Path(log_path).read_text(errors="replace").splitlines()[-lines:]
                if line.strip()]
    except OSError:
        return "no log"
    # vLLM's last line points back at the cause ("See root cause above"): passed over
    told = [line for line in tail if not line.startswith("$ ") and "root cause above" not in line]
    raised = [i for i, line in enumerate(told) if _RAISED.search(line)]  # an exception's own message
    if raised:
        return _with_details(told, raised[-1])[:400]
    errors = [line for line in told if _ERROR_LINE.search(line)]
    return (errors or tail or ["nothing in its log"])[-1][:400]


def _with_details(lines: list[str], at: int) -> str:
    """The exception line at ``at`` with the details a validation error prints under it (pydantic's "1 validation
    error for SchedulerConfig" says which setting only on its next line), their links and type tags left out."""
    text = lines[at]
    if _VALIDATION.search(text):
        details = [_PYDANTIC_TAG.sub("", line).strip() for line in lines[at + 1:at + 4]
                   if not line.startswith(("For further information", "(APIServer", "(EngineCore"))]
        text = ": ".join([text] + [d for d in details if d][:2])
    return text


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True

