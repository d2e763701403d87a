"""The engine loop: one dedicated thread owns the `LLMEngine` and calls `step()`; the HTTP front end (an asyncio
event loop in another thread) talks to it only through a command queue and gets its tokens back on asyncio queues.

- The front end never takes the engine's lock, so a step never stalls accepting connections or writing to
  clients; the engine thread never waits for a client, so a slow reader never stalls a step (its tokens pile
  up in an unbounded asyncio queue).
- Everything that touches the engine (tokenizing, the chat template, adding, aborting, reconfiguring) runs in
  the engine thread between two steps, so commands land at step boundaries and the tokenizer is never used
  from two threads at once.
- One `loop.call_soon_threadsafe` per step hands all of that step's tokens to the event loop.
- Latency metrics (TTFT, inter-token, end-to-end, queue time) are measured here, where tokens are produced.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.config import RELAYOUT_KNOBS, ConfigError, EngineConfig, ModelLimits
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine
    from engine.metrics import ServerMetrics

logger = logging.getLogger("slotune.engine_loop")

IDLE_WAIT_S = 0.5


# Errors the front end maps to HTTP statuses ---------------------------------------------------------------------
class EngineLoopError(Exception):
    status = 500
    error_type = "internal_error"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequest(EngineLoopError):
    status = 400
    error_type = "invalid_request_error"


class QueueFull(EngineLoopError):
    status = 429
    error_type = "rate_limit_error"


class EngineUnavailable(EngineLoopError):
    status = 503
    error_type = "service_unavailable"


class RequestFailed(EngineLoopError):
    """The engine failed while serving the request (not the client's fault)."""


# What the engine thread hands to the front end --------------------------------------------------------------
@dataclass(frozen=True)
class Prompt:
    """Exactly one of: text, token ids, chat messages."""

    text: str | None = None
    token_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None


@dataclass(frozen=True)
class TokenDelta:
    index: int  # which prompt of the HTTP request
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int


_END = object()  # sentinel: the handle was aborted


class GenerationHandle:
    """The front end's side of one HTTP request: one engine request per prompt, tokens on one asyncio queue."""

    def __init__(self, loop_: EngineLoop, request_ids: list[str], prompt_lens: list[int]) -> None:
        self._engine_loop = loop_
        self.request_ids = request_ids
        self.prompt_lens = prompt_lens
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self._unfinished = set(range(len(request_ids)))
        self.aborted = False

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def abort(self) -> None:
        """Abort what is still running (idempotent; safe from the event loop thread only)."""
        if self.aborted or self.finished:
            return
        self.aborted = True
        self._engine_loop.abort([self.request_ids[i] for i in self._unfinished])
        self.queue.put_nowait(_END)

    async def next_batch(self) -> list[TokenDelta]:
        """Every delta that is ready (waiting for at least one); [] once all prompts finished or it was aborted.
        Raises RequestFailed if the engine failed the request."""
        if self.finished or self.aborted:
            return []
        items = [await self.queue.get()]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        batch = []
        for item in items:
            if item is _END:
                return []
            if isinstance(item, BaseException):
                self._unfinished.clear()
                raise item
            batch.append(item)
            if item.finished:
                self._unfinished.discard(item.index)
        return batch


@dataclass
class _Tracked:
    """Engine-thread bookkeeping of one engine request."""

    handle: GenerationHandle
    index: int
    arrival: float  # time.monotonic() when the HTTP request arrived
    num_prompt_tokens: int
    num_tokens: int = 0
    last_token: float | None = None
    queued: bool = True  # not yet scheduled for the first time
    gaps: list[float] = dataclasses.field(default_factory=list)  # inter-token gaps, for the request's own p99


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's state after the latest step or command, published by the engine thread for /metrics,
    /health and /admin/config (read lock-free by the front end)."""

    num_running: int
    num_waiting: int
    num_preempted: int
    kv_cache_usage: float
    kv_blocks_used: int
    kv_blocks_free: int
    prompt_tokens: int
    generation_tokens: int
    preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    requests_finished: dict[str, int]
    config: EngineConfig
    limits: ModelLimits
    max_model_len: int
    last_step: int


@dataclass
class _Command:
    kind: str
    args: tuple[Any, ...] = ()
    future: asyncio.Future[Any] | None = None


@dataclass
class _AddRequest:
    prompts: list[Prompt]
    params: SamplingParams
    max_tokens: int | None  # None: what the context leaves after the prompt
    priority: int
    arrival_time: float  # wall clock, for the engine
    arrival: float  # monotonic, for latency metrics
    request_id: str


def available_memory_bytes(device: str) -> int | None:
    """Memory free for a new KV pool on `device` (None if unknown)."""
    try:
        if device.startswith("cuda"):
            import torch

            return int(torch.cuda.mem_get_info(torch.device(device))[0])
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except Exception:  # noqa: BLE001 - an unknown amount means no automatic cap
        return None
    return None


def check_knob_types(knobs: dict[str, Any]) -> None:
    """Reject a JSON value of the wrong type for its knob (ConfigError naming it), before the config sees it."""
    for f in dataclasses.fields(EngineConfig):
        if f.name not in knobs or f.name == "generation":
            continue
        value, kind = knobs[f.name], str(f.type)
        optional = "None" in kind
        if value is None:
            if optional:
                continue
            raise ConfigError(f.name, value, "must not be null")
        if kind.startswith("int"):
            ok, allowed = isinstance(value, int) and not isinstance(value, bool), "must be an integer"
        elif kind.startswith("float"):
            ok, allowed = isinstance(value, (int, float)) and not isinstance(value, bool), "must be a number"
        elif kind.startswith("bool"):
            ok, allowed = isinstance(value, bool), "must be true or false"
        else:
            ok, allowed = isinstance(value, str), "must be a string"
        if not ok:
            raise ConfigError(f.name, value, allowed + (" or null" if optional else ""))


class EngineLoop:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None, *, max_waiting_requests: int = 1024,
                 max_kv_memory_bytes: int | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_waiting_requests = max_waiting_requests
        self.max_kv_memory_bytes = max_kv_memory_bytes  # None: a share of the memory free at PATCH time
        self.device = str(getattr(engine, "device", "cpu"))
        self.vocab_size: int = engine.model_config.vocab_size
        self._commands: collections.deque[_Command] = collections.deque()
        self._wakeup = threading.Event()
        self._tracked: dict[str, _Tracked] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop_requested = False
        self._ids = itertools.count()
        self.draining = False  # set on SIGTERM: no new requests
        self.dead: BaseException | None = None
        self._last_step = -1
        self.snapshot = self._take_snapshot()

    # Lifecycle (event loop thread) -----------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="slotune-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead is None

    def stop(self, timeout: float = 30.0) -> None:
        """Abort whatever is still in flight and end the engine thread (blocking; call after the HTTP server
        stopped accepting and drained)."""
        self._stop_requested = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout)

    # Commands (event loop thread) --------------------------------------------------------------------------------
    def _submit(self, command: _Command) -> None:
        self._commands.append(command)
        self._wakeup.set()

    def _future(self) -> asyncio.Future[Any]:
        assert self._loop is not None, "the engine loop is not started"
        return self._loop.create_future()

    def _check_available(self) -> None:
        if self.draining or self._stop_requested:
            raise EngineUnavailable("the server is shutting down")
        if not self.alive:
            raise EngineUnavailable("the engine is not running")

    async def generate(self, prompts: list[Prompt], params: SamplingParams, *, max_tokens: int | None,
                       priority: int = 0, arrival: float | None = None, arrival_time: float | None = None,
                       request_id: str | None = None) -> GenerationHandle:
        """Queue one engine request per prompt (all or none). Raises InvalidRequest, QueueFull or
        EngineUnavailable."""
        self._check_available()
        future = self._future()
        add = _AddRequest(prompts, params, max_tokens, priority,
                          arrival_time if arrival_time is not None else time.time(),
                          arrival if arrival is not None else time.monotonic(),
                          request_id or f"req-{next(self._ids)}")
        self._submit(_Command("add", (add,), future))
        return await future  # if cancelled (the client left), the handle is aborted once it exists

    def abort(self, request_ids: list[str]) -> None:
        """Thread-safe, non-blocking; the requests stop before the next step."""
        if request_ids:
            self._submit(_Command("abort", (list(request_ids),)))

    async def update_config(self, knobs: dict[str, Any]) -> EngineConfig:
        """Apply knobs at the next step boundary; raises ConfigError (nothing changed) on a bad value."""
        if not self.alive:
            raise EngineUnavailable("the engine is not running")
        future = self._future()
        self._submit(_Command("config", (dict(knobs),), future))
        return await future

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run `fn(engine)` in the engine thread between two steps."""
        if not self.alive:
            raise EngineUnavailable("the engine is not running")
        future = self._future()
        self._submit(_Command("call", (fn,), future))
        return await future

    # Engine thread ---------------------------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                self._wakeup.clear()
                self._process_commands()
                if self._stop_requested:
                    self._abort_all("the server is shutting down")
                    self._publish()
                    return
                if engine.has_unfinished_requests():
                    self._step()
                else:
                    self._publish()
                    self._wakeup.wait(IDLE_WAIT_S)
        except BaseException as error:  # noqa: BLE001 - the loop must report its death, not vanish
            logger.exception("the engine loop died")
            self.dead = error
            self._fail_all(RequestFailed(f"the engine loop died: {error!r}"))
            self._fail_commands(EngineUnavailable("the engine loop died"))

    def _process_commands(self) -> None:
        while self._commands:
            command = self._commands.popleft()
            try:
                if command.kind == "add":
                    result: Any = self._add(*command.args)
                elif command.kind == "abort":
                    result = self._abort(*command.args)
                elif command.kind == "config":
                    result = self._update_config(*command.args)
                elif command.kind == "call":
                    result = command.args[0](self.engine)
                else:  # pragma: no cover
                    raise RuntimeError(f"unknown command {command.kind}")
            except Exception as error:  # noqa: BLE001 - a bad command fails itself, not the loop
                if not isinstance(error, (EngineLoopError, ConfigError)):
                    logger.exception("engine command %s failed", command.kind)
                self._resolve(command.future, error=error)
            else:
                self._resolve(command.future, result=result)

    def _resolve(self, future: asyncio.Future[Any] | None, result: Any = None,
                 error: BaseException | None = None) -> None:
        if future is None or self._loop is None:
            return

        def settle() -> None:
            if future.cancelled():
                if isinstance(result, GenerationHandle):
                    result.abort()  # nobody waits for it
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        try:
            self._loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the event loop is closed: nobody waits any more
            if isinstance(result, GenerationHandle):
                self._abort(result.request_ids)

    def _fail_commands(self, error: EngineLoopError) -> None:
        while self._commands:
            command = self._commands.popleft()
            self._resolve(command.future, error=error)

    def _add(self, add: _AddRequest) -> GenerationHandle:
        engine = self.engine
        waiting = len(engine.scheduler.waiting)
        if waiting + len(add.prompts) > self.max_waiting_requests:
            raise QueueFull(f"too many waiting requests ({waiting}; the bound is {self.max_waiting_requests}); "
                            "retry later")
        token_lists = [self._tokenize(p) for p in add.prompts]
        max_len = engine.max_model_len
        params_list = []
        for ids in token_lists:
            if not ids:
                raise InvalidRequest("the prompt is empty", param="prompt")
            if len(ids) >= max_len:
                raise InvalidRequest(
                    f"the prompt has {len(ids)} tokens but this model's context (max_model_len) is {max_len} "
                    "tokens, which must also leave room for at least one generated token", param="prompt")
            max_tokens = add.max_tokens if add.max_tokens is not None else max_len - len(ids)
            if len(ids) + max_tokens > max_len:
                raise InvalidRequest(
                    f"this model's context (max_model_len) is {max_len} tokens, but {len(ids) + max_tokens} "
                    f"were requested ({len(ids)} in the prompt, {max_tokens} for the completion)",
                    param="max_tokens")
            params = add.params
            if params.max_tokens != max_tokens:
                try:
                    params = dataclasses.replace(params, max_tokens=max_tokens)
                except ValueError as error:
                    raise InvalidRequest(str(error)) from None
            params_list.append(params)
        request_ids = [f"{add.request_id}-{i}" for i in range(len(add.prompts))]
        handle = GenerationHandle(self, request_ids, [len(ids) for ids in token_lists])
        added: list[str] = []
        try:
            for i, (rid, ids, params) in enumerate(zip(request_ids, token_lists, params_list)):
                engine.add_request(ids, params, request_id=rid, priority=add.priority,
                                   arrival_time=add.arrival_time)
                added.append(rid)
                self._tracked[rid] = _Tracked(handle, i, add.arrival, len(ids))
        except Exception as error:
            self._abort(added)
            if isinstance(error, ValueError):
                raise InvalidRequest(str(error)) from None
            raise
        return handle

    def _tokenize(self, prompt: Prompt) -> list[int]:
        try:
            if prompt.messages is not None:
                return self.engine.apply_chat_template(prompt.messages)
            if prompt.token_ids is not None:
                return self.engine.tokenize(prompt.token_ids)
            return self.engine.tokenize(prompt.text or "")
        except (ValueError, TypeError, KeyError, IndexError) as error:
            raise InvalidRequest(f"invalid prompt: {error}", param="prompt") from None
        except Exception as error:
            if type(error).__module__.startswith("jinja2"):  # the chat template rejected the conversation
                raise InvalidRequest(f"invalid messages: {error}", param="messages") from None
            raise

    def _abort(self, request_ids: list[str]) -> int:
        aborted = 0
        for rid in request_ids:
            self._tracked.pop(rid, None)  # the front end already stopped listening
            if self.engine.abort_request(rid):
                aborted += 1
        return aborted

    def _update_config(self, knobs: dict[str, Any]) -> EngineConfig:
        engine = self.engine
        if not knobs:
            return engine.config
        check_knob_types(knobs)
        candidate = engine.config.updated(engine.limits, **knobs)  # raises ConfigError, changes nothing
        if candidate.changed_knobs(engine.config) & RELAYOUT_KNOBS:
            self._check_kv_memory(candidate, knobs)
        new = engine.update_config(**knobs)
        if self.metrics is not None:
            self.metrics.config_changed()
        self._publish()
        return new

    def _check_kv_memory(self, candidate: EngineConfig, knobs: dict[str, Any]) -> None:
        limits = self.engine.limits
        per_block = limits.kv_bytes_per_token * candidate.block_size  # keys and values
        device_bytes = candidate.resolved_num_kv_blocks(limits) * per_block
        host_bytes = candidate.num_swap_blocks(limits) * per_block
        cap = self.max_kv_memory_bytes
        if cap is None:
            free = available_memory_bytes(self.device)
            cap = None if free is None else int(free * 0.5)
        if cap is None:
            return
        total = device_bytes + (host_bytes if self.device == "cpu" else 0)
        if total > cap or (self.device != "cpu" and host_bytes > cap):
            if candidate.num_kv_blocks is not None:
                knob = "num_kv_blocks"
            elif "kv_cache_bytes" in knobs or "block_size" not in knobs:
                knob = "kv_cache_bytes"
            else:
                knob = "block_size"
            if host_bytes > device_bytes and "swap_space_bytes" in knobs:
                knob = "swap_space_bytes"
            raise ConfigError(knob, knobs.get(knob, getattr(candidate, knob)),
                              f"the KV pools would take {total} bytes; this server allows at most {cap} "
                              "(see --max-kv-memory-bytes)")

    def _step(self) -> None:
        engine = self.engine
        step_start = time.monotonic()
        try:
            outputs = engine.step()
        except Exception as error:  # noqa: BLE001 - fail the requests in flight, keep serving
            logger.exception("an engine step failed; failing the requests in flight")
            self._fail_all(RequestFailed(f"the engine failed while serving this request: {error!r}"))
            return
        now = time.monotonic()
        metrics = self.metrics
        self._observe_steps()
        if metrics is not None:
            for seq in engine.scheduler.running:
                tracked = self._tracked.get(seq.request_id)
                if tracked is not None and tracked.queued:
                    tracked.queued = False
                    metrics.queue_time.observe(max(0.0, step_start - tracked.arrival))
        deliveries: list[tuple[GenerationHandle, TokenDelta]] = []
        for output in outputs:
            tracked = self._tracked.get(output.request_id)
            if tracked is None:
                continue  # aborted
            try:
                n_new = len(output.new_token_ids)
                if n_new and metrics is not None:
                    if tracked.queued:
                        tracked.queued = False
                        metrics.queue_time.observe(max(0.0, step_start - tracked.arrival))
                    if tracked.last_token is None:
                        metrics.ttft.observe(now - tracked.arrival)
                        n_gaps = n_new - 1
                    else:
                        n_gaps = n_new
                    gap = now - (tracked.last_token or now)
                    for _ in range(n_gaps):
                        metrics.itl.observe(gap)
                    tracked.gaps.extend([gap] * n_gaps)
                tracked.num_tokens += n_new
                if n_new:
                    tracked.last_token = now
                deliveries.append((tracked.handle, TokenDelta(
                    tracked.index, list(output.new_token_ids), output.new_text, output.finished,
                    output.finish_reason, tracked.num_prompt_tokens, len(output.token_ids))))
                if output.finished:
                    del self._tracked[output.request_id]
                    if metrics is not None and output.finish_reason in ("stop", "length"):
                        metrics.e2e.observe(now - tracked.arrival)
                        metrics.observe_request_itl_p99(tracked.gaps)
            except Exception as error:  # noqa: BLE001 - one request's failure must not fail the others
                logger.exception("failed to deliver the output of %s", output.request_id)
                self._fail_request(output.request_id, RequestFailed(f"internal error: {error!r}"))
        self._publish()  # before the tokens go out: a client that saw its last token scrapes settled counters
        self._deliver(deliveries)

    def _observe_steps(self) -> None:
        for record in self.engine.step_records(self._last_step):
            if self.metrics is not None:
                self.metrics.observe_step(record)
            self._last_step = record.step

    def _deliver(self, deliveries: list[tuple[GenerationHandle, Any]]) -> None:
        if not deliveries or self._loop is None:
            return

        def dispatch() -> None:
            for handle, item in deliveries:
                handle.queue.put_nowait(item)

        try:
            self._loop.call_soon_threadsafe(dispatch)
        except RuntimeError:  # the event loop is gone: nobody listens, stop generating
            self._abort([h.request_ids[d.index] for h, d in deliveries if isinstance(d, TokenDelta)])

    def _fail_request(self, request_id: str, error: EngineLoopError) -> None:
        tracked = self._tracked.pop(request_id, None)
        try:
            self.engine.abort_request(request_id)
        except Exception:  # noqa: BLE001
            logger.exception("could not abort %s", request_id)
        if tracked is not None:
            # Fail the whole HTTP request (its other prompts too).
            others = [rid for rid in tracked.handle.request_ids if rid in self._tracked]
            for rid in others:
                self._tracked.pop(rid, None)
                try:
                    self.engine.abort_request(rid)
                except Exception:  # noqa: BLE001
                    logger.exception("could not abort %s", rid)
            self._deliver([(tracked.handle, error)])

    def _fail_all(self, error: EngineLoopError) -> None:
        for rid in list(self._tracked):
            if rid in self._tracked:
                self._fail_request(rid, error)

    def _abort_all(self, reason: str) -> None:
        self._fail_all(EngineUnavailable(reason))

    def _publish(self) -> None:
        self.snapshot = self._take_snapshot()

    def _take_snapshot(self) -> EngineSnapshot:
        engine = self.engine
        sched = engine.scheduler
        stats = engine.stats
        return EngineSnapshot(
            num_running=sched.num_running, num_waiting=len(sched.waiting), num_preempted=len(sched.preempted),
            kv_cache_usage=sched.kv.usage, kv_blocks_used=sched.kv.num_used_blocks,
            kv_blocks_free=sched.kv.num_free_blocks, prompt_tokens=stats.prompt_tokens,
            generation_tokens=stats.generation_tokens, preemptions=sched.num_preemptions,
            prefix_cache_queries=sched.prefix_cache_queries, prefix_cache_hits=sched.prefix_cache_hits,
            requests_finished=dict(stats.requests_finished), config=engine.config, limits=engine.limits,
            max_model_len=engine.max_model_len, last_step=self._last_step)

