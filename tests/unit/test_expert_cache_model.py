"""The expert cache in the performance model: hit rate, miss cost fit, prediction, break-even."""

from __future__ import annotations

import pytest

from moe_cluster.coordinator.plan import expert_cache as m


def test_hit_rate_is_the_share_under_uniform_routing_and_grows_with_skew():
    assert m.hit_rate(0.5, 16, 0.0) == pytest.approx(0.5)
    assert m.hit_rate(0.25, 16, 0.0) == pytest.approx(0.25)
    assert m.hit_rate(1.0, 16, 2.0) == pytest.approx(1.0)
    rates = [m.hit_rate(0.25, 16, z) for z in (0.0, 0.5, 1.0, 2.0)]
    assert rates == sorted(rates) and rates[-1] > 0.8
    assert m.hit_rate(0.01, 16, 0.0) == pytest.approx(1 / 16)  # at least one slot
    with pytest.raises(ValueError):
        m.hit_rate(0.0, 16, 0.0)


def _rows(per_miss, per_layer, layers, skew, base=0.01):
    rows = [m.CacheRow(1.0, 16, 1.0, 8.0, 0.0, base)]
    for share in (0.5, 0.25):
        h = m.hit_rate(share, 16, skew)
        misses = 8.0 * (1 - h)
        rows.append(
            m.CacheRow(share, 16, h, 8.0, misses, base + misses * per_miss + layers * per_layer)
        )
    return rows


def test_the_fit_recovers_the_miss_and_layer_costs_and_the_skew():
    rows = _rows(per_miss=2e-3, per_layer=5e-4, layers=4, skew=0.7)
    cost = m.fit_cost(rows, 0.01, 4)
    assert cost.per_miss_s == pytest.approx(2e-3, rel=1e-6) and cost.per_layer_s == pytest.approx(
        5e-4, rel=1e-6
    )
    assert m.fit_skew(rows) == pytest.approx(0.7, abs=0.02)
    p = m.predict(0.01, 8.0, 0.5, 16, 0.7, cost, 4)
    assert p["time_s"] == pytest.approx(rows[1].time_per_token_s, rel=1e-3)
    with pytest.raises(m.CalibrationError, match="no expert-cache row below 100%"):
        m.fit_cost(rows[:1], 0.01, 4)


def test_negative_parts_are_not_fitted():
    # times that fall with misses: no per-miss cost, the layer cost alone
    rows = [
        m.CacheRow(1.0, 16, 1.0, 8, 0, 0.01),
        m.CacheRow(0.5, 16, 0.5, 8, 4, 0.014),
        m.CacheRow(0.25, 16, 0.25, 8, 6, 0.013),
    ]
    cost = m.fit_cost(rows, 0.01, 4)
    # the joint fit gives -0.5 ms a miss: refused; the layer cost alone fits (4 ms, 3 ms over 4
    # layers: 0.875 ms a layer) better than the miss cost alone, so it is what is kept
    assert cost.per_miss_s == 0 and cost.per_layer_s == pytest.approx((0.004 + 0.003) / 2 / 4)


def test_break_even_hit_rate():
    cost = m.MissCost(per_miss_s=1e-3, per_layer_s=0.0)
    # 10 selections per token, a node saves 4 ms: up to 4 misses pay, i.e. a hit rate of 60%
    assert m.break_even_hit_rate(10, cost, 4, 4e-3) == pytest.approx(0.6)
    assert (
        m.break_even_hit_rate(10, m.MissCost(1e-3, 2e-3), 4, 4e-3) is None
    )  # fixed cost alone exceeds it
    assert m.break_even_hit_rate(10, cost, 4, 1.0) == 0.0  # saves more than every miss costs


def test_calibrate_predicts_the_bench_rows_back():
    rows = _rows(per_miss=1e-3, per_layer=2e-4, layers=2, skew=0.5)
    bench = {
        "expert_cache": [
            {
                "nodes": 2,
                "expert_cache": f"{r.share:.0%}",
                "profile": False,
                "capacity": int(64 * r.share),
                "local": 64,
                "hit_rate": r.hit_rate,
                "selected_per_token": r.selected_per_token,
                "misses_per_token": r.misses_per_token,
                "time_per_token_s": r.time_per_token_s,
            }
            for r in rows
        ]
    }
    cal = m.calibrate(bench, 2, 2)
    assert cal["max_abs_error"] < 0.01 and cal["skew"] == pytest.approx(0.5, abs=0.02)
    assert m.calibrate(bench, 3, 2) is None  # no rows of 3 nodes
