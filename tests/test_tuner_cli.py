"""`tune` bad input: an error naming the flag or field, exit code 2, no traceback, and no engine started."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tuner.commands.tune import main

REPO = Path(__file__).resolve().parent.parent
VLLM_POLICY = str(REPO / "policies" / "vllm-cpu.yaml")


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as info:
        main(argv)
    return int(info.value.code or 0), capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["--slo-p99-tbt", "fast"], "argument --slo-p99-tbt: not a duration: 'fast'"),
    (["--slo-p99-tbt", "-5ms"], "argument --slo-p99-tbt"),
    (["--slo-p99-ttft", "2 parsecs"], "argument --slo-p99-ttft: not a duration"),
    (["--trial-duration", "0s"], "argument --trial-duration: must be > 0"),
    (["--trials", "0"], "argument --trials: must be >= 1"),
    (["--trials", "many"], "argument --trials: must be an integer"),
    (["--rate", "-1"], "argument --rate: must be > 0"),
    (["--rate", "lots"], "argument --rate: must be requests/s"),
    (["--sampler", "cmaes"], "argument --sampler: invalid choice"),
    (["--objective", "latency"], "argument --objective: invalid choice"),
    (["--storage", "studies"], "argument --storage:"),
    (["--storage", "nosuchdb://x/y"], "argument --storage: cannot open"),
    (["--workload", "/nonexistent/trace.csv"], "argument --workload: no such file"),
    (["--policy", "/nonexistent/policy.yaml"], "--policy /nonexistent/policy.yaml: cannot read"),
    (["--apply"], "argument --apply: needs --engine-url"),
    (["--admin-token", "t"], "argument --admin-token: only with --engine-url"),
    (["--engine-url", "http://127.0.0.1:1"], "argument --admin-token: required with --engine-url"),
    (["--engine-url", "localhost:8000", "--admin-token", "t"], "argument --engine-url: must be an http(s) URL"),
    (["--model", "/nonexistent/model.gguf"], "argument --model: no such file"),
    (["--out", "tuned.json"], "argument --out: must be a .yaml file"),
    (["--engine", "vllm", "--apply"], "argument --apply: --engine vllm has no live knobs"),
    (["--engine", "vllm", "--screen", "8"], "argument --screen: the simulator's step-time model is calibrated on"),
    (["--engine", "vllm", "--engine-url", "http://127.0.0.1:1"], "argument --engine-url: tune --engine vllm starts"),
    (["--engine", "command"], "argument --engine-command: required with --engine command"),
    (["--engine", "command", "--engine-command", "server --listen 8000"], "put {port} in it"),
    (["--engine", "command", "--engine-command", "srv {port}", "--knob-flag", "max_seqs=--x"],
     "--knob-flag max_seqs=--x: unknown knob"),
    (["--engine", "command", "--engine-command", "srv {port}", "--knob-flag", "nonsense"],
     "argument --knob-flag: must look like KNOB=--flag"),
    (["--engine", "command", "--engine-command", "srv {port}", "--knob-flag", "chunk_size="],
     "argument --knob-flag: must look like KNOB=--flag"),
    (["--engine", "vllm", "--policy", VLLM_POLICY, "--vllm-python", "/nonexistent/bin/python"],
     "vLLM's python /nonexistent/bin/python does not exist: create its environment"),
    (["--engine", "vllm", "--policy", VLLM_POLICY, "--vllm-python", sys.executable], "vLLM is not installed for"),
    (["--engine", "vllm", "--vllm-python", sys.executable], "the policy searches block_size 8, 16: vLLM's CPU"),
    (["--check", "tuned.vllm.txt"], "argument --check: only with --engine vllm or --engine command"),
    (["--engine", "command", "--engine-command", "srv {port}", "--check", "/nonexistent/tuned.yaml"],
     "argument --check: no such file"),
])
def test_bad_flags_name_the_flag(argv: list[str], words: str, capsys: pytest.CaptureFixture[str],
                                 monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("SLOTUNE_ADMIN_TOKEN", raising=False)
    monkeypatch.chdir(tmp_path)
    code, err = run_main(argv, capsys)
    assert code == 2
    assert words in err
    assert "Traceback" not in err
    assert not (tmp_path / "tune-study.db").exists()  # nothing was created


def test_bad_policy_field_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    policy = tmp_path / "p.yaml"
    policy.write_text("slo: {tbt_p99: 50ms}\nsearch_space:\n  max_num_seqs: {low: 4, high: 2}\n")
    code, err = run_main(["--policy", str(policy)], capsys)
    assert code == 2 and "search_space.max_num_seqs.low: must be <= high" in err and str(policy) in err


def test_grid_sampler_needs_discrete_knobs(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    policy = tmp_path / "p.yaml"
    policy.write_text("slo: {tbt_p99: 50ms}\nsearch_space:\n  prefill_token_ratio: {low: 0.1, high: 1.0}\n")
    code, err = run_main(["--policy", str(policy), "--sampler", "grid"], capsys)
    assert code == 2 and "argument --sampler: grid: search_space.prefill_token_ratio" in err


def test_console_scripts_exit_2_without_traceback(tmp_path: Path) -> None:
    tune = shutil.which("tune") or str(Path(sys.executable).parent / "tune")
    for cmd in ([tune, "--slo-p99-tbt", "abc"], [sys.executable, "-m", "slotune.cli", "tune", "--trials", "-3"]):
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert "Traceback" not in proc.stderr and "error: argument" in proc.stderr
    helptext = subprocess.run([tune, "--help"], capture_output=True, text=True, timeout=60).stdout
    for flag in ("--slo-p99-tbt", "--slo-p99-ttft", "--workload", "--rate", "--trials", "--trial-duration",
                 "--sampler", "--objective", "--policy", "--storage", "--study-name", "--engine-url",
                 "--admin-token", "--model", "--out", "--apply"):
        assert flag in helptext


def test_a_trace_keeps_the_scales_a_policy_gives_it_and_drops_those_meant_for_mixed(tmp_path: Path) -> None:
    """`--workload TRACE` with a policy that names that trace and scales it: the policy's scales hold (they once
    silently fell back to x1, so a run meant at x1/8 replayed prompts of 1,300 tokens at x1); with the default policy,
    whose scales are for the mixed workload, the trace keeps its own lengths."""
    import yaml

    from tuner.commands.tune import build_parser, policy_from_args

    trace = tmp_path / "trace.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0,100,10\n1,200,20\n")
    policy = yaml.safe_load((REPO / "policies" / "default.yaml").read_text())
    policy["workload"] = {"name": str(trace), "length_scale": 0.0625, "max_context": 2048}
    (tmp_path / "policy.yaml").write_text(yaml.safe_dump(policy))
    args = build_parser().parse_args(["--workload", str(trace), "--policy", str(tmp_path / "policy.yaml")])
    w = policy_from_args(args).workload
    assert (w.name, w.length_scale, w.max_context, w.output_scale) == (str(trace), 0.0625, 2048, None)
    w = policy_from_args(build_parser().parse_args(["--workload", str(trace)])).workload
    assert (w.name, w.length_scale, w.output_scale) == (str(trace), 1.0, None)
    w = policy_from_args(build_parser().parse_args(["--workload", "mixed"])).workload
    assert (w.name, w.length_scale, w.output_scale) == ("mixed", 0.125, 0.25)


def test_the_transfer_check_reads_the_flags_tune_wrote(tmp_path: Path) -> None:
    """A tuned.vllm.txt as tune writes it (multi-line, with its notes) gives back the knobs it was written from."""
    from tuner.commands.engines import checked_knobs
    from tuner.output import write_vllm

    knobs = {"max_num_seqs": 6, "max_num_batched_tokens": 16, "chunk_size": 16, "block_size": 32,
             "enable_prefix_caching": False, "prefill_token_ratio": 0.5}
    write_vllm(tmp_path / "tuned.vllm.txt", knobs, "SmolLM2-135M-Instruct.Q4_1")
    text = (tmp_path / "tuned.vllm.txt").read_text()
    assert "measured on slotune's engine, not on vLLM" in text
    assert checked_knobs(str(tmp_path / "tuned.vllm.txt")) == {k: v for k, v in knobs.items()
                                                               if k != "prefill_token_ratio"}


def test_tune_at_a_server_that_is_not_slotunes_names_what_is_missing(tmp_path: Path) -> None:
    stub = subprocess.Popen([sys.executable, str(REPO / "tests" / "streaming_stub_server.py"), "--port", "0"],
                            stdout=subprocess.PIPE, text=True)
    try:
        port = int(stub.stdout.readline().split()[1])  # type: ignore[union-attr]
        proc = subprocess.run([sys.executable, "-m", "tuner.commands.tune", "--slo-p99-tbt", "50ms", "--engine-url",
                               f"http://127.0.0.1:{port}", "--admin-token", "t"], cwd=tmp_path, capture_output=True,
                              text=True, timeout=120)
    finally:
        stub.terminate()
        stub.wait(10)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"tune: error: the server at http://127.0.0.1:{port} is not slotune's engine (it has no /admin/config, so its "
        "knobs cannot change live): tune vLLM with --engine vllm, any other OpenAI-compatible server with --engine "
        "command --engine-command TEMPLATE (a server per configuration; docs/engines.md)")


def test_a_policy_with_values_vllms_cpu_build_refuses_is_stopped_before_any_start() -> None:
    """vLLM's CPU attention takes block sizes in multiples of 32 only (a refused one costs minutes of start-up)."""
    from policies import load_policy
    from tuner.commands.engines import check_vllm_values
    from tuner.commands.flags import CliError

    with pytest.raises(CliError, match=r"the policy searches block_size 8, 16: vLLM's CPU build takes only "
                                       r"multiples of 32 \(policies/vllm-cpu.yaml"):
        check_vllm_values(load_policy(None))
    check_vllm_values(load_policy(str(REPO / "policies" / "vllm-cpu.yaml")))


