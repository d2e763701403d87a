"""The whole capacity flow of `tune` (floor, the default config's rate search, the screen, the searches of the best
configs, the paired verdict, tuned.yaml) on the simulator standing in for the engine: deterministic, in seconds."""

from __future__ import annotations

import contextlib
import io
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from slotune.slo import SLO
from tests import trace_files
from policies import load_policy
from tuner.commands.capacity_run import CapacityRun
from tuner.commands.nearest_run import none_shown
from tuner.commands.tune import build_parser
from tuner.commands.session import TuneSession
from tuner.simulation.profiles import limits_of, profile_path
from tuner.simulation.simulator_trial import SimTrialRunner
from tuner.simulation.step_time_model import StepTimeModel
from tuner.search.study import enqueue_default, open_storage, open_study


def run_on_the_simulator(tmp_path: Path, tbt: float, searches_budget: float | None = None,
                         apply_to: str | None = None, ttft: float = 2.0) -> tuple[int, str, str]:
    """One simulated `tune` (3 trials, a 6-config screen): its exit code, stdout and stderr."""
    policy = load_policy().replace(trials=3)
    if searches_budget is not None:  # a time budget spent before the searches (less than one verdict round)
        policy = policy.replace(time_budget=searches_budget)
    policy = policy.replace(slo=policy.slo.__class__(tbt_p99=tbt, ttft_p99=ttft))
    args = build_parser().parse_args(["--out", str(tmp_path / "out" / "tuned.yaml"), "--screen", "6", "--seed", "0"]
                                     + (["--apply"] if apply_to else []))
    storage = open_storage(f"sqlite:///{tmp_path}/study.db")
    session = TuneSession(args, policy, storage, None)
    if apply_to is not None:  # a real engine the tuned config is applied to (the simulator measured it)
        from tuner.trials.engine_handle import EngineHandle
        session.handle = EngineHandle(apply_to, "secret")
    model = StepTimeModel.load(profile_path(None))
    sim = SimTrialRunner(model, limits=limits_of(model), workload=policy.workload, duration=policy.trial_duration,
                         warmup=policy.warmup, slo=SLO(tbt, ttft), seed=policy.seed)
    study = open_study(storage, session.study_name, policy)
    enqueue_default(study)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = CapacityRun(session.context(), sim, study, "sim").run()
    return rc, out.getvalue(), err.getvalue()


@dataclass(frozen=True)
class AppliedFlow:
    """The whole flow at the README's 50 ms, with ``--apply`` to a real engine: what it said and wrote, and the
    engine's config after it."""

    rc: int
    out: str
    err: str
    folder: Path
    url: str
    engine_config: dict[str, Any]


@pytest.fixture(scope="module")
def applied_flow(tmp_path_factory: pytest.TempPathFactory) -> AppliedFlow:
    """One simulated `tune --apply` for the flow's tests (the flow takes most of a test's time)."""
    import httpx

    from tests.server_helpers import InProcessServer

    server = InProcessServer(admin_token="secret")
    try:
        folder = tmp_path_factory.mktemp("flow")
        rc, out, err = run_on_the_simulator(folder, 0.050, apply_to=server.url)
        config = httpx.get(server.url + "/admin/config", headers={"authorization": "Bearer secret"}).json()["config"]
        return AppliedFlow(rc, out, err, folder, server.url, config)
    finally:
        server.stop()


def long_run_attainment(knobs: dict, rate: float, tmp_path: Path) -> float:
    """The truth the claims are about: the config's attainment over 20 simulated minutes at ``rate`` (the engine
    here is the simulator, so its long run is the config's long-run share)."""
    policy = load_policy()
    model = StepTimeModel.load(profile_path(None))
    sim = SimTrialRunner(model, limits=limits_of(model), workload=policy.workload, duration=1200.0,
                         warmup=policy.warmup, slo=SLO(0.05, 2.0), seed=4321)
    o = sim.run(knobs, tmp_path / f"truth-{len(list(tmp_path.glob('truth-*')))}", rate=rate, duration=1200.0)
    return float(o.summary["attainment"])


