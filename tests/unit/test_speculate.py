"""Speculative decoding's parts (node/speculate.py): where drafts come from, which are accepted,
the keys a sampled sequence draws with, and which caches can drop a rejected tail."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import pytest

from moe_cluster.node.sampling import key_chain
from moe_cluster.node.speculate import accept, can_roll_back, lookup, predicted, rollback


def test_lookup_takes_what_followed_the_latest_longest_suffix():
    # the 3-gram (2, 3, 4) occurred at 1 and 6: the latest one's followers
    assert lookup([1, 2, 3, 4, 9, 9, 2, 3, 4, 7, 8, 2, 3, 4], 2) == [7, 8]
    # no 3-gram or 2-gram occurred before, the 1-gram 5 did
    assert lookup([5, 6, 1, 2, 5], 3) == [6, 1, 2]
    # drafts stop where the history ends
    assert lookup([1, 2, 1], 4) == [2, 1]
    assert lookup([1, 2, 3], 4) == [] and lookup([7], 4) == [] and lookup([1, 2, 1], 0) == []


def test_a_prediction_drafts_from_where_the_output_stands():
    pred = [10, 11, 12, 13, 10, 11, 14]
    assert predicted(pred, [1, 2], done=0, k=3) == [10, 11, 12]  # nothing out yet: its start
    # (10, 11) occurs at 0 and 4; after 6 tokens of output the one ending at 6 is where it stands
    assert predicted(pred, [1, 2, 10, 11, 12, 13, 10, 11], done=6, k=2) == [14]
    assert predicted(pred, [1, 2, 10, 11], done=2, k=2) == [12, 13]
    assert predicted(pred, [1, 2, 99], done=1, k=2) == [] and predicted((), [1], 0, 2) == []


def test_accept_keeps_the_drafts_up_to_the_first_the_model_disagrees_with():
    v = accept([5, 6, 7], [5, 6, 9, 4])
    assert (v.tokens, v.accepted) == ([5, 6, 9], 2)
    v = accept([5, 6], [5, 6, 8])  # all accepted, and the model's token after them
    assert (v.tokens, v.accepted) == ([5, 6, 8], 2)
    assert accept([], [3]).tokens == [3] and accept([1], [2, 2]).tokens == [2]


def test_the_key_chain_is_the_keys_of_one_draw_at_a_time():
    key = mx.random.key(7)
    keys, subs = key_chain(key, 3)
    k = key
    for j in range(3):
        k, sub = mx.random.split(k)
        assert mx.array_equal(sub, subs[j]).item() and mx.array_equal(k, keys[j]).item()


def test_kv_and_windowed_caches_roll_back_and_a_recurrent_state_says_why_not():
    from mlx_lm.models.cache import (
        ArraysCache,
        CacheList,
        ChunkedKVCache,
        KVCache,
        RotatingKVCache,
    )

    assert can_roll_back([KVCache(), CacheList(KVCache(), RotatingKVCache(16))]) is None
    assert can_roll_back([ChunkedKVCache(8)]) is None
    why = can_roll_back([KVCache(), ArraysCache(2), CacheList(KVCache(), RotatingKVCache(16))])
    assert why.startswith("its caches (ArraysCache) cannot drop rejected drafts: a recurrent state")


def test_a_window_has_room_for_a_step_no_wider_than_it_and_a_chunk_while_the_step_stays_in_it():
    from mlx_lm.models.cache import ChunkedKVCache, KVCache, RotatingKVCache

    from moe_cluster.node.speculate import room

    r = RotatingKVCache(16)
    r.update_and_fetch(mx.zeros((1, 1, 10, 4)), mx.zeros((1, 1, 10, 4)))
    assert room([KVCache(), r], 16) and not room([KVCache(), r], 17)  # its turn rolls back too
    c = ChunkedKVCache(8)
    c.update_and_fetch(mx.zeros((1, 1, 5, 4)), mx.zeros((1, 1, 5, 4)))
    assert room([c], 3) and not room([c], 4)


@pytest.mark.parametrize("drop", [[0, 0], [2, 2], [0, 3], [3, 1]])
def test_rollback_leaves_each_row_as_if_only_its_kept_positions_were_fed(drop):
    """A batch cache fed 4 positions per row, each row's last drop[i] removed, holds what a cache
    fed only the kept positions holds (and the positions its next keys go to)."""
    from mlx_lm.models.cache import BatchKVCache

    mx.random.seed(0)
    keys = mx.random.normal((2, 1, 7, 4))
    fed = BatchKVCache([1, 0])  # row 0 is one shorter: one position of left padding
    fed.update_and_fetch(keys[:, :, :3], keys[:, :, :3])
    fed.update_and_fetch(keys[:, :, 3:], keys[:, :, 3:])
    rollback([fed], drop)
    for row in range(2):
        got = fed.extract(row)
        kept = 7 - drop[row]
        start = 1 if row == 0 else 0
        assert got.offset == kept - start
        assert mx.array_equal(
            got.keys[..., : got.offset, :], keys[row : row + 1, :, start:kept]
        ).item()


def test_the_allowance_halves_on_failed_guesses_rests_then_probes_and_comes_back_whole():
    from moe_cluster.node.speculate import COOL_STEPS, MAX_COOL, adapt

    state = (4, 0, COOL_STEPS)
    seen, tried = [], 4
    for _ in range(3 + COOL_STEPS):  # nothing ever holds
        state = adapt(*state[:2], tried, 0, 4, state[2])
        tried = state[0]
        seen.append(state[0])
    assert seen[:3] == [2, 1, 0] and seen[3:-1] == [0] * (COOL_STEPS - 1) and seen[-1] == 1
    assert state[2] == 2 * COOL_STEPS  # the next rest is longer
    # the probe's outcome comes a step late: the step before it (no guess) teaches nothing
    assert adapt(1, 0, 0, 0, 4, 16) == (1, 0, 16)
    assert adapt(1, 0, 1, 0, 4, 16) == (0, 16, 32)  # the probe failed: rest longer
    assert adapt(0, 16, 1, 0, 4, 32) == (0, 15, 32)  # a late failure while resting: no new rest
    assert adapt(0, 0, 0, 0, 4, MAX_COOL)[2] == MAX_COOL
    assert adapt(1, 0, 1, 1, 4, 32) == (4, 0, COOL_STEPS)  # a guess held: all back
    assert adapt(0, 9, 1, 1, 4, 32) == (4, 0, COOL_STEPS)


def test_auto_is_quietly_off_where_it_cannot_run_and_an_explicit_mode_says_so_too():
    """`auto` is the default: a recurrent state, two micro-batches or attention by stream turn it
    off with the reason (for the node's status), never an error; on plain caches it is on."""
    from types import SimpleNamespace

    from mlx_lm.models.cache import ArraysCache, ChunkedKVCache, KVCache, RotatingKVCache

    from moe_cluster.node.batch import BatchLimits
    from moe_cluster.node.speculate import speculation

    two = SimpleNamespace(world_size=2, rank=1)
    auto = BatchLimits(speculative="auto")
    assert speculation(auto, two, [KVCache(), RotatingKVCache(8)], 300)[:2] == (4, None)
    for limits, cache, why in (
        (
            auto,
            [ArraysCache(2)],
            "its caches (ArraysCache) cannot drop rejected drafts: a recurrent state",
        ),
        (replace(auto, overlap=True), [KVCache()], "overlap: true runs two micro-batches"),
        (replace(auto, attention="by-stream"), [KVCache()], "attention: by-stream"),
        (replace(auto, speculative="prompt-lookup"), [ArraysCache(2)], "its caches (ArraysCache)"),
    ):
        draft_max, off, spec = speculation(limits, two, cache, 300)
        assert draft_max == 0 and spec is None and off.startswith(why), off
    # by stream a chunk's fill is its owner's alone: prompt lookup there on plain caches and
    # rotating windows (whose room is the step's: speculate.room), not on chunked ones
    lookup_by_stream = replace(auto, speculative="prompt-lookup", attention="by-stream")
    why = speculation(lookup_by_stream, two, [KVCache(), ChunkedKVCache(8)], 300)[1]
    assert why.startswith("its caches (ChunkedKVCache) are chunked windows, and by stream"), why
    assert speculation(lookup_by_stream, two, [KVCache(), RotatingKVCache(8)], 300)[:2] == (4, None)
    # explicitly asked for, prompt lookup runs by stream (each owner drafts its own streams)
    assert (
        speculation(
            replace(auto, speculative="prompt-lookup", attention="by-stream"), two, [KVCache()], 300
        )[1]
        is None
    )


def test_auto_with_an_mtp_layer_guesses_from_the_prediction_then_lookup_then_the_layer():
    """`auto` where the checkpoint has an MTP layer (Speculator.candidates): the request's
    prediction first, then prompt lookup from a suffix of 2 tokens or more, then the MTP layer's
    guesses (MTP_DRAFTS at most), none from a layer whose cache missed a position (`missed`)."""
    from types import SimpleNamespace as NS

    from moe_cluster.node.speculate import MTP_DRAFTS, Speculator

    assert lookup([5, 6, 1, 2, 5], 3, min_ngram=2) == []  # only a lone token matched
    assert lookup([1, 2, 3, 9, 1, 2], 3, min_ngram=2) == [3, 9, 1]

    class Layer:  # the MTP layer's guesses: the block output's first value, then counting up
        def guess(self, h):
            return h[:, 0].astype(mx.int32)

        def chain(self, first, h, k, cache):
            return [first + j for j in range(k)]

    spec = Speculator("auto", 4, NS(world_size=1), None, mtp=Layer())
    assert spec.auto_mtp and MTP_DRAFTS == 2

    def seq(n, prompt, fed=(), prediction=()):
        req = NS(prompt=list(prompt), prediction=list(prediction))
        return NS(seq=n, req=req, fed=list(fed), pending=[])

    rows = [
        seq(1, [7, 8, 9], prediction=[40, 41, 42]),  # the prediction's start
        seq(2, [1, 2, 3, 9, 1, 2]),  # a 2-gram occurred before: lookup
        seq(3, [5, 6, 1, 2, 5]),  # a lone token only: the layer's guesses
        seq(4, [5, 6, 1, 2, 5]),  # the same, its MTP cache behind: nothing
    ]
    spec.last = {n: mx.array([20.0 + n]) for n in (1, 2, 3, 4)}  # what each row fed last
    spec.missed([rows[3]])
    got = spec.candidates(NS(rows=rows, cache=[None]), rows)
    assert got == [[40, 41, 42], [3, 9, 1, 2], [23, 24], []]
    assert spec.riding(rows) is None  # one node: nothing to vote on
    spec.drop(4)
    assert 4 not in spec.stale and 4 not in spec.found


def _attend(q: mx.array, cache, k: mx.array) -> mx.array:
    """A query's attention output after feeding key (= value) `k` into `cache` (its own mask)."""
    mask = cache.make_mask(1)
    keys, values = cache.update_and_fetch(k, k)
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=1.0, mask=mask)


