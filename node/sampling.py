"""How a decoding sequence picks its next token: mlx-lm's logits processors (logit bias, repetition,
presence and frequency penalties) over the tokens it has seen, then greedy, or a draw with its own
key after mlx-lm's filters (top-p, min-p, top-k, in `mlx_lm.sample_utils.make_sampler`'s order),
one row of the step's logits at a time.

A sequence's history is its prompt, its agreed tokens and the step's input (with speculation, each
verified position's drafts before it), as mlx-lm's `generate_step` hands its processors the prompt
and every token fed since; a resumed request's prompt holds the tokens it streamed before. A
sequence's sampler has its own key (its seed's, or one drawn for it, advanced past the draws a
resumed request made before), so its tokens do not depend on what else runs beside it. A sampler
or processor that raises fails its own sequence only (`error`), never the batch.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from ..proto.errors import UserError
from ..proto.records import Sampling


def sample_tokens(decoding: list, logits: mx.array) -> mx.array:
    """Each decoding sequence's next token (lazy, (B,)) from the step's (B, vocab) logits.
    A sequence whose sampler raises gets `error` set and the greedy token in its row: it leaves the
    batch after the step, alone (every rank raises alike: the same inputs, the same code)."""
    if all(s.req.sampling.greedy and not s.req.sampling.processed for s in decoding):
        return mx.argmax(_logprobs(logits), axis=-1)
    rows = []
    for i, s in enumerate(decoding):
        row = logits[i : i + 1]
        try:
            if s.req.sampling.processed:
                tail = [] if s.token is None else [s.token.reshape(-1)[:1].astype(mx.uint32)]
                row = process(s.req.sampling, _history(s.req.sampling, _seen(s), tail), row)
            rows.append(sample_one(s, _logprobs(row)))
        except Exception as exc:  # noqa: BLE001 - this sequence's failure, not the batch's
            s.error = exc
            rows.append(mx.argmax(logits[i : i + 1], axis=-1))
    return mx.concatenate(rows)


def sample_positions(decoding: list, logits: mx.array, drafts: list | tuple = ()) -> tuple:
    """The model's token at every verified position ((B, width), lazy) from (B, width, vocab)
    logits, and per sequence the key after each number of draws (None where greedy). Position j
    of sequence i was fed drafts[i][j - 1] (position 0: its next input), so its history holds
    drafts[i][:j] (no drafts given: none). Position j of a sampling sequence draws with the subkey its j-th next token
    would use without speculation (`key_chain`), so an accepted prefix keeps the tokens and the
    keys."""
    if all(s.req.sampling.greedy and not s.req.sampling.processed for s in decoding):
        return mx.argmax(_logprobs(logits), axis=-1), [None] * len(decoding)
    rows, keys = [], []
    for i, s in enumerate(decoding):
        sampling, row = s.req.sampling, logits[i]
        try:
            if sampling.processed:
                seen = [*_seen(s), *s.pending]
                mine = list(drafts[i]) if drafts else []
                row = mx.concatenate(
                    [
                        process(sampling, _history(sampling, seen + mine[:j]), row[j : j + 1])
                        for j in range(row.shape[0])
                    ]
                )
            logprobs = _logprobs(row)
            if sampling.greedy:
                rows.append(mx.argmax(logprobs, axis=-1))
                keys.append(None)
                continue
            after, subs = key_chain(s.key, row.shape[0])
            rows.append(
                mx.concatenate([draw(s, logprobs[j : j + 1], sub) for j, sub in enumerate(subs)])
            )
            keys.append(after)
        except Exception as exc:  # noqa: BLE001 - this sequence's failure, not the batch's
            s.error = exc
            rows.append(mx.argmax(logits[i], axis=-1))
            keys.append(None)
    return mx.stack(rows), keys


def advance_key(key: mx.array, steps: int) -> mx.array:
    """The key a sequence's sampler holds after `steps` draws (`_sample` splits it once per draw): a
    resumed request samples its step k as the run that was cut would have, on every rank alike."""
    for _ in range(steps):
        key = mx.random.split(key)[0]
    return key


def key_chain(key: mx.array, n: int) -> tuple[list[mx.array], list[mx.array]]:
    """(keys, subkeys): the key after each of n draws and the subkey each draw uses, as
    `sample_one` splits them one draw at a time."""
    keys, subs = [], []
    for _ in range(n):
        key, sub = mx.random.split(key)
        keys.append(key)
        subs.append(sub)
    return keys, subs


def sample_one(s, logprobs: mx.array) -> mx.array:
    """One sequence's token from its (1, vocab) log-probabilities, with its own key."""
    sampling = s.req.sampling
    if sampling.greedy:  # the edge values too (proto.records.GREEDY_*): never handed to the kernels
        return mx.argmax(logprobs, axis=-1)
    keys = mx.random.split(s.key)
    s.key = keys[0]
    return draw(s, logprobs, keys[1])


