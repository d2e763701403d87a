"""The deployment stack's files read as data, and its topology started natively (no Docker engine needed): engine
replicas (`slotune serve`), a real Prometheus with the shipped config and rules, load with `slotune loadtest`.

- `compose()`: docker-compose.yml with `${VAR}` interpolated as `docker compose` does.
- `dashboard_queries()`: every PromQL expression of the Grafana dashboards, template variables substituted.
- `NativeStack`: the topology; Prometheus gets the shipped prometheus.yml with only the service discovery replaced
  (static 127.0.0.1 targets instead of Docker's DNS names), the rules files as shipped.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.server_helpers import REPO, SubprocessServer, free_port

DEPLOY = REPO / "deploy"
PROMETHEUS_DIR = DEPLOY / "prometheus"
GRAFANA_DIR = DEPLOY / "grafana"
# Grafana's $__rate_interval for a 5 s scrape interval: max(4 x scrape, step + scrape), 1m at a 30m range's step
GRAFANA_BUILTINS = {"__rate_interval": "1m", "__interval": "15s", "__range": "30m"}
_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


class MissingVariable(ValueError):
    pass


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's interpolation: ${V}, ${V:-default}, ${V-default}, ${V:?error}, ${V?error}, $$ -> $."""
    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m.group(1), m.group(2), m.group(3) or ""
        value = env.get(name)
        unset = value is None or (op is not None and op.startswith(":") and value == "")
        if op is not None and op.endswith("?") and unset:
            raise MissingVariable(f"{name}: {arg}")
        if op is not None and op.endswith("-") and unset:
            return arg
        return value or ""
    return _VAR.sub(one, text)


def _interpolate_tree(node: Any, env: dict[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [_interpolate_tree(n, env) for n in node]
    if isinstance(node, dict):
        return {k: _interpolate_tree(v, env) for k, v in node.items()}
    return node


def compose(env: dict[str, str]) -> dict[str, Any]:
    """docker-compose.yml as compose sees it with this environment (YAML anchors and merge keys resolved)."""
    return _interpolate_tree(yaml.safe_load((REPO / "docker-compose.yml").read_text()), env)


def prometheus_config() -> dict[str, Any]:
    return yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())


def dashboards() -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted((GRAFANA_DIR / "dashboards").glob("*.json"))}


def _variable_choices(dashboard: dict[str, Any]) -> dict[str, list[str]]:
    """Each template variable's values to try: every option of a custom variable, `.*` (All) for a query one."""
    choices: dict[str, list[str]] = {}
    for var in dashboard["templating"]["list"]:
        if var["type"] == "custom":
            choices[var["name"]] = [o.strip() for o in var["query"].split(",")]
        else:
            choices[var["name"]] = [var.get("allValue") or ".*"]
    return choices


def substitute(expr: str, values: dict[str, str]) -> str:
    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name not in values:
            raise KeyError(f"unknown template variable ${name} in {expr!r}")
        return values[name]
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", one, expr)


@dataclass(frozen=True)
class DashboardQuery:
    dashboard: str
    where: str  # panel title or annotation name
    expr: str  # as written in the JSON
    promql: str  # with template variables substituted


def dashboard_queries() -> list[DashboardQuery]:
    """Every panel target and annotation expression, once per value of each custom variable it uses."""
    out: list[DashboardQuery] = []
    for name, board in dashboards().items():
        choices = _variable_choices(board)
        items = [(p["title"], t["expr"]) for p in board["panels"] for t in p.get("targets", [])]
        items += [(a["name"], a["expr"]) for a in board["annotations"]["list"] if "expr" in a]
        for where, expr in items:
            used = [v for v in choices if re.search(rf"\$(\{{{v}\}}|{v}\b)", expr)]
            variants: list[dict[str, str]] = [{}]
            for v in used:
                variants = [{**d, v: c} for d in variants for c in choices[v]]
            for values in variants:
                promql = substitute(expr, {**GRAFANA_BUILTINS, **{v: choices[v][0] for v in choices}, **values})
                out.append(DashboardQuery(name, where, expr, promql))
    return out


# ----------------------------------------------------------------------------------------- the native topology

