"""The simulator: the engine's own Scheduler and KV-cache bookkeeping driven by a virtual clock.

It makes exactly the calls the engine makes, in the same order (``engine.llm_engine.LLMEngine.step`` under the
server's loop, ``engine.engine_loop.EngineLoop``): requests that have arrived by a step boundary are added
(``Scheduler.add``), then ``schedule()``, then ``postprocess()`` with one sampled token per sequence that samples.
Only the model is replaced: the step's duration comes from a step-time model (or from measured durations, replayed),
and the sampled tokens are dummies, since a load test forces every output to its length (``ignore_eos`` +
``max_tokens``). Prompts that share a prefix (prefix workload, Mooncake hash ids) get their real token ids from the
load generator's :class:`loadtest.tokens.PromptBuilder`, so the prefix cache hits exactly as in the engine; a prompt
of unique tokens gets cheap unique ids (it can share nothing either way).

The clock: a step starts at ``t``, its tokens are out at ``t + duration`` (the step-time model's prediction,
scaled by a seeded draw from the engine's measured step-to-step variation), the next busy step starts ``gap_s``
later; when nothing is in flight the clock jumps to the next arrival. A request reaches the engine
``request_latency_s`` after its intended send time and each token reaches the client ``token_latency_s`` after
its step. As in the load test, a request that has no token after ``request_timeout`` is abandoned (the client
disconnects and the engine aborts it), a full queue refuses new requests, and requests still in flight
``drain_timeout`` after the last send are unfinished.

Out come the load test's records (``loadtest.records.RequestRecord``), its summary (``loadtest.summary.summarize``)
and the engine's step records (``engine.step_record.StepRecord``).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from engine.config import EngineConfig, ModelLimits
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus
from engine.step_record import StepRecord
from loadtest.records import RequestRecord
from loadtest.schedule import build_schedule
from slotune.slo import SLO
from loadtest.summary import summarize
from loadtest.tokens import UNIQUE, PromptBuilder, TokenSpace
from loadtest.workloads import RequestSpec
from tuner.simulation.step_time_model import StepFn

# The default model's limits (SmolLM2-135M in float32: 8192 tokens of context, 2 x 30 layers x 3 KV heads x 64 x 4 B
# per token; half that in bfloat16); a profile made by `slotune calibrate` carries the limits of the engine it
# measured, and a live engine's admin config gives its own (its dtype sets the KV bytes per token).
DEFAULT_LIMITS = ModelLimits(max_context_len=8192, kv_bytes_per_token=46080)

# Unique prompts get ids from here on: far above any vocabulary, so they never meet a real token id.
_UNIQUE_BASE = 1 << 40
_DUMMY_TOKEN = 0
_STEP_FIELDS = ("step", "start_time", "total_s", "num_prefill_seqs", "num_prefill_tokens", "num_decode_tokens",
                "num_running", "num_waiting", "num_preempted", "kv_blocks_used", "kv_blocks_free", "num_preemptions",
                "prefix_cache_hit_tokens", "context_tokens", "num_swapped_blocks")


class StepTimer(Protocol):
    """What the simulator needs of a step-time model (tuner.simulation.step_time_model.StepTimeModel is one)."""

    gap_s: float
    request_latency_s: float
    token_latency_s: float

    def bind(self, block_size: int, seed: int | None = 0) -> StepFn: ...

    def check_range(self, observed: dict[str, Any]) -> list[str]: ...


@dataclass
class ReplayStepTimes:
    """Measured step durations replayed in order (the n-th step takes ``durations[n]``; no gaps, no latencies):
    with the engine's own durations the simulator's clock is the engine's, so its decisions must be the same."""

    durations: list[float]
    gap_s: float = 0.0
    request_latency_s: float = 0.0
    token_latency_s: float = 0.0

    def bind(self, block_size: int, seed: int | None = 0) -> StepFn:
        it = iter(self.durations)

        def step_time(prefill_seqs: int, prefill_tokens: int, decode_tokens: int, context_tokens: int,
                      swapped_blocks: int) -> float:
            try:
                return next(it)
            except StopIteration:
                raise RuntimeError(f"the simulator took more steps than the {len(self.durations)} replayed") from None

        return step_time

    def check_range(self, observed: dict[str, Any]) -> list[str]:
        return []


@dataclass(frozen=True)
class SimOptions:
    drain_timeout: float = 60.0  # after the last send, how long in-flight requests may still finish
    request_timeout: float = 120.0  # a request with no token this long after it was sent is abandoned
    max_waiting_requests: int = 1024  # the server's queue bound (more waiting: 429)
    t0: float | None = None  # epoch of the run's start (default: now)
    seed: int | None = 0  # of the step-time variation (None: every step takes exactly the predicted time)


