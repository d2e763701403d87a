"""The engine loop: one dedicated thread owns the `LLMEngine` and calls `step()`; the HTTP front end (an asyncio
event loop in another thread) talks to it only through typed commands (`engine.loop_commands`) and gets its
tokens back on asyncio queues (`GenerationHandle`).

Who owns what:
- The engine thread owns the engine (scheduler, KV cache, model, tokenizer), the routes from engine requests to
  handles, the latency tracker and the lease book. Every command runs there between two steps, so adding,
  aborting and reconfiguring land at step boundaries and the tokenizer is never used from two threads at once.
- The event loop's thread owns the handles and the futures. It never calls the engine; the engine thread never
  waits for it: one `call_soon_threadsafe` per step hands that step's tokens over (a slow reader's tokens pile up
  in its unbounded queue, it does not stall a step).
- Shared: the command deque (append and popleft are atomic) with its wake-up event; `snapshot`, an immutable
  record replaced after every step and command, which /metrics, /health and /admin/config read; the step-record
  ring buffer, which /debug/steps reads. That buffer is the only thing both threads touch, so its lock (inside
  `StepRecorder`) is the only lock: the engine has none, because one thread makes all its calls.

The loop validates nothing itself: `LLMEngine.admit` checks a request, `LLMEngine.validate_update` a knob change.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, assert_never

from engine.config import ConfigError, EngineConfig
from engine.config_lease import LeaseBook
from engine.errors import EngineError, EngineUnavailable, RequestFailed
from engine.generation_handle import GenerationHandle, TokenDelta
from engine.latency import LatencyTracker
from engine.loop_commands import (
    AbortAll,
    AbortRequests,
    AddRequest,
    Command,
    ConfirmConfig,
    ResetPrefixCache,
    UpdateConfig,
)
from engine.memory import KVMemoryGuard
from engine.metrics import ServerMetrics
from engine.prompt import Prompt
from engine.sampling_params import RequestOutput, SamplingParams
from engine.snapshot import EngineSnapshot

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

logger = logging.getLogger("slotune.engine_loop")

IDLE_WAIT_S = 0.5


@dataclass(slots=True)
class _Route:
    """Where the outputs of one engine request go."""

    handle: GenerationHandle
    index: int
    num_prompt_tokens: int
    num_output_tokens: int = 0


@dataclass(frozen=True)
class _Queued:
    command: Command
    future: asyncio.Future[Any] | None  # None: nobody waits for an answer


Delivery = tuple[GenerationHandle, TokenDelta | EngineError]


class EngineLoop:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, *, max_waiting_requests: int = 1024,
                 max_kv_memory_bytes: int | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_waiting_requests = max_waiting_requests  # beyond the free running slots
        self.memory_guard = KVMemoryGuard(str(engine.device), max_kv_memory_bytes)
        self.latency = LatencyTracker(metrics)
        self.leases = LeaseBook()
        self._commands: collections.deque[_Queued] = collections.deque()
        self._wakeup = threading.Event()
        self._routes: dict[str, _Route] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop_requested = False
        self._ids = itertools.count()
        self.draining = False  # set on SIGTERM: no new requests
        self.dead: BaseException | None = None
        self._last_step = -1
        self.snapshot = self._take_snapshot()
        metrics.export_snapshots(lambda: self.snapshot)

    # Lifecycle (event loop thread) -----------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="slotune-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead is None

    def stop(self, timeout: float = 30.0) -> None:
        """End whatever is still in flight (a final "abort" delta each) and the engine thread (blocking; call
        after the HTTP server stopped accepting and drained)."""
        self._stop_requested = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout)

    # Commands (event loop thread) --------------------------------------------------------------------------------
    async def generate(self, prompts: list[Prompt], params: SamplingParams, *, max_tokens: int | None,
                       priority: int = 0, arrival: float | None = None, arrival_time: float | None = None,
                       request_id: str | None = None) -> GenerationHandle:
        """Queue one engine request per prompt (all or none). Raises InvalidRequest, QueueFull or
        EngineUnavailable."""
        if self.draining or self._stop_requested:
            raise EngineUnavailable("the server is shutting down")
        command = AddRequest(prompts, params, max_tokens, priority,
                             arrival_time if arrival_time is not None else time.time(),
                             arrival if arrival is not None else time.monotonic(),
                             request_id or f"req-{next(self._ids)}")
        handle: GenerationHandle = await self._ask(command)  # if cancelled, the handle is aborted once it exists
        return handle

    def abort(self, request_ids: list[str]) -> None:
        """Thread-safe, non-blocking; the requests stop before the next step."""
        if request_ids:
            self._submit(AbortRequests(list(request_ids)))

    def abort_all(self) -> None:
        """Thread-safe, non-blocking: every request in flight ends with finish_reason "abort" before the next
        step (the shutdown deadline)."""
        self._submit(AbortAll())

    async def update_config(self, knobs: dict[str, Any], lease_s: float | None = None) -> EngineConfig:
        """Apply knobs at the next step boundary; raises ConfigError (nothing changed) on a bad value. With
        `lease_s`, the engine returns to the last kept config by itself unless `confirm_config` names the new
        generation within that many seconds."""
        config: EngineConfig = await self._ask(UpdateConfig(dict(knobs), lease_s))
        return config

    async def confirm_config(self, generation: int) -> EngineConfig:
        """Keep the leased config of `generation`; raises LeaseConflict when that generation is not under lease."""
        config: EngineConfig = await self._ask(ConfirmConfig(generation))
        return config

    async def reset_prefix_cache(self) -> int:
        """Drop the cached prefix blocks no running request holds; the number dropped."""
        dropped: int = await self._ask(ResetPrefixCache())
        return dropped

    async def _ask(self, command: Command) -> Any:
        if not self.alive:
            raise EngineUnavailable("the engine is not running")
        assert self._loop is not None, "the engine loop is not started"
        future = self._loop.create_future()
        self._submit(command, future)
        return await future

    def _submit(self, command: Command, future: asyncio.Future[Any] | None = None) -> None:
        self._commands.append(_Queued(command, future))
        self._wakeup.set()

    # Engine thread: the loop and its commands ---------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                self._wakeup.clear()
                self._process_commands()
                self._expire_lease()
                if self._stop_requested:
                    self._abort_all()
                    self._publish()
                    return
                if self.engine.has_unfinished_requests():
                    self._step()
                else:
                    self._publish()
                    self._wakeup.wait(self.leases.wait_s(IDLE_WAIT_S))
        except BaseException as error:  # the loop must report its death, not vanish
            logger.exception("the engine loop died")
            self.dead = error
            self._fail_all(RequestFailed(f"the engine loop died: {error!r}"))
            while self._commands:
                self._resolve(self._commands.popleft().future, error=EngineUnavailable("the engine loop died"))

    def _process_commands(self) -> None:
        while self._commands:
            queued = self._commands.popleft()
            try:
                result = self._execute(queued.command)
            except Exception as error:  # a bad command fails itself, not the loop
                if not isinstance(error, (EngineError, ConfigError)):
                    logger.exception("engine command %s failed", type(queued.command).__name__)
                self._resolve(queued.future, error=error)
            else:
                self._resolve(queued.future, result=result)

    def _execute(self, command: Command) -> Any:
        match command:
            case AddRequest():
                return self._add(command)
            case AbortRequests():
                return self._abort(command.request_ids)
            case AbortAll():
                return self._abort_all()
            case UpdateConfig():
                return self._update_config(command)
            case ConfirmConfig():
                self.leases.confirm(command.generation, self.engine.config.generation)
                self._publish()
                return self.engine.config
            case ResetPrefixCache():
                return self.engine.reset_prefix_cache()
            case _:
                assert_never(command)

    def _add(self, add: AddRequest) -> GenerationHandle:
        request_ids = [f"{add.request_id}-{i}" for i in range(len(add.prompts))]
        prompt_lens = self.engine.admit(add.prompts, add.params, request_ids=request_ids, max_tokens=add.max_tokens,
                                        priority=add.priority, arrival_time=add.arrival_time,
                                        max_waiting=self.max_waiting_requests)
        handle = GenerationHandle(request_ids, prompt_lens, self.abort)
        for index, (rid, num_prompt_tokens) in enumerate(zip(request_ids, prompt_lens)):
            self._routes[rid] = _Route(handle, index, num_prompt_tokens)
            self.latency.arrived(rid, add.arrival)
        return handle

    def _abort(self, request_ids: list[str]) -> int:
        aborted = 0
        for rid in request_ids:
            self._routes.pop(rid, None)  # the front end already stopped listening
            self.latency.forget(rid)
            if self.engine.abort_request(rid):
                aborted += 1
        return aborted

    def _abort_all(self) -> int:
        """End every routed request with a final "abort" delta, so its stream closes properly."""
        deliveries: list[Delivery] = []
        for rid, route in list(self._routes.items()):
            self._abort([rid])
            deliveries.append((route.handle, TokenDelta(route.index, [], "", True, "abort", route.num_prompt_tokens,
                                                        route.num_output_tokens)))
        self._deliver(deliveries)
        return len(deliveries)

    def _update_config(self, update: UpdateConfig) -> EngineConfig:
        engine = self.engine
        if not update.knobs:
            return engine.config
        before = engine.config
        new = engine.apply_config(engine.validate_update(update.knobs, self.memory_guard))
        self.leases.applied(before, new, update.lease_s)
        self.metrics.config_changed()
        self._publish()
        return new

    def _expire_lease(self) -> None:
        lease = self.leases.take_expired()
        if lease is None:
            return
        try:
            new = self.engine.update_config(**lease.revert_to)
        except Exception:  # a config that was applied before should apply again; say so if not
            logger.exception("could not return to generation %d's config after the lease of generation %d "
                             "expired", lease.kept_generation, lease.generation)
        else:
            logger.warning("the lease of config generation %d expired unconfirmed after %.3g s: back to the "
                           "knobs of generation %d as generation %d", lease.generation, lease.lease_s,
                           lease.kept_generation, new.generation)
            self.metrics.config_changed()
        self._publish()

    # Engine thread: steps and deliveries ------------------------------------------------------------------------
    def _step(self) -> None:
        engine = self.engine
        step_start = time.monotonic()
        try:
            outputs = engine.step()
        except Exception as error:  # fail the requests in flight, keep serving
            logger.exception("an engine step failed; failing the requests in flight")
            self._fail_all(RequestFailed(f"the engine failed while serving this request: {error!r}"))
            return
        now = time.monotonic()
        self._observe_steps()
        self.latency.scheduled((seq.request_id for seq in engine.scheduler.running), step_start)
        deliveries: list[Delivery] = []
        for output in outputs:
            route = self._routes.get(output.request_id)
            if route is None:
                continue  # aborted
            try:
                deliveries.append((route.handle, self._delta(output, route, now, step_start)))
            except Exception as error:  # one request's failure must not fail the others
                logger.exception("failed to deliver the output of %s", output.request_id)
                self._fail_request(output.request_id, RequestFailed(f"internal error: {error!r}"))
        self._publish()  # before the tokens go out: a client that saw its last token scrapes settled counters
        self._deliver(deliveries)

    def _delta(self, output: RequestOutput, route: _Route, now: float, step_start: float) -> TokenDelta:
        rid = output.request_id
        self.latency.tokens(rid, len(output.new_token_ids), now, step_start)
        route.num_output_tokens = len(output.token_ids)
        if output.finished:
            del self._routes[rid]
            self.latency.finished(rid, output.finish_reason, now, route.num_prompt_tokens, route.num_output_tokens)
        return TokenDelta(route.index, list(output.new_token_ids), output.new_text, output.finished,
                          output.finish_reason, route.num_prompt_tokens, route.num_output_tokens)

    def _observe_steps(self) -> None:
        for record in self.engine.step_records(self._last_step):
            self.metrics.observe_step(record)
            self._last_step = record.step

    def _deliver(self, deliveries: list[Delivery]) -> None:
        if not deliveries or self._loop is None:
            return

        def dispatch() -> None:
            for handle, item in deliveries:
                handle.queue.put_nowait(item)

        try:
            self._loop.call_soon_threadsafe(dispatch)
        except RuntimeError:  # the event loop is gone: nobody listens, stop generating
            self._abort([h.request_ids[d.index] for h, d in deliveries if isinstance(d, TokenDelta)])

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

    def _fail_request(self, request_id: str, error: EngineError) -> None:
        """Fail the whole HTTP request of `request_id` (its other prompts too)."""
        route = self._routes.get(request_id)
        if route is None:
            self._abort([request_id])
            return
        for rid in route.handle.request_ids:
            try:
                self._abort([rid])
            except Exception:  # abort the others all the same
                logger.exception("could not abort %s", rid)
        self._deliver([(route.handle, error)])

    def _fail_all(self, error: EngineError) -> None:
        for rid in list(self._routes):
            if rid in self._routes:
                self._fail_request(rid, error)

    def _publish(self) -> None:
        self.snapshot = self._take_snapshot()

    def _take_snapshot(self) -> EngineSnapshot:
        return EngineSnapshot.of(self.engine, self._last_step, self.leases.current, self.leases.reverts)