def test_the_capacity_flow_on_the_simulator_claims_only_what_long_runs_confirm(
        applied_flow: AppliedFlow, tmp_path: Path) -> None:
    rc, out, flow = applied_flow.rc, applied_flow.out, applied_flow.folder
    assert rc == 0, out + applied_flow.err
    assert "floor: batch-1 p99 TBT" in out and "screened" in out
    # the prompts meet the 2 s TTFT target one at a time: no target is named as binding, the search goes on
    assert "binds" not in out + applied_flow.err
    # the screen's design is the run's, recorded
    assert "screening 6 configs of a Latin hypercube over the 1200 combinations (design seed 0, kept in the study)" \
        in out, out
    # a search's line: where it read the knee, and apart from it what it showed at its level
    assert re.search(r"\[1/3\] #0 default config \| searched [\d.]+ req/s \([\d.]+-[\d.?]+\), shown at 95%: served "
                     r"(no rate|[\d.]+ req/s), missed (no rate|[\d.]+ req/s)", out), out
    # the default's search is bisected as closely as a candidate's: to 15 %, or until its probes run out
    low, high = map(float, re.search(r"#0 default config \| searched [\d.]+ req/s \(([\d.]+)-([\d.]+)\)",
                                     out).groups())  # type: ignore[union-attr]
    assert high / low <= 1.15 + 1e-6 or len(re.findall(r"^    [\d.]+ req/s:", out.split("[1/3]")[0], re.M)) == 5, out
    doc = yaml.safe_load((flow / "out" / "tuned.yaml").read_text())
    assert doc["evidence"]["design_seed"] == 0
    verdict = doc["evidence"]["verdict"]
    claims = [(c["knobs"], p["rate"], p["verdict"]) for c in [verdict["default"]] + verdict["candidates"]
              for p in c["pools"] if p["verdict"] != "undecided"]
    assert claims, verdict  # the verdict showed something
    for knobs, rate, shown in claims:  # each one true of the config's long run
        truth = long_run_attainment(knobs, rate, tmp_path)
        assert (truth >= 0.9) == (shown == "met"), (knobs, rate, shown, truth)
    last = out.strip().splitlines()[-1]
    assert doc["evidence"]["verdict_line"] == last and "p99 TBT <= 50ms and p99 TTFT <= 2.00s" in last
    winner = verdict["winner"]
    if winner is not None:
        cand = next(c for c in verdict["candidates"] if c["outcome"] == "better")
        served = cand["shown"]["bracket"][0]
        assert last.startswith(f"tuned serves {served:.3g} req/s") and doc["evidence"]["held"]
        ratio = doc["tuned"]["ratio_to_default"]
        assert ratio["low"] is not None and ratio["low"] >= 1.0  # only from shown bounds
        # the headline: paired attainment on the same arrivals at the highest rate shown served with the default
        # measured there (a winner's climbs above it run alone)
        beside = {p["rate"] for p in verdict["default"]["pools"]}
        paired = max(p["rate"] for p in cand["pools"] if p["verdict"] == "met" and p["rate"] in beside)
        assert f"at {paired:.3g} req/s on the same arrivals it attains" in last
        climbs = [p["rate"] for p in cand["pools"] if p["climb"] and p["verdict"] == "met"]
        assert served == max([paired, *climbs])
    else:
        assert last.startswith("no config was shown to serve more than the default") and not doc["evidence"]["held"]
    for side in ("tuned", "default"):
        cap = doc[side]["capacity_req_per_s"]
        assert {"bracket", "level", "contradictions"} <= set(cap) and doc[side]["rounds"] >= 1
        assert all(p["requests"] >= p["attaining"] >= 0 and p["blocks"] >= 1 for p in doc[side]["pools"])
    # every config the engine searched beside the simulator's twin of its search, the default's included
    rows = doc["evidence"]["confirmed"]
    assert {row["role"] for row in rows} == {"default", "screened"} and len(rows) == 3
    assert all(row["predicted"] is not None for row in rows if row["role"] == "screened")
    error = doc["evidence"]["simulator_error"]
    assert error["configs"] == 3 and error["median_capacity_error"] is not None
    assert re.search(r"the simulator against the engine over 3 configs: capacity error median \d+% \(largest \d+%\), "
                     r"\d of 3 brackets meet, rank correlation (-?[\d.]+|-)", out), out
    assert "&id" not in (flow / "out" / "tuned.yaml").read_text()
    assert (flow / "out" / "tuned.html").exists()


