"""Turns logits into next tokens: greedy, temperature, top-k, top-p, with a per-request seed; tokens that would
stop a request before its `min_tokens` are masked out (as vLLM does)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    generator: torch.Generator | None  # a per-request generator when the request has a seed
    num_output_tokens: int
    eos_token_ids: frozenset[int]


def sample(logits: torch.Tensor, rows: list[SamplingRow], default_generator: torch.Generator) -> list[int]:
    """logits [rows, vocab] float32 -> one token id per row."""
    for i, row in enumerate(rows):
        if row.num_output_tokens < row.params.min_tokens:
            banned = set(row.params.stop_token_ids)
            if not row.params.ignore_eos:
                banned |= row.eos_token_ids
            if banned:
                logits[i, list(banned)] = float("-inf")
    tokens = logits.argmax(dim=-1).tolist()
    for i, row in enumerate(rows):
        if not row.params.greedy:
            tokens[i] = _sample_row(logits[i], row.params, row.generator or default_generator)
    return tokens


def _sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    # Shift by the max first: a tiny temperature then sends other logits to -inf instead of overflowing to NaN.
    logits = (logits - logits.max()) / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = sorted_probs.cumsum(-1)
        # Keep the smallest set whose mass reaches top_p (the token that crosses it stays in).
        drop = cumulative - sorted_probs >= params.top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    # The generators live on the CPU (seeded per request, device-independent draws): a GPU row is drawn there.
    return int(torch.multinomial(probs.to(generator.device), 1, generator=generator).item())