def draw(s, logprobs: mx.array, key: mx.array) -> mx.array:
    """A draw from a (1, vocab) row with `key`, after mlx-lm's filters in make_sampler's order
    (top-p, min-p, top-k), at the sequence's temperature."""
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    sampling = s.req.sampling
    if 0 < sampling.top_p < 1:
        logprobs = apply_top_p(logprobs, sampling.top_p)
    if sampling.min_p != 0:
        logprobs = apply_min_p(logprobs, sampling.min_p)
    if 0 < sampling.top_k < logprobs.shape[-1]:  # at least the vocabulary: every token stays
        logprobs = apply_top_k(logprobs, sampling.top_k)
    return mx.random.categorical(logprobs * (1.0 / sampling.temperature), key=key)


def process(sampling: Sampling, history: mx.array, logits: mx.array) -> mx.array:
    """(1, vocab) logits after mlx-lm's logits processors, given the tokens seen so far."""
    bias = sampling.logit_bias
    if bias and bias[-1][0] >= logits.shape[-1]:  # MLX would read past the row, not raise
        raise UserError(
            f"logit_bias names token {bias[-1][0]}, past this model's {logits.shape[-1]} logits"
        )
    for processor in processors(sampling):
        logits = processor(history, logits)
    return logits


def _logprobs(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _seen(s) -> list[int]:
    """The tokens a sequence has seen up to its step's input: the prompt (a resumed request's
    holds what it streamed before) and the agreed tokens fed since."""
    return [*s.req.prompt, *s.fed]


def _history(sampling: Sampling, seen: list[int], lazy: list | tuple = ()) -> mx.array:
    """The tail of `seen` (and the step's `lazy` input, not read on the host yet) the processors
    look at: their longest context, or everything where a context of 0 asks for all of it."""
    sizes = [
        n
        for n, on in (
            (sampling.repetition_context_size, sampling.repetition_penalty),
            (sampling.presence_context_size, sampling.presence_penalty),
            (sampling.frequency_context_size, sampling.frequency_penalty),
        )
        if on
    ]
    keep = 0 if 0 in sizes else max(sizes, default=1)
    tokens = mx.array(seen[-keep:] if keep else seen, dtype=mx.uint32)
    return mx.concatenate([tokens, *lazy]) if lazy else tokens


@functools.lru_cache(maxsize=256)
def processors(sampling: Sampling) -> tuple:
    """mlx-lm's logits processors for a request's settings (make_logits_processors), kept while
    the request runs: the bias is an array built once."""
    from mlx_lm.sample_utils import make_logits_processors

    return tuple(
        make_logits_processors(
            dict(sampling.logit_bias) or None,
            sampling.repetition_penalty or None,
            sampling.repetition_context_size,
            sampling.presence_penalty or None,
            sampling.presence_context_size,
            sampling.frequency_penalty or None,
            sampling.frequency_context_size,
        )
    )