def test_one_candidate_is_searched_even_when_the_default_s_search_spent_the_searches_budget(tmp_path: Path) -> None:
    """A study of the default config alone cannot answer the question: the first screened candidate is searched
    whatever the clock says; the budget stops the searches after it."""
    rc, out, _ = run_on_the_simulator(tmp_path, 0.050, searches_budget=0.001)
    assert rc == 0, out
    assert re.search(r"\[2/3\] #1 seqs=", out) and "[3/3]" not in out, out
    assert "no further configs searched" in out and "candidate 1" in out


def test_the_verdict_sizes_its_windows_to_show_the_share_and_splits_its_error_rate_over_its_rates() -> None:
    """A candidate's sustained window holds a quarter more blocks than showing the target share takes when every
    block attains, at its pool's level; the default's beside it is half as long, at its own ceiling the policy's
    window. Each side's half of the 5 % is spread over the rates it may be judged at."""
    from tuner.measure.verdict import RATES_PER_CANDIDATE
    from tuner.measure.verdict_plan import VerdictPlan

    policy = load_policy()
    plan = VerdictPlan.of(policy)
    candidate = plan.spec_for(False)
    assert candidate.level == 1 - 0.05 / RATES_PER_CANDIDATE and candidate.block_s == policy.measurement.block
    blocks = candidate.blocks_to_show()
    assert plan.window_for(False) == math.ceil(1.25 * blocks) * policy.measurement.block == candidate.sustained_s
    assert plan.window_for(True) == plan.window_for(False) / 2 and plan.window_for(True, beside=False) == 60.0
    assert plan.spec_for(True).level == 1 - 0.05 / (RATES_PER_CANDIDATE + 1)
    # two full rounds fit the policy's verdict budget, and the searches leave it that
    assert 2 * plan.full_round_s() <= policy.verdict.budget
    from tuner.measure.dependence import attainment_interval
    assert attainment_interval([(1, 1)] * blocks, candidate.level, 0.9).low >= 0.9
    assert attainment_interval([(1, 1)] * (blocks - 1), candidate.level, 0.9).low < 0.9


def test_an_slo_below_the_simulated_floor_stops_before_searching(tmp_path: Path) -> None:
    rc, _, err = run_on_the_simulator(tmp_path, 0.001)
    assert rc == 1 and "below this machine's floor" in err
    assert not (tmp_path / "out" / "tuned.yaml").exists()