@pytest.mark.parametrize("drop", [[1, 1], [0, 3], [3, 1], [2, 0]])
def test_a_rotating_window_rolls_back_past_its_first_turn(drop):
    """A window of 8 fed 13 positions (past its first turn; one row 6 shorter), then a verifying step of 4 of which
    each row drops its last drop[i]: each of the step's positions attends to the window a
    one-token-at-a-time decode gives it (the turned batched window put in order first, `_in_order`),
    and after the rollback the next token attends to what it would have attended to had only the
    kept positions been fed, one at a time, row by row (lone and batched windows)."""
    from mlx_lm.models.cache import BatchRotatingKVCache, RotatingKVCache

    from moe_cluster.node.speculate import _in_order, room

    mx.random.seed(1)
    keys = mx.random.normal((2, 1, 18, 4))
    q = mx.random.normal((1, 1, 1, 4))

    def reference(row: int, upto: int, at: int) -> mx.array:  # positions [start, upto), then at
        ref = RotatingKVCache(8)
        for j in range(6 if row == 0 else 0, upto):
            ref.update_and_fetch(
                keys[row : row + 1, :, j : j + 1], keys[row : row + 1, :, j : j + 1]
            )
        return _attend(q, ref, keys[row : row + 1, :, at : at + 1])[0]

    batch = BatchRotatingKVCache(8, [6, 0])  # row 0 is 6 shorter: 6 positions of left padding
    lone = RotatingKVCache(8)
    for c, k in ((batch, keys), (lone, keys[1:])):
        c.update_and_fetch(k[:, :, :5], k[:, :, :5])  # a prompt in two chunks
        c.update_and_fetch(k[:, :, 5:9], k[:, :, 5:9])
        for j in range(9, 13):  # decoding, past the window's turn
            c.update_and_fetch(k[:, :, j : j + 1], k[:, :, j : j + 1])
        assert room([c], 4) and not room([c], 9)
    _in_order([batch])
    mask = batch.make_mask(4)
    window, _ = batch.update_and_fetch(keys[:, :, 13:17], keys[:, :, 13:17])  # a verifying step
    lone.update_and_fetch(keys[1:, :, 13:17], keys[1:, :, 13:17])
    step = mx.fast.scaled_dot_product_attention(
        mx.concatenate([q, q]) * mx.ones((2, 1, 4, 4)), window, window, scale=1.0, mask=mask
    )
    for row in range(2):
        for i in range(4):
            assert mx.allclose(step[row, :, i], reference(row, 13 + i, 13 + i)[:, 0], atol=1e-6)
    rollback([batch], drop)
    rollback([lone], drop[1:])
    got = _attend(mx.concatenate([q, q]), batch, keys[:, :, 17:18])
    alone = _attend(q, lone, keys[1:, :, 17:18])
    for row in range(2):
        # the kept positions, then the next token's key in the place of the first dropped one
        kept = 17 - drop[row]
        ref = RotatingKVCache(8)
        for j in range(6 if row == 0 else 0, kept):
            ref.update_and_fetch(
                keys[row : row + 1, :, j : j + 1], keys[row : row + 1, :, j : j + 1]
            )
        want = _attend(q, ref, keys[row : row + 1, :, 17:18])
        assert mx.allclose(got[row], want[0], atol=1e-6).item(), row
        if row == 1:
            assert mx.allclose(alone[0], want[0], atol=1e-6).item()
