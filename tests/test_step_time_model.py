"""The step-time model: a fit that recovers known costs, honest held-out error, range warnings, files."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from tuner.simulation.step_time_model import (FEATURES, ExtrapolationWarning, ProfileError, StepTimeModel, feature_row)

TRUE = {"const": 0.02, "tokens": 4e-4, "seqs": 1e-3, "prefill_seqs": 2e-3, "context_tokens": 2e-6,
        "context_blocks": 3e-5, "prefill_square": 1e-6, "swapped_blocks": 0.0, "prefill_step": 5e-3}


def synthetic_steps(n: int, seed: int = 0, noise: float = 0.0) -> list[dict]:
    rng = np.random.default_rng(seed)
    steps = []
    for _ in range(n):
        bs = int(rng.choice([8, 16, 32]))
        pseqs = int(rng.integers(0, 4))
        ptok = int(rng.integers(pseqs, 64 * pseqs + 1)) if pseqs else 0
        dec = int(rng.integers(0 if pseqs else 1, 16))
        ctx = ptok + dec * int(rng.integers(10, 400)) + int(rng.integers(0, 200))
        row = feature_row(pseqs, ptok, dec, ctx, bs)
        total = sum(TRUE[f] * v for f, v in zip(FEATURES, row)) * (1 + noise * rng.standard_normal())
        steps.append({"num_prefill_seqs": pseqs, "num_prefill_tokens": ptok, "num_decode_tokens": dec,
                      "context_tokens": ctx, "block_size": bs, "num_swapped_blocks": 0, "total_s": total})
    return steps


def test_fit_recovers_known_costs_and_reports_held_out_error() -> None:
    model = StepTimeModel.fit(synthetic_steps(400))
    for f in FEATURES:
        assert model.coef[f] == pytest.approx(TRUE[f], rel=1e-4, abs=1e-9), f
    assert model.fit_error is not None and model.fit_error.p90_rel < 1e-6 and model.fit_error.n > 40
    assert model.predict(2, 40, 8, 1000, 16) == pytest.approx(
        sum(TRUE[f] * v for f, v in zip(FEATURES, feature_row(2, 40, 8, 1000, 16))))
    # The simulator's fast function gives the same numbers.
    assert model.bind(16)(2, 40, 8, 1000, 0) == pytest.approx(model.predict(2, 40, 8, 1000, 16))


def test_noisy_fit_error_is_measured_on_records_left_out() -> None:
    model = StepTimeModel.fit(synthetic_steps(600, seed=1, noise=0.1))
    assert model.fit_error is not None
    assert 0.03 < model.fit_error.median_rel < 0.12  # ~ the noise's median absolute deviation (0.067)
    assert all(v >= 0 for v in model.coef.values())


def test_prediction_outside_the_profiled_range_warns_once_per_input() -> None:
    model = StepTimeModel.fit(synthetic_steps(200))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.predict(1, 10, 4, 300, 16)  # inside: no warning
        assert not caught
        model.predict(1, 10, 500, 300, 16)
        model.predict(1, 10, 900, 300, 16)  # the same input again: no second warning
        model.predict(1, 10, 4, 300, 128)  # block size never profiled
    messages = [str(w.message) for w in caught if issubclass(w.category, ExtrapolationWarning)]
    assert len(messages) == 3  # num_decode_tokens, num_seqs (it grows with the decodes) and block_size
    assert any("num_decode_tokens 500..500" in m for m in messages) and any("block_size" in m for m in messages)


def test_profile_round_trips_and_bad_files_name_the_problem(tmp_path: Path) -> None:
    model = StepTimeModel.fit(synthetic_steps(100), gap_s=0.004, token_latency_s=0.01)
    path = tmp_path / "profile.json"
    model.save(path)
    again = StepTimeModel.load(path)
    assert again.coef == model.coef and again.ranges == model.ranges and again.gap_s == 0.004
    assert again.fit_error == model.fit_error
    (tmp_path / "bad.json").write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ProfileError, match="not a step-time profile"):
        StepTimeModel.load(tmp_path / "bad.json")
    with pytest.raises(ProfileError, match="cannot read"):
        StepTimeModel.load(tmp_path / "missing.json")
    with pytest.raises(ProfileError, match="too few"):
        StepTimeModel.fit(synthetic_steps(5))
    # a profile written before the prefill_step feature existed reads it as 0, i.e. predicts as it always did
    old = model.to_dict()
    del old["coef"]["prefill_step"]
    older = StepTimeModel.from_dict(old)
    assert older.coef["prefill_step"] == 0.0
    expected = model.predict(2, 40, 8, 1000, 16) - model.coef["prefill_step"]
    assert older.predict(2, 40, 8, 1000, 16) == pytest.approx(expected)
    del old["coef"]["seqs"]
    with pytest.raises(ProfileError, match="coef lacks seqs"):
        StepTimeModel.from_dict(old)


def test_step_to_step_variation_is_kept_and_drawn_reproducibly() -> None:
    model = StepTimeModel.fit(synthetic_steps(600, seed=2, noise=0.3))
    assert model.noise == sorted(model.noise) and model.noise[0] < 0.7 and model.noise[-1] > 1.3
    plain = model.bind(16, seed=None)(1, 10, 4, 300, 0)
    draws = [model.bind(16, seed=5)(1, 10, 4, 300, 0) for _ in range(3)]
    assert draws[0] == draws[1] == draws[2]  # a fresh function with the same seed: the same first draw
    f = model.bind(16, seed=5)
    sample = [f(1, 10, 4, 300, 0) for _ in range(400)]
    assert max(sample) / min(sample) > 2  # the spread of the measured steps ...
    true = sum(TRUE[k] * v for k, v in zip(FEATURES, feature_row(1, 10, 4, 300, 16)))
    assert 0.85 < float(np.median(sample)) / true < 1.15  # ... around the true time, though the fit is biased low
    assert plain < true
    assert StepTimeModel.from_dict(model.to_dict()).noise == model.noise


def test_rescaled_to_a_slower_machine_predicts_its_steps() -> None:
    # Calibrated on a quiet machine; a trial then runs while the box is 1.6x slower and noisier (other load).
    model = StepTimeModel.fit(synthetic_steps(400, seed=3))
    slow = [{**s, "total_s": s["total_s"] * 1.6} for s in synthetic_steps(300, seed=4, noise=0.2)]
    adapted = model.rescaled(slow)
    assert adapted is not None
    assert adapted.meta["rescaled"]["scale"] == pytest.approx(1.6, rel=0.05)
    assert adapted.meta["rescaled"]["steps"] == 300
    new = synthetic_steps(50, seed=5)  # other shapes than the trial's
    for s in new:
        assert adapted.predict_record(s) == pytest.approx(1.6 * model.predict_record(s), rel=0.05)
    # the profile's step-to-step variation and range stay; the model rescaled from is unchanged
    assert adapted.noise == model.noise and adapted.ranges == model.ranges
    assert model.coef == StepTimeModel.fit(synthetic_steps(400, seed=3)).coef
    assert model.rescaled(slow[:10]) is None  # too few steps to say how fast the machine runs


def test_rescaled_says_how_wrong_one_factor_is_at_each_decode_batch_size() -> None:
    """A machine whose batch scaling is not the profile's (its steps of 8 or more sequences cost 1.5x the profile,
    smaller ones 1.0x): one decode factor is right at neither end, and the rescaled model says by how much at the
    batch sizes a config can run; on a machine that is uniformly slower it says the error is small."""
    model = StepTimeModel.fit(synthetic_steps(400, seed=3))
    uneven = [{**s, "total_s": s["total_s"] * (1.5 if not s["num_prefill_seqs"] and s["num_decode_tokens"] >= 8
                                               else 1.0)} for s in synthetic_steps(3000, seed=4, noise=0.05)]
    adapted = model.rescaled(uneven)
    assert adapted is not None
    errors = adapted.meta["rescaled"]["decode_errors"]
    assert [(lo, hi) for lo, hi, _, _ in errors] == [(1, 1), (2, 3), (4, 7), (8, 15)]
    ratio = {(lo, hi): r for lo, hi, r, _ in errors}  # measured / predicted after the one factor
    assert ratio[8, 15] / ratio[2, 3] == pytest.approx(1.5, rel=0.1)  # the machine's own batch scaling
    assert ratio[2, 3] < 0.8 and adapted.batch_error(3) == pytest.approx(max(1 / ratio[1, 1], 1 / ratio[2, 3]) - 1)
    assert adapted.batch_error(1) == pytest.approx(1 / ratio[1, 1] - 1) and adapted.batch_error(0) is None
    assert adapted.batch_error(None) == adapted.batch_error(64) >= adapted.batch_error(3)  # the worst bin it can run
    assert StepTimeModel.from_dict(adapted.to_dict()).batch_error(3) == adapted.batch_error(3)
    even = model.rescaled([{**s, "total_s": s["total_s"] * 1.6} for s in synthetic_steps(3000, seed=4, noise=0.05)])
    assert even is not None and even.batch_error(None) is not None and even.batch_error(None) < 0.03
    assert model.batch_error(None) is None  # not rescaled: nothing measured to say it


def test_rescaled_says_how_wrong_its_prefill_law_is_at_each_size_of_prefill_step() -> None:
    """A machine whose prefill steps of 64-127 tokens cost 1.5x the profile and the others 1.0x (no power law of the
    tokens fits that): the rescaled model says where its law is off, the bump's bin above its neighbours, and a
    config's allowance grows with the steps its token budget reaches; on a machine whose prefill is uniformly
    slower (a law fits) the error is small."""
    model = StepTimeModel.fit(synthetic_steps(400, seed=3))
    bump = [{**s, "total_s": s["total_s"] * (1.5 if 64 <= s["num_prefill_tokens"] < 128 and s["num_prefill_seqs"]
                                             else 1.0)} for s in synthetic_steps(4000, seed=4, noise=0.05)]
    adapted = model.rescaled(bump)
    assert adapted is not None
    errors = adapted.meta["rescaled"]["prefill_errors"]
    ratio = {(lo, hi): r for lo, hi, r, _ in errors}  # measured / predicted after the law
    assert ratio[64, 127] > 1.2 * max(ratio[32, 63], ratio[128, 255])  # the bump, where it is
    assert adapted.prefill_error(None) == adapted.prefill_error(4096) > 0.2
    budgets = [adapted.prefill_error(t) or 0.0 for t in (16, 32, 64, 128, 256)]
    assert budgets == sorted(budgets) and budgets[3] >= ratio[64, 127] - 1  # a larger budget runs every smaller step
    assert StepTimeModel.from_dict(adapted.to_dict()).prefill_error(128) == adapted.prefill_error(128)
    even = model.rescaled([{**s, "total_s": s["total_s"] * (1.4 if s["num_prefill_seqs"] else 1.0)}
                           for s in synthetic_steps(4000, seed=4, noise=0.05)])
    assert even is not None and even.prefill_error(None) is not None and even.prefill_error(None) < 0.05
    assert model.prefill_error(None) is None  # not rescaled: nothing measured to say it


def test_rescaled_moves_prefill_and_decode_steps_by_their_own_factors() -> None:
    # a machine whose decode steps run 1.7x the profile and whose prefill steps run 1.4x (another memory system,
    # other matrix units): one factor would miss both
    model = StepTimeModel.fit(synthetic_steps(400, seed=3))
    other = [{**s, "total_s": s["total_s"] * (1.4 if s["num_prefill_seqs"] else 1.7)}
             for s in synthetic_steps(400, seed=4, noise=0.1)]
    adapted = model.rescaled(other)
    assert adapted is not None
    r = adapted.meta["rescaled"]
    assert r["scale"] == pytest.approx(1.7, rel=0.05) and r["prefill_scale"] == pytest.approx(1.4, rel=0.05)
    for s in synthetic_steps(60, seed=5):
        factor = 1.4 if s["num_prefill_seqs"] else 1.7
        assert adapted.predict_record(s) == pytest.approx(factor * model.predict_record(s), rel=0.06)
        i = (s["num_prefill_seqs"], s["num_prefill_tokens"], s["num_decode_tokens"], s["context_tokens"], 0)
        assert adapted.bind(s["block_size"], seed=None)(*i) == pytest.approx(adapted.predict_record(s), rel=1e-9)
    again = StepTimeModel.from_dict(adapted.to_dict())
    assert again.prefill_factor == adapted.prefill_factor != 1.0


def test_rescaled_prefill_factor_follows_the_chunk_size_as_measured() -> None:
    # a machine whose small prefill chunks sped up more than its large prefills (measured on an AMD EPYC against a
    # profile from another CPU: 16-token steps 0.59x, 64-token 0.74x, 256-token 0.91x): one prefill factor, the
    # median over all prefill steps, predicted a 16-token chunk 10 % too slow, enough to move a config across 50 ms
    model = StepTimeModel.fit(synthetic_steps(400, seed=3))

    def true_factor(tokens: int) -> float:
        return 0.6 * (max(tokens, 1) / 16) ** 0.15

    other = [{**s, "total_s": s["total_s"] * (true_factor(s["num_prefill_tokens"]) if s["num_prefill_seqs"] else 0.55)}
             for s in synthetic_steps(600, seed=4, noise=0.05)]
    adapted = model.rescaled(other)
    assert adapted is not None and adapted.prefill_exponent == pytest.approx(0.15, abs=0.03)
    for s in synthetic_steps(80, seed=5):
        p = s["num_prefill_tokens"]
        lo, hi = adapted.prefill_tokens
        factor = true_factor(int(min(max(p, lo), hi))) if s["num_prefill_seqs"] else 0.55
        assert adapted.predict_record(s) == pytest.approx(factor * model.predict_record(s), rel=0.06)
        i = (s["num_prefill_seqs"], p, s["num_decode_tokens"], s["context_tokens"], 0)
        assert adapted.bind(s["block_size"], seed=None)(*i) == pytest.approx(adapted.predict_record(s), rel=1e-9)
    again = StepTimeModel.from_dict(adapted.to_dict())
    assert (again.prefill_exponent, again.prefill_tokens) == (adapted.prefill_exponent, adapted.prefill_tokens)
    # rescaling an already rescaled model fits from the profile's plain prediction, not on top of the old factors
    twice = adapted.rescaled(other)
    assert twice is not None and twice.prefill_exponent == pytest.approx(adapted.prefill_exponent, abs=0.03)
