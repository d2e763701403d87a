"""Outcomes with a known share that miss in bursts, as requests queueing behind one burst do: the truths the level
tests simulate the project's procedures on.

- :func:`markov_chain`: each request attains or misses, and the next one keeps its state with a fixed chance: misses
  come in runs of mean ``burst`` requests (geometric), attaining runs as long as the share requires.
- :func:`markov_modulated`: a hidden state (a queue episode or not) that lasts ``burst`` requests on average inside
  an episode; inside, a request misses with chance ``inside``, outside with chance ``outside``: misses cluster
  within episodes without forming one unbroken run.

Both start from their stationary state, so every request attains with chance ``share``.
"""

from __future__ import annotations

import numpy as np


def _alternating(rng: np.random.Generator, n: int, first: bool, mean_true: float, mean_false: float) -> np.ndarray:
    """``n`` states in alternating runs (geometric lengths of the given means), starting in state ``first``."""
    pairs = int(2 * n / (mean_true + mean_false)) + 16
    out = np.empty(0, dtype=bool)
    state = first
    while out.size < n:
        mean_a, mean_b = (mean_true, mean_false) if state else (mean_false, mean_true)
        a = rng.geometric(1.0 / max(mean_a, 1.0), pairs)
        b = rng.geometric(1.0 / max(mean_b, 1.0), pairs)
        # a run longer than n ends past the last outcome wanted: capped there, the first n are the same (and a
        # share near 1 does not build runs of millions to drop them)
        lengths = np.minimum(np.column_stack([a, b]).ravel(), n)
        states = np.tile([state, not state], pairs)
        out = np.concatenate([out, np.repeat(states, lengths)])
    return out[:n]


def markov_chain(rng: np.random.Generator, n: int, share: float, burst: float) -> np.ndarray:
    """``n`` outcomes (True: attained) of a two-state Markov chain with stationary share ``share`` and misses in runs
    of mean ``burst``."""
    attain_run = burst * share / (1.0 - share)
    return _alternating(rng, n, bool(rng.random() < share), attain_run, burst)


def markov_modulated(rng: np.random.Generator, n: int, share: float, burst: float, inside: float = 0.7,
                     outside: float = 0.01) -> np.ndarray:
    """``n`` outcomes whose miss chance is ``inside`` during hidden episodes of mean ``burst`` requests and
    ``outside`` between them, the episodes as frequent as the share ``share`` requires."""
    in_episode = (1.0 - share - outside) / (inside - outside)  # the stationary share of requests inside
    between = burst * (1.0 - in_episode) / in_episode
    hidden = _alternating(rng, n, bool(rng.random() < in_episode), burst, between)
    miss = np.where(hidden, inside, outside)
    return rng.random(n) >= miss


TRUTHS = {"chain": markov_chain, "modulated": markov_modulated}
