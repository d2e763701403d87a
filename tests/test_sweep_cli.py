"""`slotune sweep`: flag errors name the flag before anything starts; a real two-point sweep against a running
engine writes the sweep folder the dashboard reads, and puts the engine's config back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from dashboards.figures import sweep_curves_figure
from dashboards.results import load_sweep, load_trial, read_request_records, read_steps
from tests.server_helpers import REPO, SubprocessServer
from tuner.commands.sweep import main

TOKEN = "sweep-test-token"


@pytest.mark.parametrize("args, message", [
    (["--knob", "max_num_seqs", "--values", "4,x"], "--values: max_num_seqs takes int values, got 'x'"),
    (["--knob", "max_num_seqs", "--values", "0,4"], "--values: must be >= 1"),
    (["--knob", "max_num_seqs", "--values", "4,4"], "--values: a value is repeated"),
    (["--knob", "max_num_seqs", "--values", "4", "--max-num-seqs", "8"], "--max-num-seqs: max_num_seqs is the knob"),
    (["--knob", "chunk_size", "--values", "16", "--block-size", "big"], "--block-size: block_size takes int"),
    (["--knob", "max_num_seqs", "--values", "4", "--engine-url", "http://127.0.0.1:1"], "--admin-token: required"),
    (["--knob", "max_num_seqs", "--values", "4", "--workload", "missing.csv"], "--workload: no such file"),
    (["--knob", "max_num_seqs", "--values", "4", "--duration", "0s"], "--duration: must be > 0"),
])
def test_bad_flags_exit_2_naming_the_flag(args: list[str], message: str, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    monkeypatch.delenv("SLOTUNE_ADMIN_TOKEN", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--rate", "1", "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing started, nothing written


@pytest.mark.slow  # about 30 s on a real engine; the simulated sweep below runs the same command in the default suite
def test_a_two_point_sweep_on_a_real_engine(tmp_path: Path) -> None:
    server = SubprocessServer(args=["--admin-token", TOKEN, "--max-num-seqs", "6"])
    headers = {"authorization": f"Bearer {TOKEN}"}
    try:
        before = httpx.get(server.url + "/admin/config", headers=headers).json()["config"]
        out = tmp_path / "sweep-seqs"
        proc = subprocess.run(
            [sys.executable, "-m", "slotune.cli", "sweep", "--knob", "max_num_seqs", "--values", "2,8",
             "--max-num-batched-tokens", "64", "--rate", "2", "--duration", "3s", "--warmup", "0.5s",
             "--engine-url", server.url, "--admin-token", TOKEN, "--out", str(out)],
            cwd=REPO, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        after = httpx.get(server.url + "/admin/config", headers=headers).json()["config"]
    finally:
        server.stop()
    assert after == before  # the engine's own config is back

    doc = json.loads((out / "sweep.json").read_text())
    assert doc["format"] == "slotune-sweep/1" and doc["knob"] == "max_num_seqs" and doc["values"] == [2, 8]
    assert doc["fixed"] == {"max_num_batched_tokens": 64} and doc["simulated"] is False
    assert doc["rate"] == 2.0 and doc["slo"]["tbt_p99"] == 0.05
    for point, value in zip(doc["points"], [2, 8]):
        assert point["value"] == value and point["dir"] == f"max_num_seqs={value}"
        assert point["summary"]["requests"] >= 3 and point["summary"]["completed"] >= 1
        assert point["step_stats"]["steps"] > 0
        trial = load_trial(out / point["dir"])
        assert trial.knobs["max_num_seqs"] == value and trial.knobs["max_num_batched_tokens"] == 64
        assert len(read_request_records(out / point["dir"])) >= point["summary"]["requests"]
        assert len(read_steps(out / point["dir"])) == point["step_stats"]["steps"]
        # the knob was really applied: the engine never ran more sequences than the point allowed
        assert max(s["num_running"] for s in read_steps(out / point["dir"])) <= value

    fig = sweep_curves_figure(load_sweep(out))  # what the dashboard's Curves page draws
    assert list(next(t for t in fig.data if t.name == "output_tokens_per_s").x) == [2, 8]


def test_a_simulated_sweep_is_marked_simulated_and_drawn_so(tmp_path: Path) -> None:
    from tuner.simulation.step_time_model import StepTimeModel

    profile = tmp_path / "profile.json"  # a step-time model: 30 ms + 0.4 ms/token + 2 ms/sequence
    StepTimeModel(coef={"const": 0.030, "tokens": 4e-4, "seqs": 2e-3, "prefill_seqs": 1e-3, "context_tokens": 1e-6,
                        "context_blocks": 1e-5, "prefill_square": 0.0, "swapped_blocks": 0.0},
                  ranges={}, gap_s=0.001).save(profile)
    out = tmp_path / "sweep-sim"
    assert main(["--simulate", "--profile", str(profile), "--knob", "max_num_seqs", "--values", "1,4,16",
                 "--rate", "4", "--duration", "10s", "--warmup", "1s", "--out", str(out)]) == 0
    sweep = load_sweep(out)
    assert sweep.simulated and [p.value for p in sweep.points] == [1, 4, 16]
    for point in sweep.points:
        assert point.dir is not None
        trial = load_trial(out / point.dir)
        assert trial.simulated and trial.knobs["max_num_seqs"] == point.value
        running = [s["num_running"] for s in read_steps(out / point.dir)]
        assert max(running) <= point.value
    assert max(s["num_running"] for s in read_steps(out / "max_num_seqs=16")) > 1  # the knob mattered
    assert "SIMULATED" in sweep_curves_figure(sweep).layout.title.text


def test_simulate_rejects_an_engine_url_and_profile_needs_simulate(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    for extra, message in ((["--simulate", "--engine-url", "http://127.0.0.1:1", "--admin-token", "t"],
                            "--simulate: the simulator replaces the engine"),
                           (["--profile", "p.json"], "--profile: only with --simulate"),
                           (["--simulate", "--profile", str(tmp_path / "none.json")], "--profile: cannot read")):
        with pytest.raises(SystemExit) as exit_info:
            main(["--knob", "max_num_seqs", "--values", "2", "--rate", "1", "--out", str(tmp_path / "o"), *extra])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
