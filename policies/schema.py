"""The policy document's schema, validated by pydantic. The knob part is derived from the engine's knob table
(engine.knobs): one optional entry per knob in ``search_space`` and ``fixed``, each value checked as the engine
checks it. :func:`validate_document` turns pydantic's errors into a :class:`PolicyError` that names the field
(``search_space.max_num_seqs.low: must be <= high (2), got 8``).
"""

from __future__ import annotations

import math
import re
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, ValidationError, create_model, model_validator
from pydantic_core import ErrorDetails

from engine.knobs import KNOB_BY_NAME, KNOB_NAMES, KNOBS, Knob
from slotune.slo import NAMES as SLO_NAMES
from slotune.slo import SLO
from slotune.units import parse_duration

Sampler = Literal["tpe", "gp", "random", "grid", "nsga2"]
Objective = Literal["goodput", "capacity"]
Start = Literal["structured", "random"]  # TPE's first trials: tuner.search.structured_start, or Optuna's random start-up

_CONSTRAINT = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*|[-+]?\d+(?:\.\d*)?)\s*(<=|>=)\s*"
                         r"([A-Za-z_][A-Za-z0-9_]*|[-+]?\d+(?:\.\d*)?)\s*$")


class PolicyError(ValueError):
    """A bad policy value; the message starts with the field's path."""

    def __init__(self, field_path: str, message: str) -> None:
        super().__init__(f"{field_path}: {message}")
        self.field = field_path
        self.message = message


class At(ValueError):
    """Raised inside a validator: the error belongs to `sub` (a path below the value being validated)."""

    def __init__(self, sub: str, message: str) -> None:
        super().__init__(message)
        self.sub = sub


# ------------------------------------------------------------------------------------------ scalar validators

def _positive_seconds(value: Any) -> float:
    if value is None:
        raise ValueError("is required (a duration such as 50ms)")
    seconds = parse_duration(value)
    if seconds <= 0:
        raise ValueError(f"must be > 0, got {value!r}")
    return seconds


def _optional_positive_seconds(value: Any) -> float | None:
    return None if value is None else _positive_seconds(value)


def _seconds_or_zero(value: Any) -> float:
    return parse_duration(0 if value is None else value)


def _seconds(value: Any) -> float:
    return parse_duration(value)


def _rate(value: Any) -> float | None:
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    try:
        rate = float(value) if isinstance(value, (str, int, float)) and not isinstance(value, bool) else math.nan
    except ValueError:
        rate = math.nan
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"must be a number of requests/s > 0 or 'auto', got {value!r}")
    return rate


PositiveSeconds = Annotated[float, PlainValidator(_positive_seconds)]
OptionalPositiveSeconds = Annotated[float | None, PlainValidator(_optional_positive_seconds)]
Seconds = Annotated[float, PlainValidator(_seconds_or_zero)]  # None is 0
Duration = Annotated[float, PlainValidator(_seconds)]  # a duration >= 0, required
Rate = Annotated[float | None, PlainValidator(_rate)]


def _knob_value(knob: Knob, allow_none: bool) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if value is None and not allow_none:
            raise ValueError(f"{knob.allowed()}, got None")
        reason = knob.check(value)
        if reason is not None:
            raise ValueError(f"{reason}, got {value!r}")
        return knob.type(value) if knob.numeric and value is not None else value

    return check


def _step(knob: Knob) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, knob.type if knob.type is int else (int, float)) or \
                not value > 0:
            raise ValueError(f"must be {'an integer' if knob.type is int else 'a number'} > 0, got {value!r}")
        return knob.type(value)

    return check


