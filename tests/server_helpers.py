"""Helpers of the server tests: a server in this process (uvicorn in a thread) or a real `slotune serve`
subprocess, a Prometheus scrape parser and an async SSE client."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parent.parent
TUNE = [sys.executable, "-m", "tuner.commands.tune"]  # the `tune` command of this checkout


def run_tune(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """`tune ARGS` in ``cwd``, its output captured."""
    return subprocess.run([*TUNE, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)
STARTUP_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, timeout: float = STARTUP_TIMEOUT_S, process: subprocess.Popen[bytes] | None = None
                 ) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not become healthy in {timeout} s")


class InProcessServer:
    """`create_server` around a real engine, run by uvicorn in a background thread of this process."""

    def __init__(self, admin_token: str | None = None, max_body_bytes: int = 1 << 20,
                 max_waiting_requests: int = 1024, max_kv_memory_bytes: int | None = None,
                 shutdown_timeout: float = 5, **knobs: Any) -> None:
        from engine.llm_engine import LLMEngine
        from engine.server import create_server

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.engine = LLMEngine(**knobs)
        self.server = create_server(self.engine, port=self.port, admin_token=admin_token,
                                    max_body_bytes=max_body_bytes, max_waiting_requests=max_waiting_requests,
                                    max_kv_memory_bytes=max_kv_memory_bytes, log_level="warning",
                                    shutdown_timeout=shutdown_timeout)
        self.engine_loop = self.server.engine_loop
        self.model = self.engine.model_name
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.thread.start()
        wait_healthy(self.url)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.engine.close()


@dataclass
class SubprocessServer:
    """A real `slotune serve` process."""

    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="slotune-serve-", suffix=".log", delete=False)
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **self.env}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "slotune.cli", "serve", "--port", str(self.port), "--log-level", "warning",
             *self.args], cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(self.url, process=self.process)
        except BaseException:
            self.stop()
            print(self.output(), file=sys.stderr)
            raise
        self.model = httpx.get(self.url + "/v1/models").json()["data"][0]["id"]

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def terminate(self) -> None:
        self.process.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.log.close()


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """/metrics as {(sample name, sorted labels): value}, parsed by prometheus_client's own parser."""
    text = httpx.get(url + "/metrics", timeout=30).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def metric(samples: dict[Any, float], sample_name: str, /, **labels: str) -> float:
    return samples.get((sample_name, tuple(sorted(labels.items()))), 0.0)


def delta(before: dict[Any, float], after: dict[Any, float], sample_name: str, /, **labels: str) -> float:
    return metric(after, sample_name, **labels) - metric(before, sample_name, **labels)


async def stream_completion(client: httpx.AsyncClient, body: dict[str, Any], path: str = "/v1/completions",
                            stop_after: int | None = None, progress: list[int] | None = None) -> dict[str, Any]:
    """POST a streamed request and read its SSE events; with `stop_after`, disconnect after that many token
    events; `progress[0]` counts token events as they arrive. Returns the events' texts, the usage and whether
    [DONE] came."""
    texts: list[str] = []
    result: dict[str, Any] = {"texts": texts, "usage": None, "done": False, "finish_reason": None,
                              "status": None}
    async with client.stream("POST", path, json={**body, "stream": True}) as response:
        result["status"] = response.status_code
        if response.status_code != 200:
            result["body"] = (await response.aread()).decode()
            return result
        if stop_after == 0:
            return result
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                result["done"] = True
                break
            event = json.loads(data)
            if "error" in event:
                result["error"] = event["error"]
                continue
            if event.get("usage"):
                result["usage"] = event["usage"]
            for choice in event["choices"]:
                texts.append(choice["text"] if "text" in choice else choice["delta"].get("content", ""))
                if progress is not None:
                    progress[0] += 1
                result["finish_reason"] = choice["finish_reason"] or result["finish_reason"]
            if stop_after is not None and len(texts) >= stop_after:
                return result  # leaving the block closes the connection mid-stream
    return result
