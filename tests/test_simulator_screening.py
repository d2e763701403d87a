"""Screening and the search-method comparison on the simulator, on a small search space."""

from __future__ import annotations

import math

import pytest

from loadtest.summary import SLO
from policies import parse_policy
from tuner.search.screening import measured_steps, sample_configs, screen, sim_runner_like
from tuner.search.comparison import compare, grid_configs, space_configs
from tuner.simulation.simulator_trial import SimTrialRunner
from tuner.simulation.step_time_model import StepTimeModel

COEF = {"const": 0.030, "tokens": 4e-4, "seqs": 2e-3, "prefill_seqs": 1e-3, "context_tokens": 1e-6,
        "context_blocks": 1e-5, "prefill_square": 0.0, "swapped_blocks": 0.0}
POLICY = parse_policy({
    "slo": {"tbt_p99": "60ms"},
    "search_space": {"max_num_seqs": {"low": 1, "high": 4, "log": True},
                     "max_num_batched_tokens": {"choices": [16, 64, 128]},
                     "chunk_size": {"choices": [8, 32, 128]}},
    "constraints": ["chunk_size <= max_num_batched_tokens", "max_num_seqs <= max_num_batched_tokens"],
    "workload": {"name": "mixed", "length_scale": 0.125},
})


@pytest.fixture()
def runner() -> SimTrialRunner:
    model = StepTimeModel(coef=dict(COEF), ranges={}, gap_s=0.001)
    return SimTrialRunner(model, workload=POLICY.workload, rate=3.0, duration=8.0, warmup=1.0, slo=SLO(0.06))


def test_screen_ranks_feasible_configs_by_goodput(runner: SimTrialRunner) -> None:
    ranked = screen(POLICY, 12, runner, seed=1)
    assert len(ranked) == 12 and len({str(sorted(s.knobs.items())) for s in ranked}) == 12
    assert all(s.knobs["chunk_size"] <= s.knobs["max_num_batched_tokens"] for s in ranked)
    feasible = [s for s in ranked if s.outcome.feasible]
    assert feasible and ranked[: len(feasible)] == feasible  # feasible ones first
    assert [s.goodput for s in feasible] == sorted((s.goodput for s in feasible), reverse=True)
    assert all(s.outcome.simulated and (s.outcome.summary["tbt_p99"] <= 0.06) == s.outcome.feasible for s in ranked)
    # The landscape is not flat: the SLO or the load separates configs.
    assert len({round(s.goodput, 6) for s in ranked}) > 1 or len(feasible) < len(ranked)


def test_sampled_configs_cover_the_space_without_repeats() -> None:
    space = space_configs(POLICY)
    sampled = sample_configs(POLICY, 500, seed=0)  # more than there are: all of them, once
    assert sorted(map(str, sampled)) == sorted(map(str, space))


def test_search_comparison_curves_and_the_grid(runner: SimTrialRunner) -> None:
    grid = grid_configs(POLICY)
    assert [(g["max_num_seqs"], g["max_num_batched_tokens"]) for g in grid[:5]] == \
        [(1, 16), (1, 64), (1, 128), (2, 16), (2, 64)]  # auto_tune's nested loop order
    c = compare(POLICY, runner, trials=8, seeds=2, methods=("tpe", "tpe-random-start", "random", "grid"))
    for curves in c.curves.values():
        for curve in curves:
            assert all(b >= a for a, b in zip(curve, curve[1:]))  # best-so-far never drops
            assert curve[-1] <= c.optimum + 1e-12  # nothing beats the exhaustive optimum
    assert c.curves["grid"][0][-1] == pytest.approx(c.grid_best)
    s = c.summary()
    assert s["space_size"] >= len(space_configs(POLICY)) and s["methods"]["tpe"]["seeds"] == 2
    assert s["default_trial"] is not None  # counted as the first trial of each sampler's study, as tune does
    assert all(len(curve) == 8 for m in ("tpe", "tpe-random-start", "random") for curve in c.curves[m])
    assert all(t >= 1 for m in ("tpe", "random") for t in c.trials_to(m) if not math.isinf(t))


