"""The replica rule and placements: deterministic, load-balancing, with clear errors."""

from __future__ import annotations

import itertools
import json

import pytest

from moe_cluster.proto.placement import Placement, PlacementError
from moe_cluster.node.moe.routing import assign, rank_counts
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


@pytest.mark.parametrize("text, message", [
    ('{"layers": {"0": {"0": [0, 1], "1": [2]}}}', r"experts \[3\] are on no node"),
    ('{"layers": {"0": {"0": [0, 1, 2, 3, 4], "1": []}}}', "out of range"),
    ('{"layers": {"0": {"5": [0, 1, 2, 3]}}}', "rank 5 is out of range"),
    ('{"layers": {"x": {}}}', "not an integer"),
    ('{"layers": {"0": {"0": "all"}}}', "list of integers"),
    ('[1, 2]', "must be a JSON object"),
    ('{"layers": {"0": {"0": [0, 1, 2, 3]}, "7": {"0": [0]}}}', "not MoE layers"),
])
def test_bad_placements(text, message):
    with pytest.raises(PlacementError, match=message):
        Placement.from_json(text, 2).check({0: 4})
