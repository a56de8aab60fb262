"""The node's sampler against stock mlx-lm (demo model, the running batch in one process): top-k,
min-p, logit bias and the repetition, presence and frequency penalties give the tokens of mlx-lm's
`generate_step` with `make_logits_processors` and the same filters, beside other sequences, with
speculation and after a resume; a bad sequence fails alone; the draws follow the filtered
distribution (a chi-square)."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from sampling_reference import stock_generate
from test_batch import PROMPTS, SPEC, Log, drive

from moe_cluster.coordinator.serve.resume import continuation
from moe_cluster.node.batch import BatchLimits
from moe_cluster.node.collective.base import LocalCollective
from moe_cluster.node.demo import MODEL_DIR
from moe_cluster.node.moe.load import load_shard
from moe_cluster.node.runtime import GenerateResult, NodeRuntime
from moe_cluster.node.sampling import sample_tokens
from moe_cluster.proto.records import GenerateRequest, Sampling

STEPS = 20


@pytest.fixture(scope="module")
def cluster_path():
    return load_shard("demo", None, 0, collective=LocalCollective())


@pytest.fixture(scope="module")
def stock():
    """stock(prompt ids, sampling) -> stock mlx-lm's tokens (sampling_reference.py)."""
    from mlx_lm.utils import load_model

    model, _ = load_model(MODEL_DIR)
    return lambda prompt, s: stock_generate(model, prompt, s)


@pytest.fixture(scope="module")
def prompt():
    from mlx_lm.tokenizer_utils import load

    return tuple(load(MODEL_DIR).encode(PROMPTS[0], add_special_tokens=False))


@pytest.fixture(scope="module")
def cases(stock, prompt):
    """Settings that each change the tokens: the bias pushes the greedy answer's first two
    tokens away and another one up."""
    plain = stock(prompt, Sampling(STEPS))
    bias = tuple(sorted({plain[0]: -100.0, plain[1]: -100.0, 300: 4.0}.items()))
    return {
        "greedy, repetition": Sampling(STEPS, repetition_penalty=1.8),
        "greedy, presence, frequency over all, bias": Sampling(
            STEPS,
            presence_penalty=1.5,
            frequency_penalty=0.8,
            frequency_context_size=0,
            logit_bias=bias,
        ),
        "sampled, top-k, min-p, repetition": Sampling(
            STEPS, 0.9, seed=3, top_k=4, min_p=0.05, repetition_penalty=1.3
        ),
        "sampled, top-p, top-k, bias, presence": Sampling(
            STEPS, 1.0, 0.9, seed=8, top_k=3, logit_bias=bias, presence_penalty=0.5
        ),
    }


NAMES = [
    "greedy, repetition",
    "greedy, presence, frequency over all, bias",
    "sampled, top-k, min-p, repetition",
    "sampled, top-p, top-k, bias, presence",
]


def _without(s: Sampling) -> Sampling:
    """The same request with mlx-lm's processors and filters off."""
    return Sampling(s.max_tokens, s.temperature, s.top_p, s.seed)


@pytest.mark.parametrize("name", NAMES)
def test_processors_and_filters_give_stock_mlx_lm_s_tokens_beside_others(
    cluster_path, stock, prompt, cases, name
):
    s = cases[name]
    want = stock(prompt, s)
    assert want != stock(prompt, _without(s))  # the settings matter: ignoring them would show
    others = [
        GenerateRequest("plain", prompt, Sampling(STEPS)),
        GenerateRequest("drawn", prompt, Sampling(STEPS, 1.0, seed=11)),
    ]
    req = GenerateRequest("it", prompt, s)
    results, _ = drive(NodeRuntime(cluster_path, limits=BatchLimits(max_batch=4)), [*others, req])
    assert results[2].tokens == want
    assert results[0].tokens == stock(prompt, Sampling(STEPS))  # the neighbours are unmoved


