"""The engine's C++ kernels, engine/csrc/ (one .cpp file per concept: work pool, SIMD helpers, linear kernels, decode
attention, norms and rotary, the layer loop, the Python bindings), built once with torch.utils.cpp_extension (g++ and
ninja) into the cache folder, for this CPU (-march=native; the folder is named after the CPU's model and features):

- ``decoder_layers``: the decoder's layer loop of one step (decode groups and prefill chunks) as one C++ call to the
  same ops in the same order as LlamaModel.forward and paged_attention. A batch-1 decode step is ~1,700 small
  ATen calls besides its ~120 matrix-vector products; from Python each costs a few microseconds of binding
  overhead.
- ``linear``: residual + at::linear, with a streaming kernel for fp32 inputs of at most 6 rows (decode steps of a
  few sequences), which reads the weights at the bandwidth torch.sum reads at, and register tiles for more rows up
  to a limit measured once per machine against at::linear (``tiled_rows_limit``).
- The kernels' loops run on torch's thread count through the work pool in csrc/work_pool.h (not ATen's
  parallel_for: without -fopenmp it compiles to a serial loop, and OpenMP's barrier stalls beside a busy process).
- ``decode_attention``: one query per sequence against its keys and values read in place through the block table;
  the query heads that share a KV head read each key and value row once, and at small batches each context is split
  into slices (merged after) so that both threads work.
- bf16 weights and KV cache (engine/model.py keeps activations, norms and biases fp32): ``linear`` takes a bf16
  weight with an fp32 input, which it rounds to bf16, with fp32 sums. The kernel ($SLOTUNE_BF16_KERNEL, else the
  best this CPU has): "amx" (AMX-BF16 tiles, csrc/linear_bf16_amx.cpp) or "vnni" (AVX512-BF16 register tiles,
  csrc/linear_bf16_vnni.cpp) on weights stored packed at load (``pack_vnni_weight``; ``packed_layout``) for every
  row count; "dot" (AVX512-BF16 dot products) or "widen" (the weights widened to fp32 by a shift, for CPUs without
  bf16 instructions) on plain weights, up to their own measured limit, and at::linear in bf16 above it (oneDNN).
  ``decode_attention`` and ``rotary_cache_write`` take bf16 caches; ``bf16_speedup`` is what dtype "auto"
  (engine/precision.py) decides by.
- ``prefill_attention``: a prefill chunk's causal attention over its cached context and itself from the paged bf16
  cache, flash-attention style on vdpbf16ps (CPUs with AVX512-BF16); elsewhere torch's scaled_dot_product_attention.
- ``pack_weights``: the model's weights, in the order a forward pass reads them, in one buffer on 2 MB pages.
- ``rms_norm``, ``rotary_cache_write`` (rotary queries and keys, new keys and values into the cache) and
  ``silu_and_mul``: one loop each instead of several ATen calls.

Both layer loops (C++ and Python) use these kernels, so they stay bit-identical to each other; against torch's ops
they differ in the last bits (summation order, exp), which tests/test_fused_layers.py bounds and the greedy
equivalence tests against transformers check end to end. What the design choices were measured against is in
BENCHMARKS.md ("The kernels' design measurements").

``load()`` returns the built module, or None when it is turned off (SLOTUNE_FUSED_LAYERS=0) or cannot be built
(then the Python layer loop and torch's ops run, after one warning)."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import platform
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from engine.model_loader import default_cache_dir

KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # the weights' and KV cache's dtypes the kernels take
ENV_SWITCH = "SLOTUNE_FUSED_LAYERS"  # "0": never build or use it
TILED_ROWS_ENV = "SLOTUNE_TILED_ROWS"  # overrides the measured limit of the tiled linear (6: tiles off)
BF16_TILED_ROWS_ENV = "SLOTUNE_BF16_TILED_ROWS"  # the same for bf16 weights
BF16_KERNEL_ENV = "SLOTUNE_BF16_KERNEL"  # "amx", "vnni", "dot" or "widen": the bf16 kernel (default: the best here)
PACKED_KERNELS = ("amx", "vnni")  # the bf16 kernels that read weights in the packed layout
TORCH_BUILD_LOCK = "lock"  # torch.utils.cpp_extension's lock file in the build folder
MEASUREMENTS_FILE = "machine_measurements-2.json"  # in the build folder: what load() measured on this machine
# (-2: the row limits measured in a thread of their own; a folder measured before keeps its old file unread)
SOURCE_DIR = Path(__file__).with_name("csrc")  # headers (*.h) and translation units (*.cpp)


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


def cpu_tag() -> str:
    """A short tag of this CPU's model and instruction-set features: -march=native code is only reused on a CPU
    that has the same (a shared cache folder may serve several machine types)."""
    described = platform.machine()
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
        for key in ("model name", "flags"):  # the first core's; the others repeat them
            described += next((line for line in cpuinfo if line.startswith(key)), "")
    except OSError:
        described += platform.processor()
    return hashlib.sha1(described.encode()).hexdigest()[:10]


def source_tag() -> str:
    """A short hash of the kernels' sources and where they are: each version, and each checkout, builds in its own
    folder (a cache folder shared by checkouts of different versions would otherwise rebuild, or race, in one; ninja
    also rebuilds when the source paths in its commands change, so two checkouts of one version took turns)."""
    digest = hashlib.sha1(str(SOURCE_DIR.resolve()).encode() + b"\0")
    for path in sorted(SOURCE_DIR.glob("*.[ch]*")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:10]


@functools.cache
def load() -> Any | None:
    if not enabled():
        return None
    from torch.utils.cpp_extension import load as build_extension

    build_dir = (default_cache_dir() / "extensions" /
                 f"fused_layers-torch{torch.__version__}-cpu{cpu_tag()}-src{source_tag()}")
    build_dir.mkdir(parents=True, exist_ok=True)
    if not any(build_dir.glob("*.so")):
        print(f"slotune: building the engine's C++ kernels in {build_dir} (once; about half a minute)...",
              file=sys.stderr, flush=True)
    try:
        sources = [str(path) for path in sorted(SOURCE_DIR.glob("*.cpp"))]
        with _build_lock(build_dir):
            module = build_extension(name="slotune_fused_layers", sources=sources, build_directory=str(build_dir),
                                     extra_cflags=["-O3", "-march=native"],
                                     extra_include_paths=[str(SOURCE_DIR)], verbose=False)
    except Exception as error:  # no compiler, no ninja, a broken toolchain: decoding still works, only slower
        warnings.warn(f"slotune: the C++ kernels could not be built ({str(error).splitlines()[0]}); "
                      f"steps run the Python layer loop and torch's ops instead (slower; {ENV_SWITCH}=0 skips the "
                      "attempt)",
                      RuntimeWarning, stacklevel=2)
        return None
    if os.environ.get(BF16_KERNEL_ENV):
        module.set_bf16_kernel(os.environ[BF16_KERNEL_ENV])
    module.set_tiled_rows_limit(tiled_rows_limit(module, build_dir), False)
    if bf16_kernel_name(module) not in PACKED_KERNELS:  # the packed kernels take every row count: no limit to measure
        module.set_tiled_rows_limit(tiled_rows_limit(module, build_dir, True), True)
    module.build_dir = str(build_dir)  # where this machine's measurements are kept (bf16_speedup)
    return module


@contextlib.contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """One build at a time per folder, under a lock the kernel releases when its holder dies. torch's own lock is a
    plain file that a build killed midway leaves behind, after which every later start waits on it forever: holding
    ours, no other slotune process is building, so such a file is stale and removed."""
    with open(build_dir / "slotune.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (build_dir / TORCH_BUILD_LOCK).unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _measurements(build_dir: Path) -> dict[str, Any]:
    try:
        data = json.loads((build_dir / MEASUREMENTS_FILE).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _measured(build_dir: Path, key: str, measure: Any) -> Any:
    """The value kept under `key` in the build folder's measurements, else measure() -> (value, details), kept."""
    data = _measurements(build_dir)
    if key not in data:
        print(f"slotune: measuring the C++ kernels on this machine ({key}; once, a few seconds)...", file=sys.stderr,
              flush=True)
        value, details = measure()
        data = _measurements(build_dir) | {key: value, f"{key}_seconds": details}
        (build_dir / MEASUREMENTS_FILE).write_text(json.dumps(data, indent=1))
    return data[key]


