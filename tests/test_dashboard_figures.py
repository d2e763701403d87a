"""The dashboard's analysis and figure functions on hand-made data with known answers (no browser)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dashboards.analysis import Knee, find_knee, pareto_front, slo_crossing
from dashboards.engine_client import HistogramBuckets, parse_histogram
from dashboards.figures import (history_figure, importance_figure, itl_histogram_figure, pareto_figure,
                                request_distributions_figure, step_timeline_figure, sweep_curves_figure, sweep_knee)
from dashboards.results import FormatError, load_sweep, load_trial, read_request_records, read_steps
from dashboards.study import StudyUnavailable, load_study
from tests import dashboard_data as data


# Knee ------------------------------------------------------------------------------------------------------------
def test_knee_where_the_gain_of_the_next_step_falls_below_ten_percent() -> None:
    # gains: +90 %, +50 %, +25 %, +4 %, +1 % -> past 32 a doubling buys 4 %
    knee = find_knee([4, 8, 16, 32, 64, 128], [100, 190, 285, 356, 370, 373])
    assert knee == Knee(index=3, value=32.0, reason="gain")


def test_knee_where_the_slo_is_crossed_before_the_gain_falls_off() -> None:
    # throughput grows strongly everywhere, but p99 TBT crosses 50 ms at 16 -> the knee is 8, for the SLO
    knee = find_knee([4, 8, 16, 32], [100, 200, 400, 800], [0.02, 0.04, 0.06, 0.09], slo=0.05)
    assert knee == Knee(index=1, value=8.0, reason="slo")


def test_knee_takes_the_earlier_of_gain_and_slo() -> None:
    values, tput = [1, 2, 3, 4, 5], [10, 20, 21, 30, 31]
    assert find_knee(values, tput, [0.01] * 4 + [0.2], slo=0.05) == Knee(1, 2.0, "gain")
    assert find_knee(values, tput, [0.01, 0.08, 0.1, 0.1, 0.1], slo=0.05) == Knee(0, 1.0, "slo")


def test_no_knee_when_throughput_keeps_growing_or_every_point_misses_the_slo() -> None:
    assert find_knee([1, 2, 4], [10, 20, 40]) is None
    assert find_knee([1, 2, 4], [10, 20, 40], [0.01, 0.02, 0.03], slo=0.05) is None
    assert find_knee([1, 2, 4], [10, 20, 40], [0.09, 0.1, 0.2], slo=0.05) is None  # crossed at the first point
    assert slo_crossing([0.09, 0.1], 0.05) == 0
    assert slo_crossing([0.01, None], 0.05) == 1  # no tokens at all: not within the SLO


def test_knee_rejects_unsorted_or_mismatched_points() -> None:
    with pytest.raises(ValueError, match="increasing"):
        find_knee([8, 4], [1, 2])
    with pytest.raises(ValueError, match="one entry per point"):
        find_knee([4, 8], [1])


# Pareto front ----------------------------------------------------------------------------------------------------
def test_pareto_front_on_hand_made_points() -> None:
    #         0     1     2     3     4     5 (dominated by 1)  6 (equal to 3: both kept)
    tput = [100, 200, 300, 400, 350, 150, 400]
    tbt = [0.01, 0.02, 0.03, 0.05, 0.06, 0.025, 0.05]
    assert pareto_front(tput, tbt) == [0, 1, 2, 3, 6]


def test_pareto_front_skips_points_without_measurements() -> None:
    assert pareto_front([None, 100, 50], [0.01, 0.02, None]) == [1]
    assert pareto_front([], []) == []


def said(figure: Any) -> str:
    """An empty figure's message, its lines joined."""
    return str(figure.layout.annotations[0].text).replace("<br>", " ")


# Importance ------------------------------------------------------------------------------------------------------
def test_param_importance_ranks_the_knob_that_drives_the_objective(tmp_path: Path) -> None:
    url = f"journal:{tmp_path / 'study.journal'}"  # faster to write than SQLite
    data.write_study(url, n_trials=20)
    study = load_study(url)
    assert list(study.importances)[0] == "max_num_seqs"
    assert study.importances["max_num_seqs"] > study.importances["chunk_size"]


