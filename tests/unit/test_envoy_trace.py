"""The per-hop table of `bench allreduce --trace` from the nodes' stamps on one clock
(node/collective/trace.py)."""

from __future__ import annotations

import pytest

from moe_cluster.node.collective import trace


def test_hops_follow_one_all_reduce_across_both_ranks():
    # stamps in ns on one clock: entered, on the host, writing, frame out, every partial in, on
    # the device; then when each rank's frame was read here (0: its own). Rank 1 writes its frame
    # 5 us later; rank 0's is read there before rank 0 stamped its write's end.
    r0 = trace.record(7, (0, 2_000, 6_000, 10_000, 40_000, 50_000), [0, 30_000])
    r1 = trace.record(7, (1_000, 4_000, 12_000, 15_000, 35_000, 45_000), [8_000, 0])
    warm = trace.record(0, (0, 1, 2, 3, 4, 5), [0, 0])  # left out: a warm-up step
    d = trace.hops({0: [warm, r0], 1: [warm, r1]}, skip=1)
    assert d["node: partial to the host"] == [2.0, 3.0]
    assert d["node: frame out"] == [8.0, 11.0]
    # rank 1 began writing at 12 -> read at 30; rank 0 at 6 -> read at 8 (its write's end: 10)
    assert sorted(d["wire: peer's frame in"]) == [2.0, 18.0]
    assert d["node: wait for the last partial"] == [30.0, 20.0]
    assert d["node: sum to the device"] == [10.0, 10.0]
    assert d["late peer"] == [5.0, 0.0]
    assert d["after the last frame out"] == [35.0, 30.0]
    assert d["total"] == [50.0, 44.0]
    rows = trace.table(d)
    assert [r["hop"] for r in rows] == [h for h, _ in trace.HOPS]
    assert rows[-1] == {
        "hop": "total",
        "covers": trace.HOPS[-1][1],
        "p50_us": 47.0,
        "p90_us": pytest.approx(49.4),
        "samples": 2,
    }


def test_a_step_missing_on_a_rank_is_left_out():
    r0 = trace.record(3, (0, 1, 2, 3, 4, 5), [0, 1])
    assert all(not v for v in trace.hops({0: [r0], 1: []}).values())
