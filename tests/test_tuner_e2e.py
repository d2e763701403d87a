"""`tune` end to end on the default model: a short study on the engine it starts itself writes tuned.yaml (plus
the vLLM flags and the HTML report); `slotune serve --config tuned.yaml` loads it, and the re-measured p99 TBT
meets the SLO. Then an SLO no config can meet, against that running engine: a clear message, the closest config
flagged infeasible, a non-zero exit, and the engine gets its config back."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from policies import load_policy
from tests.server_helpers import SubprocessServer, run_tune
from tuner.trials.engine_handle import EngineHandle
from tuner.trials.trial_runner import TrialRunner

REPO = Path(__file__).resolve().parent.parent
SLO_S = 1.0  # loose: the searched configs take <= 32 prefill tokens a step, far below 1 s even on a busy CPU
POLICY = """
slo: {tbt_p99: 1s, ttft_p99: null}
objective: goodput
search_space:
  max_num_seqs: {choices: [1, 2, 4]}
  max_num_batched_tokens: {choices: [32, 64]}
  chunk_size: {choices: [16, 32]}
  block_size: {choices: [16, 32]}
constraints: [chunk_size <= max_num_batched_tokens, max_num_seqs <= max_num_batched_tokens]
trials: 3
trial_duration: 4s
warmup: 1s
workload: {name: mixed, length_scale: 0.125, output_scale: null}
rate: 1.0
"""


def tune(args: list[str], cwd: Path, timeout: float = 420) -> subprocess.CompletedProcess[str]:
    return run_tune(args, cwd, timeout)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    d = tmp_path_factory.mktemp("tune")
    (d / "policy.yaml").write_text(POLICY)
    proc = tune(["--policy", "policy.yaml", "--slo-p99-tbt", "1s", "--out", "out/tuned.yaml"], d)
    return d, proc


@pytest.mark.slow  # about 2 minutes: with the slow tests, so that the default suite stays under 15 minutes on 2 cores
def test_tune_writes_a_servable_config_whose_p99_tbt_meets_the_slo(
        tuned: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    d, proc = tuned
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    out = proc.stdout
    # one progress line per trial: knobs, goodput, p99 TBT, TTFT, feasibility, best so far, time left
    lines = [line for line in out.splitlines() if re.match(r"\[\d/3\] #\d ", line)]
    assert len(lines) == 3, out
    assert "default config" in lines[0]
    for line in lines:
        assert "goodput" in line and "p99 TBT" in line and "p99 TTFT" in line and "best" in line and "left" in line
    # the engine it started is gone
    port = re.search(r"engine up at (http://127\.0\.0\.1:\d+)", out).group(1)
    with pytest.raises(httpx.HTTPError):
        httpx.get(port + "/health", timeout=2)

    doc = yaml.safe_load((d / "out" / "tuned.yaml").read_text())
    knobs = doc["knobs"]
    trial_files = (d / "out" / "tuned-trials").glob("*/trial-*/trial.json")
    trial_knobs = [yaml.safe_load(p.read_text())["knobs"] for p in trial_files]
    assert knobs in trial_knobs  # the winner is one of the measured configs (the default may win a loose SLO)
    assert doc["slo"] == {"tbt_p99": SLO_S} and doc["rate_rps"] == 1.0 and doc["workload"]["name"] == "mixed"
    assert doc["model"] and doc["date"] and doc["objective"] == "goodput"
    assert doc["tuned"]["tbt_p99"] <= SLO_S and doc["tuned"]["goodput_rps"] >= 0
    assert doc["default"]["knobs"]["max_num_seqs"] == 64  # the engine's default config was measured too
    assert "tbt_p99" in doc["default"] and "tbt_p99" in doc["tuned_remeasured"]
    vllm = (d / "out" / "tuned.vllm.txt").read_text()
    assert "vllm serve" in vllm and "--enable-chunked-prefill" in vllm
    assert f"--max-num-seqs {knobs['max_num_seqs']}" in vllm
    assert f"--max-num-batched-tokens {knobs['max_num_batched_tokens']}" in vllm
    html = (d / "out" / "tuned.html").read_text()
    assert "plotly" in html.lower() and "p99 TBT vs goodput" in html
    trial_dirs = sorted((d / "out" / "tuned-trials").glob("*/trial-*"))
    assert len(trial_dirs) == 3
    for t in trial_dirs:
        assert {"records.parquet", "summary.json", "steps.jsonl", "trial.json"} <= {p.name for p in t.iterdir()}

    # serve it, and re-measure on the served engine: the p99 TBT meets the SLO
    server = SubprocessServer(args=["--config", str(d / "out" / "tuned.yaml"), "--admin-token", "secret"])
    try:
        handle = EngineHandle(server.url, "secret")
        served = handle.get_config()
        assert {k: served[k] for k in knobs} == knobs
        policy = load_policy(d / "policy.yaml")
        runner = TrialRunner(handle, workload=policy.workload, rate=1.0, duration=4.0, warmup=1.0, slo=policy.slo)
        outcome = runner.run({}, d / "remeasure")
        assert outcome.summary["completed"] > 0
        assert outcome.summary["tbt_p99"] <= SLO_S, outcome.summary
        assert outcome.feasible and outcome.step_stats["steps"] > 0

        # an SLO nobody meets, on this running engine
        proc2 = tune(["--policy", "policy.yaml", "--slo-p99-tbt", "1ms", "--trials", "1", "--trial-duration", "3s",
                      "--engine-url", server.url, "--admin-token", "secret", "--out", "out2/tuned.yaml"], d)
        assert proc2.returncode == 1, proc2.stdout + proc2.stderr
        assert "Traceback" not in proc2.stderr
        assert "no config met the SLO (p99 TBT <= 1ms) in 1 trial at 1 req/s" in proc2.stderr
        assert re.search(r"closest \(infeasible\): trial #\d .*p99 TBT \d+ms > 1ms", proc2.stderr), proc2.stderr
        assert not (d / "out2" / "tuned.yaml").exists() and (d / "out2" / "tuned.html").exists()
        assert handle.get_config() == served  # not --apply: the engine got its config back

        # --screen: the simulator ranks 40 configs, the best goes first on the engine, and the end report puts the
        # simulator's prediction beside the engine's measurement of it
        proc3 = tune(["--policy", "policy.yaml", "--screen", "40", "--trials", "2", "--trial-duration", "3s",
                      "--study-name", "screened",
                      "--engine-url", server.url, "--admin-token", "secret", "--out", "out3/tuned.yaml"], d)
        assert proc3.returncode in (0, 1) and "Traceback" not in proc3.stderr, proc3.stdout + proc3.stderr
        # the default config runs first; the screen's step times are the profile's rescaled to its steps
        assert re.search(r"screening 40 configs in the simulator \(decode steps x\d+\.\d\d, prefill steps x[\d.]+.*"
                         r"\(rescaled to \d+ engine steps\): the steps the engine just ran\)", proc3.stdout), proc3.stdout
        assert proc3.stdout.index("default config") < proc3.stdout.index("screening 40 configs"), proc3.stdout
        assert re.search(r"screened 24 configs in .*predicted feasible", proc3.stdout), proc3.stdout
        assert "simulator's prediction against the engine's measurement:" in proc3.stdout, proc3.stdout
        screened = proc3.stdout.split("simulator's prediction against the engine's measurement:")[1].splitlines()
        assert "goodput sim/real" in screened[1]
        row = re.match(r"\s*1 seqs=\d+ budget=\d+ chunk=\d+ block=\d+.* (\d+\.\d\d) / (\d+\.\d\d) +(\d+)ms / (\d+)ms",
                       screened[2])
        assert row, proc3.stdout
        ranking = yaml.safe_load(next((d / "out3" / "tuned-trials").glob("*/screen.json")).read_text())
        assert len(ranking) == 3 * 2 * 2 * 2  # the policy's whole space: fewer distinct configs than asked for
    finally:
        server.stop()
