"""The replica rule and placements: deterministic, load-balancing, with clear errors."""

from __future__ import annotations

import itertools
import json

import pytest

from moe_cluster.proto.placement import Placement, PlacementError
from moe_cluster.node.moe.routing import (
    ArrayRule,
    assign,
    everywhere_or_once,
    rank_counts,
    selected_experts,
)
from moe_cluster.proto.placement import holders_of


def test_single_holders_go_to_their_holder():
    holders = {0: (0,), 1: (1,), 2: (0,), 3: (1,)}
    assert assign([3, 0, 2], holders) == {0: 0, 2: 0, 3: 1}


def test_replicas_go_to_the_least_loaded_holder_deterministically():
    holders = {0: (0,), 1: (0,), 2: (0, 1), 3: (1,)}
    # rank 0 already computes 0 and 1, so the replicated expert 2 goes to rank 1
    assert assign([0, 1, 2], holders) == {0: 0, 1: 0, 2: 1}
    assert assign([2, 1, 0], holders) == assign([0, 1, 2], holders)


def test_replication_never_raises_the_maximum():
    base = Placement.even({0: 8}, 2).layers[0]
    replicated = {0: base[0] + (4, 5), 1: base[1] + (0, 1)}
    h0, h1 = holders_of(base, 8), holders_of(replicated, 8)
    for sel in itertools.combinations(range(8), 3):
        assert max(rank_counts(sel, h1, 2)) <= max(rank_counts(sel, h0, 2))


@pytest.mark.parametrize("world", [2, 3, 5])
def test_the_array_rule_is_assign(world):
    """ArrayRule (the rule on the device) assigns every selected expert as `assign` does, where each
    expert is held by one node or all: random holders, from no replica to all replicated, calls of
    1-3 tokens."""
    import mlx.core as mx
    import numpy as np

    rng = np.random.default_rng(world)
    for share in (0.0, 0.3, 0.7, 1.0):  # the fraction of experts replicated everywhere
        for _ in range(40):
            n = int(rng.integers(world, 24))
            holders = {
                e: tuple(range(world)) if rng.random() < share else (int(rng.integers(world)),)
                for e in range(n)
            }
            k, tokens = int(rng.integers(1, min(n, 8) + 1)), int(rng.integers(1, 4))
            sel = np.stack([rng.choice(n, k, replace=False) for _ in range(tokens)]).astype(
                np.uint32
            )
            inds = mx.array(sel.reshape(1, tokens, k))
            got = np.array(ArrayRule(holders, world)(inds, selected_experts(inds, mx.arange(n))))
            want = assign(np.unique(sel).tolist(), holders)
            assert {e: int(got[e]) for e in want} == want, (holders, sel)


def test_the_array_rule_needs_replicas_everywhere():
    holders = {0: (0,), 1: (0, 1), 2: (2,)}  # expert 1 on 2 of 3 nodes
    assert not everywhere_or_once(holders, 3)
    assert everywhere_or_once({0: (0,), 1: (0, 1, 2), 2: (2,)}, 3)
    with pytest.raises(ValueError, match="every node"):
        ArrayRule(holders, 3)


def test_holders_errors():
    with pytest.raises(ValueError, match=r"experts \[3\] are on no node"):
        holders_of({0: (0, 1), 1: (2,)}, 4)
    with pytest.raises(ValueError, match="out of range"):
        holders_of({0: (0, 1, 9), 1: (2, 3)}, 4)
    with pytest.raises(KeyError):
        assign([5], {0: (0,)})


def test_even_placement_and_json_round_trip():
    p = Placement.even({1: 7, 2: 7}, 3)
    assert p.layers[1] == {0: (0, 1, 2), 1: (3, 4), 2: (5, 6)}
    q = Placement.from_json(json.dumps(p.to_json()), 3)
    assert q.layers == p.layers
    q.check({1: 7, 2: 7})


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"layers": {"0": {"0": [0, 1], "1": [2]}}}', r"experts \[3\] are on no node"),
        ('{"layers": {"0": {"0": [0, 1, 2, 3, 4], "1": []}}}', "out of range"),
        ('{"layers": {"0": {"5": [0, 1, 2, 3]}}}', "rank 5 is out of range"),
        ('{"layers": {"x": {}}}', "not an integer"),
        ('{"layers": {"0": {"0": "all"}}}', "list of integers"),
        ("[1, 2]", "must be a JSON object"),
        ('{"layers": {"0": {"0": [0, 1, 2, 3]}, "7": {"0": [0]}}}', "not MoE layers"),
    ],
)
def test_bad_placements(text, message):
    with pytest.raises(PlacementError, match=message):
        Placement.from_json(text, 2).check({0: 4})
