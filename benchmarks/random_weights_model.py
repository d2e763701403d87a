#!/usr/bin/env python
"""The default model's exact shapes with random weights, for a machine that cannot install the model's package (a
lent GPU machine reaches no registry, and carries at most tens of MB): speed figures are the same as the real
weights' (every benchmark fixes output lengths with ``ignore_eos``), and greedy-equality checks still compare the
engine with transformers on the same weights. Written where the engine looks for the default model, so the tests'
fixtures and every benchmark use it unchanged:

    python benchmarks/random_weights_model.py --from MODEL_DIR --cache /tmp/slc --package-root /tmp/pkgs
    SLOTUNE_CACHE_DIR=/tmp/slc PYTHONPATH=/tmp/pkgs:. python benchmarks/gpu_suite.py --out gpu_suite.json

MODEL_DIR needs only the model's config.json and tokenizer files (a few MB), e.g. copied from the engine's cache
folder of the converted default model (``~/.cache/slotune/models/SmolLM2-135M-Instruct.Q4_1``).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from engine.model_loader import DEFAULT_GGUF_NAME, DEFAULT_MODEL_PACKAGE

SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--from", dest="source", type=Path, required=True, help="a folder with config.json and tokenizer")
    p.add_argument("--cache", type=Path, required=True, help="the SLOTUNE_CACHE_DIR the engine will be given")
    p.add_argument("--package-root", type=Path, required=True,
                   help="a folder for an empty stand-in of the model's package (put it on PYTHONPATH)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    target = args.cache / "models" / Path(DEFAULT_GGUF_NAME).stem
    target.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.source)).eval()
    with torch.no_grad():
        # unit-scale embeddings (the LM head is tied to them): logits far apart, so greedy ties are unlikely
        model.get_input_embeddings().weight.normal_(0.0, 1.0)
    model.save_pretrained(target, safe_serialization=True)
    for name in SIDE_FILES:
        if (args.source / name).is_file():
            shutil.copyfile(args.source / name, target / name)
    # The engine finds the default model's package with find_spec and uses the cache folder above when it holds
    # model.safetensors: the stand-in's GGUF is never read.
    package = args.package_root / DEFAULT_MODEL_PACKAGE
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("")
    (package / DEFAULT_GGUF_NAME).write_bytes(b"")
    print(f"{sum(t.numel() for t in model.parameters())} random parameters in {target}")


if __name__ == "__main__":
    main()