@dataclass
class SimResult:
    records: list[RequestRecord]
    config: EngineConfig
    steps_raw: list[tuple]  # one tuple per step, fields _STEP_FIELDS (StepRecords are built on demand)
    t0: float
    wall_s: float  # how long the simulation itself took
    end_time: float  # virtual seconds from t0 when the simulation stopped
    out_of_range: list[str] = field(default_factory=list)  # step-time model inputs outside the profiled range

    def step_records(self) -> list[StepRecord]:
        gen = self.config.generation
        return [StepRecord(step=s[0], start_time=s[1], schedule_s=0.0, forward_s=s[2], sample_s=0.0, total_s=s[2],
                           num_prefill_seqs=s[3], num_prefill_tokens=s[4], num_decode_tokens=s[5], num_running=s[6],
                           num_waiting=s[7], num_preempted=s[8], kv_blocks_used=s[9], kv_blocks_free=s[10],
                           num_preemptions=s[11], prefix_cache_hit_tokens=s[12], config_generation=gen,
                           context_tokens=s[13], num_swapped_blocks=s[14]) for s in self.steps_raw]

    def step_dicts(self) -> list[dict[str, Any]]:
        """The step records as StepRecord.to_dict() gives them (built directly: asdict deep-copies, slowly)."""
        gen = self.config.generation
        return [{"step": s[0], "start_time": s[1], "schedule_s": 0.0, "forward_s": s[2], "sample_s": 0.0,
                 "total_s": s[2], "num_prefill_seqs": s[3], "num_prefill_tokens": s[4], "num_decode_tokens": s[5],
                 "num_running": s[6], "num_waiting": s[7], "num_preempted": s[8], "kv_blocks_used": s[9],
                 "kv_blocks_free": s[10], "num_preemptions": s[11], "prefix_cache_hit_tokens": s[12],
                 "config_generation": gen, "context_tokens": s[13], "num_swapped_blocks": s[14]}
                for s in self.steps_raw]


class _Tokens:
    """Prompt token ids: real ones (the load generator's) where a prompt has shared segments, else unique ids."""

    def __init__(self, space: TokenSpace) -> None:
        self.builder = PromptBuilder(space)
        self._next_unique = _UNIQUE_BASE

    def prompt(self, spec: RequestSpec) -> list[int]:
        if all(seg[0] == UNIQUE for seg in spec.segments):
            start = self._next_unique
            self._next_unique += spec.prompt_len
            return list(range(start, start + spec.prompt_len))
        return self.builder.tokens(spec.segments, spec.prompt_len)


def simulate(requests: list[RequestSpec], config: EngineConfig, timer: StepTimer, *,
             limits: ModelLimits = DEFAULT_LIMITS, options: SimOptions = SimOptions(),
             token_space: TokenSpace | None = None) -> SimResult:
    """Run ``requests`` (their ``at`` is the intended send time, seconds from the start) through the engine's
    scheduler under ``config`` on a virtual clock. Returns the per-request records and the step records."""
    wall_start = time.perf_counter()
    t0 = options.t0 if options.t0 is not None else time.time()
    specs = sorted(requests, key=lambda r: (r.at, r.index))
    run = _Run(specs, config, timer, limits, options, token_space or TokenSpace(), t0)
    t = 0.0
    while True:
        run.arrive(t)
        run.give_up(t)
        if t > run.end_time:
            break
        done = run.step(t) if run.sched.num_unfinished else None
        if done is not None:
            t = done + run.gap
            continue
        # Nothing can run until something arrives (the engine would spin on empty steps).
        if run.next_arrival is None:
            break
        t = max(t, run.next_arrival)
    out_of_range = timer.check_range(run.ranges.observed()) if run.steps else []
    records = _records(specs, run.seq_of, run.times, run.errors, t0, timer.token_latency_s)
    return SimResult(records=records, config=config, steps_raw=run.steps, t0=t0,
                     wall_s=time.perf_counter() - wall_start, end_time=t, out_of_range=out_of_range)