@pytest.mark.parametrize("name", [NAMES[1], NAMES[2]])
def test_with_speculation_each_position_sees_the_drafts_before_it(
    cluster_path, stock, prompt, cases, name
):
    """Drafts from the right answer (accepted: a position's history holds the drafts before it)
    and from a spoiled one (rejected mid-draft): the tokens of one token a step."""
    s = cases[name]
    want = stock(prompt, s)
    spoiled = tuple((t + 1) % 300 if i % 4 == 3 else t for i, t in enumerate(want))
    reqs = [
        GenerateRequest("right", prompt, s, prediction=tuple(want)),
        GenerateRequest("spoiled", prompt, s, prediction=spoiled),
    ]
    results, _ = drive(NodeRuntime(cluster_path, limits=SPEC), reqs)
    assert [r.tokens for r in results] == [want, want]
    assert results[0].figures.accepted >= STEPS // 2, results[0].figures


@pytest.mark.parametrize("name", [NAMES[1], NAMES[3]])
def test_a_resumed_request_goes_on_with_the_tokens_of_the_run_it_continues(
    cluster_path, stock, prompt, cases, name
):
    """The resumed run's prompt holds the tokens streamed before: its penalties see them."""
    s = cases[name]
    want = stock(prompt, s)
    resumed = continuation(GenerateRequest("r", prompt, s), want[:7], 1)
    (result,), _ = drive(NodeRuntime(cluster_path), [resumed])
    assert result.tokens == want[7:]


def test_a_bias_past_the_vocabulary_fails_its_own_sequence_alone(cluster_path, prompt, stock):
    """Handed to the node directly (the coordinator refuses it): that sequence fails, naming the
    token; the one beside it decodes on."""
    rt = NodeRuntime(cluster_path, limits=BatchLimits(max_batch=4))
    bad = GenerateRequest("bad", prompt, Sampling(STEPS, logit_bias=((5000, 1.0),)))
    good = GenerateRequest("good", prompt, Sampling(STEPS, repetition_penalty=1.8))
    steps = [0]
    logs, results = [Log(steps), Log(steps)], [GenerateResult(), GenerateResult()]
    for i, req in enumerate((bad, good)):
        rt.batch.submit(req, i + 1, logs[i], results[i])
    while rt.batch.busy():
        rt.batch.step()
        steps[0] += 1
    assert "5000" in str(logs[0].error), logs[0].error
    assert logs[1].error is None and results[1].tokens == stock(prompt, good.sampling)


def test_the_draws_follow_the_filtered_distribution():
    """2,000 sequences of one row of logits, each with its own key: a chi-square of their tokens
    against softmax(logits / T) over what top-k and min-p keep, computed here in numpy."""
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 2.0, size=64).astype(np.float32)
    n, temperature = 2000, 0.8
    s = Sampling(1, temperature, seed=0, top_k=5, min_p=0.1)
    req = GenerateRequest("c", (1,), s)
    seqs = [SimpleNamespace(req=req, key=mx.random.key(i), error=None) for i in range(n)]
    row = mx.array(logits)[None]
    drawn = np.array(sample_tokens(seqs, mx.repeat(row, n, axis=0)))
    logprobs = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    keep = np.argsort(-logits)[: s.top_k]
    keep = keep[logprobs[keep] >= logprobs.max() + np.log(s.min_p)]
    p = np.exp(logprobs[keep] / temperature)
    p /= p.sum()
    assert set(np.unique(drawn)) <= set(keep.tolist())  # nothing outside the filters
    counts = np.array([(drawn == k).sum() for k in keep])
    chi2 = float((((counts - n * p) ** 2) / (n * p)).sum())
    # the 0.999 quantile of chi-square with len(keep) - 1 degrees of freedom (3 or 4 here)
    limit = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47}[len(keep) - 1]
    assert len(keep) >= 3 and chi2 < limit, (chi2, counts, n * p)
    # and the same test catches a sampler that ignores the temperature
    q = np.exp(logprobs[keep])
    q /= q.sum()
    assert float((((counts - n * q) ** 2) / (n * q)).sum()) > limit
