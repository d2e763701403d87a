"""Iteration-level scheduling: every step re-forms the batch under one token budget shared by prefill chunks and
decode tokens (vLLM v1's idea). Running sequences are served first, then preempted ones, then new ones.
When blocks run out, the newest (lowest-priority) running sequence is preempted, by recompute or by swap.

No torch here: the scheduler works on token counts and block ids, so the simulator drives it on a virtual clock.
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass, field

from engine.block_manager import KVCacheManager
from engine.config import RELAYOUT_KNOBS, ConfigError, EngineConfig, ModelLimits
from engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSequence:
    seq: Sequence
    num_tokens: int  # new tokens computed for this sequence in this step
    is_prefill: bool
    samples: bool  # the step reaches the sequence's last token, so a next token is sampled


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    num_preemptions: int = 0
    prefix_hit_tokens: int = 0

    @property
    def num_prefill_seqs(self) -> int:
        return sum(1 for s in self.scheduled if s.is_prefill)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled if s.is_prefill)

    @property
    def num_decode_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled if not s.is_prefill)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.swap_out and not self.swap_in


@dataclass(slots=True)
class _StepBudget:
    """What one step has left as sequences are scheduled into ``out``: tokens (prefill and decode alike), prefill
    tokens, and the largest prefill chunk of one sequence."""

    out: SchedulerOutput
    tokens: int
    prefill: int
    chunk: int

    def tokens_for(self, seq: Sequence, uncomputed: int) -> int:
        """How many of ``seq``'s ``uncomputed`` tokens fit in the step."""
        if seq.in_prefill:
            return min(uncomputed, self.chunk, self.prefill, self.tokens)
        return min(uncomputed, self.tokens)

    def take(self, seq: Sequence, n: int) -> None:
        is_prefill = seq.in_prefill
        self.out.scheduled.append(ScheduledSequence(
            seq, n, is_prefill, samples=seq.num_computed_tokens + n == seq.num_tokens))
        self.tokens -= n
        if is_prefill:
            self.prefill -= n