def test_vllm_in_bf16_on_a_cpu_without_bf16_instructions_gets_a_note_unless_a_dtype_is_given() -> None:
    from tuner.commands.engines import bf16_note

    avx2 = "flags\t\t: fpu sse avx avx2 fma"
    assert "--engine-arg=--dtype=float32" in (bf16_note([], avx2) or "")
    assert bf16_note(["--dtype=float32"], avx2) is None and bf16_note(["--dtype", "bfloat16"], avx2) is None
    assert bf16_note([], avx2 + " avx512f avx512_bf16") is None and bf16_note([], avx2 + " amx_bf16 amx_tile") is None


def test_a_long_measurement_shows_a_live_line_on_a_terminal_and_nothing_in_a_log() -> None:
    import io
    import time

    from tuner.commands.progress import LiveLine, say

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    progress = {"knobs": {"max_num_seqs": 6, "max_num_batched_tokens": 32, "kv_cache_bytes": 1}, "rate": 2.5,
                "elapsed_s": 21.4, "duration_s": 48.0, "warmup": 3.0, "ok": 17, "in_flight": 3}
    term, log = Terminal(), io.StringIO()
    LiveLine(["max_num_seqs", "max_num_batched_tokens"], deadline=time.monotonic() + 600, stream=term)(progress)
    LiveLine(["max_num_seqs"], stream=log)(progress)
    assert log.getvalue() == ""
    line = term.getvalue()
    assert line.startswith("\r\033[K  measuring seqs=6 budget=32 at 2.5 req/s: 21 of 48s of load (the first 3s "
                           "warm-up), 17 finished, 3 in flight; ")
    assert re.search(r"; (9m\d\d\.\ds|10m00\.0s) of the run's budget left$", line), line
    say("[1/4] #0 default config", stream=term)  # a result line replaces the live line, not follows it
    assert term.getvalue().endswith("\r\033[K[1/4] #0 default config\n")
    say("done", stream=log)
    assert log.getvalue() == "done\n"


