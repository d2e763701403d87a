"""CUDA graphs of decode-only steps on the Triton backend: a decode step of a small model is a few hundred short
kernel launches, and on a GPU their launch cost, not the memory traffic, sets the step time; a captured graph
replays them with one launch.

One graph per batch-size bucket (1, 2, 4, 8, then multiples of 8), captured the first time the scheduler produces
a decode-only step of that size, over static input buffers: token ids, positions, KV slots, block tables as wide as
the model's context, context lengths. A step of n sequences copies its inputs into the first n rows of its bucket;
the other rows are padding (slot -1: nothing written; context 0: a zero attention output). The context slices of
the split path are sized for the model's whole context (a graph fixes the launch grid). The graphs hold the KV
cache's addresses: when the engine re-lays the cache (a block_size change) they are dropped and captured anew.

Switched off with SLOTUNE_CUDA_GRAPHS=0 (or LLMEngine(cuda_graphs=False)). Written for CUDA and not yet run on a
GPU: see BENCHMARKS.md, "GPU"."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F

from engine.attention import AttentionMetadata, DecodeGroup
from engine.kv_cache import KVCache
from engine.model import LlamaModel

ENV_SWITCH = "SLOTUNE_CUDA_GRAPHS"  # "0": never capture
MAX_CAPTURED_BATCH = 256


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


def bucket(num_seqs: int) -> int:
    return num_seqs if num_seqs <= 2 else 4 if num_seqs <= 4 else -(-num_seqs // 8) * 8


class CapturedDecode:
    """One bucket's static buffers and graph. capture=False runs the same body eagerly at every step (the CPU tests
    check the padding and the buffers that way; a CPU has no graphs)."""

    def __init__(self, model: LlamaModel, kv_cache: KVCache, size: int, pool: Any = None,
                 capture: bool = True) -> None:
        from engine.triton_kernels import TritonBatch

        device = model.device
        self.size = size
        self.max_context = model.config.max_position_embeddings
        width = -(-self.max_context // kv_cache.block_size)
        self.ids = torch.zeros(size, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        self.slots = torch.full((size,), -1, dtype=torch.long, device=device)
        self.tables = torch.zeros(size, width, dtype=torch.long, device=device)
        self.context_lens = torch.zeros(size, dtype=torch.long, device=device)
        meta = AttentionMetadata(slot_mapping=self.slots, decode_groups=[
            DecodeGroup(0, size, self.tables, self.max_context, None, self.context_lens)])
        empty = torch.zeros(0, dtype=torch.long, device=device)
        batch = TritonBatch(meta=meta, decode_max_contexts=[self.max_context],
                            prefill_tables=torch.zeros(0, 1, dtype=torch.long, device=device), prefill_starts=empty,
                            prefill_lens=empty, prefill_contexts=empty, max_prefill_len=0)

        def body() -> torch.Tensor:
            hidden = F.embedding(self.ids, model.embed_tokens)
            cos, sin = model._rope(self.positions)
            return model._triton_layers(hidden, cos, sin, meta, kv_cache, batch)

        self.body = body
        self.graph: torch.cuda.CUDAGraph | None = None
        if capture:
            self.hidden = self._capture(pool)

    def _capture(self, pool: Any) -> torch.Tensor:
        device, body = self.ids.device, self.body
        side = torch.cuda.Stream(device)  # warm-up (compiles the kernels) off the capturing stream, as CUDA wants
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                body()  # every row padding: nothing is written to the cache
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            hidden = body()
        return hidden

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, group: DecodeGroup,
            slot_mapping: torch.Tensor) -> torch.Tensor:
        n = input_ids.shape[0]
        self.ids[:n] = input_ids
        self.positions[:n] = positions
        self.slots[:n] = slot_mapping
        self.slots[n:] = -1
        self.tables[:n, : group.block_tables.shape[1]] = group.block_tables
        self.context_lens[:n] = group.context_lens
        self.context_lens[n:] = 0
        if self.graph is None:
            return self.body()[:n]
        self.graph.replay()
        return self.hidden[:n]


class DecodeGraphs:
    """The captured decode steps of one model over one KV cache."""

    def __init__(self, model: LlamaModel, kv_cache: KVCache) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, CapturedDecode] = {}

    @staticmethod
    def applies(model: LlamaModel) -> bool:
        return enabled() and model.device.type == "cuda" and model.kernel_backend == "triton"

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
                ) -> torch.Tensor | None:
        """The final hidden states of a decode-only step of one group, or None when no graph fits the step."""
        if meta.prefills or len(meta.decode_groups) != 1 or input_ids.shape[0] > MAX_CAPTURED_BATCH:
            return None
        size = bucket(input_ids.shape[0])
        graph = self.graphs.get(size)
        if graph is None:
            graph = self.graphs[size] = CapturedDecode(self.model, self.kv_cache, size, self.pool)
        return graph.run(input_ids, positions, meta.decode_groups[0], meta.slot_mapping)