def test_screen_enqueues_the_best_for_the_study_to_confirm(runner: SimTrialRunner, tmp_path) -> None:
    import json

    import optuna

    from tuner.search.objective import suggest_knobs

    study = optuna.create_study(direction="maximize")
    ranked = screen(POLICY, 10, runner, seed=2, study=study, out_dir=tmp_path, top=2)
    waiting = study.get_trials(states=(optuna.trial.TrialState.WAITING,))
    assert [t.user_attrs["screen_rank"] for t in waiting] == [1, 2]
    assert waiting[0].user_attrs["screen_predicted"]["goodput_rps"] == ranked[0].goodput
    # The study's next trial asks for exactly the best screened config.
    assert suggest_knobs(study.ask(), POLICY) == ranked[0].knobs
    assert len(json.loads((tmp_path / "screen.json").read_text())) == 10


def test_screen_accepts_the_tuners_real_trial_runner(tmp_path) -> None:
    # `tune --screen N` passes its real TrialRunner: the screen runs on that runner's simulated twin (same
    # workload, rate, window, SLO, base config) with the shipped profile; nothing reaches the engine.
    import optuna

    from tuner.trials.engine_handle import EngineHandle
    from tuner.trials.trial_runner import TrialRunner

    real = TrialRunner(EngineHandle("http://127.0.0.1:9"), workload=POLICY.workload, rate=1.0, duration=6.0,
                       warmup=1.0, slo=SLO(tbt_p99=0.8), base_knobs={"max_num_seqs": 4, "block_size": 16})
    study = optuna.create_study(direction="maximize")
    ranked = screen(study=study, policy=POLICY, runner=real, n=4, out_dir=tmp_path)
    assert len(ranked) == 4 and all(s.outcome.simulated and s.outcome.rate == 1.0 for s in ranked)
    assert all(s.outcome.knobs["block_size"] == 16 for s in ranked)  # laid over the runner's base config
    assert len(study.get_trials(states=(optuna.trial.TrialState.WAITING,))) == 3


def test_the_screens_simulator_runs_at_the_speed_the_engine_just_measured(tmp_path) -> None:
    # `tune --screen` runs the default config first; its trial folder's step records rescale the profile, so a box
    # that got slower since calibration is screened at its present speed.
    import json

    import optuna

    from tuner.trials.engine_handle import EngineHandle
    from tuner.simulation.simulator import profile_path
    from tuner.trials.trial_runner import TrialRunner

    profile = StepTimeModel.load(profile_path(None))
    shapes = [(0, 0, 1, 40), (0, 0, 4, 300), (1, 24, 3, 200), (2, 64, 0, 64), (0, 0, 8, 900)]
    steps = []
    for i in range(60):
        p_seqs, p_tok, dec, ctx = shapes[i % len(shapes)]
        rec = {"num_prefill_seqs": p_seqs, "num_prefill_tokens": p_tok, "num_decode_tokens": dec,
               "context_tokens": ctx, "num_swapped_blocks": 0}
        steps.append({**rec, "total_s": 2.0 * profile.predict_record(rec, 16)})
    trial_dir = tmp_path / "trial-0000"
    trial_dir.mkdir()
    (trial_dir / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    study = optuna.create_study(direction="maximize")
    study.add_trial(optuna.trial.create_trial(value=1.0, user_attrs={
        "knobs": {"max_num_seqs": 8, "block_size": 16}, "trial_dir": str(trial_dir), "simulated": False}))
    study.add_trial(optuna.trial.create_trial(value=1.0, user_attrs={  # a simulated trial tells nothing
        "knobs": {"block_size": 16}, "trial_dir": str(tmp_path / "nowhere"), "simulated": True}))
    measured = measured_steps(study)
    assert len(measured) == 60 and all(s["block_size"] == 16 for s in measured)

    real = TrialRunner(EngineHandle("http://127.0.0.1:9"), workload=POLICY.workload, rate=1.0, duration=6.0,
                       warmup=1.0, slo=SLO(tbt_p99=0.8), base_knobs={"block_size": 16})
    twin, slower = sim_runner_like(real), sim_runner_like(real, measured=measured)
    assert "rescaled" not in twin.timer.meta
    assert slower.timer.meta["rescaled"] == {"scale": pytest.approx(2.0), "steps": 60}
    knobs = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "chunk_size": 32}
    fast_tbt, slow_tbt = twin.run(knobs).summary["tbt_p50"], slower.run(knobs).summary["tbt_p50"]
    assert 1.7 < slow_tbt / fast_tbt < 3.2  # 2x per step; a little more as slower steps batch more requests