def test_param_importance_is_empty_below_two_completed_trials(tmp_path: Path) -> None:
    url = f"journal:{tmp_path / 'study.journal'}"  # faster to write than SQLite
    data.write_study(url, n_trials=1)
    study = load_study(url)
    assert study.importances == {}
    assert study.importance_note.startswith("1 completed trial with sampled knobs cannot rank 2 parameters")
    assert said(importance_figure({}, study.importance_note)) == study.importance_note
    assert "at least 3 completed trials" in said(importance_figure({}))


def test_two_trials_cannot_rank_parameters(tmp_path: Path) -> None:
    import optuna

    from dashboards.analysis import param_importances

    # the default config (no params) and one sampled trial: Optuna would share the importance equally
    study = optuna.create_study(direction="maximize")
    study.enqueue_trial({})
    study.tell(study.ask(), 1.0)
    trial = study.ask()
    for knob in ("max_num_seqs", "chunk_size", "max_num_batched_tokens", "block_size"):
        trial.suggest_int(knob, 1, 64)
    study.tell(trial, 2.0)
    assert param_importances(study) == {}
    # a capacity study: the default config and two sampled trials
    url = f"journal:{tmp_path / 'study.journal'}"
    data.write_capacity_study(url)
    capacity = load_study(url)
    assert capacity.importances == {}
    assert capacity.importance_note.startswith("2 completed trials with sampled knobs cannot rank 2 parameters")
    figure = importance_figure(capacity.importances, capacity.importance_note)
    assert figure.data == () and said(figure) == capacity.importance_note


def test_param_importance_is_empty_when_every_trial_scored_the_same() -> None:
    import optuna

    from dashboards.analysis import param_importances

    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    study.optimize(lambda trial: 0.0 * trial.suggest_int("max_num_seqs", 1, 16), n_trials=5)  # all goodput 0
    assert param_importances(study) == {}
    study.optimize(lambda trial: float(trial.suggest_int("max_num_seqs", 1, 16)), n_trials=5)
    assert set(param_importances(study)) == {"max_num_seqs"}


# Loading folders and studies -------------------------------------------------------------------------------------
def test_sweep_folder_loads_and_its_knee_is_found(tmp_path: Path) -> None:
    sweep = load_sweep(data.write_sweep(tmp_path / "sweep"))
    assert [p.value for p in sweep.points] == data.SWEEP_VALUES
    knee = sweep_knee(sweep)
    assert knee is not None and knee.value == data.KNEE_VALUE and knee.reason == "slo"


def test_older_or_unknown_folders_raise_a_format_error_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "sweep.json").write_text(json.dumps({"knob": "max_num_seqs", "points": []}))
    with pytest.raises(FormatError, match=r"sweep.json: no `format` field .*slotune-sweep/1"):
        load_sweep(tmp_path / "old")
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "trial.json").write_text(json.dumps({"format": "slotune-trial/9"}))
    with pytest.raises(FormatError, match="'slotune-trial/9'"):
        load_trial(tmp_path / "new")
    with pytest.raises(FormatError, match="no sweep.json"):
        load_sweep(tmp_path)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "sweep.json").write_text("{not json")
    with pytest.raises(FormatError, match="cannot read it as JSON"):
        load_sweep(tmp_path / "bad")


def test_missing_storage_is_no_study_yet_and_is_not_created(tmp_path: Path) -> None:
    with pytest.raises(StudyUnavailable, match="no study yet"):
        load_study(f"sqlite:///{tmp_path / 'none.db'}")
    with pytest.raises(StudyUnavailable, match="no study yet"):
        load_study(str(tmp_path / "study.journal"))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("feasible_attr", [True, False], ids=["user-attr", "constraints"])
def test_study_rows_carry_feasibility_and_measurements(tmp_path: Path, feasible_attr: bool) -> None:
    url = f"journal:{tmp_path / 'study.journal'}"  # faster to write than SQLite
    data.write_study(url, n_trials=12, feasible_attr=feasible_attr)
    study = load_study(url)
    assert study.name == "tune" and len(study.rows) == 12
    assert 0 < sum(r.feasible for r in study.rows) < 12
    for row in study.rows:
        assert row.feasible == (row.tbt_p99 <= data.SLO["tbt_p99"])
        assert row.throughput is not None and row.value is not None


