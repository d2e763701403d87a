"""The engine: requests in, one scheduled and executed step at a time, outputs and step records out.

One thread owns an engine (the caller offline, the engine loop's thread in the server) and makes every call, so
requests, aborts and config changes land between steps by construction and the engine needs no lock. The one
exception is the step-record ring buffer, which has its own lock: the server reads it from its event loop.

Two entry points check what comes in once: `admit` (the server's requests: prompts tokenized once, every limit
checked before anything is queued, all prompts or none) and `validate_update` + `apply_config` (a knob change
validated once, then applied at the step boundary).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import sys
import time
from collections.abc import Mapping
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.config import RELAYOUT_KNOBS, EngineConfig, ModelLimits
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import InvalidRequest, QueueFull
from engine.kv_cache import KVCache
from engine.memory import KVMemoryGuard
from engine.model import LlamaModel
from engine.model_loader import ModelConfig, load_state_dict, resolve_model_dir
from engine.model_runner import ModelRunner
from engine.precision import choose_dtype
from engine.prompt import Prompt
from engine.sampler import SamplingRow
from engine.sampling_params import RequestOutput, SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence
from engine.step_record import StepPage, StepRecord, StepRecorder

logger = logging.getLogger("slotune.engine")


@dataclass
class EngineStats:
    """Monotonic totals since start, for metrics."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_finished: dict[str, int] = field(default_factory=dict)  # by finish reason


@dataclass
class _Request:
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    row: SamplingRow


