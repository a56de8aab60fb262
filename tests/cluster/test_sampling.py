"""Sampling against the model, through `moe-cluster up` (real node processes, real HTTP), N = 1, 2.

A seeded request at temperature > 0 differs from the greedy answer and from another seed's. Over
DRAWS seeded requests for one next token, sent at once so the nodes run them in batches, the
token frequencies match softmax(stock mlx-lm's log-probabilities / T) on the same checkpoint, with
mlx-lm's own top-p filter where top_p < 1, by a chi-square test at significance ALPHA. The draws
are fixed by their seeds, so the test is deterministic; ALPHA is the chance that a correct sampler
fails it over a random choice of seeds. The same draws are also checked to be *far* from the
distribution at another temperature or without the filter, so the test shows it can tell them apart.
A few of the seeds, sent one at a time (alone), draw what they drew inside the batch.
"""

from __future__ import annotations

import math
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from cluster_fixture import cluster, http, yaml_for
from sampling_law import chi2_critical, sampling_probs

PROMPT = "Once upon a time there was"  # the demo model's next token is spread: top 0.22 at T = 1
DRAWS = 300
ALPHA = 1e-3
CASES = [(0.7, 1.0), (0.8, 0.6)]  # (temperature, top_p)
MIN_EXPECTED = (
    5  # tokens expected fewer times than this are pooled into one bin (chi-square's rule)
)
CLIENTS = 32
ALONE = 8  # seeds re-sent one at a time
SERVING = f"serving:\n  max_batch: {CLIENTS}\n  queue: {2 * CLIENTS}\n"


def test_the_chi_square_critical_values_are_the_tables():
    for df, want in ((1, 10.828), (5, 20.515), (10, 29.588), (20, 45.315)):  # alpha = 0.001
        assert abs(chi2_critical(1e-3, df) - want) < 2e-3, (df, chi2_critical(1e-3, df))


def chi_square(tokens: list[int], probs: np.ndarray) -> tuple[float, int]:
    """(statistic, degrees of freedom) of the draws against `probs`. A token drawn where `probs`
    is 0 (outside the nucleus) gives an infinite statistic."""
    n = len(tokens)
    counts = Counter(tokens)
    if any(probs[t] == 0 for t in counts):
        return math.inf, 1
    big = [t for t in range(len(probs)) if probs[t] * n >= MIN_EXPECTED]
    observed = [counts[t] for t in big]
    expected = [probs[t] * n for t in big]
    rest = n - sum(observed), n * (1 - sum(probs[t] for t in big))
    if rest[1] >= MIN_EXPECTED:
        observed.append(rest[0])
        expected.append(rest[1])
    elif rest[0]:  # a few draws in a tail too thin for its own bin: into the smallest bin
        i = int(np.argmin(expected))
        observed[i] += rest[0]
        expected[i] += rest[1]
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    return stat, len(observed) - 1


@pytest.fixture(scope="module")
def stock():
    """(prompt ids, stock mlx-lm's float32 logits for the next token) on the demo checkpoint."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    from moe_cluster.node.checkpoint import load_tokenizer
    from moe_cluster.node.demo import MODEL_DIR

    ids = list(load_tokenizer(MODEL_DIR).encode(PROMPT))
    model, _ = load_model(MODEL_DIR)
    return ids, np.array(model(mx.array([ids]))[0, -1].astype(mx.float32))


@pytest.fixture(scope="module", params=[1, 2], ids=["N=1", "N=2"])
def served(request, tmp_path_factory):
    with cluster(
        tmp_path_factory.mktemp(f"sampling{request.param}"), yaml_for(request.param, extra=SERVING)
    ) as (url, _, _):
        yield url


def _tokens(url: str, ids: list[int], **sampling) -> list[int]:
    status, out = http(url, "/v1/completions", {"prompt": ids, **sampling})
    assert status == 200, out
    return out["moe_cluster"]["tokens"]


def _draws(url: str, ids: list[int], temperature: float, top_p: float, seeds) -> list[int]:
    """The first token of one seeded request per seed, CLIENTS requests in flight at a time."""

    def one(seed: int) -> int:
        got = _tokens(url, ids, max_tokens=1, temperature=temperature, top_p=top_p, seed=seed)
        return got[0] if got else 0  # nothing generated: the draw was EOS (the demo's id 0)

    with ThreadPoolExecutor(CLIENTS) as pool:
        return list(pool.map(one, seeds))


def test_a_seeded_request_differs_from_greedy_and_from_another_seed(served, stock):
    ids, _ = stock
    greedy = _tokens(served, ids, max_tokens=24, temperature=0)
    a, b = (_tokens(served, ids, max_tokens=24, temperature=0.9, seed=s) for s in (1, 2))
    assert len(greedy) == len(a) == len(b) == 24, (greedy, a, b)
    assert a != greedy and b != greedy and a != b, (greedy, a, b)
    assert _tokens(served, ids, max_tokens=24, temperature=0.9, seed=1) == a  # and the seed repeats


@pytest.mark.parametrize("temperature, top_p", CASES)
def test_next_token_frequencies_match_stock_softmax(temperature, top_p, served, stock):
    ids, logits = stock
    seeds = range(10_000, 10_000 + DRAWS)
    tokens = _draws(served, ids, temperature, top_p, seeds)
    probs = sampling_probs(logits, temperature, top_p)
    stat, df = chi_square(tokens, probs)
    bound = chi2_critical(ALPHA, df)
    top = Counter(tokens).most_common(4)
    assert stat <= bound, (
        f"chi-square {stat:.1f} > {bound:.1f} (df {df}, alpha {ALPHA}): draws {top}, "
        f"expected {[(t, round(float(probs[t]) * DRAWS, 1)) for t, _ in top]}"
    )
    # The same draws are far from the distribution at T = 1 with no filter: the test has the power
    # to catch a sampler that ignores the temperature or top_p.
    other, odf = chi_square(tokens, sampling_probs(logits, 1.0, 1.0))
    assert other > chi2_critical(ALPHA, odf), (other, odf)
    # Alone: a few of the seeds, one request at a time, draw what they drew in the batch.
    alone = [_draws(served, ids, temperature, top_p, [s])[0] for s in seeds[:ALONE]]
    assert alone == tokens[:ALONE], (alone, tokens[:ALONE])
