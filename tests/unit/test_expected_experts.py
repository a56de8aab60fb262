"""E[max experts per node per layer] against brute-force enumeration."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest

from moe_cluster.coordinator.plan.expected import (
    even_split,
    expected_experts,
    expected_max_enumerated,
    expected_max_from_sets,
    expected_max_hypergeometric,
    expected_max_sampled,
    is_disjoint,
    placement_for,
)
from moe_cluster.coordinator.plan.perfmodel import PlanError
from moe_cluster.proto.errors import UserError
from moe_cluster.proto.profile import ProfileError, parse_profile
from moe_cluster.node.moe.routing import rank_counts
from moe_cluster.proto.placement import holders_of


def brute_force(placement, num_experts, k):
    """Mean over all C(E, k) selections of the busiest rank's count, via the routing rule."""
    holders = holders_of(placement, num_experts)
    combos = list(itertools.combinations(range(num_experts), k))
    return Fraction(sum(max(rank_counts(c, holders, len(placement))) for c in combos), len(combos))


def brute_force_disjoint(sizes, k):
    """Independent of the routing module: rank of each expert from contiguous blocks."""
    owner = [r for r, s in enumerate(sizes) for _ in range(s)]
    combos = list(itertools.combinations(range(len(owner)), k))
    total = 0
    for c in combos:
        counts = [0] * len(sizes)
        for e in c:
            counts[owner[e]] += 1
        total += max(counts)
    return Fraction(total, len(combos))


def test_dbrx_two_nodes_is_2_646():
    e = expected_experts(even_split(16, 2), 16, 4, "lru")
    assert e.value == pytest.approx(2.646, abs=5e-4)
    assert e.stderr == 0 and e.method.startswith("exact")
    assert expected_max_hypergeometric([8, 8], 4) == Fraction(172, 65)
    # The reference figures for 3 and 4 nodes (even split, no replicas).
    assert expected_experts(even_split(16, 3), 16, 4).value == pytest.approx(2.258, abs=5e-4)
    assert expected_experts(even_split(16, 4), 16, 4).value == pytest.approx(1.969, abs=5e-4)


@pytest.mark.parametrize(
    "sizes", [[8, 8], [6, 5, 5], [3, 5], [1, 2, 5], [4, 4, 4, 4], [7, 1], [2, 2, 2, 2, 2, 2]]
)
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_hypergeometric_matches_brute_force(sizes, k):
    assert expected_max_hypergeometric(sizes, k) == brute_force_disjoint(sizes, k)


def test_even_and_uneven_placements_via_routing_rule():
    for sizes in ([6, 5, 5], [3, 5], [1, 2, 5]):
        start, placement = 0, {}
        for r, s in enumerate(sizes):
            placement[r] = list(range(start, start + s))
            start += s
        for k in (2, 3):
            assert expected_max_hypergeometric(sizes, k) == brute_force(placement, start, k)


@pytest.mark.parametrize(
    "placement, num_experts",
    [
        ({0: [0, 1, 2, 3, 4, 5, 6, 7, 8, 9], 1: [0, 1, 8, 9, 10, 11, 12, 13, 14, 15]}, 16),
        ({0: [0, 1, 2, 3, 4], 1: [3, 4, 5, 6, 7], 2: [0, 6, 7, 8, 9], 3: [1, 2, 9, 10, 11]}, 12),
        ({0: list(range(8)), 1: list(range(8))}, 8),  # full replication
        ({0: [0, 1, 2, 3, 4, 5], 1: [5, 6, 7]}, 8),  # uneven with one shared expert
    ],
)
@pytest.mark.parametrize("k", [2, 4])
def test_replicated_placements_match_brute_force(placement, num_experts, k):
    assert not is_disjoint(placement)
    e = expected_experts(placement, num_experts, k, "none")
    assert e.method.startswith("exact: all C(")
    assert Fraction(e.value).limit_denominator(10**6) == brute_force(placement, num_experts, k)


