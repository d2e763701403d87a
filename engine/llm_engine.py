"""The engine: requests in, one scheduled and executed step at a time, outputs and step records out.

Thread-safe: the server's engine loop calls `step()` while front-end threads add, abort and reconfigure; a lock
serializes them, so a config update or an abort always lands at a step boundary.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.config import RELAYOUT_KNOBS, EngineConfig, ModelLimits
from engine.detokenizer import IncrementalDetokenizer
from engine.kv_cache import KVCache
from engine.model import LlamaModel
from engine.model_loader import ModelConfig, load_state_dict, resolve_model_dir
from engine.model_runner import ModelRunner
from engine.precision import choose_dtype
from engine.sampler import SamplingRow
from engine.sampling_params import RequestOutput, SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence
from engine.step_record import StepRecord, StepRecorder

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
                 step_record_capacity: int = 10_000, **knobs: Any) -> None:
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
        self.model = LlamaModel(self.model_config, load_state_dict(self.model_dir), self.dtype, self.device)
        self.scheduler = Scheduler(self.config, self.limits)
        self.runner = ModelRunner(self.model, self._new_kv_cache(self.config), seed=seed)
        self.recorder = StepRecorder(step_record_capacity, step_log)
        self.stats = EngineStats()
        self._requests: dict[str, _Request] = {}
        self._lock = threading.RLock()
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
        """Queue a request; raises ValueError (and changes nothing) for a bad prompt or a duplicate id."""
        params = params or SamplingParams()
        vocab = self.model_config.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids in 0..{vocab - 1}")
        token_ids = self.tokenize(prompt)
        request_id = request_id if request_id is not None else f"req-{next(self._request_counter)}"
        seq = Sequence(request_id=request_id, prompt_token_ids=token_ids, params=params,
                       eos_token_ids=self.eos_token_ids, priority=priority,
                       arrival_time=arrival_time if arrival_time is not None else time.time())
        generator = torch.Generator(device="cpu").manual_seed(params.seed) if params.seed is not None else None
        with self._lock:
            self.scheduler.add(seq)
            self._requests[request_id] = _Request(
                seq, IncrementalDetokenizer(self.tokenizer, params.stop),
                SamplingRow(params, generator, 0, self.eos_token_ids))
        return request_id

    def abort_request(self, request_id: str) -> bool:
        """Abort a request wherever it is; its blocks are freed at once. False if it is not in flight."""
        with self._lock:
            request = self._requests.pop(request_id, None)
            if request is None:
                return False
            self.scheduler.abort(request_id)
            self._count_finished(request.seq)
            return True

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return bool(self._requests or self._pending_outputs)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    # Config -----------------------------------------------------------------------------------------------------
    def update_config(self, **knobs: Any) -> EngineConfig:
        """Validate and apply a knob update at the next step boundary; all-or-nothing (raises ConfigError and
        changes nothing on a bad value). Changing the KV layout recomputes running sequences; none is lost."""
        with self._lock:
            new = self.config.updated(self.limits, **knobs)
            self.scheduler.check_config(new)
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

    # Stepping ---------------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and run one step. Returns an output for every request that produced tokens or finished."""
        with self._lock:
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

    def close(self) -> None:
        self.recorder.close()
