"""The step-time model: how long one engine step takes, from what the step computes.

A step's duration is a non-negative sum of physically meaningful costs, fitted by non-negative least squares on
relative error (so that short decode steps, which set the TBT, weigh as much as long prefill steps) to the
engine's own step records:

    const            per-step overhead (scheduling, Python, building the batch, the sampler call)
    tokens           new tokens (prefill + decode): projections and MLP, linear in tokens
    seqs             sequences in the batch (prefill chunks + decodes): LM head row, sampling, per-sequence work
    prefill_seqs     prefill chunks: each builds its own mask and gathers its own context
    prefill_step     1 when the step prefills at all: the prefill attention path's fixed cost (without it, the
                     per-chunk cost absorbed it and steps of several chunks were over-predicted by 10-20 %)
    context_tokens   tokens attended (sum of the sequences' contexts): attention's key/value reads
    context_blocks   context_tokens / block_size: the KV gather's index work (smaller blocks, more of it)
    prefill_square   prefill_tokens**2 / prefill_seqs: causal attention within the chunks
    swapped_blocks   blocks copied by swap-out / swap-in

Besides the step itself the engine spends ``gap_s`` between two busy steps (delivering tokens, taking new requests)
and the HTTP path adds ``request_latency_s`` (client send -> engine queue) and ``token_latency_s`` (token made ->
client receives it). The engine's step times also vary from step to step at the same composition (on a shared CPU
by a factor of two or more); the profile keeps the quantiles of measured/predicted, and the simulator scales each
step by a seeded draw from them, so the tails (p99 TBT) come out as the engine's do. The saved JSON holds the
coefficients, these latencies and variations, the fit error on held-out records and the profiled range of every
input; predicting outside that range warns once per input (never silently).
"""

from __future__ import annotations

import json
import math
import random
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from tuner.simulation.batch_error import batch_errors, worst_batch_error

FEATURES = ("const", "tokens", "seqs", "prefill_seqs", "context_tokens", "context_blocks", "prefill_square",
            "swapped_blocks", "prefill_step")
# Features added after profiles were first written: a profile without one reads it as 0 (its old fit).
LATER_FEATURES = frozenset({"prefill_step"})
# The step-record inputs whose profiled range is kept (and checked when predicting).
INPUTS = ("num_prefill_seqs", "num_prefill_tokens", "num_decode_tokens", "context_tokens", "num_seqs",
          "num_swapped_blocks", "block_size")
PROFILE_FORMAT = "slotune-step-time-model/1"
LOWER_CHECKED = frozenset({"block_size"})  # inputs whose lower bound is checked too (see check_range)
NOISE_POINTS = 201  # quantiles of the step-to-step variation kept in a profile
MIN_RESCALE_STEPS = 30  # a trial with fewer busy steps says too little about the machine's speed (see rescaled)

# A step function as the simulator calls it: (prefill seqs, prefill tokens, decode tokens, context tokens,
# swapped blocks) -> seconds; the block size is bound when the function is made.
StepFn = Callable[[int, int, int, int, int], float]


class ExtrapolationWarning(UserWarning):
    """A prediction for a step (or a config) outside the range the model was profiled on."""


class ProfileError(ValueError):
    """A step-time profile that cannot be read or fitted; the message names the file or the field."""


def feature_row(num_prefill_seqs: float, num_prefill_tokens: float, num_decode_tokens: float,
                context_tokens: float, block_size: float, num_swapped_blocks: float = 0.0) -> list[float]:
    """The model's features of one step (the order of FEATURES)."""
    seqs = num_prefill_seqs + num_decode_tokens
    square = num_prefill_tokens * num_prefill_tokens / num_prefill_seqs if num_prefill_seqs else 0.0
    return [1.0, num_prefill_tokens + num_decode_tokens, seqs, num_prefill_seqs, context_tokens,
            context_tokens / block_size, square, num_swapped_blocks, 1.0 if num_prefill_seqs else 0.0]