def test_full_replication_balances_perfectly():
    full = {r: list(range(16)) for r in range(4)}
    assert expected_max_enumerated(full, 16, 4) == 1
    assert expected_max_enumerated({0: list(range(16)), 1: list(range(16))}, 16, 3) == 2


def test_monte_carlo_agrees_with_exact():
    placement = placement_for(16, 4, replicas_per_node=2)
    exact = float(expected_max_enumerated(placement, 16, 4))
    mean, se = expected_max_sampled(placement, 16, 4, samples=4000, seed=1)
    assert se > 0 and abs(mean - exact) < 5 * se
    assert expected_max_sampled(placement, 16, 4, samples=500, seed=3) == expected_max_sampled(
        placement, 16, 4, samples=500, seed=3
    )  # seeded


def test_large_models_use_the_exact_formula_or_say_they_sample():
    e = expected_experts(even_split(256, 8), 256, 8, "lru")
    assert e.method.startswith("exact: hypergeometric")
    mean, se = expected_max_sampled(even_split(256, 8), 256, 8, samples=3000, seed=2)
    assert abs(e.value - mean) < 5 * se
    big = expected_experts(placement_for(256, 8, replicas_per_node=8), 256, 8, "lru")
    assert big.method.startswith("Monte Carlo") and "seed" in big.method and big.stderr > 0


def test_keepalive_policies():
    p = even_split(16, 3)
    none = expected_experts(p, 16, 4, "none")
    lru = expected_experts(p, 16, 4, "lru")
    busy = expected_experts(p, 16, 4, "busy")
    assert none.value == lru.value  # lru pads every node to the same max
    assert busy.value == 6  # the fullest node's local experts
    assert expected_experts(even_split(16, 1), 16, 4, "busy").value == 4  # one node: the k selected
    with pytest.raises(PlanError, match="'eager'"):
        expected_experts(p, 16, 4, "eager")


def test_profile_expectation_is_the_empirical_mean():
    placement = {0: [0, 1], 1: [2, 3]}
    sets = [[0, 1], [0, 2], [2, 3], [1, 3]]
    # max per token: 2, 1, 2, 1
    assert expected_max_from_sets(placement, 4, sets) == 1.5
    e = expected_experts(placement, 4, 2, "lru", sets=sets)
    assert e.value == 1.5 and "4 recorded tokens" in e.method
    # With expert 0 replicated on rank 1, [0, 1] splits 1/1 under the routing rule.
    replicated = {0: [0, 1], 1: [0, 2, 3]}
    assert expected_max_from_sets(replicated, 4, sets) == pytest.approx(
        sum(max(rank_counts(s, holders_of(replicated, 4), 2)) for s in sets) / 4
    )
    assert expected_max_from_sets(replicated, 4, sets) == 1.25


def test_profile_over_every_selection_equals_uniform_enumeration():
    placement = placement_for(8, 2, replicas_per_node=1)
    sets = [list(c) for c in itertools.combinations(range(8), 3)]
    assert expected_max_from_sets(placement, 8, sets) == pytest.approx(
        float(brute_force(placement, 8, 3))
    )


def test_placement_for():
    assert even_split(16, 3) == {0: list(range(6)), 1: list(range(6, 11)), 2: list(range(11, 16))}
    # The paper's placement, every expert on two of 4 nodes (8 each): it measured E = 1.57.
    paper = {0: list(range(8)), 1: list(range(8)), 2: list(range(8, 16)), 3: list(range(8, 16))}
    assert expected_experts(paper, 16, 4).value == pytest.approx(1.57, abs=0.01)
    # The planner copies an expert to every node or to none (ArrayRule assigns those on the device):
    # with 4 spare slots per node, 5 experts on all 4 nodes (15 slots), and E lower than the paper's
    p = placement_for(16, 4, replicas_per_node=4)
    holders = holders_of(p, 16)
    assert (
        all(len(h) in (1, 4) for h in holders.values())
        and sum(len(h) == 4 for h in holders.values()) == 5
    )
    assert all(len(v) <= 8 for v in p.values())
    assert expected_experts(p, 16, 4).value == pytest.approx(1.459, abs=0.001)
    counts = [1] * 16
    counts[13], counts[2] = 100, 50
    hot = placement_for(16, 2, replicas_per_node=1, profile_counts=counts)
    assert hot == {
        0: sorted(list(range(8)) + [13]),
        1: [2] + list(range(8, 16)),
    }  # the hottest, copied
    capped = placement_for(8, 2, replicas_per_node=100)
    assert capped == {0: list(range(8)), 1: list(range(8))}
    with pytest.raises(PlanError, match="16 experts cannot be split over 17"):
        even_split(16, 17)
    with pytest.raises(PlanError, match="counts for 3 experts"):
        placement_for(16, 2, 1, profile_counts=[1, 2, 3])


