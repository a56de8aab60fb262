"""Placement planning: budgets, proportional split, profile balance and replication, refusal."""

from __future__ import annotations

import itertools

import pytest

from moe_cluster.coordinator.serve.placement import (
    ModelFootprint,
    NodeBudget,
    PlacementError,
    plan_placement,
    proportional_counts,
)
from moe_cluster.node.moe.routing import everywhere_or_once, rank_counts

MODEL = ModelFootprint(
    replicated_bytes=1000, expert_bytes={0: 100, 1: 100}, num_experts={0: 16, 1: 16}
)


def _nodes(*mems):
    return [NodeBudget(f"n{i}", m) for i, m in enumerate(mems)]


def test_even_split_and_bytes():
    plan = plan_placement(MODEL, _nodes(10_000, 10_000), memory_fraction=1.0)
    assert plan.placement.layers[0] == {0: tuple(range(8)), 1: tuple(range(8, 16))}
    assert plan.used == (1000 + 2 * 8 * 100,) * 2


def test_split_follows_memory_budgets():
    plan = plan_placement(MODEL, _nodes(20_000, 5_000), memory_fraction=1.0)
    # budgets 19000 and 4000: 16 experts split ~ 13 : 3
    assert [len(plan.placement.layers[0][r]) for r in (0, 1)] == [13, 3]
    assert plan.used[1] <= plan.available[1]


def test_proportional_counts_respect_caps():
    assert proportional_counts(16, [3, 1], [20, 20]) == [12, 4]
    assert proportional_counts(16, [3, 1], [10, 20]) == [10, 6]
    with pytest.raises(PlacementError):
        proportional_counts(16, [1, 1], [5, 5])


def test_refused_with_needed_and_available_per_node():
    with pytest.raises(PlacementError) as info:
        plan_placement(MODEL, _nodes(2_000, 2_500), memory_fraction=1.0, kv_reserve=100)
    msg = str(info.value)
    assert (
        "does not fit" in msg and "n0 needs" in msg and "has 2.00 KB" in msg and "n1 needs" in msg
    )


def _e_max(placement, layer, sets):
    holders = placement.holders(layer, 16)
    return sum(max(rank_counts(s, holders, placement.world_size)) for s in sets) / len(sets)


def test_profile_balances_and_replication_lowers_the_maximum():
    skew = [400, 300, 200, 150, 100, 60, 40, 30, 20, 15, 10, 8, 6, 4, 2, 1]
    # token selections drawn in proportion to the skew: every 4-subset weighted by its product
    sets = [
        s
        for s in itertools.combinations(range(16), 4)
        for _ in range(max(1, int(skew[s[0]] * skew[s[1]] * skew[s[2]] * skew[s[3]] / 1e6)))
    ]
    nodes = _nodes(3_600, 3_600)  # room for 13 experts per layer each: 5 spare slots
    even = plan_placement(MODEL, nodes, memory_fraction=1.0, strategy="even").placement
    balanced = plan_placement(
        MODEL,
        nodes,
        memory_fraction=1.0,
        strategy="profile",
        profile_counts={0: skew, 1: skew},
        replicate=False,
    ).placement
    replicated = plan_placement(
        MODEL, nodes, memory_fraction=1.0, strategy="profile", profile_counts={0: skew, 1: skew}
    ).placement
    e_even, e_bal, e_rep = (_e_max(p, 0, sets) for p in (even, balanced, replicated))
    assert e_bal < e_even
    assert e_rep < e_bal
    assert all(len(replicated.layers[0][r]) == 13 for r in (0, 1))


def test_replicas_are_full_copies_so_the_device_assigns_them():
    """At 4 nodes the hottest experts are copied to every node, while each has room: a layer's
    replicas are then assigned on the device (routing.ArrayRule); a copy on some nodes would send
    every decode step's routing through the host. The copies still lower the busiest node's load."""
    skew = [400, 300, 200, 150, 100, 60, 40, 30, 20, 15, 10, 8, 6, 4, 2, 1]
    sets = [
        s
        for s in itertools.combinations(range(16), 4)
        for _ in range(max(1, int(skew[s[0]] * skew[s[1]] * skew[s[2]] * skew[s[3]] / 1e6)))
    ]
    nodes = _nodes(
        *[1_000 + 200 * 7] * 4
    )  # 4 experts each (of 2 layers, 100 B each), and room for 3 more
    common = dict(memory_fraction=1.0, strategy="profile", profile_counts={0: skew, 1: skew})
    balanced = plan_placement(MODEL, nodes, replicate=False, **common).placement
    replicated = plan_placement(MODEL, nodes, **common)
    holders = replicated.placement.holders(0, 16)
    assert everywhere_or_once(holders, 4)
    assert sorted(e for e, h in holders.items() if len(h) == 4) == [
        0,
        1,
        2,
        3,
    ]  # the 4 hottest: 3 copies each
    assert replicated.replicas == (3, 3, 3, 3)
    assert _e_max(replicated.placement, 0, sets) < _e_max(balanced, 0, sets)


