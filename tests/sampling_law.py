"""The law a sampler's draws must follow, for the tests that check it (tests/cluster/test_sampling.py
on the first token through the API, tests/unit/test_batch.py at every step in the batch): the
distribution mlx-lm's sampler draws from, and chi-square's critical values."""

from __future__ import annotations

import math

import numpy as np


def chi2_sf(x: float, df: int) -> float:
    """P(X > x) for X ~ chi-square(df): 1 - the regularized lower gamma P(df/2, x/2) (its series)."""
    a, z = df / 2, x / 2
    if z <= 0:
        return 1.0
    term = total = 1.0 / a
    n = 1
    while term > total * 1e-15:
        term *= z / (a + n)
        total += term
        n += 1
    return max(0.0, 1.0 - math.exp(a * math.log(z) - z - math.lgamma(a)) * total)


def chi2_critical(alpha: float, df: int) -> float:
    """The x with P(X > x) = alpha (bisection on chi2_sf)."""
    lo, hi = 0.0, 10.0 * df + 100
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi2_sf(mid, df) > alpha else (lo, mid)
    return hi


def sampling_probs(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """The next-token distribution mlx-lm's sampler draws from: log-probabilities (as
    generate_step hands them over), mlx-lm's apply_top_p where top_p < 1, then softmax(· / T)."""
    import mlx.core as mx
    from mlx_lm.sample_utils import apply_top_p

    logprobs = mx.array(logits)[None] - mx.logsumexp(mx.array(logits))
    if 0 < top_p < 1:
        logprobs = apply_top_p(logprobs, top_p)
    return np.array(mx.softmax(logprobs / temperature, axis=-1)[0]).astype(np.float64)