def test_parse_profile():
    ok = {
        "model": "m",
        "num_experts": 4,
        "top_k": 2,
        "layers": {"0": {"counts": [1, 1, 1, 1], "tokens": 2, "sets": [[0, 1], [2, 3]]}},
    }
    prof = parse_profile(ok)
    assert prof.layers[0].sets == ((0, 1), (2, 3))
    bad = {**ok, "layers": {"0": {"counts": [1, 1, 1, 1], "tokens": 2, "sets": [[0, 7]]}}}
    with pytest.raises(ProfileError, match=r"p.json: layers\['0'\]: selection \[0, 7\]"):
        parse_profile(bad, "p.json")
    assert issubclass(ProfileError, UserError)  # the CLI's one-line error, exit 2
    with pytest.raises(ProfileError, match="missing field 'layers'"):
        parse_profile({"model": "m", "num_experts": 4, "top_k": 2})
    with pytest.raises(ProfileError, match="counts must be 4"):
        parse_profile({**ok, "layers": {"0": {"counts": [1], "tokens": 2, "sets": [[0]]}}})
    assert math.isclose(
        expected_experts({0: [0, 1], 1: [2, 3]}, 4, 2, sets=prof.layers[0].sets).value, 2.0
    )


def test_a_batch_alone_is_the_closed_form_and_grows_to_every_expert():
    from moe_cluster.coordinator.plan.expected import expected_distinct_alone

    alone = {0: list(range(16))}
    assert expected_experts(alone, 16, 4, "none", batch=1).value == 4
    # E * (1 - (1 - k/E)^B), checked against a direct count over all pairs of 2-of-4 selections
    pairs = list(itertools.product(itertools.combinations(range(4), 2), repeat=2))
    direct = sum(len(set(a) | set(b)) for a, b in pairs) / len(pairs)
    assert expected_distinct_alone(4, 2, 2) == pytest.approx(direct)
    values = [expected_experts(alone, 16, 4, "none", batch=b).value for b in (1, 2, 8, 64)]
    assert values == sorted(values) and values[-1] == pytest.approx(16, abs=0.01)


def test_a_batch_across_nodes_matches_exhaustive_counting():
    """Monte Carlo E_B against every pair of selections of a small even split, within 4 standard errors."""
    from moe_cluster.coordinator.plan.expected import even_split
    from moe_cluster.node.moe.routing import rank_counts
    from moe_cluster.proto.placement import holders_of

    placement = even_split(6, 2)
    holders = holders_of(placement, 6)
    subsets = list(itertools.combinations(range(6), 2))
    exact = (
        sum(max(rank_counts(sorted(set(a) | set(b)), holders, 2)) for a in subsets for b in subsets)
        / len(subsets) ** 2
    )
    got = expected_experts(placement, 6, 2, "none", batch=2)
    assert abs(got.value - exact) <= 4 * got.stderr + 1e-9, (got, exact)
    assert got.value > expected_experts(placement, 6, 2, "none").value
    assert (
        expected_experts(placement, 6, 2, "busy", batch=2).value == 3
    )  # busy computes every local expert anyway
    with pytest.raises(PlanError, match="batch must be at least 1"):
        expected_experts(placement, 6, 2, "none", batch=0)
