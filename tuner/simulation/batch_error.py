"""The step-time model's error by decode batch size, after it was rescaled to a machine's measured steps.

A rescale moves every decode step by one factor (the median measured / predicted ratio). When the machine's batch
scaling differs from the calibration CPU's (its step at 8 sequences costs nearly what 16 cost there), the one factor
is right on average and wrong at both ends, and so is every capacity the simulator predicts for a config that runs
there. The residual ratio per batch-size bin says how wrong, where the study measured steps of that size; a config's
allowance is the worst of the bins it can run (up to its ``max_num_seqs``).

The same bins serve the steps that prefill, by their prefill tokens: the rescale fits those a power law of the
tokens, and the residual per bin says where a config's token budget (its largest prefill step) lies off that law.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

MIN_BIN_STEPS = 20  # decode steps a bin needs before its residual counts (fewer say little about a median)


def batch_bins(largest: int) -> list[tuple[int, int]]:
    """Powers-of-two bins of decode batch sizes up to ``largest``: (1, 1), (2, 3), (4, 7), ..."""
    bins, lo = [], 1
    while lo <= largest:
        bins.append((lo, 2 * lo - 1))
        lo *= 2
    return bins


def batch_errors(batch_sizes: Sequence[float], ratios: Sequence[float]) -> list[list[float]]:
    """[lo, hi, the median measured / predicted ratio, steps] of each bin with MIN_BIN_STEPS decode steps or more
    (``ratios`` of the rescaled model, one per step)."""
    sizes, values = np.asarray(batch_sizes, dtype=float), np.asarray(ratios, dtype=float)
    if not sizes.size:
        return []
    out = []
    for lo, hi in batch_bins(int(sizes.max())):
        inside = (sizes >= lo) & (sizes <= hi)
        if inside.sum() >= MIN_BIN_STEPS:
            out.append([float(lo), float(hi), float(np.median(values[inside])), float(inside.sum())])
    return out


def worst_batch_error(errors: Sequence[Sequence[float]], max_seqs: int | None) -> float | None:
    """The relative error of the worst measured bin a config with ``max_num_seqs`` ``max_seqs`` can run (any bin
    when None): max(ratio, 1 / ratio) - 1; None without a measured bin. Bins above the largest measured one are
    not known: the worst measured bin stands for them."""
    bins = [e for e in errors if max_seqs is None or e[0] <= max_seqs]
    if not bins:
        return None
    return max(max(r, 1.0 / r) - 1.0 for _, _, r, _ in bins if r > 0 and math.isfinite(r))
