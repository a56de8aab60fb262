"""The per-hop table of `bench allreduce --trace` from stamps on one clock (envoy/trace.py)."""

from __future__ import annotations

import numpy as np
import pytest

from moe_cluster.envoy import trace


def _row(
    step: int,
    node: tuple[int, ...],
    link: int,
    sent: int,
    complete: int,
    summed: int,
    arrived: tuple[int, ...],
) -> tuple[int, ...]:
    words = np.zeros(trace.WORDS, np.uint64)
    words[:4] = (link, sent, complete, summed)
    words[4 : 4 + len(arrived)] = arrived
    return trace.record(step, node, words)


def test_hops_follow_one_all_reduce_across_both_ranks():
    # rank 1 hands its REDUCE 5 us after rank 0; stamps in ns on one clock
    r0 = _row(
        7,
        (0, 2_000, 5_000, 90_000, 93_000),
        link=15_000,
        sent=20_000,
        complete=60_000,
        summed=70_000,
        arrived=(0, 60_000),
    )
    r1 = _row(
        7,
        (1_000, 4_000, 10_000, 85_000, 86_000),
        link=30_000,
        sent=40_000,
        complete=50_000,
        summed=80_000,
        arrived=(45_000, 0),
    )
    warm = _row(0, (0, 1, 2, 3, 4), 1, 1, 1, 1, (1, 1))  # left out: a warm-up step
    d = trace.hops({0: [warm, r0], 1: [warm, r1]}, skip=1)
    assert d["node: partial to the host"] == [2.0, 3.0]
    assert d["node: hand-off"] == [3.0, 6.0]
    assert d["envoy: wake-up on REDUCE"] == [10.0, 20.0]
    assert d["envoy: frame out"] == [5.0, 10.0]
    assert sorted(d["wire: peer's frame in"]) == [20.0, 25.0]  # made at 40 -> in at 60; 20 -> 45
    assert d["envoy: wait for the last partial"] == [40.0, 10.0]
    assert d["envoy: sum"] == [10.0, 30.0]
    assert d["node: wake-up on the answer"] == [20.0, 5.0]
    assert d["node: result to the device"] == [3.0, 1.0]
    assert d["late peer"] == [5.0, 0.0]
    assert d["after the last REDUCE"] == [80.0, 75.0]
    assert d["total"] == [93.0, 85.0]
    rows = trace.table(d)
    assert [r["hop"] for r in rows] == [h for h, _ in trace.HOPS]
    assert rows[-1] == {
        "hop": "total",
        "covers": trace.HOPS[-1][1],
        "p50_us": 89.0,
        "p90_us": pytest.approx(92.2),
        "samples": 2,
    }


def test_a_step_missing_on_a_rank_or_unstamped_by_its_envoy_is_left_out():
    r0 = _row(3, (0, 1, 2, 3, 4), 1, 1, 1, 1, (0, 1))
    unstamped = _row(3, (0, 1, 2, 3, 4), 0, 0, 0, 0, (0, 0))  # the envoy failed the step
    assert all(not v for v in trace.hops({0: [r0], 1: []}).values())
    d = trace.hops({0: [r0], 1: [unstamped]})
    assert d["total"] == [0.004]
    assert d["wire: peer's frame in"] == []  # rank 1 stamped no send
