"""The step's agreement (node/agreement.py): a vote encodes and reads back by part, on a summing
transport's slots too (the MTP layer's guesses as the prefix every rank fed), and the scheduler's
pure decisions (node/scheduler.py)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from moe_cluster.node.agreement import Agreed, Layout
from moe_cluster.node.collective.base import (
    Agreement,
    TokenMismatch,
    read_slots,
    ride_slots,
)
from moe_cluster.node.scheduler import admissions, emit, prefill_chunks, prefill_passes


def _votes(layout: Layout, *votes) -> Agreement:
    """Every rank's vote as a summing transport carries it: each in its own slots, summed."""
    n = len(votes)
    total = sum(ride_slots(r, n, layout.encode(*v), mx.float32) for r, v in enumerate(votes))
    return read_slots(total.tolist(), n)


def test_a_vote_reads_back_by_part_through_the_summed_slots():
    layout = Layout(queue=4, active=3, decoding=2, slots=3)
    held_a, held_b = [2, 5, 9], [5, 9, 11]
    tokens = [[7, 0, 123456], None]
    agreement = _votes(
        layout,
        (held_a, [False, True, False], tokens),
        (held_b, [False, False, True], tokens),
    )
    got = layout.read(agreement, ["r1", "r2"], [4, 0])
    assert got.admit == (5, 9)  # held by every rank, in order
    assert got.cancel == (False, True, True)  # cancelled on any rank
    assert got.tokens == ((7, 0, 123456), None)
    assert not got.mismatches
    assert layout.size == 4 + 3 + 2 * 3 == len(layout.encode(held_a, [0, 0, 0], tokens))


def test_guesses_read_back_as_the_prefix_every_rank_fed():
    """The MTP layer's guesses, made on every rank: a step verifies only what every rank fed."""
    layout = Layout(queue=1, active=3, decoding=3, slots=1, guesses=3)
    tokens = [[4], [4], [4]]
    a = ([], [False] * 3, tokens, [[5, 9, 2], [3, 1, 1], [7, 7]])
    b = ([], [False] * 3, tokens, [[5, 8, 2], [3, 1, 1], []])
    got = layout.read(_votes(layout, a, b), ["r1", "r2", "r3"], [0, 0, 0])
    assert got.guesses == ((5,), (3, 1, 1), ())  # up to the first that differs, or is missing
    assert got.tokens == ((4,), (4,), (4,)) and not got.mismatches
    assert layout.size == 1 + 3 + 3 * (1 + 3) == len(layout.encode(*a))
    plain = Layout(queue=1, active=1, decoding=1, slots=1)
    got = plain.read(_votes(plain, ([], [False], [[4]])), ["r"], [0])
    assert got.guesses == ()  # a step whose guesses do not ride carries none
    with pytest.raises(ValueError, match="does not fit"):
        layout.encode([], [False] * 3, tokens, [[1, 2, 3, 4], [], []])


def test_a_lazy_token_rides_as_itself():
    layout = Layout(queue=2, active=1, decoding=1, slots=1)
    vote = layout.encode([3], [False], [mx.array([41])])
    assert vote.tolist() == [3, 0, 0, 42]  # queue (padded), cancel flag, token + 1
    assert Agreed.alone([3], [False], [mx.array([41])]).tokens == ((41,),)


def test_tokens_the_ranks_sampled_differently_fail_that_sequence_alone():
    layout = Layout(queue=1, active=2, decoding=2, slots=1)
    agreement = _votes(layout, ([], [False, False], [[5], [6]]), ([], [False, False], [[5], [7]]))
    got = layout.read(agreement, ["same", "forked"], [0, 3])
    assert got.tokens[0] == (5,)
    assert isinstance(got.mismatches[1], TokenMismatch)
    assert "request forked, step 3: rank 1 sampled token 7" in str(got.mismatches[1])


def test_a_vote_that_does_not_fit_its_layout_is_refused():
    with pytest.raises(ValueError, match="does not fit"):
        Layout(queue=1, active=1, decoding=0, slots=1).encode([1, 2], [False], [])


