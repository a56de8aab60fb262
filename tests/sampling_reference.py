"""Stock mlx-lm's tokens for a request's sampling: `generate_step` with mlx-lm's logits processors
(`make_logits_processors`) and its filters in `make_sampler`'s order; a sampled request draws with
the key a node gives it (its seed's, split once per draw), so the tokens are comparable one by one.

Import as `from sampling_reference import stock_generate` (tests/ is on sys.path)."""

from __future__ import annotations

import mlx.core as mx

from moe_cluster.node.sampling import advance_key
from moe_cluster.proto.records import Sampling


def keyed_sampler(s: Sampling):
    """mlx-lm's sampler chain for `s`, drawing with the node's key for the request."""
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_sampler

    if s.greedy:
        return make_sampler(temp=0.0)
    key = [advance_key(mx.random.key(s.seed), s.step)]

    def sampler(logprobs):
        key[0], sub = mx.random.split(key[0])
        if 0 < s.top_p < 1:
            logprobs = apply_top_p(logprobs, s.top_p)
        if s.min_p:
            logprobs = apply_min_p(logprobs, s.min_p)
        if s.top_k:
            logprobs = apply_top_k(logprobs, s.top_k)
        return mx.random.categorical(logprobs * (1 / s.temperature), key=sub)

    return sampler


def stock_generate(model, prompt, s: Sampling, eos: tuple[int, ...] = ()) -> list[int]:
    """Up to s.max_tokens tokens of stock mlx-lm's generate_step, ending before an EOS token."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_logits_processors

    processors = make_logits_processors(
        dict(s.logit_bias) or None,
        s.repetition_penalty or None,
        s.repetition_context_size,
        s.presence_penalty or None,
        s.presence_context_size,
        s.frequency_penalty or None,
        s.frequency_context_size,
    )
    out = []
    for token, _ in generate_step(
        mx.array(list(prompt), dtype=mx.uint32),
        model,
        max_tokens=s.max_tokens,
        sampler=keyed_sampler(s),
        logits_processors=processors,
    ):
        if int(token) in eos:
            break
        out.append(int(token))
    return out
