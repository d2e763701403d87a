"""The fused layer loop: engine/fused_layers.cpp, the decoder's layer loop of one step (decode groups and prefill
chunks) as one C++ call to the same ATen ops in the same order as LlamaModel.forward and paged_attention, so the
results are bit-identical, built once with torch.utils.cpp_extension (g++ and ninja) into the cache folder. A
batch-1 decode step is ~1,700 small ATen calls besides its ~120 matrix-vector products; from Python each costs a
few microseconds of binding overhead, together a sixth of the step on a CPU.

``load()`` returns the built module, or None when it is turned off (SLOTUNE_FUSED_LAYERS=0) or cannot be built
(then the Python layer loop runs, after one warning)."""

from __future__ import annotations

import functools
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from engine.model_loader import default_cache_dir

ENV_SWITCH = "SLOTUNE_FUSED_LAYERS"  # "0": never build or use it
SOURCE = Path(__file__).with_name("fused_layers.cpp")


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


@functools.cache
def load() -> Any | None:
    if not enabled():
        return None
    from torch.utils.cpp_extension import load as build_extension

    build_dir = default_cache_dir() / "extensions" / f"fused_layers-torch{torch.__version__}"
    build_dir.mkdir(parents=True, exist_ok=True)
    if not any(build_dir.glob("*.so")):
        print(f"slotune: building the fused layer loop in {build_dir} (once; about half a minute)...",
              file=sys.stderr, flush=True)
    try:
        return build_extension(name="slotune_fused_layers", sources=[str(SOURCE)], build_directory=str(build_dir),
                               extra_cflags=["-O2"], verbose=False)
    except Exception as error:  # no compiler, no ninja, a broken toolchain: decoding still works, only slower
        warnings.warn(f"slotune: the fused layer loop could not be built ({str(error).splitlines()[0]}); "
                      f"steps run the Python layer loop instead (slower; {ENV_SWITCH}=0 skips the attempt)",
                      RuntimeWarning, stacklevel=2)
        return None