def packed_layout(module: Any, weight: torch.Tensor) -> torch.Tensor:
    """A bf16 weight [N, K] in the packed layout ([N/16, K/32, 16, 32], which ``linear`` takes) where the bf16 kernel
    in use reads it ("amx", "vnni") and the shape divides into its blocks; otherwise the weight itself."""
    if (weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.shape[0] % 16 or weight.shape[1] % 32
            or bf16_kernel_name(module) not in PACKED_KERNELS):
        return weight
    return module.pack_vnni_weight(weight)


def in_features(weight: torch.Tensor) -> int:
    """K of a weight [N, K], plain or in the packed layout [N/16, K/32, 16, 32]."""
    return weight.shape[1] * weight.shape[3] if weight.dim() == 4 else weight.shape[1]


def bf16_kernel_name(module: Any) -> str:
    """The kernel bf16 weights run on: "amx" or "vnni" (packed weights, all row counts), else "dot" or "widen" up to
    their measured limit."""
    return str(module.get_bf16_kernel())


def tiled_rows_limit(module: Any, build_dir: Path, bf16: bool = False) -> int:
    """Up to how many input rows ``linear`` uses its own tiles rather than at::linear (BLAS; for bf16 weights
    oneDNN, which has AMX tiles where the CPU has them): $SLOTUNE_TILED_ROWS / $SLOTUNE_BF16_TILED_ROWS, else the
    limit measured on this machine, once, and kept in the build folder (MEASUREMENTS_FILE)."""
    env = BF16_TILED_ROWS_ENV if bf16 else TILED_ROWS_ENV
    if os.environ.get(env):
        return int(os.environ[env])
    key = "bf16_tiled_rows_limit" if bf16 else "tiled_rows_limit"
    return int(_measured(build_dir, key, lambda: measure_tiled_rows_limit(module, bf16=bf16)))