def test_a_ttft_target_the_prompts_miss_even_one_at_a_time_stops_before_searching_naming_the_binding_target(
        tmp_path: Path) -> None:
    """The workload's own prompts, one at a time on an idle engine, take longer than the TTFT target to their first
    token: no config serves any rate. tune says so at once, which target binds, and what this machine reaches."""
    rc, out, err = run_on_the_simulator(tmp_path, 1.0, ttft=0.001)
    assert rc == 1, out + err
    assert re.search(r"one request at a time, \d+% \([\d.]+-[\d.]+\) of the workload's requests attain the SLO",
                     err), err
    assert "TTFT <= 1ms binds" in err and "p99 TBT <= 1s binds" not in err
    assert re.search(r"the targets this machine reaches for 90% of the requests one at a time: TTFT [\d.]+s", err)
    assert not (tmp_path / "out" / "tuned.yaml").exists()
    floor = yaml.safe_load(next((tmp_path / "out" / "tuned-trials").glob("*/floor/floor.json")).read_text())
    assert floor["one_at_a_time"]["binds"] == ["ttft"] and floor["one_at_a_time"]["attainment"]["high"] < 0.9
    # and what it serves at the nearest targets it meets: the TTFT target raised to what the requests reached, the
    # default config's capacity searched there
    found = re.search(r"the nearest targets this machine meets \(90% of the requests reached them one request at a "
                      r"time\): p99 TBT <= 1.00s and p99 TTFT <= (\d+)ms; there the default config serves: searched ([\d.]+) "
                      r"req/s", err)
    assert found, err
    nearest = yaml.safe_load(next((tmp_path / "out" / "tuned-trials").glob("*/nearest.json")).read_text())
    assert nearest["slo"]["ttft_p99"] == int(found.group(1)) / 1000 > floor["one_at_a_time"]["ttft"]["value"]
    assert nearest["slo"]["tbt_p99"] == 1.0 and nearest["asked"]["ttft_p99"] == 0.001
    assert math.isclose(nearest["capacity"]["req_per_s"], float(found.group(2)), rel_tol=0.01) and nearest["capacity"]["req_per_s"] > 0
    # (targets that one request at a time meets let the search go on: the applied flow's test says so)


def test_a_low_rate_is_measured_by_its_requests_and_can_be_shown_served(tmp_path: Path) -> None:
    """Below 1 req/s a block of three requests spans more than the policy's block seconds: a measurement's cap and a
    verdict window grow to hold as many blocks as they do at higher rates, so that 0.3 req/s can be decided."""
    from tuner.measure.capacity import measurement_spec
    from tuner.measure.measurement import measure
    from tuner.measure.verdict_plan import VerdictPlan

    policy = load_policy()
    spec = measurement_spec(policy)
    assert spec.segments_at(3.0) == spec.segments_at(1.0) == spec.max_segments
    blocks = spec.max_segments * spec.window_s / spec.block_s
    assert spec.segments_at(0.3) * spec.window_s * 0.3 / spec.block_at(0.3) >= blocks
    plan = VerdictPlan.of(policy)
    candidate = plan.spec_for(False, rate=0.3)
    assert candidate.sustained_s * 0.3 / candidate.block_at(0.3) >= 1.25 * candidate.blocks_to_show()
    assert plan.full_round_s(0.3) > 2 * plan.full_round_s()  # the time the verdict keeps grows with its windows
    model = StepTimeModel.load(profile_path(None))
    sim = SimTrialRunner(model, limits=limits_of(model), workload=policy.workload, duration=policy.trial_duration,
                         warmup=policy.warmup, slo=SLO(1.0, 10.0), seed=7)
    m = measure(sim, {}, 0.3, tmp_path / "low", 7, candidate)
    assert m.verdict == "met", m.describe()
    assert m.figures is not None and len(m.figures.blocks) >= candidate.blocks_to_show()


