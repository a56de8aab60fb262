"""How a decoding sequence picks its next token: greedy, or a draw with its own key from its
temperature and top-p, one row of the step's log-probabilities at a time.

A sequence's sampler has its own key (its seed's, or one drawn for it, advanced past the draws a
resumed request made before), so its tokens do not depend on what else runs beside it. A sampler
that raises fails its own sequence only (`error`), never the batch.
"""

from __future__ import annotations

import mlx.core as mx


def sample_tokens(decoding: list, logprobs: mx.array) -> mx.array:
    """Each decoding sequence's next token (lazy, (B,)) from the step's (B, vocab) log-probabilities.
    A sequence whose sampler raises gets `error` set and the greedy token in its row: it leaves the
    batch after the step, alone (every rank raises alike: the same inputs, the same code)."""
    if all(s.req.sampling.greedy for s in decoding):
        return mx.argmax(logprobs, axis=-1)
    rows = []
    for i, s in enumerate(decoding):
        row = logprobs[i : i + 1]
        try:
            rows.append(sample_one(s, row))
        except Exception as exc:  # noqa: BLE001 - this sequence's failure, not the batch's
            s.error = exc
            rows.append(mx.argmax(row, axis=-1))
    return mx.concatenate(rows)


def sample_positions(decoding: list, logprobs: mx.array) -> tuple[mx.array, list]:
    """The model's token at every verified position ((B, width), lazy) from (B, width, vocab)
    log-probabilities, and per sequence the key after each number of draws (None where greedy).
    Position j of a sampling sequence draws with the subkey its j-th next token would use without
    speculation (`key_chain`), so an accepted prefix keeps the tokens and the keys."""
    if all(s.req.sampling.greedy for s in decoding):
        return mx.argmax(logprobs, axis=-1), [None] * len(decoding)
    rows, keys = [], []
    for i, s in enumerate(decoding):
        row = logprobs[i]
        if s.req.sampling.greedy:
            rows.append(mx.argmax(row, axis=-1))
            keys.append(None)
            continue
        after, subs = key_chain(s.key, row.shape[0])
        try:
            rows.append(
                mx.concatenate([draw(s, row[j : j + 1], sub) for j, sub in enumerate(subs)])
            )
            keys.append(after)
        except Exception as exc:  # noqa: BLE001 - this sequence's failure, not the batch's
            s.error = exc
            rows.append(mx.argmax(row, axis=-1))
            keys.append(None)
    return mx.stack(rows), keys


def advance_key(key: mx.array, steps: int) -> mx.array:
    """The key a sequence's sampler holds after `steps` draws (`_sample` splits it once per draw): a
    resumed request samples its step k as the run that was cut would have, on every rank alike."""
    for _ in range(steps):
        key = mx.random.split(key)[0]
    return key


def sample_one(s, logprobs: mx.array) -> mx.array:
    """One sequence's token from its (1, vocab) log-probabilities, with its own key."""
    sampling = s.req.sampling
    if sampling.greedy:  # the edge values too (proto.records.GREEDY_*): never handed to the kernels
        return mx.argmax(logprobs, axis=-1)
    keys = mx.random.split(s.key)
    s.key = keys[0]
    return draw(s, logprobs, keys[1])


def draw(s, logprobs: mx.array, key: mx.array) -> mx.array:
    """A draw from a (1, vocab) row with the sequence's temperature and top-p, with `key`."""
    from mlx_lm.sample_utils import apply_top_p

    sampling = s.req.sampling
    if sampling.top_p < 1:
        logprobs = apply_top_p(logprobs, sampling.top_p)
    return mx.random.categorical(logprobs * (1.0 / sampling.temperature), key=key)


def key_chain(key: mx.array, n: int) -> tuple[list[mx.array], list[mx.array]]:
    """(keys, subkeys): the key after each of n draws and the subkey each draw uses, as
    `sample_one` splits them one draw at a time."""
    keys, subs = [], []
    for _ in range(n):
        key, sub = mx.random.split(key)
        keys.append(key)
        subs.append(sub)
    return keys, subs
