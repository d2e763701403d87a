"""`tune --engine vllm` on a real vLLM (its CPU build, in its own environment; docs/engines.md says how to create
it): the server per configuration, its defaults read back, its metrics read through the one reader, a config it
rejects infeasible in its own words, a flag it does not know refused before anything starts, nothing left running.

Marked slow (each vLLM start takes minutes in its compiled mode on a small CPU); skipped where vLLM's environment is
missing: python -m pytest -m slow tests/test_vllm_engine.py
"""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from policies import WorkloadSpec, load_policy
from slotune.slo import SLO
from tests.server_helpers import run_tune
from tuner.commands.engines import SERVED_NAME, default_model_dir, default_vllm_python
from tuner.trials.engine_kinds import vllm_kind
from tuner.trials.restarted_engine import RestartedEngine
from tuner.trials.trial_runner import TrialRunner

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not Path(default_vllm_python()).exists(),
                                 reason="no vLLM environment (docs/engines.md: vLLM's environment)")]


def vllm_processes() -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline", "name"]):
        words = " ".join(p.info["cmdline"] or []) + " " + (p.info["name"] or "")
        if ("vllm.entrypoints" in words or "VLLM::" in words) and p.status() != psutil.STATUS_ZOMBIE:
            out.append(p)
    return out


def dtype_args() -> list[str]:
    """vLLM's CPU build serves in bf16, which a CPU without bf16 instructions (no AVX512-BF16 or AMX) emulates about
    four times slower than float32: the test's light load would then overload it and show nothing of the path."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return [] if ("avx512_bf16" in flags or "amx_bf16" in flags) else ["--dtype", "float32"]


def test_vllm_per_configuration_with_its_defaults_read_back_and_a_rejected_config(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM's CPU build takes ~90 % of the machine's memory for its KV cache by default (docs/engines.md, "Memory")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    kind = vllm_kind(default_vllm_python(), default_model_dir(), SERVED_NAME, dtype_args())
    with RestartedEngine(kind, tmp_path / "servers") as vllm:
        defaults = vllm.defaults()
        # vLLM's own defaults on a CPU, as it resolved them (not assumed)
        assert defaults["max_num_seqs"] == 128 and defaults["max_num_batched_tokens"] == 2048
        assert defaults["block_size"] == 128
        runner = TrialRunner(vllm, workload=WorkloadSpec(name="mixed", length_scale=0.125, output_scale=0.25),
                             duration=10.0, warmup=2.0, slo=SLO(tbt_p99=1.0, ttft_p99=10.0), busy_cores=None,
                             server_warmup=load_policy().server_warmup)
        assert runner.base_knobs == defaults
        o = runner.run({}, tmp_path / "default", rate=0.5)
        assert o.summary.get("completed"), o.reason
        assert vllm.starts[0].warm_s >= load_policy().server_warmup  # the fresh server was warmed, not measured
        assert (Path(vllm.starts[0].log).with_suffix(".warmup") / "records.parquet").exists()
        assert o.summary["engine_itl_p99"] is not None  # vLLM's own histogram, read through the one reader
        assert o.summary["usage_checked"] == o.summary["completed"] and o.summary["usage_mismatches"] == 0
        assert len(vllm.starts) == 1  # the default config: no restart
        # a config vLLM refuses: infeasible with vLLM's own words, and the next start is clean
        bad = runner.run({"max_num_seqs": 64, "max_num_batched_tokens": 32}, tmp_path / "bad", rate=0.5)
        assert not bad.feasible and bad.reason is not None
        assert bad.reason.startswith("rejected by the engine at start-up"), bad.reason
        assert "max_num_batched_tokens" in bad.reason or "max_num_seqs" in bad.reason, bad.reason
    assert vllm_processes() == []


def test_a_flag_the_installed_vllm_does_not_know_is_refused_before_anything_starts(tmp_path: Path) -> None:
    policy = str(Path(__file__).resolve().parent.parent / "policies" / "vllm-cpu.yaml")
    proc = run_tune(["--slo-p99-tbt", "50ms", "--engine", "vllm", "--policy", policy, "--engine-arg=--no-such-flag",
                     "--out", "out/tuned.yaml"], tmp_path, timeout=600)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "the installed vLLM does not know --no-such-flag" in proc.stderr
    assert not (tmp_path / "out").exists() and vllm_processes() == []