class RequestQueue:
    """Sequences ordered by (priority, arrival) under the priority policy, by arrival under FCFS.
    A heap with lazy removal: push, pop and remove are O(log n) or O(1)."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._heap: list[tuple[tuple[int, int], Sequence]] = []
        self._members: set[Sequence] = set()

    def sort_key(self, seq: Sequence) -> tuple[int, int]:
        return (seq.priority if self.policy == "priority" else 0, seq.arrival_order)

    def push(self, seq: Sequence) -> None:
        self._members.add(seq)
        heapq.heappush(self._heap, (self.sort_key(seq), seq))

    def peek(self) -> Sequence | None:
        while self._heap and self._heap[0][1] not in self._members:
            heapq.heappop(self._heap)
        return self._heap[0][1] if self._heap else None

    def pop(self) -> Sequence:
        seq = self.peek()
        assert seq is not None, "pop from an empty queue"
        heapq.heappop(self._heap)
        self._members.discard(seq)
        return seq

    def remove(self, seq: Sequence) -> None:
        self._members.discard(seq)

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, seq: Sequence) -> bool:
        return seq in self._members

    def drain(self) -> list[Sequence]:
        """All members in queue order; the queue is left empty."""
        ordered = sorted(self._members, key=self.sort_key)
        self._heap.clear()
        self._members.clear()
        return ordered


class Scheduler:
    def __init__(self, config: EngineConfig, limits: ModelLimits) -> None:
        self.limits = limits
        self.config = config
        self.max_model_len = config.resolved_max_model_len(limits)
        self.kv = self._new_kv_manager(config)
        self.waiting = RequestQueue(config.scheduling_policy)
        self.preempted = RequestQueue(config.scheduling_policy)
        self.running: list[Sequence] = []  # sorted by the queues' key: the last one is the preemption victim
        self._by_id: dict[str, Sequence] = {}
        # Monotonic counters (they outlive KV re-layouts): tokens looked up in the prefix cache, and found.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_preemptions = 0

    def _new_kv_manager(self, config: EngineConfig) -> KVCacheManager:
        return KVCacheManager(
            num_blocks=config.resolved_num_kv_blocks(self.limits),
            block_size=config.block_size,
            num_host_blocks=config.num_swap_blocks(self.limits),
            enable_prefix_caching=config.enable_prefix_caching,
        )

    # Requests ---------------------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if seq.request_id in self._by_id:
            raise ValueError(f"request id {seq.request_id!r} is already in flight")
        if seq.num_prompt_tokens < 1:
            raise ValueError("the prompt is empty")
        if seq.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"the prompt has {seq.num_prompt_tokens} tokens; max_model_len is {self.max_model_len}, "
                "which must leave room for at least one generated token"
            )
        seq.status = SequenceStatus.WAITING
        self._by_id[seq.request_id] = seq
        self.waiting.push(seq)

    def abort(self, request_id: str) -> Sequence | None:
        seq = self._by_id.get(request_id)
        if seq is None:
            return None
        self.finish(seq, "abort")
        return seq

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence wherever it is; its blocks return to the pool at once."""
        if seq.status.finished:
            return
        self.waiting.remove(seq)
        self.preempted.remove(seq)  # a running one leaves `running` at the next schedule()
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._by_id.pop(seq.request_id, None)

    @property
    def num_unfinished(self) -> int:
        return len(self._by_id)

    @property
    def num_running(self) -> int:
        return sum(1 for s in self.running if s.status is SequenceStatus.RUNNING)

    def in_flight(self) -> list[Sequence]:
        return list(self._by_id.values())

    # Scheduling -------------------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """The next step's batch under one token budget: the running sequences first (the newest preempted when
        blocks run out), then preempted ones coming back, then new ones."""
        cfg = self.config
        out = SchedulerOutput()
        step = _StepBudget(out, cfg.max_num_batched_tokens, cfg.max_prefill_tokens_per_step(), cfg.max_chunk())
        self.running = self._schedule_running(step)
        # Preempted sequences come back before new ones are admitted; not in a step that just preempted (as in
        # vLLM v1): the blocks freed were needed by older sequences, and a victim must not bounce straight back.
        if out.num_preemptions:
            return out
        while self._has_room(step) and len(self.preempted):
            if not self._resume(step):
                break
        # New sequences, only once no preempted one is left waiting to come back.
        while self._has_room(step) and len(self.waiting) and not len(self.preempted):
            if not self._admit(self.waiting, step):
                break
        return out

    def _has_room(self, step: _StepBudget) -> bool:
        return step.tokens > 0 and len(self.running) < self.config.max_num_seqs

    def _schedule_running(self, step: _StepBudget) -> list[Sequence]:
        """Schedule the running sequences, oldest (highest priority) first; victims of preemption come from the
        end. Returns the sequences still running."""
        running = [s for s in self.running if s.status is SequenceStatus.RUNNING]
        while len(running) > self.config.max_num_seqs:  # a lowered max_num_seqs holds from this step on
            self._preempt(running.pop(), step.out)
        block_size = self.kv.block_size
        scheduled = step.out.scheduled
        i = 0
        while i < len(running):
            seq = running[i]
            # Fast path, most sequences in most steps: one decode token that fits in the last block.
            computed = seq.num_computed_tokens
            if (computed + 1 == seq.num_tokens and computed >= seq.num_prompt_tokens and step.tokens > 0
                    and computed < len(seq.block_table) * block_size):
                scheduled.append(ScheduledSequence(seq, 1, False, True))
                step.tokens -= 1
                i += 1
                continue
            n = step.tokens_for(seq, seq.num_uncomputed_tokens)
            if n > 0:
                if not self._allocate_or_preempt(seq, n, running, step.out):
                    break
                step.take(seq, n)
            i += 1
        return running

    def _allocate_or_preempt(self, seq: Sequence, n: int, running: list[Sequence], out: SchedulerOutput) -> bool:
        """Blocks for ``n`` more tokens of ``seq``, preempting the newest of ``running`` until they fit; False when
        ``seq`` itself had to go."""
        while not self.kv.allocate(seq, n):
            victim = running.pop()
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _resume(self, step: _StepBudget) -> bool:
        """Bring the head of the preempted queue back (a swapped one swapped in, a recomputed one restarted); False
        when it does not fit."""
        seq = self.preempted.peek()
        assert seq is not None
        if seq.status is not SequenceStatus.SWAPPED:
            return self._admit(self.preempted, step)
        n = step.tokens_for(seq, seq.num_uncomputed_tokens)
        if n == 0 or not self.kv.can_swap_in(seq, n):
            return False
        step.out.swap_in.extend(self.kv.swap_in(seq, n))
        self._start_running(self.preempted.pop())
        step.take(seq, n)
        return True

    def _admit(self, queue: RequestQueue, step: _StepBudget) -> bool:
        """Start (or restart from scratch) the head of `queue` if its first chunk fits; False if it does not."""
        seq = queue.peek()
        assert seq is not None
        prefix = self.kv.find_prefix(seq)
        cached_tokens = prefix.num_blocks * self.kv.block_size
        n = step.tokens_for(seq, seq.num_tokens - cached_tokens)
        if n == 0 or not self.kv.allocate(seq, n, prefix):
            return False
        if self.kv.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += cached_tokens
        step.out.prefix_hit_tokens += cached_tokens
        if seq.status is SequenceStatus.WAITING:
            seq.num_cached_tokens = cached_tokens
        self._start_running(queue.pop())
        step.take(seq, n)
        return True

    def _start_running(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=self.waiting.sort_key)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        out.num_preemptions += 1
        self.num_preemptions += 1
        seq.num_preemptions += 1
        if self.config.preemption_mode == "swap" and self.kv.can_swap_out(seq):
            out.swap_out.extend(self.kv.swap_out(seq))
            seq.status = SequenceStatus.SWAPPED
        else:
            self._reset_for_recompute(seq)
        self.preempted.push(seq)

    def _reset_for_recompute(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.block_hashes = []
        seq.status = SequenceStatus.PREEMPTED

    # After the model ran ---------------------------------------------------------------------------------------
    def postprocess(self, out: SchedulerOutput, sampled: list[int | None]) -> list[Sequence]:
        """Advance the scheduled sequences by their computed tokens and append the sampled ones (aligned with
        `out.scheduled`; None where nothing was sampled). Returns the sequences that finished on length or stop
        tokens; their blocks are already freed."""
        finished = []
        register = self.kv.enable_prefix_caching
        block_size = self.kv.block_size
        running = SequenceStatus.RUNNING
        for item, token in zip(out.scheduled, sampled, strict=True):
            seq = item.seq
            if seq.status is not running:
                continue  # aborted while the step ran
            seq.num_computed_tokens += item.num_tokens
            if register and seq.num_computed_tokens // block_size > seq.num_registered_blocks:
                self.kv.register_full_blocks(seq)
            if item.samples:
                assert token is not None
                seq.append_token(token)
                reason = seq.check_length_stop(self.max_model_len)
                if reason is not None:
                    self.finish(seq, reason)
                    finished.append(seq)
        return finished

    # Live config ------------------------------------------------------------------------------------------------
    def check_config(self, new: EngineConfig) -> None:
        """Reject a config that would strand an in-flight request (beyond what `EngineConfig` checks)."""
        new_len = new.resolved_max_model_len(self.limits)
        longest = max((s.num_prompt_tokens for s in self._by_id.values()), default=0)
        if longest >= new_len:
            raise ConfigError("max_model_len", new.max_model_len,
                              f"must be > {longest}, the longest prompt in flight")

    def apply_config(self, new: EngineConfig) -> tuple[bool, list[Sequence]]:
        """Switch to `new` at a step boundary. Returns whether the KV cache was laid out anew (then every
        in-flight sequence was preempted for recompute; none is dropped) and the sequences that a shorter
        max_model_len ended."""
        self.check_config(new)
        changed = new.changed_knobs(self.config)
        relayout = bool(changed & RELAYOUT_KNOBS)
        if relayout:
            for seq in self.running + self.preempted.drain():
                if not seq.status.finished:
                    self._reset_for_recompute(seq)
                    self.preempted.push(seq)
            self.running = []
        self.config = new
        self.max_model_len = new.resolved_max_model_len(self.limits)
        if relayout:
            self.kv = self._new_kv_manager(new)
        elif "enable_prefix_caching" in changed:
            self.kv.set_prefix_caching(new.enable_prefix_caching)
        if "scheduling_policy" in changed:
            for queue in (self.waiting, self.preempted):
                members = queue.drain()
                queue.policy = new.scheduling_policy
                for seq in members:
                    queue.push(seq)
            self.running.sort(key=self.waiting.sort_key)
        # A shorter max_model_len ends sequences that already reached it.
        ended = [s for s in self._by_id.values() if s.num_output_tokens and s.num_tokens >= self.max_model_len]
        for seq in ended:
            self.finish(seq, "length")
        return relayout, ended