def _constraint(text: Any) -> tuple[str | float, str, str | float]:
    if not isinstance(text, str):
        raise ValueError(f"must be a string such as 'chunk_size <= max_num_batched_tokens', got {text!r}")
    m = _CONSTRAINT.match(text)
    if not m:
        raise ValueError(f"cannot parse {text!r}: use 'KNOB <= KNOB', 'KNOB >= KNOB' or a number on one side")
    sides: list[str | float] = []
    for raw in (m.group(1), m.group(3)):
        if raw[0].isalpha() or raw[0] == "_":
            if raw not in KNOB_BY_NAME:
                raise ValueError(f"unknown knob {raw!r}; knobs: {', '.join(KNOB_NAMES)}")
            if not KNOB_BY_NAME[raw].numeric:
                raise ValueError(f"knob {raw!r} is not numeric")
            sides.append(raw)
        else:
            sides.append(float(raw))
    if not any(isinstance(s, str) for s in sides):
        raise ValueError("needs at least one knob")
    return sides[0], m.group(2), sides[1]


# ------------------------------------------------------------------------------------------------- models

class Doc(BaseModel):
    """A mapping of a policy document: unknown fields, values of another type and non-finite numbers are errors."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


class KnobRangeDoc(Doc):
    """How one knob is searched: ``choices`` (a list is short for it), or ``low``..``high`` with ``log``/``step``.
    One subclass per knob (:data:`RANGE_MODELS`) types low, high, step and the choices as that knob."""

    knob: ClassVar[Knob]
    low: Any = None
    high: Any = None
    log: bool = False
    step: Any = None
    choices: list[Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _shape(cls, data: Any) -> Any:
        if isinstance(data, list):
            data = {"choices": data}
        if not isinstance(data, dict):
            return data  # pydantic says "must be a mapping"
        known = ("low", "high", "log", "step", "choices")
        for key in data:
            if key not in known:
                raise At(str(key), f"unknown field; known: {', '.join(known)}")
        if "choices" in data:
            if set(data) - {"choices"}:
                raise At("", "give either `choices` or `low`/`high`, not both")
            if not isinstance(data["choices"], list) or not data["choices"]:
                raise At("choices", "must be a non-empty list")
            return data
        if not cls.knob.numeric:
            raise At("", f"a {cls.knob.type.__name__} knob needs `choices`")
        for key in ("low", "high"):
            if key not in data:
                raise At(key, "is required (or give `choices`)")
        return data

    @model_validator(mode="after")
    def _consistent(self) -> KnobRangeDoc:
        if self.choices is not None:
            if len(set(map(repr, self.choices))) != len(self.choices):
                raise At("choices", "has duplicates")
        elif self.low > self.high:
            raise At("low", f"must be <= high ({self.high}), got {self.low}")
        elif self.step is not None and self.log:
            raise At("step", "cannot be combined with log: true")
        return self


def _range_model(knob: Knob) -> type[KnobRangeDoc]:
    value = Annotated[Any, PlainValidator(_knob_value(knob, allow_none=True))]
    bound = Annotated[Any, PlainValidator(_knob_value(knob, allow_none=False))]
    step = Annotated[Any, PlainValidator(_step(knob))]
    model = create_model(f"{knob.name}_range", __base__=KnobRangeDoc, low=(bound | None, None),
                         high=(bound | None, None), step=(step | None, None), choices=(list[value] | None, None))
    model.knob = knob
    return model


RANGE_MODELS: dict[str, type[KnobRangeDoc]] = {k.name: _range_model(k) for k in KNOBS}
if TYPE_CHECKING:  # built at import time from the knob table: one optional entry per knob
    SearchSpaceDoc = Doc
    FixedDoc = Doc
else:
    SearchSpaceDoc = create_model(
        "SearchSpaceDoc", __base__=Doc, **{k.name: (RANGE_MODELS[k.name] | None, None) for k in KNOBS})
    FixedDoc = create_model(
        "FixedDoc", __base__=Doc,
        **{k.name: (Annotated[Any, PlainValidator(_knob_value(k, allow_none=k.optional))], None) for k in KNOBS})


def _slo(value: Any) -> SLO:
    """The ``slo`` section as the one SLO record: tbt_p99 required, the others optional, each a positive duration."""
    if not isinstance(value, dict):
        raise ValueError(f"must be a mapping of targets ({', '.join(SLO_NAMES)}), got {type(value).__name__}")
    for key in value:
        if key not in SLO_NAMES:
            raise At(str(key), f"unknown field; known: {', '.join(SLO_NAMES)}")
    targets: dict[str, float | None] = {}
    for key in SLO_NAMES:
        try:
            targets[key] = (_positive_seconds if key == "tbt_p99" else _optional_positive_seconds)(value.get(key))
        except ValueError as error:
            raise At(key, str(error)) from None
    return SLO(**targets)


# No defaults here: a policy is read over the shipped default.yaml, the one home of every default (policies.policy).
class WorkloadDoc(Doc):
    name: str = Field(min_length=1)
    length_scale: float = Field(gt=0)
    mix: str | None
    mix_weights: str | None
    time_scale: float | None = Field(gt=0)
    trace_offset: Seconds  # seconds of the trace's own timeline to skip (traces often start sparse)
    max_context: int | None = Field(ge=2)
    output_scale: float | None = Field(gt=0)  # output lengths' own scale (None: length_scale scales them)


class MeasurementDoc(Doc):
    level: float = Field(gt=0.5, lt=1.0)
    min_gaps: int = Field(ge=1)
    cap: PositiveSeconds
    block: PositiveSeconds
    busy: float | None = Field(gt=0)  # cores; null: other processes' CPU is recorded, not judged


class CapacityDoc(Doc):
    resolution: float = Field(gt=0)
    max_probes: int = Field(ge=1)
    start_rate: float = Field(gt=0)


class VerdictDoc(Doc):
    candidates: int = Field(ge=1)
    max_rounds: int = Field(ge=2)
    budget: PositiveSeconds
    window: PositiveSeconds


class PruningDoc(Doc):
    enabled: bool
    min_gaps: int = Field(ge=1)
    violation_share: float = Field(ge=0.01, le=1.0)
    min_elapsed: float = Field(ge=0.0, le=1.0)


class PolicyDoc(Doc):
    slo: Annotated[SLO, PlainValidator(_slo)]
    search_space: SearchSpaceDoc
    fixed: FixedDoc
    constraints: list[Annotated[tuple[str | float, str, str | float], PlainValidator(_constraint)]]
    sampler: Sampler
    start: Start
    objective: Objective
    trials: int = Field(ge=1)
    trial_duration: PositiveSeconds
    warmup: Seconds
    server_warmup: Seconds
    seed: int = Field(ge=0)
    workload: WorkloadDoc
    rate: Rate  # None: auto
    pruning: PruningDoc
    measurement: MeasurementDoc
    capacity: CapacityDoc
    verdict: VerdictDoc
    time_budget: PositiveSeconds  # capacity objective: the whole run; the engine's searches stop in time
    # the controller's sections, validated by policies.control (against the validated search space)
    guardrails: Any = None
    triggers: Any = None
    canary: Any = None
    retune: Any = None
    name: Any = None
    description: Any = None

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_empty(cls, data: Any) -> Any:
        if isinstance(data, dict):
            empty: dict[str, Any] = {"search_space": {}, "fixed": {}, "constraints": []}
            data = {**data, **{k: v for k, v in empty.items() if data.get(k) is None}}
        return data

    @model_validator(mode="after")
    def _knobs(self) -> PolicyDoc:
        searched = self.search_space.model_fields_set
        if not searched:
            raise At("search_space", "must name at least one knob to search")
        for name in sorted(self.fixed.model_fields_set & searched):
            raise At(f"fixed.{name}", "is also in search_space")
        if self.measurement.cap < self.trial_duration:
            raise At("measurement.cap", f"must be >= trial_duration ({self.trial_duration:g}s), got "
                                        f"{self.measurement.cap:g}s")
        if self.time_budget <= self.verdict.budget:
            raise At("time_budget", f"must be more than verdict.budget ({self.verdict.budget:g}s), got {self.time_budget:g}s")
        return self


# ------------------------------------------------------------------------------------------------- errors

_PHRASES: dict[str, Callable[[dict[str, Any], Any], str]] = {
    "missing": lambda ctx, got: "is required",
    "int_type": lambda ctx, got: f"must be an integer, got {got!r}",
    "int_from_float": lambda ctx, got: f"must be an integer, got {got!r}",
    "float_type": lambda ctx, got: f"must be a number, got {got!r}",
    "bool_type": lambda ctx, got: f"must be true or false, got {got!r}",
    "string_type": lambda ctx, got: f"must be a string, got {got!r}",
    "string_too_short": lambda ctx, got: "must not be empty",
    "model_type": lambda ctx, got: f"must be a mapping, got {type(got).__name__}",
    "model_attributes_type": lambda ctx, got: f"must be a mapping, got {type(got).__name__}",
    "dict_type": lambda ctx, got: f"must be a mapping, got {type(got).__name__}",
    "list_type": lambda ctx, got: f"must be a list, got {type(got).__name__}",
    "literal_error": lambda ctx, got: f"must be one of {ctx['expected']}, got {got!r}",
    "greater_than": lambda ctx, got: f"must be > {ctx['gt']}, got {got!r}",
    "greater_than_equal": lambda ctx, got: f"must be >= {ctx['ge']}, got {got!r}",
    "less_than": lambda ctx, got: f"must be < {ctx['lt']}, got {got!r}",
    "less_than_equal": lambda ctx, got: f"must be <= {ctx['le']}, got {got!r}",
    "finite_number": lambda ctx, got: f"must be finite, got {got!r}",
}


def _model_at(loc: tuple[int | str, ...], root: type[BaseModel]) -> type[BaseModel] | None:
    """The model whose fields `loc` names (for the list of known fields), or None."""
    model, parts = root, list(loc)
    while parts:
        field = model.model_fields.get(str(parts.pop(0)))
        if field is None:
            return None
        annotation = field.annotation
        if typing.get_origin(annotation) is dict and parts:  # a mapping of models by name: the next part is a name
            annotation = typing.get_args(annotation)[1]
            parts.pop(0)
        inner = [a for a in (annotation, *typing.get_args(annotation))
                 if isinstance(a, type) and issubclass(a, BaseModel)]
        if not inner:
            return None
        model = inner[0]
    return model


def _path(loc: tuple[int | str, ...], sub: str = "") -> str:
    text = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
    return ".".join(p for p in (text, sub) if p) or "policy"


def _policy_error(error: ErrorDetails, root: type[BaseModel]) -> PolicyError:
    loc, kind, ctx = tuple(error["loc"]), error["type"], error.get("ctx") or {}
    cause = ctx.get("error")
    if isinstance(cause, At):
        return PolicyError(_path(loc, cause.sub), str(cause))
    if kind == "extra_forbidden":
        if root is PolicyDoc and loc[:1] in (("search_space",), ("fixed",)):
            return PolicyError(_path(loc), f"unknown knob; knobs: {', '.join(KNOB_NAMES)}")
        model = _model_at(loc[:-1], root)
        known = f"; known: {', '.join(model.model_fields)}" if model is not None else ""
        return PolicyError(_path(loc), f"unknown field{known}")
    if cause is not None:
        return PolicyError(_path(loc), str(cause))
    phrase = _PHRASES.get(kind)
    return PolicyError(_path(loc), phrase(ctx, error.get("input")) if phrase else error["msg"])


M = typing.TypeVar("M", bound=BaseModel)


def validate_as(model: type[M], data: Any, context: dict[str, Any] | None = None) -> M:
    """``data`` validated as ``model`` (``context``: what its validators may read); the first error raised as a
    PolicyError naming its field."""
    try:
        return model.model_validate(data, context=context)
    except ValidationError as error:
        raise _policy_error(error.errors()[0], model) from None


def validate_document(data: Any) -> PolicyDoc:
    """The validated document; the first error raised as a PolicyError naming its field."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise PolicyError("policy", f"must be a mapping, got {type(data).__name__}")
    return validate_as(PolicyDoc, data)