def test_when_nothing_was_shown_served_the_last_lines_tell_undecided_from_missed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import optuna

    from tuner.search.samplers import ROLE_DEFAULT

    policy = load_policy()
    args = build_parser().parse_args(["--out", str(tmp_path / "tuned.yaml")])
    storage = open_storage(f"sqlite:///{tmp_path}/study.db")
    session = TuneSession(args, policy, storage, None)
    study = open_study(storage, session.study_name, policy)
    model = StepTimeModel.load(profile_path(None))
    sim = SimTrialRunner(model, limits=limits_of(model), workload=policy.workload, duration=policy.trial_duration,
                         warmup=policy.warmup, slo=SLO(0.05, 2.0))
    run = CapacityRun(session.context(), sim, study, "sim")

    def add(role: str, probes: list[tuple[float, str]], stopped: str) -> None:
        cap = {"bracket": [0.0, min(r for r, _ in probes)], "stopped": stopped,
               "probes": [{"rate": r, "verdict": v, "describe": ""} for r, v in probes]}
        study.add_trial(optuna.trial.create_trial(value=0.0, user_attrs={
            "role": role, "knobs": {"max_num_seqs": 64}, "capacity": cap, "feasible": False}))

    add(ROLE_DEFAULT, [(1.0, "missed"), (0.5, "undecided")], "undecided at 0.5 req/s (attainment 93%)")
    assert run.finish() == 1
    err = capsys.readouterr().err
    assert "no candidate config read served at any rate searched" in err
    assert "#0 default config: missed at 1 req/s, undecided at 0.5 req/s" in err
    assert "undecided is not missed" in err and "longer measurement cap" in err
    assert not (tmp_path / "tuned.yaml").exists() and (tmp_path / "tuned.html").exists()

    study2 = open_study(storage, "all-missed", policy)
    run.study = study2
    study = study2
    # every rate missed, measured: the lowest rate's requests say which target binds and what they reached
    from tuner.measure.capacity import measurement_spec, probe_record
    from tuner.measure.measurement import measure

    tight = SimTrialRunner(model, limits=limits_of(model), workload=policy.workload, duration=policy.trial_duration,
                           warmup=policy.warmup, slo=SLO(0.05, 0.02))
    probes = [probe_record(measure(tight, {}, r, tmp_path / f"r{r}", 3, measurement_spec(policy))) for r in (1.0, 0.5)]
    assert [p["verdict"] for p in probes] == ["missed", "missed"]
    study.add_trial(optuna.trial.create_trial(value=0.0, user_attrs={
        "role": ROLE_DEFAULT, "knobs": {"max_num_seqs": 64}, "feasible": False,
        "capacity": {"bracket": [0.0, 0.5], "stopped": "not served at 0.5 req/s", "probes": probes}}))
    assert run.finish() == 1
    err = capsys.readouterr().err
    assert re.search(r"  at 0.5 req/s: TTFT <= 20ms binds \(\d+% \([\d.]+-[\d.]+\) within it\); 90% of the requests "
                     r"reached TTFT [\d.]+s \([\d.?]+-[\d.?]+\), p99 TBT [\d.]+ms", err), err
    assert "every rate probed was missed: the targets each config reached at its lowest rate" in err
    # the run's own targets were those: the config nearest to them is searched at the nearest targets it meets
    tight_policy = policy.replace(slo=policy.slo.__class__(tbt_p99=0.05, ttft_p99=0.02))
    tight_session = TuneSession(build_parser().parse_args(["--out", str(tmp_path / "tight" / "tuned.yaml")]),
                                tight_policy, storage, None)
    assert none_shown(tight_session.context(), tight, study) == 1
    err = capsys.readouterr().err
    found = re.search(r"the nearest targets this machine meets \(90% of the requests reached them at 0.5 req/s\): "
                      r"p99 TBT <= 50ms and p99 TTFT <= [\d.]+m?s; there the default config serves: searched "
                      r"([\d.]+) req/s", err)
    assert found and float(found.group(1)) >= 0.5, err


# the real conversation trace: the full one where present, else the excerpt the repository ships
CONV = trace_files.CONV.path


