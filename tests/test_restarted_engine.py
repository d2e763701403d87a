"""The restart-per-configuration path on a real engine: `slotune serve` started per config from a command template
(the knobs as its flags, no live change), measured like the live path and giving the same answer on the same draws;
a config the server rejects, and a server that hangs at start-up, are infeasible with their reason and leave nothing
running."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from policies import WorkloadSpec
from slotune.slo import SLO
from tuner.measure.measurement import MeasurementSpec, measure
from tuner.trials.engine_handle import ManagedEngine
from tuner.trials.engine_kinds import command_kind
from tuner.trials.restarted_engine import RestartedEngine, StartFailed
from tuner.trials.trial_runner import TrialRunner

SERVE = f"{sys.executable} -m slotune.cli serve --port {{port}} --log-level warning --max-waiting-requests 100000"
CONFIG = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "chunk_size": 16}
WORKLOAD = WorkloadSpec(name="mixed", length_scale=0.125, output_scale=0.25)
SLO_LOOSE = SLO(tbt_p99=1.0, ttft_p99=5.0)
SPEC = MeasurementSpec(min_gaps=200, max_segments=2, window_s=6.0)
SHORT_S = 3.0  # a window that only has to show which server ran it


def runner_on(engine: ManagedEngine | RestartedEngine, server_warmup: float = 0.0) -> TrialRunner:
    return TrialRunner(engine, workload=WORKLOAD, duration=6.0, warmup=1.0, slo=SLO_LOOSE, seed=0, busy_cores=None,
                       server_warmup=server_warmup)


@pytest.mark.slow  # about 50 s: three model loads (the live engine, the server's defaults, the config's server)
def test_the_restart_path_measures_a_config_as_the_live_path_does_on_the_same_draws(tmp_path: Path) -> None:
    live = ManagedEngine(log_path=str(tmp_path / "live.log"))
    live.start()
    try:
        live_m = measure(runner_on(live), CONFIG, 2.0, tmp_path / "live", draw=5, spec=SPEC)
    finally:
        live.stop()
    kind = command_kind(SERVE, {"chunk_size": "--chunk-size"}, None)
    with RestartedEngine(kind, tmp_path / "servers") as restarted:
        runner = runner_on(restarted, server_warmup=2.0)
        assert runner.base_knobs == restarted.defaults()
        assert runner.base_knobs["max_num_seqs"] == 64 and runner.base_knobs["max_num_batched_tokens"] == 512
        restart_m = measure(runner, CONFIG, 2.0, tmp_path / "restart", draw=5, spec=SPEC)
        # the server was started with the config's flags and took no live change
        admin = httpx.get(restarted.handle.url + "/admin/config",
                          headers={"authorization": f"Bearer {restarted.token}"}).json()
        assert {k: admin["config"][k] for k in CONFIG} == CONFIG and admin["generation"] == 0
        assert "--max-num-seqs 4 --max-num-batched-tokens 64 --chunk-size 16" in \
            Path(restarted.starts[-1].log).read_text().splitlines()[0]
        # the fresh server had its warm-up load (its own arrivals, kept beside its log) before the first window
        warm = Path(restarted.starts[-1].log).with_suffix(".warmup")
        assert restarted.starts[-1].warm_s >= 2.0 and (warm / "records.parquet").exists()
        # a second rate of the same config runs on the same server, warmed once
        starts, warm_s = len(restarted.starts), restarted.starts[-1].warm_s
        runner.run(CONFIG, tmp_path / "again", rate=1.0, duration=SHORT_S)
        assert len(restarted.starts) == starts and restarted.starts[-1].warm_s == warm_s
        pgid = restarted.process.pid
    assert not psutil.pid_exists(pgid) or psutil.Process(pgid).status() == psutil.STATUS_ZOMBIE
    a, b = live_m.figures, restart_m.figures
    assert a is not None and b is not None and live_m.void is None and restart_m.void is None
    assert a.requests == b.requests  # the same arrivals
    assert a.tbt_p99.low <= b.tbt_p99.high and b.tbt_p99.low <= a.tbt_p99.high, (a.tbt_p99, b.tbt_p99)
    assert a.attainment.low <= b.attainment.high and b.attainment.low <= a.attainment.high
    assert a.verdicts["attainment"] == b.verdicts["attainment"]


def test_a_config_the_server_rejects_is_infeasible_with_the_servers_own_words(tmp_path: Path) -> None:
    kind = command_kind(SERVE, {"chunk_size": "--chunk-size"}, None)
    with RestartedEngine(kind, tmp_path / "servers") as restarted:
        runner = runner_on(restarted)
        o = runner.run({"max_num_seqs": 600, "max_num_batched_tokens": 64}, tmp_path / "bad", rate=1.0)
        assert not o.feasible and o.reason is not None
        assert o.reason.startswith("rejected by the engine at start-up: the server exited with 2 while starting")
        assert "max_num_seqs=600" in o.reason and "must be <= max_num_batched_tokens" in o.reason
        # the next config, the default, starts clean: a server with no knob flags, as the engine resolves it
        ok = runner.run({}, tmp_path / "default", rate=1.0, duration=SHORT_S)
        assert ok.summary.get("completed") and not (ok.reason or "").startswith("rejected"), ok.reason
        assert [s.ok for s in restarted.starts] == [True, False, True]
        assert "--max-num-seqs" not in Path(restarted.starts[-1].log).read_text().splitlines()[0]


def test_a_server_that_hangs_at_start_up_is_ended_with_its_whole_process_group(tmp_path: Path) -> None:
    # a "server" that never listens and leaves a child of its own behind
    hang = (f"{sys.executable} -c \"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
            f"'import time; time.sleep(600)']); print('starting', flush=True); time.sleep(600)\" {{port}}")
    restarted = RestartedEngine(command_kind(hang, {}, None), tmp_path / "servers", startup_timeout=3.0,
                                stop_grace=2.0)
    with pytest.raises(StartFailed, match=r"did not answer within 3s of starting"):
        restarted.defaults()
    start = restarted.starts[-1]
    assert not start.ok and "starting" in Path(start.log).read_text()
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if "time.sleep(600)" in " ".join(p.info["cmdline"] or [])
                 and p.status() != psutil.STATUS_ZOMBIE]
    assert leftovers == []


STUBBORN = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "subprocess.Popen([sys.executable, '-c', 'import signal, time; signal.signal(signal.SIGTERM, "
            "signal.SIG_IGN); time.sleep(601)']); time.sleep(601)")


def test_a_killed_tuner_leaves_no_server_running_even_one_that_ignores_sigterm(tmp_path: Path) -> None:
    """vLLM's API server, sent SIGTERM while its engine compiles, keeps its engine processes: the guard the server
    runs under ends the whole group when the tuner dies, kill -9 included."""
    template = f"{sys.executable} -c \"{STUBBORN}\" {{port}}"
    tuner = (f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r}); "
             "from pathlib import Path; from tuner.trials.engine_kinds import command_kind; "
             "from tuner.trials.restarted_engine import RestartedEngine; "
             f"RestartedEngine(command_kind({template!r}, {{}}, None), Path({str(tmp_path)!r}), stop_grace=2.0)"
             ".defaults()")
    proc = subprocess.Popen([sys.executable, "-c", tuner])

    def stubborn() -> list[psutil.Process]:
        return [p for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [])[1:2] == ["-c"]
                and p.info["cmdline"][2].startswith("import signal") and p.status() != psutil.STATUS_ZOMBIE]

    try:
        deadline = time.monotonic() + 60
        while len(stubborn()) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(stubborn()) == 2  # the server and the child it spawned are up, both ignoring SIGTERM
    finally:
        proc.kill()
        proc.wait(10)
    deadline = time.monotonic() + 15
    while stubborn() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert stubborn() == []


def test_a_server_that_exits_at_once_says_why(tmp_path: Path) -> None:
    crash = f"{sys.executable} -c \"import sys; print('ValueError: --max-num-seqs must be positive'); sys.exit(3)\" " \
            "{port}"
    restarted = RestartedEngine(command_kind(crash, {}, None), tmp_path / "servers", startup_timeout=30.0)
    with pytest.raises(StartFailed, match=r"exited with 3 while starting: ValueError: --max-num-seqs must be "
                                          r"positive"):
        restarted.defaults()


@pytest.mark.slow  # about 6 minutes: several servers started, the floor, two capacity searches and a verdict round
def test_tune_with_a_command_template_runs_the_whole_flow_on_a_server_per_configuration(tmp_path: Path) -> None:
    from tests.server_helpers import run_tune
    from tests.test_tune_capacity_e2e import POLICY

    (tmp_path / "policy.yaml").write_text(POLICY)
    proc = run_tune(["--policy", "policy.yaml", "--seed", "3", "--out", "out/tuned.yaml", "--engine", "command",
                     "--engine-command", SERVE + " {knobs}", "--knob-flag", "chunk_size=--chunk-size"], tmp_path,
                    timeout=1500)
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert re.search(r"starting command with its own defaults .*\n.*command up at http://127.0.0.1:\d+ in \d+s; its "
                     r"defaults as it resolved them: seqs=64 budget=512", proc.stdout), proc.stdout
    assert "no step-time model is calibrated on command: the search runs on the engine alone" in proc.stdout
    logs = sorted((tmp_path / "out" / "tuned-trials" / "servers").glob("server-*.log"))
    assert len(logs) >= 3  # the defaults, batch 1 and batch 4 of the floor at least
    assert any("--max-num-seqs 1" in log.read_text().splitlines()[0] for log in logs)
    if proc.returncode == 0:
        assert re.search(r"done in .*, [\dms ]+ of it starting \d+ servers \(0 did not come up\)", proc.stdout)
        text = (tmp_path / "out" / "tuned.vllm.txt").read_text()
        assert "measured on command itself, a server per configuration" in text