def test_a_warning_during_tune_is_one_of_its_own_lines_where_it_happened() -> None:
    """The simulator's step shapes leaving its profile: a `tune: warning:` line among tune's, not Python's file name,
    line number and source line; outside tune, warnings show as before."""
    import io
    import warnings

    from tuner.commands.progress import say, warning_lines
    from tuner.simulation.profiles import profile_path
    from tuner.simulation.step_time_model import StepTimeModel

    model = StepTimeModel.load(profile_path(None))
    top = model.ranges["num_seqs"][1]
    err = io.StringIO()
    shown_before = warnings.showwarning
    with warning_lines(err):
        say("tune: screening ...", stream=err)
        model.check_range({"num_seqs": (1, top + 2)})
        say("tune: screened", stream=err)
    lines = err.getvalue().splitlines()
    assert lines[0] == "tune: screening ..." and lines[2] == "tune: screened", lines
    assert lines[1].startswith("tune: warning: step-time model: num_seqs 1..") and "leaves the profiled range" in lines[1]
    assert ".py" not in err.getvalue() and warnings.showwarning is shown_before


def test_a_long_measurement_writes_its_progress_where_the_dashboard_reads_it(tmp_path: Path) -> None:
    import io
    import json
    import time

    from slotune import result_files as files
    from tuner.commands.progress import LiveLine

    path = tmp_path / "trials" / files.PROGRESS
    line = LiveLine(["max_num_seqs"], deadline=time.monotonic() + 600, stream=io.StringIO(), path=path)
    line({"knobs": {"max_num_seqs": 6}, "rate": 2.5, "elapsed_s": 21.4, "duration_s": 48.0, "ok": 17})
    written = json.loads(path.read_text())
    assert written["text"].startswith("measuring seqs=6 at 2.5 req/s: 21 of 48s of load")
    assert 590 < written["budget_left_s"] <= 600 and abs(written["updated"] - time.time()) < 5
    assert written["progress"]["ok"] == 17 and not list(path.parent.glob("*.partial"))
    line({"knobs": {"max_num_seqs": 6}, "rate": 2.5, "elapsed_s": 22.0, "duration_s": 48.0, "ok": 18})
    assert json.loads(path.read_text())["progress"]["ok"] == 17  # at most once a second
