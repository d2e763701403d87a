"""Builds one flattened variable-length batch per step (decode tokens and prefill chunks together), runs the
model over the paged KV cache and samples the next tokens."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from engine.attention import AttentionMetadata, DecodeGroup, PrefillChunk
from engine.cuda_graphs import DecodeGraphs
from engine.kv_cache import KVCache
from engine.model import LlamaModel
from engine.sampler import SamplingRow, sample
from engine.scheduler import ScheduledSequence, SchedulerOutput
from engine.sequence import Sequence

# A decode group is split when its longest context would exceed this multiple of its shortest one,
# trading the padding of one big gather against the per-group overhead of several small ones. With the C++
# decode attention (engine/fused_layers.py) nothing is gathered or padded: all decodes form one group.
DECODE_GROUP_SPREAD = 2.0


@dataclass
class StepTimings:
    forward_s: float = 0.0
    sample_s: float = 0.0


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: KVCache, seed: int = 0, cuda_graphs: bool = True) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = model.device
        self.default_generator = torch.Generator(device="cpu").manual_seed(seed)
        # Decode steps replayed from CUDA graphs (engine/cuda_graphs.py): on a GPU with the Triton backend only.
        self.use_cuda_graphs = cuda_graphs and DecodeGraphs.applies(model)
        self._graphs: DecodeGraphs | None = None

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.use_cuda_graphs:
            if self._graphs is None or self._graphs.kv_cache is not self.kv_cache:  # a re-laid cache: capture anew
                self._graphs = DecodeGraphs(self.model, self.kv_cache)
            hidden = self._graphs.forward(input_ids, positions, meta)
            if hidden is not None:
                return hidden
        return self.model.forward(input_ids, positions, meta, self.kv_cache)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, rows: dict[str, SamplingRow]) -> tuple[list[int | None], StepTimings]:
        """Run one step; returns a sampled token (or None) per entry of `out.scheduled`."""
        self.kv_cache.swap_out(out.swap_out)
        self.kv_cache.swap_in(out.swap_in)
        timings = StepTimings()
        if not out.scheduled:
            return [], timings
        start = time.perf_counter()
        order, input_ids, positions, meta = self._prepare(out.scheduled)
        hidden = self._forward(input_ids, positions, meta)
        # The last token of every sequence that samples; `ends` are the sequences' positions in the batch.
        ends: list[int] = []
        sampling: list[int] = []
        offset = 0
        for index in order:
            item = out.scheduled[index]
            offset += item.num_tokens
            if item.samples:
                ends.append(offset - 1)
                sampling.append(index)
        logits = self.model.compute_logits(hidden[torch.tensor(ends, dtype=torch.long, device=self.device)]) \
            if ends else None
        if self.device.type == "cuda":  # the GPU runs ahead of the host: forward_s is the GPU's time too
            torch.cuda.synchronize(self.device)
        timings.forward_s = time.perf_counter() - start
        start = time.perf_counter()
        tokens: list[int | None] = [None] * len(out.scheduled)
        if logits is not None:
            sampled = sample(logits, [rows[out.scheduled[i].seq.request_id] for i in sampling],
                             self.default_generator)
            for index, token in zip(sampling, sampled):
                tokens[index] = token
        timings.sample_s = time.perf_counter() - start
        return tokens, timings

    def _prepare(self, scheduled: list[ScheduledSequence]
                 ) -> tuple[list[int], torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Lay the batch out as decodes (sorted by context length, in groups) followed by prefill chunks."""
        decodes = sorted((i for i, s in enumerate(scheduled) if not s.is_prefill),
                         key=lambda i: scheduled[i].seq.num_computed_tokens)
        prefills = [i for i, s in enumerate(scheduled) if s.is_prefill]
        flat = _FlatBatch()
        meta = AttentionMetadata(slot_mapping=torch.empty(0))
        in_place = self.model.kernels is not None or self.model.triton is not None  # no gather, no mask
        context_lens = [scheduled[i].seq.num_computed_tokens + 1 for i in decodes]
        for start, end in decode_group_bounds(context_lens, math.inf if in_place else DECODE_GROUP_SPREAD):
            members = [scheduled[i].seq for i in decodes[start:end]]
            meta.decode_groups.append(self._decode_group(members, start, end, in_place, flat))
        for i in prefills:
            meta.prefills.append(self._prefill_chunk(scheduled[i], flat))
        meta.slot_mapping = self._tensor(flat.slots)
        return decodes + prefills, self._tensor(flat.ids), self._tensor(flat.positions), meta

    def _tensor(self, values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _decode_group(self, members: list[Sequence], start: int, end: int, in_place: bool, flat: _FlatBatch
                      ) -> DecodeGroup:
        """One decode token of each of ``members`` (batch rows ``start``..``end``) laid into ``flat``, and the
        group's block tables padded to its longest context (with the mask torch's attention needs)."""
        bs = self.kv_cache.block_size
        context_lens = [seq.num_computed_tokens + 1 for seq in members]
        longest = max(context_lens)
        num_blocks = -(-longest // bs)
        tables = [seq.block_table[:num_blocks] + [0] * (num_blocks - len(seq.block_table[:num_blocks]))
                  for seq in members]
        for seq in members:
            pos = seq.num_computed_tokens
            flat.ids.append(seq.token_id(pos))
            flat.positions.append(pos)
            flat.slots.append(seq.block_table[pos // bs] * bs + pos % bs)
        lens = self._tensor(context_lens)
        mask = None
        if min(context_lens) != longest and not in_place:  # the mask is for torch's attention only
            mask = (torch.arange(longest, device=self.device)[None, :] < lens[:, None])[:, None, None, :]
        return DecodeGroup(start=start, end=end, block_tables=self._tensor(tables), context_len=longest, mask=mask,
                           context_lens=lens)

    def _prefill_chunk(self, item: ScheduledSequence, flat: _FlatBatch) -> PrefillChunk:
        """The item's prefill chunk laid into ``flat``, with its block table and causal mask."""
        bs = self.kv_cache.block_size
        seq = item.seq
        start = seq.num_computed_tokens
        end = start + item.num_tokens
        token_start = len(flat.ids)
        flat.ids.extend(seq.token_slice(start, end))
        flat.positions.extend(range(start, end))
        num_blocks = -(-end // bs)
        table = self._tensor(seq.block_table[:num_blocks])
        chunk_positions = torch.arange(start, end, device=self.device)
        flat.slots.extend((table[chunk_positions // bs] * bs + chunk_positions % bs).tolist())
        mask = None
        if start > 0:
            mask = torch.arange(end, device=self.device)[None, :] <= chunk_positions[:, None]
        return PrefillChunk(start=token_start, end=len(flat.ids), context_len=end, block_table=table, mask=mask)


@dataclass
class _FlatBatch:
    """The step's tokens, flattened: each one's id, position and KV-cache slot."""

    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)


def decode_group_bounds(context_lens: list[int], spread: float) -> list[tuple[int, int]]:
    """The [start, end) of each decode group over context lengths in increasing order: a group ends before the
    first length over ``spread`` times its shortest."""
    bounds: list[tuple[int, int]] = []
    start = 0
    while start < len(context_lens):
        end = start
        while end < len(context_lens) and context_lens[end] <= spread * context_lens[start]:
            end += 1
        bounds.append((start, end))
        start = end
    return bounds