class LLMEngine:
    def __init__(self, model: str | Path | None = None, *, dtype: str = "auto", device: str = "cpu",
                 cache_dir: str | Path | None = None, seed: int = 0, step_log: str | Path | None = None,
                 step_record_capacity: int = 10_000, cuda_graphs: bool = True, **knobs: Any) -> None:
        """cuda_graphs: replay decode steps from CUDA graphs on a GPU with the Triton backend
        (engine/cuda_graphs.py; SLOTUNE_CUDA_GRAPHS=0 also turns them off)."""
        self.dtype_choice = choose_dtype(dtype, device)  # "auto": bf16 where the CPU and the kernels make it faster
        print(f"slotune: {self.dtype_choice.reason}", file=sys.stderr, flush=True)
        from transformers import AutoTokenizer  # loading only

        self.model_dir = resolve_model_dir(model, cache_dir)
        self.model_name = self.model_dir.name if model is None else str(model)
        self.model_config = ModelConfig.from_dir(self.model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.dtype = self.dtype_choice.dtype
        self.device = torch.device(device)
        self.limits = ModelLimits(max_context_len=self.model_config.max_position_embeddings,
                                  kv_bytes_per_token=self.model_config.kv_bytes_per_token(self.dtype))
        self.config = EngineConfig.create(self.limits, **knobs)
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids) | (
            {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set())
        self.kernel_backend = self.config.resolved_kernel_backend(self.device, self.dtype)
        logger.info("kernel backend: %s (kernel_backend=%s, device %s, %s)", self.kernel_backend,
                    self.config.kernel_backend, self.device, dtype)
        self.model = LlamaModel(self.model_config, load_state_dict(self.model_dir), self.dtype, self.device,
                                self.kernel_backend)
        self.scheduler = Scheduler(self.config, self.limits)
        self.runner = ModelRunner(self.model, self._new_kv_cache(self.config), seed=seed, cuda_graphs=cuda_graphs)
        self.recorder = StepRecorder(step_record_capacity, step_log)
        self.stats = EngineStats()
        self._requests: dict[str, _Request] = {}
        self._step_index = 0
        self._request_counter = itertools.count()
        self._pending_outputs: list[RequestOutput] = []  # requests a config change ended between steps

    def _new_kv_cache(self, config: EngineConfig) -> KVCache:
        mc = self.model_config
        return KVCache(mc.num_hidden_layers, config.resolved_num_kv_blocks(self.limits), config.block_size,
                       mc.num_key_value_heads, mc.head_dim, self.dtype, self.device,
                       num_host_blocks=config.num_swap_blocks(self.limits))

    @property
    def max_model_len(self) -> int:
        return self.config.resolved_max_model_len(self.limits)

    # Requests ---------------------------------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must be integers in 0..{vocab - 1}")
        return list(prompt)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0, arrival_time: float | None = None) -> str:
        """Queue a request (the offline API: `params.max_tokens` as given; a generation that reaches
        max_model_len ends with "length"); raises ValueError (and changes nothing) for a bad prompt or a
        duplicate id."""
        params = params or SamplingParams()
        self._check_stop_token_ids(params)
        request_id = request_id if request_id is not None else f"req-{next(self._request_counter)}"
        self._enqueue(self.tokenize(prompt), params, request_id, priority, arrival_time)
        return request_id

    def admit(self, prompts: SequenceOf[Prompt], params: SamplingParams, *, request_ids: SequenceOf[str],
              max_tokens: int | None, priority: int = 0, arrival_time: float | None = None,
              max_waiting: int | None = None) -> list[int]:
        """Check a server request once and queue one engine request per prompt, all or none; returns the prompts'
        token counts. `max_tokens`: the completion length the client asked for (prompt and completion must fit
        max_model_len), None for what the context leaves after each prompt. `max_waiting`: how many requests
        may wait beyond the free slots of max_num_seqs. Raises InvalidRequest (a retry cannot succeed) or
        QueueFull (it may, later); a tokenizer that fails otherwise raises its own error."""
        self._check_room(len(prompts), max_waiting)
        self._check_stop_token_ids(params)
        token_lists = [self._prompt_token_ids(p) for p in prompts]
        params_list = [self._fitted(ids, params, max_tokens) for ids in token_lists]
        added: list[str] = []
        try:
            for rid, ids, fitted in zip(request_ids, token_lists, params_list):
                self._enqueue(ids, fitted, rid, priority, arrival_time)
                added.append(rid)
        except ValueError as error:
            for rid in added:
                self.abort_request(rid)
            raise InvalidRequest(str(error), param="prompt") from None
        return [len(ids) for ids in token_lists]

    def _check_room(self, num_prompts: int, max_waiting: int | None) -> None:
        if max_waiting is None:
            return
        slots = self.config.max_num_seqs
        if num_prompts > slots + max_waiting:
            raise InvalidRequest(
                f"the request has {num_prompts} prompts; this server takes at most {slots + max_waiting} at once "
                f"(max_num_seqs {slots} running + {max_waiting} waiting)", param="prompt")
        scheduler = self.scheduler
        free = max(0, slots - scheduler.num_running)
        queued = len(scheduler.waiting) + len(scheduler.preempted)
        if queued + num_prompts - free > max_waiting:
            raise QueueFull(f"too many waiting requests ({queued} waiting for {free} free of {slots} running "
                            f"slots; at most {max_waiting} may wait beyond them); retry later")

    def _check_stop_token_ids(self, params: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise InvalidRequest(f"stop_token_ids must be token ids in 0..{vocab - 1}", param="stop_token_ids")

    def _prompt_token_ids(self, prompt: Prompt) -> list[int]:
        try:
            if prompt.messages is not None:
                return self.apply_chat_template(prompt.messages)
            return self.tokenize(prompt.token_ids if prompt.token_ids is not None else prompt.text or "")
        except (ValueError, TypeError, KeyError, IndexError) as error:
            raise InvalidRequest(f"invalid prompt: {error}", param="prompt") from None
        except Exception as error:
            if type(error).__module__.startswith("jinja2"):  # the chat template rejected the conversation
                raise InvalidRequest(f"invalid messages: {error}", param="messages") from None
            raise

    def _fitted(self, token_ids: list[int], params: SamplingParams, max_tokens: int | None) -> SamplingParams:
        """`params` with the completion length of this prompt, which must fit the context with it."""
        max_len, n_prompt = self.max_model_len, len(token_ids)
        if n_prompt >= max_len:
            return params  # the scheduler refuses the prompt itself, naming its length
        wanted = max_tokens if max_tokens is not None else max_len - n_prompt
        if n_prompt + wanted > max_len:
            raise InvalidRequest(
                f"this model's context (max_model_len) is {max_len} tokens, but {n_prompt + wanted} were requested "
                f"({n_prompt} in the prompt, {wanted} for the completion)", param="max_tokens")
        if wanted == params.max_tokens:
            return params
        try:
            return dataclasses.replace(params, max_tokens=wanted)
        except ValueError as error:
            raise InvalidRequest(str(error)) from None

    def _enqueue(self, token_ids: list[int], params: SamplingParams, request_id: str, priority: int,
                 arrival_time: float | None) -> None:
        seq = Sequence(request_id=request_id, prompt_token_ids=token_ids, params=params,
                       eos_token_ids=self.eos_token_ids, priority=priority,
                       arrival_time=arrival_time if arrival_time is not None else time.time())
        generator = torch.Generator(device="cpu").manual_seed(params.seed) if params.seed is not None else None
        self.scheduler.add(seq)  # raises ValueError for an empty or over-long prompt, or a duplicate id
        self._requests[request_id] = _Request(seq, IncrementalDetokenizer(self.tokenizer, params.stop),
                                              SamplingRow(params, generator, 0, self.eos_token_ids))

    def abort_request(self, request_id: str) -> bool:
        """Abort a request wherever it is; its blocks are freed at once. False if it is not in flight."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.abort(request_id)
        self._count_finished(request.seq)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests or self._pending_outputs)

    # Config -----------------------------------------------------------------------------------------------------
    def update_config(self, **knobs: Any) -> EngineConfig:
        """Validate and apply a knob update; all-or-nothing (raises ConfigError and changes nothing on a bad
        value). Changing the KV layout recomputes running sequences; none is lost."""
        return self.apply_config(self.validate_update(knobs))

    def validate_update(self, knobs: Mapping[str, Any], memory_guard: KVMemoryGuard | None = None) -> EngineConfig:
        """The config that `knobs` make, checked once: types and values (`EngineConfig`), the requests in flight
        (scheduler) and, with a guard, the memory of a re-laid-out KV cache. Raises ConfigError; changes
        nothing."""
        new = self.config.updated(self.limits, **knobs)
        self.scheduler.check_config(new)  # no request in flight may be stranded
        if memory_guard is not None and new.changed_knobs(self.config) & RELAYOUT_KNOBS:
            memory_guard.check(new, knobs, self.limits)
        return new

    def apply_config(self, new: EngineConfig) -> EngineConfig:
        """Switch to a config from `validate_update`, at this step boundary."""
        # Allocate the new cache before the scheduler switches, so a failed allocation changes nothing.
        new_cache = self._new_kv_cache(new) if new.changed_knobs(self.config) & RELAYOUT_KNOBS else None
        relayout, ended = self.scheduler.apply_config(new)
        if relayout:
            assert new_cache is not None
            self.runner.kv_cache = new_cache
        self.config = new
        for seq in ended:
            request = self._requests[seq.request_id]
            self._finish_request(seq)
            self._pending_outputs.append(self._output(request, [], request.detokenizer.pop_new_text(True)))
        return new

    def reset_prefix_cache(self) -> int:
        """Drop every cached prefix block that no running request holds; returns the number dropped."""
        return self.scheduler.kv.drop_free_cached()

    # Stepping ---------------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and run one step. Returns an output for every request that produced tokens or finished."""
        wall_start = time.time()
        start = time.perf_counter()
        out = self.scheduler.schedule()
        schedule_s = time.perf_counter() - start
        rows = {item.seq.request_id: self._requests[item.seq.request_id].row
                for item in out.scheduled if item.samples}
        for item in out.scheduled:
            if item.samples:
                rows[item.seq.request_id].num_output_tokens = item.seq.num_output_tokens
        tokens, timings = self.runner.execute(out, rows)
        self.scheduler.postprocess(out, tokens)
        outputs = self._pending_outputs + self._collect_outputs(out)
        self._pending_outputs = []
        self._record(out, wall_start, schedule_s, timings.forward_s, timings.sample_s,
                     time.perf_counter() - start)
        return outputs

    def _collect_outputs(self, out: SchedulerOutput) -> list[RequestOutput]:
        outputs = []
        now = time.time()
        for item in out.scheduled:
            seq = item.seq
            request = self._requests.get(seq.request_id)
            if request is None or not item.samples:
                continue  # aborted during the step, or a prefill chunk that sampled nothing
            token = seq.output_token_ids[-1]
            self.stats.generation_tokens += 1
            if seq.first_token_time is None:
                seq.first_token_time = now
                self.stats.prompt_tokens += seq.num_prompt_tokens
            detok = request.detokenizer
            detok.add(token)
            if not seq.status.finished and seq.num_output_tokens >= seq.params.min_tokens \
                    and detok.truncate_at_stop():
                self.scheduler.finish(seq, "stop")
            if seq.status.finished:
                self._finish_request(seq, now)
            new_text = detok.pop_new_text(seq.status.finished)
            outputs.append(self._output(request, [token], new_text))
        return outputs

    def _finish_request(self, seq: Sequence, now: float | None = None) -> None:
        seq.finish_time = now if now is not None else time.time()
        self._requests.pop(seq.request_id, None)
        self._count_finished(seq)

    def _count_finished(self, seq: Sequence) -> None:
        reason = seq.finish_reason or "abort"
        self.stats.requests_finished[reason] = self.stats.requests_finished.get(reason, 0) + 1

    def _output(self, request: _Request, new_tokens: list[int], new_text: str) -> RequestOutput:
        seq = request.seq
        return RequestOutput(
            request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids), text=request.detokenizer.text,
            finished=seq.status.finished, finish_reason=seq.finish_reason, new_token_ids=new_tokens,
            new_text=new_text, arrival_time=seq.arrival_time, first_token_time=seq.first_token_time,
            finish_time=seq.finish_time, num_cached_tokens=seq.num_cached_tokens)

    def _record(self, out: SchedulerOutput, wall_start: float, schedule_s: float, forward_s: float,
                sample_s: float, total_s: float) -> None:
        if out.is_empty:
            return
        sched = self.scheduler
        self.recorder.append(StepRecord(
            step=self._step_index, start_time=wall_start, schedule_s=schedule_s, forward_s=forward_s,
            sample_s=sample_s, total_s=total_s, num_prefill_seqs=out.num_prefill_seqs,
            num_prefill_tokens=out.num_prefill_tokens, num_decode_tokens=out.num_decode_tokens,
            num_running=sched.num_running, num_waiting=len(sched.waiting), num_preempted=len(sched.preempted),
            kv_blocks_used=sched.kv.num_used_blocks, kv_blocks_free=sched.kv.num_free_blocks,
            num_preemptions=out.num_preemptions, prefix_cache_hit_tokens=out.prefix_hit_tokens,
            config_generation=self.config.generation,
            context_tokens=sum(s.seq.num_computed_tokens for s in out.scheduled),
            num_swapped_blocks=len(out.swap_out) + len(out.swap_in)))
        self._step_index += 1

    def step_records(self, since: int = -1) -> list[StepRecord]:
        return self.recorder.since(since)

    def step_page(self, since: int = -1) -> StepPage:
        """The step records after `since` still held, and how many after it the buffer dropped."""
        return self.recorder.page(since)

    def close(self) -> None:
        self.recorder.close()
