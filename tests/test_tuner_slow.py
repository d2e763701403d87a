"""Slow `tune` tests (``pytest -m slow``): resume after ``kill -9`` of the tuner (finished trials kept, the engine it
started not left running, the next run resumes); two tuner processes sharing one real PostgreSQL study against two
engines, without duplicate or lost trials; ``--apply`` leaves the tuned knobs in the running engine."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import optuna
import pytest
import yaml
from optuna.trial import TrialState

from slotune.slo import SLO
from tests.postgres_helpers import start_postgres
from tests.server_helpers import TUNE, SubprocessServer
from tuner.trials.engine_handle import EngineHandle
from tuner.search.study import ROLE_DEFAULT, open_storage

pytestmark = pytest.mark.slow

POLICY = """
slo: {tbt_p99: 1s, ttft_p99: null}
objective: goodput
search_space:
  max_num_seqs: {choices: [1, 2, 4, 8]}
  max_num_batched_tokens: {choices: [32, 64, 128]}
  chunk_size: {choices: [16, 32]}
constraints: [chunk_size <= max_num_batched_tokens, max_num_seqs <= max_num_batched_tokens]
trials: 4
trial_duration: 3s
warmup: 1s
workload: {name: mixed, length_scale: 0.125, output_scale: null}
rate: 1.0
"""


def tune_cmd(*args: str) -> list[str]:
    return [*TUNE, "--policy", "policy.yaml", *args]


def test_resume_after_kill_9(tmp_path: Path) -> None:
    (tmp_path / "policy.yaml").write_text(POLICY)
    args = tune_cmd("--storage", "s.db", "--study-name", "resume", "--out", "tuned.yaml")
    log = open(tmp_path / "first.log", "w")
    first = subprocess.Popen(args, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    storage = open_storage(str(tmp_path / "s.db"))
    deadline = time.monotonic() + 300
    done = 0
    while time.monotonic() < deadline and first.poll() is None:
        time.sleep(1)
        try:
            done = len(optuna.load_study(study_name="resume", storage=storage).get_trials(
                states=(TrialState.COMPLETE,)))
        except KeyError:
            continue
        if done >= 2:
            break
    assert first.poll() is None and done >= 2, (tmp_path / "first.log").read_text()
    engine_url = re.search(r"engine up at (\S+)", (tmp_path / "first.log").read_text()).group(1)
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    log.close()
    # the engine it started dies with it (PR_SET_PDEATHSIG) and frees its port
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            httpx.get(engine_url + "/health", timeout=2)
        except httpx.HTTPError:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"the engine at {engine_url} is still running after kill -9 of tune")
    study = optuna.load_study(study_name="resume", storage=storage)
    kept = [t.number for t in study.get_trials(states=(TrialState.COMPLETE,))]
    assert len(kept) >= 2

    second = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"resuming with {len(kept)} done" in second.stdout
    study = optuna.load_study(study_name="resume", storage=storage)
    complete = study.get_trials(states=(TrialState.COMPLETE,))
    assert len(complete) == 4 and set(kept) <= {t.number for t in complete}
    assert sum(t.user_attrs.get("role") == ROLE_DEFAULT for t in complete) == 1
    assert not study.get_trials(states=(TrialState.RUNNING,))  # the killed trial was marked failed and rerun
    assert (tmp_path / "tuned.yaml").exists()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_stops_the_engine_and_keeps_the_study(tmp_path: Path, sig: int) -> None:
    (tmp_path / "policy.yaml").write_text(POLICY)
    # as from a terminal: SIGINT at its default even when this test runs with it ignored (a background job)
    proc = subprocess.Popen(tune_cmd("--storage", "s.db", "--study-name", "stop"), cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:  # until the first trial is done and the second one runs
        lines.append(line)
        if line.startswith("[1/4]"):
            break
    time.sleep(4)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 130, "".join(lines) + out + err
    assert "interrupted; finished trials are kept" in err and "Traceback" not in err
    engine_url = re.search(r"engine up at (\S+)", "".join(lines)).group(1)
    with pytest.raises(httpx.HTTPError):
        httpx.get(engine_url + "/health", timeout=2)
    study = optuna.load_study(study_name="stop", storage=open_storage(str(tmp_path / "s.db")))
    assert len(study.get_trials(states=(TrialState.COMPLETE,))) >= 1
    assert not study.get_trials(states=(TrialState.RUNNING,))  # the interrupted trial is failed, redone on resume


def test_two_tuners_share_one_postgresql_study(tmp_path: Path) -> None:
    url, stop_pg = start_postgres()
    # two tuners and their engines share this machine's cores on purpose: each is the other's "other processes", so
    # their CPU is recorded, not judged (the study's sharing is under test, not a measurement)
    (tmp_path / "policy.yaml").write_text(POLICY + "measurement: {busy: null}\n")
    engines = [SubprocessServer(args=["--admin-token", f"t{i}"]) for i in range(2)]
    try:
        procs = []
        for i, engine in enumerate(engines):
            procs.append(subprocess.Popen(
                tune_cmd("--storage", url, "--study-name", "shared", "--trials", "6", "--engine-url", engine.url,
                         "--admin-token", f"t{i}", "--out", f"out{i}/tuned.yaml"),
                cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
            time.sleep(3)  # the second joins a study the first already created
        outs = [p.communicate(timeout=600) for p in procs]
        for p, (out, err) in zip(procs, outs):
            assert p.returncode == 0, out + err
        study = optuna.load_study(study_name="shared", storage=open_storage(url))
        trials = study.get_trials()
        assert [t.state for t in trials] == [TrialState.COMPLETE] * 6  # none lost, none extra
        assert sum(t.user_attrs.get("role") == ROLE_DEFAULT for t in trials) == 1
        ran = [{int(n) for n in re.findall(r"^\[\d+/6\] #(\d+) ", out, re.M)} for out, _ in outs]
        assert ran[0] and ran[1], outs  # both processes worked on the study
        assert not ran[0] & ran[1] and ran[0] | ran[1] == {t.number for t in trials}  # no trial run twice
        assert len({t.user_attrs["trial_dir"] for t in trials}) == 6
    finally:
        for engine in engines:
            engine.stop()
        stop_pg()


def test_apply_leaves_the_tuned_knobs_in_the_engine(tmp_path: Path) -> None:
    (tmp_path / "policy.yaml").write_text(POLICY.replace("trials: 4", "trials: 3"))
    server = SubprocessServer(args=["--admin-token", "secret"])
    try:
        proc = subprocess.run(tune_cmd("--engine-url", server.url, "--admin-token", "secret", "--apply",
                                       "--out", "tuned.yaml"), cwd=tmp_path, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        knobs = yaml.safe_load((tmp_path / "tuned.yaml").read_text())["knobs"]
        assert EngineHandle(server.url, "secret").get_config() == knobs
        assert "applied to" in proc.stdout and "re-measured" in proc.stdout
    finally:
        server.stop()


def test_a_trial_that_kills_the_engine_is_infeasible_and_the_engine_restarts(tmp_path: Path) -> None:
    from policies import WorkloadSpec
    from tuner.trials.engine_handle import ManagedEngine
    from tuner.trials.trial_runner import TrialRunner

    engine = ManagedEngine(log_path=str(tmp_path / "engine.log"))
    engine.start()
    try:
        killed: list[int] = []

        def crash(progress: dict) -> None:
            if progress.get("elapsed_s", 0) > 2 and not killed and engine.process is not None:
                killed.append(engine.process.pid)
                engine.process.kill()

        runner = TrialRunner(engine, workload=WorkloadSpec(length_scale=0.125), rate=2.0, duration=4.0, warmup=1.0,
                             slo=SLO(tbt_p99=1.0), on_progress=crash)
        outcome = runner.run({"max_num_seqs": 4}, tmp_path / "t")
        assert killed and not outcome.feasible
        assert outcome.reason is not None and "engine crashed" in outcome.reason
        assert engine.restarts == 1 and engine.alive()
        trial = yaml.safe_load((tmp_path / "t" / "trial.json").read_text())
        assert trial["feasible"] is False and "engine crashed" in trial["reason"]
        runner.on_progress = None
        again = runner.run({"max_num_seqs": 4}, tmp_path / "t2")  # the restarted engine serves the next trial
        assert again.summary["completed"] > 0
    finally:
        engine.stop()
