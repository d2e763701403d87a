"""Shared fixtures: the default model's folder, a fixed prompt set of mixed lengths, and the transformers
reference outputs for it (computed once per test session)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REFERENCE_MAX_TOKENS = 32

SHARED_PREFIX = (
    "You are a meticulous assistant for a logistics company. Answer precisely, cite the relevant policy section, "
    "and keep every answer under one hundred words. Policies: deliveries ship within two business days; returns "
    "are accepted for thirty days with a receipt; damaged goods are replaced at no cost; international orders "
    "carry customs fees paid by the recipient; premium members get free express shipping on every order. "
)

INDEPENDENT_PROMPTS = [
    "Hi",
    "The capital of France is",
    "def fibonacci(n):",
    "Q: What is 12 times 7?\nA:",
    "Write a haiku about autumn leaves falling on a quiet river.",
    "Explain photosynthesis step by step for a ten-year-old. " * 4,
    "import numpy as np\nimport pandas as pd\n" * 12,
    "Once upon a time in a small village by the sea, there lived an old fisherman who " * 6,
]

PREFIX_SUFFIXES = [
    "Question: how long does delivery take?",
    "Question: can I return shoes after forty days?",
    "Question: who pays customs fees for an order to Canada?",
    "Question: my vase arrived broken, what now?",
    "Question: do premium members pay for express shipping?",
    "Question: what is the return window?",
    "Question: summarize the policies in one sentence.",
    "Question: is weekend delivery available?",
]


def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from engine.model_loader import resolve_model_dir

    return resolve_model_dir(None)


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def mixed_prompts(tokenizer) -> list[list[int]]:
    """16 prompts of 1 to ~250 tokens; the last 8 share a ~90-token prefix (several full KV blocks)."""
    texts = INDEPENDENT_PROMPTS + [SHARED_PREFIX + s for s in PREFIX_SUFFIXES]
    return [list(tokenizer(t)["input_ids"]) for t in texts]


@pytest.fixture(scope="session")
def reference_outputs(model_dir: Path, mixed_prompts: list[list[int]]) -> list[list[int]]:
    """Greedy continuations from transformers' own `generate`, one prompt at a time (no padding effects)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    outputs = []
    with torch.inference_mode():
        for prompt in mixed_prompts:
            ids = torch.tensor([prompt])
            generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=REFERENCE_MAX_TOKENS,
                                       do_sample=False)
            outputs.append(generated[0, len(prompt):].tolist())
    return outputs
