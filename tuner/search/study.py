"""The Optuna study of ``tune``: storage (SQLite file, any RDB URL, or a journal file), sampler, the trial loop
shared safely by several processes and the best trial (the offered rate of ``--rate auto``: tuner/search/auto_rate.py).

Several ``tune`` processes may share one study (an RDB or journal storage) against several engines: each counts
the study's finished and running trials before it asks for the next one, so together they run the requested
number. A rerun with the same study name resumes: finished trials are kept, trials of a process that died (here:
its pid is gone; on another machine: its heartbeat stopped) are marked failed and run again, and the default
config (enqueued as the first trial) is measured once.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

import optuna
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from policies import Policy
from tuner.search.objective import (CONSTRAINTS_ATTR, Evaluation, constraints_func, evaluate_capacity, evaluate_goodput,
                             meets_constraints, suggest_knobs)
from tuner.measure.capacity import CapacitySearcher, capacity_searcher
from tuner.search.samplers import SamplerWithoutDefaultTrial
from tuner.search.structured_start import enqueue_start, startup_trials
# ROLE_DEFAULT, SURPLUS_ATTR: re-exported, where the tuner's commands and tests have imported them from
from tuner.search.trial_record import (ROLE_DEFAULT as ROLE_DEFAULT, SURPLUS_ATTR as SURPLUS_ATTR, TrialRecord,
                                       default_attrs, heartbeat_attrs, measured_attrs, owner_attrs, stamp,
                                       surplus_attrs)
from tuner.trials.trial_backend import TrialBackend
from tuner.trials.trial_runner import TrialOutcome, TrialRunner, check_stop

DEFAULT_STORAGE = "sqlite:///tune-study.db"
# A running trial stamps "heartbeat" (wall-clock seconds) this often; one silent for HEARTBEAT_STALE_S belongs to
# a tune process that died on another machine (on this machine a dead pid says so at once).
HEARTBEAT_INTERVAL_S = 15.0
HEARTBEAT_STALE_S = 120.0
OWNERLESS_GRACE_S = 5.0  # a RUNNING trial with no owner this long after its start was left by a killed process
# constraints_func is what the interface with the dashboard names (system attr "constraints"); Optuna 5 prefers
# Trial.set_constraint but keeps it. Experimental-feature notices are noise on a tune progress screen.
warnings.filterwarnings("ignore", category=FutureWarning, module=r"optuna\..*")
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)


class StorageError(ValueError):
    """A --storage value that cannot be used; the message says why."""


def open_storage(spec: str | None) -> optuna.storages.BaseStorage:
    """``None`` -> ./tune-study.db; ``sqlite:///F``/``postgresql://...`` (any SQLAlchemy URL) -> RDBStorage;
    ``journal:PATH`` or ``PATH.journal`` -> JournalStorage on a file; ``PATH.db``/``.sqlite`` -> SQLite file."""
    spec = spec or DEFAULT_STORAGE
    try:
        if spec.startswith("journal:") or spec.endswith(".journal"):
            path = spec[len("journal:"):] if spec.startswith("journal:") else spec
            if not path:
                raise StorageError("journal storage needs a file: journal:PATH")
            Path(path).expanduser().resolve().parent.mkdir(parents=True, exist_ok=True)
            return optuna.storages.JournalStorage(JournalFileBackend(str(Path(path).expanduser())))
        if "://" not in spec:
            if Path(spec).suffix.lower() in (".db", ".sqlite", ".sqlite3"):
                spec = "sqlite:///" + str(Path(spec).expanduser().resolve())
            else:
                raise StorageError(f"{spec!r} is neither a database URL (sqlite:///FILE, postgresql://...) nor a "
                                   "journal file (journal:PATH or PATH.journal) nor a .db file")
        spec = _postgres_driver(spec)
        if spec.startswith("sqlite:///"):
            Path(spec[len("sqlite:///"):]).expanduser().resolve().parent.mkdir(parents=True, exist_ok=True)
        # no heartbeats: the trial loop is ask/tell (Optuna beats only inside Study.optimize); trials of dead
        # processes are found by recover_orphans
        return optuna.storages.RDBStorage(spec, engine_kwargs={"pool_pre_ping": True}
                                          if not spec.startswith("sqlite") else None)
    except StorageError:
        raise
    except Exception as error:  # SQLAlchemy/driver errors come in many types
        text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise StorageError(f"cannot open {_masked(spec)!r}: {text}") from None


def _masked(url: str) -> str:
    """The URL without its password (error messages end up in logs)."""
    try:
        from sqlalchemy.engine import make_url  # sqlalchemy: heavy, only for a database URL's error
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not a URL at all
        return url


def _postgres_driver(url: str) -> str:
    """``postgresql://`` means psycopg2 to SQLAlchemy; use psycopg (3), the driver slotune installs, when psycopg2
    is absent."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix) and importlib.util.find_spec("psycopg2") is None \
                and importlib.util.find_spec("psycopg") is not None:
            return "postgresql+psycopg://" + url[len(prefix):]
    return url