@dataclass
class Prometheus:
    """A real Prometheus (Debian's package) on 127.0.0.1 with the shipped config's scrape jobs pointed at `targets`
    (job name -> host:port list) and the shipped rules."""

    targets: dict[str, list[str]]
    port: int = field(default_factory=free_port)

    def __post_init__(self) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            raise RuntimeError("prometheus is not installed (apt-get install prometheus)")
        self.dir = Path(tempfile.mkdtemp(prefix="slotune-prom-"))
        shutil.copytree(PROMETHEUS_DIR / "rules", self.dir / "rules")
        (self.dir / "prometheus.yml").write_text(yaml.safe_dump(native_prometheus_config(self.targets)))
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(self.dir / "prometheus.log", "w")
        self.process = subprocess.Popen(
            [binary, f"--config.file={self.dir / 'prometheus.yml'}", f"--storage.tsdb.path={self.dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.output()[-2000:]}")
            try:
                if httpx.get(self.url + "/-/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise TimeoutError("prometheus did not become ready in 60 s")

    def output(self) -> str:
        return (self.dir / "prometheus.log").read_text(errors="replace")

    def query(self, promql: str, at: float | None = None) -> list[dict[str, Any]]:
        params = {"query": promql, **({"time": f"{at:.3f}"} if at is not None else {})}
        body = httpx.get(self.url + "/api/v1/query", params=params, timeout=30).json()
        if body["status"] != "success":
            raise ValueError(f"{promql}: {body.get('error')}")
        return body["data"]["result"]

    def query_range(self, promql: str, start: float, end: float, step: float = 5.0) -> list[dict[str, Any]]:
        params = {"query": promql, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": str(step)}
        body = httpx.get(self.url + "/api/v1/query_range", params=params, timeout=30).json()
        if body["status"] != "success":
            raise ValueError(f"{promql}: {body.get('error')}")
        return body["data"]["result"]

    def wait_for_series(self, promql: str, count: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.query(promql)) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{promql}: fewer than {count} series after {timeout} s")
            time.sleep(0.5)

    def wait_for_rules_after(self, t: float, record: str, timeout: float = 60.0) -> None:
        """Until a rule evaluation later than `t` has stored `record` (the scrapes before it are in)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            result = self.query(f"timestamp({record})")
            if result and min(float(r["value"][1]) for r in result) > t:
                return
            time.sleep(1.0)
        raise TimeoutError(f"no evaluation of {record} after {t}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def native_prometheus_config(targets: dict[str, list[str]]) -> dict[str, Any]:
    """The shipped prometheus.yml with each job's service discovery replaced by static targets; jobs without
    targets are dropped. Everything else (intervals, rule files, job names) stays as shipped."""
    config = prometheus_config()
    jobs = []
    for job in config["scrape_configs"]:
        if targets.get(job["job_name"]):
            job = {k: v for k, v in job.items() if not k.endswith("_sd_configs") and k != "static_configs"}
            job["static_configs"] = [{"targets": targets[job["job_name"]]}]
            jobs.append(job)
    return {**config, "scrape_configs": jobs}


@dataclass
class NativeStack:
    """`replicas` engine replicas, a Prometheus scraping them and, where this checkout has `slotune control`, the
    controller (the compose file's command, advisory, reading through that Prometheus); `stop()` ends everything."""

    replicas: int = 2
    admin_token: str = "deploy-test-token"
    engine_env: dict[str, str] = field(default_factory=lambda: {"OMP_NUM_THREADS": "1"})  # a core each

    def __post_init__(self) -> None:
        self.engines: list[SubprocessServer] = []
        self.prometheus: Prometheus | None = None
        self.controller: subprocess.Popen[bytes] | None = None
        self.controller_port = free_port()
        try:
            self._start_engines()
            targets = {"slotune-engine": [e.url.removeprefix("http://") for e in self.engines],
                       "slotune-controller": [f"127.0.0.1:{self.controller_port}"]}
            self.prometheus = Prometheus(targets)
            self._start_controller()
        except BaseException:
            self.stop()
            raise

    def _start_engines(self) -> None:
        """The replicas start side by side (each loads the model); one that fails stops the stack."""
        def start() -> SubprocessServer:
            return SubprocessServer(args=["--admin-token", self.admin_token], env=self.engine_env)

        with ThreadPoolExecutor(self.replicas) as pool:
            futures = [pool.submit(start) for _ in range(self.replicas)]
            errors = []
            for future in futures:
                try:
                    self.engines.append(future.result())
                except Exception as error:  # noqa: BLE001 - the others are stopped by the caller
                    errors.append(error)
        if errors:
            raise errors[0]

    def _start_controller(self) -> None:
        assert self.prometheus is not None
        services = compose({"SLOTUNE_ADMIN_TOKEN": self.admin_token, "POSTGRES_PASSWORD": "-",
                            "GRAFANA_ADMIN_PASSWORD": "-"})["services"]
        command = services["controller"]["command"]
        # the engine service's DNS name gives its replicas (--discover); natively, each replica's own URL
        assert "--discover" in command, "the compose controller no longer discovers the engine's replicas"
        fleet = [a for e in self.engines for a in ("--engine-url", e.url)]
        replace = {"http://prometheus:9090": self.prometheus.url, "9400": str(self.controller_port),
                   "/data/runs/controller.jsonl": str(self.prometheus.dir / "controller.jsonl")}
        args = [replace.get(a, a) for a in command[1:] if a != "--discover"]
        at = args.index("http://engine:8000")
        args[at - 1:at + 1] = fleet
        self.controller_log = open(self.prometheus.dir / "controller.log", "w")
        self.controller = subprocess.Popen([sys.executable, "-m", "slotune.cli", *args], cwd=REPO,
                                           env={**os.environ, "SLOTUNE_ADMIN_TOKEN": self.admin_token},
                                           stdout=self.controller_log, stderr=subprocess.STDOUT)

    def stop(self) -> None:
        if self.controller is not None and self.controller.poll() is None:
            self.controller.terminate()
            try:
                self.controller.wait(20)
            except subprocess.TimeoutExpired:
                self.controller.kill()
                self.controller.wait(10)
        if self.prometheus is not None:
            self.prometheus.stop()
        for engine in self.engines:
            engine.stop()


def run_loadtest(url: str, out: Path, *args: str, seed: int = 0, timeout: float = 300) -> Path:
    """`slotune loadtest` against `url`, writing into `out`; returns `out`."""
    process = subprocess.Popen(
        [sys.executable, "-m", "slotune.cli", "loadtest", "--url", url, "--out", str(out), "--seed", str(seed), *args],
        cwd=REPO, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    if process.returncode != 0:
        raise RuntimeError(f"loadtest -> {out} exited {process.returncode}:\n{output[-3000:]}")
    return out


class ComposeLocust:
    """The compose file's `locust-master` and `locust-worker` services as native processes: their commands and
    environment, headless (LOCUST_HEADLESS / LOCUST_EXPECT_WORKERS, as the compose file describes), service names
    replaced by 127.0.0.1, free ports; the master splits one schedule over the workers and writes the records."""

    def __init__(self, url: str, out: Path, workers: int, options: dict[str, str]) -> None:
        services = compose({"SLOTUNE_ADMIN_TOKEN": "-", "POSTGRES_PASSWORD": "-", "GRAFANA_ADMIN_PASSWORD": "-"})[
            "services"]
        master, worker = services["locust-master"], services["locust-worker"]
        port = str(free_port())
        replace = {"--master-bind-host": "127.0.0.1", "--web-host": "127.0.0.1", "--master-bind-port": port,
                   "--web-port": str(free_port()), "--master-host": "127.0.0.1", "--master-port": port}
        inherited = {k: v for k, v in os.environ.items() if not k.startswith(("SLOTUNE_", "LOCUST_"))}
        env = {**inherited, **master["environment"], "LOCUST_HOST": url, "SLOTUNE_OUT": str(out),
               "LOCUST_HEADLESS": "true", "LOCUST_EXPECT_WORKERS": str(workers), **options}
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.log = open(out.parent / f"{out.name}-locust.log", "w")
        self.processes = [subprocess.Popen(self._native(master["command"], replace), cwd=REPO, env=env,
                                           stdout=self.log, stderr=subprocess.STDOUT)]
        self.processes += [subprocess.Popen(self._native(worker["command"], replace), cwd=REPO, env=inherited,
                                            stdout=self.log, stderr=subprocess.STDOUT) for _ in range(workers)]

    @staticmethod
    def _native(command: list[str], replace: dict[str, str]) -> list[str]:
        assert command[0] == "locust"
        args = [str(REPO / a.removeprefix("/app/")) if a.startswith("/app/") else a for a in command[1:]]
        args = [replace.get(args[i - 1], a) if i else a for i, a in enumerate(args)]
        return [sys.executable, "-m", "locust", *args]

    def wait(self, timeout: float) -> Path:
        """Until the master has written its records and every process ended; returns the output folder."""
        try:
            self.processes[0].wait(timeout)
            for p in self.processes[1:]:
                p.wait(30)
        finally:
            self.stop()
        if not (self.out / "records.parquet").exists():
            raise RuntimeError("the compose-form Locust wrote no records:\n"
                               + Path(self.log.name).read_text(errors="replace")[-3000:])
        return self.out

    def stop(self) -> None:
        for p in self.processes:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)
        self.log.close()