def test_on_a_trace_every_arrival_draw_replays_its_own_segment_the_same_for_every_config(tmp_path: Path) -> None:
    """The floor and every measurement pool windows of fresh draws: on a trace each draw is another stretch of it
    (the trace's start alone holds one request in the floor's first window at 1 req/s), and within a draw every
    config replays the same stretch (common random numbers)."""
    from policies import WorkloadSpec
    from tuner.measure.floor import measure_floor
    from tuner.measure.measurement import MeasurementSpec

    workload = WorkloadSpec(name=str(CONV), length_scale=0.125, max_context=2048)
    model = StepTimeModel.load(profile_path(None))
    sim = SimTrialRunner(model, limits=limits_of(model), workload=workload, duration=15.0, warmup=3.0,
                         slo=SLO(0.05, 2.0), seed=0)
    floor, outcomes = measure_floor(sim, tmp_path / "floor", spec=MeasurementSpec(min_gaps=400, max_segments=3))
    assert floor.reason is None and floor.tbt_p99_batch1.value is not None, floor.describe()
    offsets = [o.summary["trace_offset_s"] for o in outcomes]
    assert len(set(offsets)) > 1 and all(o.summary["requests"] > 0 for o in outcomes)
    a = sim.run({"max_num_seqs": 1}, tmp_path / "a", rate=1.0, seed=5)
    b = sim.run({"max_num_seqs": 8}, tmp_path / "b", rate=1.0, seed=5)
    c = sim.run({"max_num_seqs": 8}, tmp_path / "c", rate=1.0, seed=6)
    assert a.summary["trace_offset_s"] == b.summary["trace_offset_s"] != c.summary["trace_offset_s"]


def test_capacity_brackets_meet_when_they_overlap_or_touch() -> None:
    from tuner.search.confirmation import brackets_meet

    assert brackets_meet([4.43, 4.9], [4.9, 5.42])  # a step apart: the capacity may be 4.9 in both
    assert brackets_meet([4.0, None], [6.0, 6.64])  # never missed up to 4.0: it may serve 6
    assert not brackets_meet([4.43, 4.9], [5.42, 6.0])
    assert not brackets_meet([0.0, 1.0], [2.0, 2.2])  # served nowhere down to 1 req/s against 2 req/s


def test_window_agreement_on_known_pairs() -> None:
    from tuner.search.confirmation import window_agreement

    pairs = [{"attainment": [0.96, 1.0]}, {"attainment": [0.95, 0.93]}, {"attainment": [0.5, 0.95]},
             {"attainment": [None, 0.9]}]
    a = window_agreement(pairs)
    assert a["windows"] == 3 and a["median_abs_attainment_diff"] == pytest.approx(0.04)
    assert a["largest_attainment_diff"] == pytest.approx(0.45) and a["same_side_of_90"] == 2
    assert window_agreement([]) == {"windows": 0}


def test_the_bracket_of_a_searchs_readings() -> None:
    """What the searches' readings leave: the highest rate read served below every one read missed, the lowest read
    missed above every one read served; a contradiction widens the bracket, no rate is invented."""
    from tuner.search.confirmation import bracket_of, reading

    assert bracket_of([(8.0, "missed"), (5.33, "missed"), (3.56, "met"), (4.82, "met")]) == [4.82, 5.33]
    assert bracket_of([(2.0, "met"), (4.0, "met")]) == [4.0, None]
    assert bracket_of([(1.0, "missed"), (0.5, "missed")]) == [0.0, 0.5]
    assert bracket_of([(4.0, "met"), (3.0, "missed")]) == [0.0, None]  # 3 missed below 4 met: both ends open
    assert reading("undecided", 0.93) == "met" and reading("undecided", 0.87) == "missed"
    assert reading("met", 0.91) == "met" and reading("missed", 0.92) == "missed"


def test_apply_leaves_the_tuned_config_in_the_engine_with_the_capacity_objective(applied_flow: AppliedFlow) -> None:
    assert applied_flow.rc == 0, applied_flow.out + applied_flow.err
    tuned = yaml.safe_load((applied_flow.folder / "out" / "tuned.yaml").read_text())["knobs"]
    assert {k: applied_flow.engine_config[k] for k in tuned} == tuned
    assert f"tune: applied to {applied_flow.url}: " in applied_flow.out
