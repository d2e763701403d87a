"""The controller's candidates: the pick confirmed on fresh draws (the best of many noisy draws is biased up), and
a move that was rolled back not screened again until the workload drifts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from policies import PolicyError, parse_policy
from policies.control import MIN_DRAWS, REDRAW_LEVEL, Retune
from tuner.control.candidates import LEADERS, Prediction, Redraws, deciding_figure, search
from tuner.control.decision_log import resume
from tuner.control.guardrails import changed
from tuner.control.shape import Shape
from tuner.control.window import Lengths

DEFAULT = yaml.safe_load(Path("policies/default.yaml").read_text())
CURRENT = {"max_num_seqs": 2, "max_num_batched_tokens": 64, "chunk_size": 32, "block_size": 16}


def test_a_pick_that_only_won_its_one_draw_is_not_confirmed_on_fresh_draws() -> None:
    """Every config serves 1.0 goodput in truth, each draw off by 8 %: the best of 48 one-draw figures beats the
    applied config's one draw by more than MIN_GAIN nearly always; fresh draws confirm it at most at their level."""
    rng = np.random.default_rng(11)
    runs, fooled, confirmed = 400, 0, 0
    for _ in range(runs):
        screened = rng.normal(1.0, 0.08, 48)
        best = Prediction({}, {"attainment": 0.95, "goodput_rps": float(screened.max())})
        now = Prediction({}, {"attainment": 0.95, "goodput_rps": float(rng.normal(1.0, 0.08))})
        if deciding_figure(best, now, 0.9) is None:
            continue
        fooled += 1
        confirmed += Redraws("goodput_rps", tuple(rng.normal(0.0, 0.08 * np.sqrt(2), Retune.draws))).holds
    assert fooled / runs > 0.8
    assert confirmed / fooled <= REDRAW_LEVEL + 3 * np.sqrt(REDRAW_LEVEL * (1 - REDRAW_LEVEL) / fooled)
    # a real edge of 30 % holds
    assert Redraws("goodput_rps", (0.31, 0.28, 0.33, 0.27, 0.30, 0.29, 0.32, 0.26)).holds


def test_the_redraws_hold_their_level_where_most_draws_differ_by_nothing() -> None:
    """Attainment on a draw where both configs serve every request differs by 0; on a draw with a burst, by a lot
    either way. For a pick no better than the applied config (each draw 0 with probability 0.6, else a heavy-tailed
    difference of either sign) the redraws show an edge at most at their level; for a pick that attains more on
    every draw with a burst they show it (the shift benchmark's seed 9001: 0, +52, +44, 0, +8, +5, +10 and +8
    points, where a t bound on the mean read -1.2 points and the pick did not move)."""
    rng = np.random.default_rng(23)
    runs = 20_000
    held = sum(Redraws("attainment", tuple(np.where(rng.random(Retune.draws) < 0.6, 0.0,
                                                    0.1 * rng.standard_t(2, Retune.draws)))).holds
               for _ in range(runs))
    assert held / runs <= REDRAW_LEVEL + 3 * np.sqrt(REDRAW_LEVEL * (1 - REDRAW_LEVEL) / runs)
    seen = Redraws("attainment", (0.0, 0.5172, 0.4444, 0.0, 0.08, 0.0476, 0.0952, 0.0769))
    assert seen.holds and seen.as_dict()["p_value"] == round(1 / 64, 4)
    # one draw the other way is enough doubt at 8 draws
    assert not Redraws("attainment", (0.0, 0.5172, 0.4444, -0.2, 0.08, 0.0476, 0.0952, 0.0769)).holds


def test_a_policy_with_too_few_redraws_to_ever_move_is_refused() -> None:
    policy = parse_policy({**DEFAULT, "retune": {"draws": MIN_DRAWS}})
    assert policy.control.retune.draws == MIN_DRAWS
    with pytest.raises(PolicyError, match="draws"):
        parse_policy({**DEFAULT, "retune": {"draws": MIN_DRAWS - 1}})


def overloaded_shape() -> Shape:
    """Two minutes at 2 req/s of 200-token prompts and 40-token answers (one length bucket each)."""
    prompts = Lengths((100.0, 200.0, 500.0, float("inf")), (0.0, 240.0, 0.0, 0.0), 240 * 200.0)
    outputs = Lengths((20.0, 50.0, 100.0, float("inf")), (0.0, 240.0, 0.0, 0.0), 240 * 40.0)
    return Shape(seconds=120.0, requests=240, prompt_means=(200.0,), output_means=(40.0,), prefix_hit_rate=0.0,
                 prompt_lengths=prompts, output_lengths=outputs)


def test_a_rolled_back_move_is_not_screened_again_until_the_workload_drifts() -> None:
    policy = parse_policy({**DEFAULT, "retune": {"candidates": 12, "sim_duration": "10s"}})

    def pick(rolled_back: list[dict[str, Any]]) -> dict[str, Any] | None:
        found = search(policy, CURRENT, CURRENT, overloaded_shape(), [], [], target=0.9, seed=3,
                       rolled_back=rolled_back)
        return changed(found.candidate.knobs, CURRENT) if found.candidate else None

    first = pick([])
    assert first, "the applied config cannot serve 2 req/s of these requests: some move should be predicted better"
    # the decision log shows what the pick was chosen from: the best screened predictions, the pick first
    found = search(policy, CURRENT, CURRENT, overloaded_shape(), [], [], target=0.9, seed=3)
    leaders = found.as_dict()["leaders"]
    assert 1 < len(leaders) <= LEADERS and changed(leaders[0]["knobs"], CURRENT) == first
    assert all("attainment" in p and "knobs" in p for p in leaders)
    again = pick([{"from": {k: CURRENT[k] for k in first}, "to": first}])
    assert again != first
    # read back from the log: a rollback is remembered, a drift decision after it forgets it
    rollback = {"kind": "decision", "id": 1, "time": 1.0, "outcome": "rolled_back", "candidate": first,
                "kept_knobs": {k: CURRENT[k] for k in first}, "trigger": {"kind": "attainment"}}
    assert resume([rollback]).rolled_back == [{"from": rollback["kept_knobs"], "to": first, "time": 1.0}]
    drift = {"kind": "decision", "id": 2, "time": 2.0, "outcome": "no_move", "trigger": {"kind": "drift"}}
    assert resume([rollback, drift]).rolled_back == []