def _decoder_weights(weight_bytes: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Matrices of a decoder's shapes (SmolLM2's gate/up and down), `weight_bytes` in all (above the last-level
    cache, so that they stream from memory as a forward pass's do)."""
    hidden, intermediate = 576, 1536
    layers = max(1, weight_bytes // (3 * hidden * intermediate * torch.tensor([], dtype=dtype).element_size()))
    generator = torch.Generator().manual_seed(0)
    return [w.to(dtype) for _ in range(layers) for w in (torch.randn(2 * intermediate, hidden, generator=generator),
                                                         torch.randn(hidden, intermediate, generator=generator))]


def _median_times(linears: list[Any], weights: list[list[torch.Tensor]], m: int, repeats: int = 5) -> list[float]:
    """The median time of each (linear, weights) pair over `repeats` passes, the pairs alternating (so that load from
    elsewhere on the machine falls on all of them alike), timed in a thread of its own, as a served engine's steps
    run (engine/engine_loop.py): there torch's OpenMP-threaded kernels (oneDNN, BLAS) ran 1.6-2x slower than in the
    main thread, the work pool's kernels as fast. The median, not the best: torch's kernels lose much more than the
    work pool's when another process holds a core, and a best-of pass hides that (measured: BENCHMARKS.md, "The
    kernels' design measurements")."""
    result: list[list[float]] = []
    worker = threading.Thread(target=lambda: result.append(_median_times_here(linears, weights, m, repeats)),
                              name="slotune-measure")
    worker.start()
    worker.join()
    if not result:
        raise RuntimeError("slotune: the kernel measurement failed (see the thread's traceback above)")
    return result[0]


def _median_times_here(linears: list[Any], weights: list[list[torch.Tensor]], m: int, repeats: int) -> list[float]:
    inputs = {in_features(w): torch.randn(m, in_features(w)) for ws in weights for w in ws}
    times: list[list[float]] = [[] for _ in linears]
    for linear, ws in zip(linears, weights, strict=True):  # warm-up (oneDNN builds its kernels on first use)
        linear(inputs[in_features(ws[0])], ws[0])
    for _ in range(repeats):
        for i, (linear, ws) in enumerate(zip(linears, weights, strict=True)):
            start = time.perf_counter()
            for w in ws:
                linear(inputs[in_features(w)], w)
            times[i].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


BF16_MEASURED_ROWS = (2, 3, 4, 5, 6, 8, 12, 16, 32, 64, 128, 256, 512)
FP32_MEASURED_ROWS = (8, 16, 32, 64, 128, 256, 512)


def measure_tiled_rows_limit(module: Any, rows: tuple[int, ...] | None = None, weight_bytes: int = 64 << 20,
                             bf16: bool = False) -> tuple[int, dict[str, list[float]]]:
    """Up to which row count the engine's own kernels are faster than at::linear (for bf16 weights: at::linear in
    bf16, what ``linear`` runs above its limit), over weights of a decoder's shapes larger than the last-level
    cache: the row counts of ``rows`` in increasing order until the first at which the library wins. The first loss
    ends the range (a later, noisy win does not reopen it). The floor is where the kernels' range starts without a
    measurement: 6 rows for fp32 (its streaming kernel), 1 row for bf16 (every bf16 row count from 2 is measured:
    on some CPUs oneDNN's bf16 kernels win from a few rows)."""
    rows = rows or (BF16_MEASURED_ROWS if bf16 else FP32_MEASURED_ROWS)
    weights = _decoder_weights(weight_bytes, torch.bfloat16 if bf16 else torch.float32)

    def library(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.to(w.dtype), w).float()

    limit, timings, previous = (1 if bf16 else 6), {}, module.get_tiled_rows_limit(bf16)
    module.set_tiled_rows_limit(max(rows), bf16)
    try:
        for m in sorted(rows):
            own, blas = _median_times([lambda x, w: module.linear(x, w, None, None), library], [weights, weights], m,
                                      repeats=7)
            timings[str(m)] = [own, blas]
            if own > blas:
                break
            limit = m
    finally:
        module.set_tiled_rows_limit(previous, bf16)
    return limit, timings


def bf16_speedup(module: Any) -> dict[str, float]:
    """fp32 time / bf16 time of ``linear`` over a decoder's matrices, at a decode step's row count (1) and at a
    mixed step's (64), with the bf16 kernel the engine uses here (bf16_kernel_name), measured on this machine once
    and kept (> 1: the bf16 kernels are the faster)."""
    key = f"bf16_speedup_{bf16_kernel_name(module)}"
    return _measured(Path(module.build_dir), key, lambda: measure_bf16_speedup(module))


def measure_bf16_speedup(module: Any, rows: tuple[int, ...] = (1, 64),
                         weight_bytes: int = 64 << 20) -> tuple[dict[str, float], dict[str, list[float]]]:
    fp32 = _decoder_weights(weight_bytes, torch.float32)
    bf16 = [packed_layout(module, w) for w in _decoder_weights(weight_bytes // 2, torch.bfloat16)]

    def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return module.linear(x, w, None, None)

    timings = {str(m): _median_times([linear, linear], [fp32, bf16], m) for m in rows}
    return {m: t[0] / t[1] for m, t in timings.items()}, timings