def make_sampler(policy: Policy, seed: int | None = None) -> optuna.samplers.BaseSampler:
    seed = policy.seed if seed is None else seed
    startup = startup_trials(policy)
    # The model-based samplers must not see the default-config trial (no params: see tuner/search/samplers.py).
    if policy.sampler == "tpe":
        return SamplerWithoutDefaultTrial(optuna.samplers.TPESampler(
            seed=seed, n_startup_trials=startup, constraints_func=constraints_func, multivariate=True))
    if policy.sampler == "gp":
        return SamplerWithoutDefaultTrial(optuna.samplers.GPSampler(
            seed=seed, n_startup_trials=startup, constraints_func=constraints_func))
    if policy.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if policy.sampler == "grid":
        return optuna.samplers.GridSampler({k.name: k.grid_values() for k in policy.search_space}, seed=seed)
    if policy.sampler == "nsga2":
        return SamplerWithoutDefaultTrial(optuna.samplers.NSGAIISampler(
            seed=seed, population_size=max(4, min(20, policy.trials // 2)), constraints_func=constraints_func))
    raise ValueError(f"unknown sampler {policy.sampler!r}")


def directions(policy: Policy) -> list[Literal["maximize", "minimize"]]:
    # NSGA-II: the Pareto front of goodput against p99 TBT
    return ["maximize", "minimize"] if policy.sampler == "nsga2" else ["maximize"]


def open_study(storage: optuna.storages.BaseStorage, name: str, policy: Policy) -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(storage=storage, study_name=name, sampler=make_sampler(policy),
                                directions=directions(policy), load_if_exists=True)
    want = len(directions(policy))
    if len(study.directions) != want:
        raise StorageError(f"study {name!r} exists with {len(study.directions)} objective(s); the {policy.sampler} "
                           f"sampler needs {want}: use another --study-name")
    return study


def recover_orphans(study: optuna.Study, now: float | None = None) -> list[int]:
    """Mark failed the RUNNING trials of tune processes that no longer exist, so their slot is run again; returns
    their numbers. On this machine: the trial's pid is gone (kill -9). Elsewhere: its heartbeat (see
    :class:`Heartbeat`) is older than HEARTBEAT_STALE_S."""
    failed = []
    host = socket.gethostname()
    now = time.time() if now is None else now
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        record = TrialRecord.from_trial(t)
        if record.host == host and record.pid is not None:
            dead = not _pid_alive(record.pid)
        elif record.host is None and record.pid is None and record.heartbeat is None:
            # asked and never owned: its process died between the ask and naming itself its owner, which a live one
            # does within milliseconds
            started = t.datetime_start.timestamp() if t.datetime_start else now
            dead = now - started > OWNERLESS_GRACE_S
        else:
            beat = record.heartbeat
            if beat is None:
                beat = t.datetime_start.timestamp() if t.datetime_start else now
            dead = now - beat > HEARTBEAT_STALE_S
        if not dead:
            continue
        try:
            study.tell(t.number, state=TrialState.FAIL)
            failed.append(t.number)
        except (RuntimeError, ValueError):
            pass  # someone else got there first
    return failed


class Heartbeat:
    """While a trial runs, stamp its "heartbeat" user attr every ``interval`` seconds from a background thread, so
    tune processes on other machines can tell a live trial from one whose process died (recover_orphans)."""

    def __init__(self, trial: optuna.Trial, interval: float = HEARTBEAT_INTERVAL_S) -> None:
        self.trial = trial
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"heartbeat-{trial.number}", daemon=True)

    def _beat(self) -> None:
        while True:
            try:
                stamp(self.trial, heartbeat_attrs(time.time()))
            except Exception:  # a storage hiccup must not kill the trial; the next beat retries
                pass
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> "Heartbeat":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (killed, not yet reaped by its parent) is dead too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


# Trials that use up the budget: finished (complete or pruned) and running ones.
COUNTED_STATES = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)


def counted_trials(study: optuna.Study) -> int:
    return len(study.get_trials(deepcopy=False, states=COUNTED_STATES))


def is_surplus(study: optuna.Study, number: int, n_trials: int) -> bool:
    """Whether trial ``number`` is over the budget: processes sharing a study may each count n-1 trials and ask one;
    the first ``n_trials`` counted trials by number keep their slot, so exactly one of the racers runs."""
    earlier = [t for t in study.get_trials(deepcopy=False, states=COUNTED_STATES) if t.number < number]
    return len(earlier) >= n_trials


def enqueue_default(study: optuna.Study) -> bool:
    """Enqueue the engine's default config as the study's first trial (again if its run was lost). It asks for no
    params, so samplers (the grid's included) ignore it; its knobs are the runner's base config."""
    live = (TrialState.COMPLETE, TrialState.RUNNING, TrialState.WAITING)
    if any(TrialRecord.from_trial(t).role == ROLE_DEFAULT and t.state in live
           for t in study.get_trials(deepcopy=False)):
        return False
    study.enqueue_trial({}, user_attrs=default_attrs())
    return True


def feasible(t: optuna.trial.FrozenTrial) -> bool:
    return bool(TrialRecord.from_trial(t).feasible) and meets_constraints(t)


def measured(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if TrialRecord.from_trial(t).measured]


def best_trial(study: optuna.Study) -> optuna.trial.FrozenTrial | None:
    """The feasible trial with the highest objective value (ties: lower p99 TBT); None when none is feasible."""
    ok = [t for t in measured(study) if feasible(t)]
    if not ok:
        return None
    return max(ok, key=lambda t: (t.values[0], -(_summary(t).get("tbt_p99") or 0.0)))


def _summary(t: optuna.trial.FrozenTrial) -> dict[str, Any]:
    summary = TrialRecord.from_trial(t).summary
    return summary if summary is not None else {}


def closest_trial(study: optuna.Study) -> optuna.trial.FrozenTrial | None:
    """The infeasible trial nearest to the SLO (smallest total violation), for the 'no config meets it' report."""
    return min(measured(study), key=lambda t: (sum(max(0.0, c) for c in constraints_func(t)), -t.values[0]),
               default=None)


def default_trial(study: optuna.Study) -> optuna.trial.FrozenTrial | None:
    return next((t for t in measured(study) if TrialRecord.from_trial(t).role == ROLE_DEFAULT), None)


@dataclass
class TrialReport:
    """What the progress line shows about one finished trial."""

    number: int
    role: str
    outcome: TrialOutcome
    value: float
    seconds: float
    done: int
    total: int
    best: optuna.trial.FrozenTrial | None
    probes: list[dict[str, Any]] = field(default_factory=list)


def longest_trial_s(study: optuna.Study) -> float:
    """The longest complete trial so far (0 with none): one started later than this before a deadline ends past it."""
    return max(((t.datetime_complete - t.datetime_start).total_seconds() for t in study.trials
                if t.state == TrialState.COMPLETE and t.datetime_start and t.datetime_complete), default=0.0)


def starts_in_time(study: optuna.Study, deadline: float | None) -> bool:
    """Whether a trial started now ends before ``deadline`` (a time.monotonic(); None: no deadline), judged by the
    longest so far."""
    return deadline is None or time.monotonic() + longest_trial_s(study) <= deadline


def run_trials(study: optuna.Study, runner: TrialRunner | TrialBackend, policy: Policy, n_trials: int, out_dir: Path,
               on_trial: Callable[[TrialReport], None] | None = None, searcher: CapacitySearcher | None = None,
               deadline: float | None = None, max_runs: int | None = None) -> int:
    """Ask/run/tell until the study holds ``n_trials`` counted trials (or the next trial would end past
    ``deadline``, a time.monotonic(), or this call has run ``max_runs``); returns how many this process ran."""
    ran = 0
    recover_orphans(study)
    while counted_trials(study) < n_trials and (max_runs is None or ran < max_runs):
        check_stop()
        if not starts_in_time(study, deadline):
            break
        enqueue_start(study, policy)
        trial = study.ask()
        if is_surplus(study, trial.number, n_trials):
            # another process took the last slot between our count and our ask: give this one back
            stamp(trial, surplus_attrs())
            study.tell(trial, state=TrialState.FAIL)
            break
        stamp(trial, owner_attrs(os.getpid(), socket.gethostname()))
        role = TrialRecord.from_trial(trial).role_or_search
        knobs = {} if role == ROLE_DEFAULT else suggest_knobs(trial, policy)
        trial_dir = out_dir / f"trial-{trial.number:04d}"
        started = time.monotonic()
        try:
            with Heartbeat(trial):
                ev = _evaluate(trial, role, knobs, runner, policy, trial_dir, searcher)
        except BaseException:
            study.tell(trial, state=TrialState.FAIL)  # Ctrl-C/fatal error: the slot is run again on resume
            raise
        o = ev.outcome
        attrs = measured_attrs(knobs=o.knobs, summary=o.summary, step_stats=o.step_stats, feasible=o.feasible,
                               reason=o.reason, trial_dir=str(o.out_dir) if o.out_dir else "",
                               simulated=o.simulated, pruned=o.pruned, rate=o.rate, constraints=ev.constraints,
                               steps_dir=str(trial_dir),  # every window of the trial (a capacity trial's probes)
                               capacity_probes=ev.probes,
                               capacity=ev.capacity.as_dict() if ev.capacity is not None else None)
        stamp(trial, {k: _jsonable(v) for k, v in attrs.items()})
        if policy.sampler in ("random", "grid"):  # samplers without constraints_func: store them as the others do
            trial.storage.set_trial_system_attr(trial._trial_id, CONSTRAINTS_ATTR, ev.constraints)
        if policy.sampler == "nsga2":
            tbt = o.summary.get("tbt_p99") if o.summary else None
            values: list[float] = [ev.value, float(tbt) if tbt is not None else 60.0]
        else:
            values = [ev.value]
        study.tell(trial, values)
        ran += 1
        if on_trial is not None:
            on_trial(TrialReport(trial.number, role, o, ev.value, time.monotonic() - started,
                                 counted_trials(study), n_trials, best_trial(study), ev.probes))
    return ran


def _evaluate(trial: optuna.Trial, role: str, knobs: dict[str, Any], runner: TrialRunner | TrialBackend,
              policy: Policy, trial_dir: Path, searcher: CapacitySearcher | None) -> Evaluation:
    if policy.objective == "capacity":
        # a screened config's search starts at the simulator's predicted capacity, when it has one
        return evaluate_capacity(searcher or capacity_searcher(runner, policy), knobs, trial_dir,
                                 TrialRecord.from_trial(trial).screen_predicted_capacity)
    # the default config is the baseline of the report: measured over the whole window
    return evaluate_goodput(runner, knobs, trial_dir, prune=role != ROLE_DEFAULT)


def _jsonable(v: Any) -> Any:
    return json.loads(json.dumps(v, default=str))


def study_name_for(policy: Policy, rate: float | None) -> str:
    wl = Path(policy.workload.name).stem
    r = "auto" if rate is None else f"{rate:g}rps"
    seed = f"-seed{policy.seed}" if policy.seed else ""
    return (f"tune-{wl}-x{policy.workload.length_scale:g}-tbt{(policy.slo.tbt_p99 or 0) * 1000:g}ms-{r}-{policy.objective}"
            + seed)