@dataclass(slots=True)
class _FeatureRanges:
    """The step-time model's inputs seen, checked against its profiled ranges at the end (cheaper than per step)."""

    max_pseqs: int = 0
    max_ptok: int = 0
    max_dec: int = 0
    max_ctx: int = 0
    max_seqs: int = 0
    max_swap: int = 0
    min_seqs: int = 1 << 62
    min_ctx: int = 1 << 62

    def update(self, pseqs: int, ptok: int, dec: int, ctx: int, swapped: int) -> None:
        nseq = pseqs + dec
        if pseqs > self.max_pseqs:
            self.max_pseqs = pseqs
        if ptok > self.max_ptok:
            self.max_ptok = ptok
        if dec > self.max_dec:
            self.max_dec = dec
        if ctx > self.max_ctx:
            self.max_ctx = ctx
        if ctx < self.min_ctx:
            self.min_ctx = ctx
        if nseq > self.max_seqs:
            self.max_seqs = nseq
        if nseq < self.min_seqs:
            self.min_seqs = nseq
        if swapped > self.max_swap:
            self.max_swap = swapped

    def observed(self) -> dict[str, tuple[int, int]]:
        return {"num_prefill_seqs": (0, self.max_pseqs), "num_prefill_tokens": (0, self.max_ptok),
                "num_decode_tokens": (0, self.max_dec), "context_tokens": (self.min_ctx, self.max_ctx),
                "num_seqs": (self.min_seqs, self.max_seqs), "num_swapped_blocks": (0, self.max_swap)}


class _Run:
    """One simulation's state: the engine's scheduler, the requests in arrival order, what became of each (its
    sequence, its token times at the engine, or its error) and the step records."""

    def __init__(self, specs: list[RequestSpec], config: EngineConfig, timer: StepTimer, limits: ModelLimits,
                 options: SimOptions, token_space: TokenSpace, t0: float) -> None:
        self.specs, self.options, self.t0 = specs, options, t0
        self.sched = Scheduler(config, limits)
        self.step_time = timer.bind(config.block_size, options.seed)
        self.gap = timer.gap_s
        self.tokens = _Tokens(token_space)
        self.arrivals = [s.at + timer.request_latency_s for s in specs]
        self.next = 0  # the next request to arrive
        self.times: dict[Sequence, list[float]] = {}  # token times (virtual, at the engine) of each admitted request
        self.seq_of: list[Sequence | None] = [None] * len(specs)
        self.errors: dict[int, str] = {}  # index in specs -> error of a refused or abandoned request
        self.deadlines: collections.deque[tuple[float, int]] = collections.deque()  # (no-first-token deadline, i)
        self.end_time = (specs[-1].at if specs else 0.0) + options.drain_timeout
        self.steps: list[tuple] = []
        self.ranges = _FeatureRanges()

    @property
    def next_arrival(self) -> float | None:
        return self.arrivals[self.next] if self.next < len(self.specs) else None

    def arrive(self, t: float) -> None:
        """Requests that reached the engine by this step boundary (the engine loop adds them between steps)."""
        sched, options, max_len = self.sched, self.options, self.sched.max_model_len
        while self.next < len(self.specs) and self.arrivals[self.next] <= t:
            i, spec = self.next, self.specs[self.next]
            if len(sched.waiting) + 1 > options.max_waiting_requests:
                self.errors[i] = f"HTTP 429: too many waiting requests ({len(sched.waiting)})"
            elif spec.prompt_len >= max_len or spec.prompt_len + spec.output_len > max_len:
                self.errors[i] = (f"HTTP 400: {spec.prompt_len} prompt + {spec.output_len} output tokens exceed "
                                  f"max_model_len {max_len}")
            else:
                seq = Sequence(request_id=str(spec.index), prompt_token_ids=self.tokens.prompt(spec),
                               params=SamplingParams(max_tokens=spec.output_len, ignore_eos=True),
                               arrival_time=self.t0 + self.arrivals[i])
                sched.add(seq)
                self.seq_of[i] = seq
                self.times[seq] = []
                self.deadlines.append((spec.at + options.request_timeout, i))
            self.next += 1

    def give_up(self, t: float) -> None:
        """Clients that gave up on a request that never produced a token: the engine aborts it."""
        while self.deadlines and self.deadlines[0][0] <= t:
            _, j = self.deadlines.popleft()
            given_up = self.seq_of[j]
            if given_up is not None and not given_up.status.finished and not self.times[given_up]:
                self.sched.abort(given_up.request_id)
                self.errors[j] = f"timeout: nothing received for {self.options.request_timeout:g}s"

    def step(self, t: float) -> float | None:
        """One engine step from ``t``: when it ends, or None when nothing could run."""
        sched = self.sched
        out = sched.schedule()
        scheduled = out.scheduled
        if not scheduled and not out.swap_out and not out.swap_in:
            return None
        pseqs = ptok = dec = ctx = 0
        sampled: list[int | None] = []
        samplers: list[Sequence] = []
        for item in scheduled:
            seq = item.seq
            k = item.num_tokens
            ctx += seq.num_computed_tokens + k
            if item.is_prefill:
                pseqs += 1
                ptok += k
            else:
                dec += k
            if item.samples:
                sampled.append(_DUMMY_TOKEN)
                samplers.append(seq)
            else:
                sampled.append(None)
        swapped = len(out.swap_out) + len(out.swap_in)
        duration = self.step_time(pseqs, ptok, dec, ctx, swapped)
        sched.postprocess(out, sampled)
        done = t + duration
        for seq in samplers:
            self.times[seq].append(done)
        kv = sched.kv
        self.steps.append((len(self.steps), self.t0 + t, duration, pseqs, ptok, dec, sched.num_running,
                           len(sched.waiting), len(sched.preempted), kv.num_used_blocks, kv.num_free_blocks,
                           out.num_preemptions, out.prefix_hit_tokens, ctx, swapped))
        self.ranges.update(pseqs, ptok, dec, ctx, swapped)
        return done