def test_profile_needs_counts():
    with pytest.raises(PlacementError, match="needs a routing profile"):
        plan_placement(MODEL, _nodes(10_000), strategy="profile")


def test_node_below_its_share_is_served_with_an_expert_cache():
    from moe_cluster.proto.expert_cache import ExpertCacheSpec

    # 2 nodes, even split: 8 experts per layer each = 1600 B of experts; n1's budget holds 400 B of them
    nodes = _nodes(10_000, 1_400)
    with pytest.raises(PlacementError, match="does not fit"):
        plan_placement(MODEL, nodes, strategy="even", memory_fraction=1.0)
    auto = [ExpertCacheSpec.parse("auto")] * 2
    plan = plan_placement(MODEL, nodes, strategy="even", memory_fraction=1.0, expert_cache=auto)
    assert [len(plan.placement.layers[0][r]) for r in (0, 1)] == [8, 8]
    assert plan.expert_cache == ("off", "400B")  # n0 fits whole; n1 keeps its budget resident
    assert plan.used[1] <= plan.available[1]
    (note,) = [n for n in plan.notes if n.startswith("n1")]
    assert "25%" in note and "read from disk" in note
    # a node with no room for the replicated weights is still refused
    with pytest.raises(PlacementError):
        plan_placement(
            MODEL, _nodes(10_000, 900), strategy="even", memory_fraction=1.0, expert_cache=auto
        )


def test_a_cached_nodes_note_states_its_disk_reads_and_speed_ceiling():
    """The warning for a node short of memory says how much it reads from disk per token and the
    tok/s that disk bounds it to: uniform routing, and with a profile its pinned hottest experts."""
    from dataclasses import replace

    from moe_cluster.coordinator.serve.placement import disk_reads
    from moe_cluster.proto.expert_cache import ExpertCacheSpec

    model = replace(MODEL, top_k={0: 2, 1: 2})
    auto = [ExpertCacheSpec.parse("auto")] * 2
    plan = plan_placement(
        model, _nodes(10_000, 1_400), strategy="even", memory_fraction=1.0, expert_cache=auto
    )
    (note,) = [n for n in plan.notes if n.startswith("n1")]
    # n1 holds 8 of 16 experts per layer and keeps 2 (25%): a token selects 2 x 8/16 = 1 of its experts
    # per layer, 3/4 of them misses: 1.5 misses, 150 B per token over the 2 layers
    assert "1.5 misses" in note and "150 B read per token" in note and "uniform routing" in note
    assert f"{4e9 / 150:.1f}" in note and "--expert-cache 25%" in note
    # with a profile whose load sits on n1's first two experts, pinning them hits nearly always
    load = [1.0] * 8 + [100.0, 100.0] + [1.0] * 6
    held = {l: plan.placement.layers[l][1] for l in (0, 1)}
    assert held[0] == tuple(range(8, 16))
    slots = {0: 2, 1: 2}  # 25% of 8
    skewed = disk_reads(model, held, slots, {0: load, 1: load})
    uniform = disk_reads(model, held, slots)
    assert skewed.profiled and skewed.hit_rate > 0.95 > 0.25 == pytest.approx(uniform.hit_rate)
    assert skewed.bytes < uniform.bytes / 10


@pytest.mark.parametrize(
    "text,layers",
    [
        ("50%", {0: 4, 1: 2}),
        ("100%", {0: 8, 1: 3}),
        ("1%", {0: 1, 1: 1}),
        ("off", {0: 8, 1: 3}),
        ("300B", {0: 2, 1: 1}),
        ("8GB", {0: 8, 1: 3}),
    ],
)
def test_expert_cache_capacities(text, layers):
    from moe_cluster.proto.expert_cache import ExpertCacheSpec

    assert ExpertCacheSpec.parse(text).capacities({0: 8, 1: 3}, {0: 100, 1: 100}) == layers


@pytest.mark.parametrize("text", ["0%", "101%", "-1GB", "lots", "5 parsecs", "0"])
def test_expert_cache_refuses_bad_values(text):
    from moe_cluster.proto.errors import UserError
    from moe_cluster.proto.expert_cache import ExpertCacheSpec

    with pytest.raises(UserError, match="expert_cache"):
        ExpertCacheSpec.parse(text)