# Figures ---------------------------------------------------------------------------------------------------------
def test_sweep_curves_have_one_point_per_value_the_slo_line_and_the_knee(tmp_path: Path) -> None:
    fig = sweep_curves_figure(load_sweep(data.write_sweep(tmp_path / "s")))
    by_name = {t.name: t for t in fig.data}
    for key in ("output_tokens_per_s", "goodput_rps", "tbt_p99", "ttft_p99"):
        assert list(by_name[key].x) == data.SWEEP_VALUES
    assert [round(y, 6) for y in by_name["tbt_p99"].y] == [round(t * 1000, 6) for t in data.SWEEP_TBT]
    assert list(by_name["knee"].x) == [data.KNEE_VALUE]
    slo_lines = [s for s in fig.layout.shapes if s.y0 == s.y1 and s.y0 in (50.0, 2.0)]
    assert len(slo_lines) == 2  # p99 TBT and p99 TTFT targets
    assert "SIMULATED" not in fig.layout.title.text
    assert "SIMULATED" in sweep_curves_figure(load_sweep(data.write_sweep(tmp_path / "sim", simulated=True))
                                              ).layout.title.text


def test_study_figures_count_trials_and_mark_the_front(tmp_path: Path) -> None:
    url = f"journal:{tmp_path / 'study.journal'}"  # faster to write than SQLite
    data.write_study(url, n_trials=12)
    study = load_study(url)
    hist = {t.name: t for t in history_figure(study.rows).data}
    n_feasible = sum(r.feasible for r in study.rows)
    assert len(hist["feasible"].x) == n_feasible and len(hist["infeasible"].x) == 12 - n_feasible
    best = list(hist["best so far"].y)
    assert best == sorted(best) and best[-1] == max(r.value for r in study.rows if r.feasible)
    pareto = {t.name: t for t in pareto_figure(study.rows, 0.05).data}
    expected = pareto_front([r.throughput for r in study.rows], [r.tbt_p99 for r in study.rows])
    assert len(pareto["Pareto front"].x) == len(expected) >= 1


def test_trials_over_time_say_the_objective_and_draw_each_capacity_bracket(tmp_path: Path) -> None:
    import dataclasses

    url = f"journal:{tmp_path / 'study.journal'}"
    data.write_capacity_study(url)
    data.write_study(url, n_trials=3)
    capacity, goodput = load_study(url, "capacity"), load_study(url, "tune")
    assert (capacity.objective, goodput.objective) == ("capacity", "goodput")
    fig = history_figure(capacity.rows, capacity.direction, capacity.objective)
    assert fig.layout.yaxis.title.text == "objective (capacity, req/s)"
    traces = {t.name: t for t in fig.data}
    feasible, infeasible = traces["feasible"], traces["infeasible"]
    assert list(feasible.y) == [1.6, 4.2] and list(infeasible.y) == [0.0]
    # each point is its bracket's low end: the bar reaches up to the high end
    assert [round(v, 9) for v in feasible.error_y.array] == [0.4, 0.6] and list(feasible.error_y.arrayminus) == [0, 0]
    assert list(infeasible.error_y.array) == [0.5] and "bracket 0-0.5 req/s" in infeasible.text[0]
    open_end = [dataclasses.replace(r, bracket=(r.value, None)) for r in capacity.rows if r.feasible]
    assert list(history_figure(open_end, objective="capacity").data[0].error_y.array) == [0.0, 0.0]
    plain = history_figure(goodput.rows, goodput.direction, goodput.objective)
    assert plain.layout.yaxis.title.text == "objective (goodput, req/s)"
    assert all(t.error_y.array is None for t in plain.data)