def test_prefill_chunks_are_whole_in_order_and_within_the_budget():
    # 20 and 9 tokens left, chunks of 8: while others decode, at most 16 tokens a step
    assert prefill_chunks([(20, 8), (9, 8)], 16, True) == [(0, 8), (0, 8)]
    assert prefill_chunks([(4, 8), (9, 8)], 16, True) == [(0, 4), (1, 8), (1, 1)]
    assert prefill_chunks([(4, 8), (9, 8)], 12, True) == [(0, 4), (1, 8)]
    # nobody decoding: one chunk a step; the first chunk goes whatever its size
    assert prefill_chunks([(20, 8), (9, 8)], 16, False) == [(0, 8)]
    assert prefill_chunks([(40, 32)], 16, True) == [(0, 32)]


def test_emit_ends_on_eos_a_stop_sequence_or_the_length():
    kw = dict(eos={0}, stops=[(4, 5)], max_tokens=10)
    assert emit([1, 2, 3], handed=[], **kw) == emit([1, 2, 3], handed=[9], **kw)
    assert emit([1, 0, 3], handed=[], **kw).out == (1,)
    e = emit([1, 0, 3], handed=[], **kw)
    assert (e.fed, e.finish) == (2, "stop")  # the end-of-sequence token is fed, not handed out
    e = emit([5, 6], handed=[1, 4], **kw)  # a stop completed across steps
    assert (e.fed, e.out, e.finish) == (1, (5,), "stop")
    e = emit([1, 2, 3], handed=list(range(1, 9)), **kw)
    assert (e.fed, e.out, e.finish) == (2, (1, 2), "length")


def test_admissions_are_first_come_first_served_within_the_limits():
    reserve = {1: 30, 2: 80, 3: 10}
    assert admissions([1, 2, 3], reserve, [], 8, 0) == [1, 2, 3]  # no KV limit
    assert admissions([1, 2, 3], reserve, [(-1, 50)], 2, 0) == [1]  # max_batch
    # 2 does not fit beside 50 + 30: it waits, and 3 does not overtake it
    assert admissions([1, 2, 3], reserve, [(-1, 50)], 8, 100) == [1]
    assert admissions([2], reserve, [], 8, 50) == [2]  # alone, a request always runs


def test_by_stream_admissions_count_each_nodes_own_streams():
    """Owned streams hold KV on their owner only: with the same per-node budget, twice the
    streams run on two nodes; a node's full queue blocks only the requests that need that node."""
    reserve = dict.fromkeys(range(1, 9), 40)
    owner = {n: n % 2 for n in range(1, 9)}  # odd on node 1, even on node 0
    running = []
    joined = admissions(range(1, 9), reserve, running, 8, 100, owner=owner, world=2)
    assert joined == [1, 2, 3, 4]  # two of 40 fit each node's 100
    replicated = admissions(range(1, 9), reserve, running, 8, 100)
    assert len(joined) == 2 * len(replicated)
    # node 0 full: node 1's requests go on; a replicated one needs both and waits
    busy = [(0, 90)]
    got = admissions([2, 3, 5], reserve, busy, 8, 100, owner={2: 0, 3: 1, 5: 1}, world=2)
    assert got == [3, 5]
    got = admissions([7, 3], reserve, busy, 8, 100, owner={7: -1, 3: 1}, world=2)
    assert got == []  # 7 waits for node 0, and 3 (node 1) may not overtake it there
    assert admissions([3, 7], reserve, busy, 8, 100, owner={7: -1, 3: 1}, world=2) == [3]


def test_prefill_passes_pack_one_chunk_per_owner_and_keep_replicated_ones_alone():
    # (owner, tokens left, chunk): a replicated prompt, two owned by node 0, one by node 1
    joining = [(-1, 8, 8), (0, 16, 8), (1, 8, 8), (0, 8, 8)]
    passes = prefill_passes(joining, 16, True)
    assert passes == [((0, 8),), ((1, 8), (2, 8)), ((1, 8),)]
    assert prefill_passes([(1, 4, 8)], 16, False) == [((0, 4),)]