def _records(specs: list[RequestSpec], seq_of: list[Sequence | None], times: dict[Sequence, list[float]],
             errors: dict[int, str], t0: float, tok_lat: float) -> list[RequestRecord]:
    records = []
    nan = float("nan")
    shift = t0 + tok_lat
    for i, spec in enumerate(specs):
        sent = t0 + spec.at
        rec = RequestRecord(index=spec.index, id=f"sim-{spec.index}", kind=spec.kind, scheduled_at=spec.at,
                            intended_send_time=sent, actual_send_time=sent, prompt_tokens=spec.prompt_len,
                            max_tokens=spec.output_len)
        seq = seq_of[i]
        tt = [x + shift for x in times[seq]] if seq is not None else []
        rec.token_times = tt
        rec.output_tokens = len(tt)
        rec.ttft = tt[0] - sent if tt else nan
        if i in errors:
            rec.status, rec.error = "error", errors[i]
            rec.http_status = int(errors[i][5:8]) if errors[i].startswith("HTTP ") else 200
            rec.finish_time = tt[-1] if tt else sent
        elif seq is not None and seq.status is SequenceStatus.FINISHED and seq.finish_reason in ("length", "stop"):
            rec.status, rec.http_status, rec.finish_time = "ok", 200, tt[-1]
        else:
            rec.status, rec.error, rec.http_status = "unfinished", "still streaming when the run ended", 200
        records.append(rec)
    return records


# Load-test-shaped runs ------------------------------------------------------------------------------------------
def simulate_load(cfg: Any, knobs: dict[str, Any], timer: StepTimer, *, limits: ModelLimits = DEFAULT_LIMITS,
                  slo: SLO | None = None, window: tuple[float, float] | None = None,
                  t0: float | None = None, backlog: int = 0) -> tuple[SimResult, dict[str, Any]]:
    """Simulate the load test ``cfg`` (a loadtest.config.LoadConfig: workload, arrivals, rate, duration, scales,
    seed, timeouts) on an engine with ``knobs``; returns the result and its summary (loadtest.summary.summarize,
    with the schedule's description, like a real load test's). ``backlog``: that many more requests of the same
    workload already waiting at the start (a live engine's queue; they finish outside any measured window but
    hold the engine while it drains them). Raises ConfigError for a bad knob."""
    config = EngineConfig.create(limits, **knobs)
    schedule = build_schedule(cfg)
    requests = list(schedule.requests)
    if backlog > 0 and requests:
        n = len(requests)
        requests += [replace(requests[i % n], index=n + i, at=0.0) for i in range(backlog)]
    options = SimOptions(drain_timeout=cfg.drain_timeout, request_timeout=cfg.request_timeout, t0=t0, seed=cfg.seed)
    result = simulate(requests, config, timer, limits=limits, options=options,
                      token_space=TokenSpace.parse_range(cfg.token_range, cfg.seed))
    slo = slo or cfg.slo
    meta = {**schedule.meta, "url": None, "simulated": True, "start_time": result.t0,
            "simulation_wall_s": result.wall_s, "knobs": config.knobs()}
    if result.out_of_range:
        meta["extrapolated"] = result.out_of_range
    summary = summarize(result.records, slo, duration_s=None if window else schedule.duration_s, window=window,
                        meta=meta, lag_warn=cfg.lag_warn)
    if result.out_of_range:
        summary["warnings"].append("the step-time model extrapolated beyond its profiled range for: "
                                   + ", ".join(result.out_of_range))
    return result, summary