def test_step_timeline_and_request_distributions_from_a_trial_folder(tmp_path: Path) -> None:
    folder = data.write_trial(tmp_path / "t", {"max_num_seqs": 8}, data.summary_of(100, 1, 0.03, 0.4),
                              n_steps=150, n_requests=20)
    steps = read_steps(folder)
    fig = step_timeline_figure(steps)
    assert len(fig.data) == 8 and all(len(t.x) == 150 for t in fig.data)
    kv = next(t for t in fig.data if t.name == "KV usage")
    assert all(0 <= v <= 1 for v in kv.y)
    records = read_request_records(folder)
    dist = {t.name: t for t in request_distributions_figure(records, data.SLO).data}
    assert len(dist["TTFT"].x) == 20
    assert len(dist["each request's p99"].x) == 20
    assert len(dist["all gaps"].x) == sum(len(r.token_times) - 1 for r in records)
    assert step_timeline_figure([]).layout.annotations[0].text == "no engine steps recorded"


def test_step_timeline_breaks_its_lines_where_the_engine_was_idle() -> None:
    def step(start: float, prefill: int) -> dict[str, float]:
        return {"start_time": start, "total_s": 0.05, "num_prefill_tokens": prefill, "num_decode_tokens": 1}

    # two bursts of steps (back to back: each starts as the previous ends), 5 s of idle engine between them
    steps = [step(100 + 0.05 * i, 8) for i in range(3)] + [step(105.15 + 0.05 * i, 0) for i in range(2)]
    prefill = next(t for t in step_timeline_figure(steps).data if t.name == "prefill tokens")
    assert list(prefill.x[:3]) == pytest.approx([0, 0.05, 0.1]) and np.isnan(prefill.x[3])
    assert list(prefill.y[:3]) == [8, 8, 8] and np.isnan(prefill.y[3]) and list(prefill.y[4:]) == [0, 0]


def test_itl_histogram_from_prometheus_text() -> None:
    text = "\n".join([
        "# HELP slotune_inter_token_latency_seconds ITL", "# TYPE slotune_inter_token_latency_seconds histogram",
        'slotune_inter_token_latency_seconds_bucket{le="0.01"} 10.0',
        'slotune_inter_token_latency_seconds_bucket{le="0.05"} 90.0',
        'slotune_inter_token_latency_seconds_bucket{le="+Inf"} 100.0',
        "slotune_inter_token_latency_seconds_count 100.0", "slotune_inter_token_latency_seconds_sum 2.0", ""])
    buckets = parse_histogram(text, "slotune_inter_token_latency_seconds")
    assert buckets.counts == [10.0, 80.0, 10.0] and buckets.total == 100.0
    assert buckets.quantile(0.5) == pytest.approx(0.01 + 0.04 * 40 / 80)
    fig = itl_histogram_figure(buckets, 0.05)
    assert list(fig.data[0].y) == [10.0, 80.0, 10.0]
    assert itl_histogram_figure(HistogramBuckets([], [])).layout.annotations


def test_a_sweep_of_a_named_knob_is_drawn_in_its_order_without_a_knee(tmp_path: Path) -> None:
    from dashboards.results import Sweep, SweepPoint

    points = [SweepPoint(v, None, data.summary_of(t, 1.0, 0.03, 0.5), {}, True, None)
              for v, t in (("recompute", 100.0), ("swap", 90.0))]
    sweep = Sweep(tmp_path, "preemption_mode", ["recompute", "swap"], {}, "mixed", 2.0, data.SLO, False, points)
    assert sweep_knee(sweep) is None
    fig = sweep_curves_figure(sweep)
    assert list(next(t for t in fig.data if t.name == "output_tokens_per_s").x) == ["recompute", "swap"]
    assert "no knee" in fig.layout.title.text


def test_trial_records_outside_the_summary_window_are_left_out(tmp_path: Path) -> None:
    from dashboards.results import in_window

    folder = data.write_trial(tmp_path / "t", {"max_num_seqs": 8}, data.summary_of(100, 1, 0.03, 0.4), n_requests=20)
    records = read_request_records(folder)  # scheduled every 0.25 s: 0, 0.25, ..., 4.75
    assert len(in_window(records, {"window": [1.0, 3.0]})) == 8  # 1.0 .. 2.75: a 1 s warm-up left out
    assert len(in_window(records, {})) == 20