def _inputs(step: Mapping[str, Any], block_size: int | None) -> dict[str, float]:
    bs = step.get("block_size", block_size)
    if bs is None:
        raise ProfileError("a step record without block_size (give block_size= or add it to every record)")
    return {"num_prefill_seqs": float(step["num_prefill_seqs"]), "num_prefill_tokens": float(step["num_prefill_tokens"]),
            "num_decode_tokens": float(step["num_decode_tokens"]), "context_tokens": float(step.get("context_tokens", 0)),
            "num_seqs": float(step["num_prefill_seqs"] + step["num_decode_tokens"]),
            "num_swapped_blocks": float(step.get("num_swapped_blocks", 0)), "block_size": float(bs)}


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min ||a x - b|| subject to x >= 0 (scipy's Lawson-Hanson)."""
    from scipy.optimize import nnls as scipy_nnls  # scipy: heavy, only to fit a profile

    x, _ = scipy_nnls(a, b, maxiter=50 * a.shape[1])
    return x


@dataclass
class FitError:
    median_rel: float
    p90_rel: float
    mean_rel: float
    n: int


PREFILL_CLASS_STEPS = 10  # a size class of prefill steps (a power of two of tokens) counts with this many steps


def prefill_power(tokens: np.ndarray, ratios: np.ndarray) -> tuple[float, float, tuple[float, float]]:
    """(factor at the geometric middle of the tokens' range, exponent, (lowest, highest) tokens) of
    ratio = factor * (tokens / middle)^exponent, fitted to the median log ratio of each size class of prefill steps
    (powers of two of tokens, those with PREFILL_CLASS_STEPS steps or more; weighted by the root of their counts):
    medians, so that a few slow steps (a page fault, a preempted core) do not tilt it. One class: the median ratio."""
    classes = np.round(np.log2(np.maximum(tokens, 1.0)))
    x, y, w = [], [], []
    for c in np.unique(classes):
        sel = classes == c
        if sel.sum() >= PREFILL_CLASS_STEPS:
            x.append(float(np.median(np.log(np.maximum(tokens[sel], 1.0)))))
            y.append(float(np.median(np.log(ratios[sel]))))
            w.append(float(np.sqrt(sel.sum())))
    if len(x) < 2:
        return float(np.median(ratios)), 0.0, (1.0, 1.0)
    slope, intercept = np.polyfit(x, y, 1, w=w)
    lo, hi = float(np.exp(min(x))), float(np.exp(max(x)))
    middle = 0.5 * (min(x) + max(x))
    return float(np.exp(intercept + slope * middle)), float(np.clip(slope, -1.0, 1.0)), (lo, hi)


@dataclass
class StepTimeModel:
    coef: dict[str, float]  # seconds per unit of each feature
    ranges: dict[str, list[float]]  # profiled [min, max] of each input
    gap_s: float = 0.0
    request_latency_s: float = 0.0
    token_latency_s: float = 0.0
    fit_error: FitError | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    # Measured / predicted step time of the profiled steps, sorted (at most NOISE_POINTS, evenly spaced quantiles):
    # the engine's own step-to-step variation (CPU contention, allocator, GC), which sets the tail of the TBT.
    noise: list[float] = field(default_factory=list)
    # A step that prefills takes this factor times its prediction (1.0 as fitted; a rescale to a machine whose
    # prefill and decode steps moved by different factors sets it, see rescaled), times
    # (prefill tokens / the geometric middle of prefill_tokens)^prefill_exponent, the tokens clipped to that range:
    # on another machine small prefill chunks and large prefills moved by different factors (0.6x and 0.9x the
    # profile in one run), a power of the chunk's size in between
    prefill_factor: float = 1.0
    prefill_exponent: float = 0.0
    prefill_tokens: tuple[float, float] = (1.0, 1.0)
    _warned: set[str] = field(default_factory=set, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.coef = {**self.coef, **{f: 0.0 for f in LATER_FEATURES if f not in self.coef}}

    # Fitting -----------------------------------------------------------------------------------------------
    @classmethod
    def fit(cls, steps: Iterable[Mapping[str, Any]], block_size: int | None = None, holdout: float = 0.2,
            seed: int = 0, gap_s: float = 0.0, request_latency_s: float = 0.0, token_latency_s: float = 0.0,
            meta: dict[str, Any] | None = None) -> StepTimeModel:
        """Fit to step records (dicts with the StepRecord fields; ``total_s`` is the target; each needs a
        ``block_size`` unless one is given). The error is measured on a random ``holdout`` share left out of a
        first fit; the saved coefficients are then fitted on all records."""
        steps = [s for s in steps if s["num_prefill_tokens"] + s["num_decode_tokens"] > 0]
        if len(steps) < len(FEATURES) * 2:
            raise ProfileError(f"{len(steps)} step records are too few to fit {len(FEATURES)} coefficients")
        inputs = [_inputs(s, block_size) for s in steps]
        x = np.array([feature_row(i["num_prefill_seqs"], i["num_prefill_tokens"], i["num_decode_tokens"],
                                  i["context_tokens"], i["block_size"], i["num_swapped_blocks"]) for i in inputs])
        y = np.array([float(s["total_s"]) for s in steps])
        if not (y > 0).all():
            raise ProfileError("step records need total_s > 0")
        rng = np.random.default_rng(seed)
        test = rng.random(len(y)) < holdout
        if test.sum() < 5 or (~test).sum() < len(FEATURES):
            test = np.zeros(len(y), dtype=bool)
        error = None
        if test.any():
            w = _solve(x[~test], y[~test])
            error = _error(x[test] @ w, y[test])
        w = _solve(x, y)
        if error is None:
            error = _error(x @ w, y)
        ranges = {k: [min(i[k] for i in inputs), max(i[k] for i in inputs)] for k in INPUTS}
        pred = x @ w
        ratios = np.sort(y[pred > 0] / pred[pred > 0])
        noise = np.quantile(ratios, np.linspace(0, 1, NOISE_POINTS)) if len(ratios) > NOISE_POINTS else ratios
        return cls(coef=dict(zip(FEATURES, map(float, w))), ranges=ranges, gap_s=gap_s,
                   request_latency_s=request_latency_s, token_latency_s=token_latency_s, fit_error=error,
                   meta=dict(meta or {}), noise=[float(v) for v in noise])

    def refit(self, steps: Iterable[Mapping[str, Any]], block_size: int | None = None) -> StepTimeModel:
        """The same model (latencies, meta) fitted anew to other step records, e.g. a real trial's own."""
        return StepTimeModel.fit(steps, block_size, gap_s=self.gap_s, request_latency_s=self.request_latency_s,
                                 token_latency_s=self.token_latency_s, meta=self.meta)

    def rescaled(self, steps: Iterable[Mapping[str, Any]], block_size: int | None = None,
                 min_steps: int = MIN_RESCALE_STEPS) -> StepTimeModel | None:
        """This model rescaled to ``steps`` (a real trial's): decode-only steps by the median measured/predicted
        ratio of those among ``steps``; steps that prefill by a power of their prefill tokens fitted to theirs
        (:func:`prefill_power`: a machine's matrix units and its memory bandwidth move differently from the
        calibration CPU's, and small chunks differently from large prefills: one run's decode steps ran 0.54x the
        profile, its 16-token prefill steps 0.59x, its 256-token ones 0.91x). A side with fewer than ``min_steps``
        records takes the median of all. The model's shape is not refitted (one trial's few step shapes could not
        pin it down), and the step-to-step variation stays the profile's: measured over all calibration configs,
        it is a broader sample than one trial's (with the trial's own, held-out p99 TBT predictions got worse in the
        fidelity benchmark). None when fewer than ``min_steps`` records do work."""
        steps = [s for s in steps if s["num_prefill_tokens"] + s["num_decode_tokens"] > 0 and s["total_s"] > 0]
        if len(steps) < min_steps:
            return None
        plain = replace(self, prefill_factor=1.0, prefill_exponent=0.0, _warned=set())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ExtrapolationWarning)  # a trial's own shapes may leave the profile
            pred = np.array([plain.predict_record(s, block_size) for s in steps])
        y = np.array([float(s["total_s"]) for s in steps])
        tokens = np.array([s["num_prefill_tokens"] for s in steps], dtype=float)
        batches = np.array([s["num_decode_tokens"] for s in steps], dtype=float)
        prefills = np.array([s["num_prefill_seqs"] > 0 for s in steps])
        ok = pred > 0
        overall = float(np.median(y[ok] / pred[ok]))
        decoding, prefilling = ok & ~prefills, ok & prefills
        decode = float(np.median(y[decoding] / pred[decoding])) if decoding.sum() >= min_steps else overall
        if prefilling.sum() >= min_steps:
            prefill, exponent, lo_hi = prefill_power(tokens[prefilling], y[prefilling] / pred[prefilling])
        else:
            prefill, exponent, lo_hi = overall, 0.0, (1.0, 1.0)
        by_batch = batch_errors(batches[decoding], y[decoding] / (pred[decoding] * decode))
        # the prefill steps' residual after their power law, by the step's prefill tokens (what a config's token
        # budget bounds): a chunk size the law fits badly shows here
        lo, hi = lo_hi
        law = prefill * (np.clip(tokens, lo, hi) / math.sqrt(lo * hi)) ** exponent
        by_tokens = batch_errors(tokens[prefilling], y[prefilling] / (pred[prefilling] * law[prefilling]))
        return StepTimeModel(coef={k: v * decode for k, v in self.coef.items()}, ranges=self.ranges,
                             gap_s=self.gap_s, request_latency_s=self.request_latency_s,
                             token_latency_s=self.token_latency_s, fit_error=self.fit_error, noise=list(self.noise),
                             prefill_factor=prefill / decode, prefill_exponent=exponent, prefill_tokens=lo_hi,
                             meta={**self.meta, "rescaled": {"scale": decode, "prefill_scale": prefill,
                                                            "prefill_exponent": exponent,
                                                            "prefill_tokens": list(lo_hi),
                                                            "steps": int(ok.sum()),
                                                            "prefill_steps": int(prefilling.sum()),
                                                            "decode_errors": by_batch,
                                                            "prefill_errors": by_tokens}})

    def batch_error(self, max_seqs: int | None) -> float | None:
        """The rescaled model's relative error on the decode batches a config of ``max_seqs`` can run
        (:mod:`batch_error`); None before a rescale or without a measured bin."""
        return worst_batch_error(((self.meta.get("rescaled") or {}).get("decode_errors")) or [], max_seqs)

    def prefill_error(self, max_tokens: int | None) -> float | None:
        """The rescaled model's relative error on the prefill steps a config whose steps hold at most ``max_tokens``
        tokens can run (by power-of-two bins of a step's prefill tokens, :mod:`batch_error`); None before a rescale
        or without a measured bin."""
        return worst_batch_error(((self.meta.get("rescaled") or {}).get("prefill_errors")) or [], max_tokens)

    # Predicting ---------------------------------------------------------------------------------------------
    def predict(self, num_prefill_seqs: int, num_prefill_tokens: int, num_decode_tokens: int, context_tokens: int,
                block_size: int, num_swapped_blocks: int = 0) -> float:
        """Seconds of one step (warns once per input that lies outside the profiled range)."""
        self.check_range({"num_prefill_seqs": num_prefill_seqs, "num_prefill_tokens": num_prefill_tokens,
                          "num_decode_tokens": num_decode_tokens, "context_tokens": context_tokens,
                          "num_seqs": num_prefill_seqs + num_decode_tokens, "num_swapped_blocks": num_swapped_blocks,
                          "block_size": block_size})
        row = feature_row(num_prefill_seqs, num_prefill_tokens, num_decode_tokens, context_tokens, block_size,
                          num_swapped_blocks)
        t = float(sum(self.coef[f] * v for f, v in zip(FEATURES, row)))
        return t * self.prefill_factor_at(num_prefill_tokens) if num_prefill_seqs else t

    def prefill_factor_at(self, prefill_tokens: int) -> float:
        """The factor of a step that prefills ``prefill_tokens`` tokens."""
        if not self.prefill_exponent:
            return self.prefill_factor
        lo, hi = self.prefill_tokens
        return self.prefill_factor * (min(max(prefill_tokens, lo), hi) / math.sqrt(lo * hi)) ** self.prefill_exponent

    def predict_record(self, step: Mapping[str, Any], block_size: int | None = None) -> float:
        i = _inputs(step, block_size)
        return self.predict(int(i["num_prefill_seqs"]), int(i["num_prefill_tokens"]), int(i["num_decode_tokens"]),
                            int(i["context_tokens"]), int(i["block_size"]), int(i["num_swapped_blocks"]))

    def bind(self, block_size: int, seed: int | None = 0) -> StepFn:
        """A fast step function for one block size (no range checks: the simulator checks the ranges of all its
        steps at the end, with :meth:`check_range`). With a ``seed`` (and a profile that measured it), each step
        is scaled by a ratio drawn from the profiled step-to-step variation; ``seed=None``: the plain prediction."""
        self.check_range({"block_size": block_size})
        noise = self.noise if seed is not None and self.noise else None
        draw = random.Random(seed).random
        n_noise = len(noise) if noise else 0
        c = self.coef
        c0, c_tok, c_seq, c_pseq = c["const"], c["tokens"], c["seqs"], c["prefill_seqs"]
        c_ctx = c["context_tokens"] + c["context_blocks"] / block_size
        c_sq, c_swap, c_pstep = c["prefill_square"], c["swapped_blocks"], c["prefill_step"]
        pf = self.prefill_factor
        factor_at = self.prefill_factor_at if self.prefill_exponent else None

        def step_time(prefill_seqs: int, prefill_tokens: int, decode_tokens: int, context_tokens: int,
                      swapped_blocks: int) -> float:
            t = c0 + c_tok * (prefill_tokens + decode_tokens) + c_seq * (prefill_seqs + decode_tokens) \
                + c_ctx * context_tokens
            if swapped_blocks:
                t += c_swap * swapped_blocks
            if prefill_seqs:
                t += c_pstep + c_pseq * prefill_seqs + c_sq * prefill_tokens * prefill_tokens / prefill_seqs
                t *= pf if factor_at is None else factor_at(prefill_tokens)
            return t

        if noise is None:
            return step_time

        def noisy_step_time(prefill_seqs: int, prefill_tokens: int, decode_tokens: int, context_tokens: int,
                            swapped_blocks: int) -> float:
            return step_time(prefill_seqs, prefill_tokens, decode_tokens, context_tokens, swapped_blocks) \
                * noise[int(draw() * n_noise)]

        return noisy_step_time

    def check_range(self, observed: Mapping[str, float | tuple[float, float]]) -> list[str]:
        """Warn (ExtrapolationWarning, once per input and model) for every input whose observed value, or
        (min, max), leaves the profiled range. Returns the inputs that left it."""
        out = []
        for name, value in observed.items():
            lo_hi = self.ranges.get(name)
            if lo_hi is None:
                continue
            lo, hi = (value if isinstance(value, tuple) else (value, value))
            # Counts below the smallest profiled step are not checked: such a step costs between the fitted
            # per-step floor (const) and the smallest profiled one, a bounded guess; above the range nothing bounds it.
            if (name in LOWER_CHECKED and lo < lo_hi[0]) or hi > lo_hi[1]:
                out.append(name)
                if name not in self._warned:
                    self._warned.add(name)
                    warnings.warn(ExtrapolationWarning(
                        f"step-time model: {name} {_fmt(lo)}..{_fmt(hi)} leaves the profiled range "
                        f"{_fmt(lo_hi[0])}..{_fmt(lo_hi[1])}; predictions there are extrapolated (calibrate with "
                        f"shapes that cover it: slotune calibrate)"), stacklevel=2)
        return out

    # Files --------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"format": PROFILE_FORMAT, "features": list(FEATURES), "coef": dict(self.coef),
                "ranges": {k: list(v) for k, v in self.ranges.items()},
                "gap_s": self.gap_s, "request_latency_s": self.request_latency_s,
                "token_latency_s": self.token_latency_s,
                "fit_error": asdict(self.fit_error) if self.fit_error else None, "noise": self.noise,
                "prefill_factor": self.prefill_factor, "prefill_exponent": self.prefill_exponent,
                "prefill_tokens": list(self.prefill_tokens), "meta": self.meta}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "profile") -> StepTimeModel:
        if d.get("format") != PROFILE_FORMAT:
            raise ProfileError(f"{source}: not a step-time profile (format {d.get('format')!r}, expected "
                               f"{PROFILE_FORMAT!r})")
        coef = d.get("coef") or {}
        missing = [f for f in FEATURES if f not in coef and f not in LATER_FEATURES]
        if missing:
            raise ProfileError(f"{source}: coef lacks {', '.join(missing)}")
        fe = d.get("fit_error")
        return cls(coef={k: float(coef[k]) for k in FEATURES if k in coef},
                   ranges={k: [float(v[0]), float(v[1])] for k, v in (d.get("ranges") or {}).items()},
                   gap_s=float(d.get("gap_s", 0.0)), request_latency_s=float(d.get("request_latency_s", 0.0)),
                   token_latency_s=float(d.get("token_latency_s", 0.0)),
                   fit_error=FitError(**fe) if fe else None, meta=dict(d.get("meta") or {}),
                   noise=[float(v) for v in d.get("noise") or []],
                   prefill_factor=float(d.get("prefill_factor", 1.0)),
                   prefill_exponent=float(d.get("prefill_exponent", 0.0)),
                   prefill_tokens=tuple(float(v) for v in d.get("prefill_tokens", (1.0, 1.0))))  # type: ignore[arg-type]

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> StepTimeModel:
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, ValueError) as error:
            raise ProfileError(f"cannot read profile {path}: {error}") from None
        return cls.from_dict(d, str(path))


def _solve(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    # Relative error: each row divided by its target. Columns scaled to unit norm for conditioning.
    a = x / y[:, None]
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1.0
    return nnls(a / norms, np.ones(len(y))) / norms


def _error(pred: np.ndarray, y: np.ndarray) -> FitError:
    rel = np.abs(pred - y) / y
    return FitError(median_rel=float(np.median(rel)), p90_rel=float(np.percentile(rel, 90)),
                    mean_rel=float(rel.mean()), n=int(len(y)))


def _fmt(v: float) -> str:
    return f"{v:g}" if math.isfinite(v) else str(v)
