"""Fitting Eq. 1's overheads to synthetic `bench decode --json` output with known answers."""

from __future__ import annotations

import pytest

from moe_cluster.coordinator.plan import presets
from moe_cluster.coordinator.plan.calibration import (
    FORMAT,
    CalibrationError,
    fit,
    parse_bench,
    parse_calibration,
    predict_time,
)
from moe_cluster.coordinator.plan.perfmodel import estimate

R, X, LAYERS, MOE = 7_000_000_000, 15_854_469_120, 40, 40  # DBRX as in Table 1
TRUTH = dict(bw=600e9, o=150e-6, a=700e-6, b=120e-6)
E = {1: 4.0, 2: 2.65, 3: 2.32, 4: 1.57}


def bench(nodes=(1, 2, 3, 4), truth=TRUTH, noise=None) -> dict:
    clusters = []
    for i, n in enumerate(nodes):
        compute = (R + X * E[n]) / truth["bw"] + LAYERS * truth["o"]
        comm = MOE * (truth["a"] + truth["b"] * (n - 2)) if n >= 2 else 0.0
        if noise:
            compute += noise[i]
        t = compute + comm
        clusters.append(
            {
                "nodes": n,
                "keepalive": "lru",
                "transport": "envoy" if n > 1 else "local",
                "generation_tps": 1 / t,
                "time_per_token_s": t,
                "expected_experts": E[n],
                "breakdown_s": {
                    "attention_router": 0.2 * compute,
                    "experts": 0.7 * compute,
                    "collective_wait": comm,
                    "other": 0.1 * compute,
                },
                "future_field": "ignored",
            }
        )
    return {
        "model": "dbrx-instruct",
        "prompt_tokens": 128,
        "generated_tokens": 128,
        "ours_tps": 6.1,
        "mlx_lm_tps": 7.0,
        "ratio": 0.87,
        "model_bytes": {
            "replicated_read_per_token": R,
            "expert": X,
            "layers": LAYERS,
            "moe_layers": MOE,
            "hidden": 6144,
            "dtype_bytes": 2,
        },
        "clusters": clusters,
    }


def test_fit_recovers_known_parameters():
    cal = fit(parse_bench(bench()), network="10gbe", hardware="m2-ultra-192")
    assert cal.bandwidth_Bps == pytest.approx(TRUTH["bw"], rel=1e-9)
    assert cal.layer_overhead_s == pytest.approx(TRUTH["o"], rel=1e-6)
    assert cal.collective_base_s == pytest.approx(TRUTH["a"], rel=1e-9)
    assert cal.collective_per_node_s == pytest.approx(TRUTH["b"], rel=1e-9)
    assert cal.residual_rms_s == pytest.approx(0, abs=1e-12)
    assert [p.nodes for p in cal.points] == [1, 2, 3, 4]
    assert cal.points[1].tokens_per_s == pytest.approx(bench()["clusters"][1]["generation_tps"])
    assert cal.transport == "envoy" and cal.network == "10gbe" and not cal.notes


def test_fit_with_noise_stays_close():
    cal = fit(parse_bench(bench(noise=[1e-3, -1e-3, 5e-4, -5e-4])))
    assert cal.bandwidth_Bps == pytest.approx(TRUTH["bw"], rel=0.1)
    assert cal.residual_rms_s < 2e-3


def test_one_multi_node_count_gives_a_constant_collective():
    cal = fit(parse_bench(bench(nodes=(1, 2))))
    assert cal.collective_base_s == pytest.approx(TRUTH["a"])
    assert cal.collective_per_node_s == 0
    assert any("one node count" in n for n in cal.notes)


def test_single_node_only_has_no_collective():
    cal = fit(parse_bench(bench(nodes=(1,))))
    assert cal.collective_base_s is None
    assert cal.layer_overhead_s == 0 and any("not separable" in n for n in cal.notes)
    assert cal.overheads(apply_collective=True).collective_s(4) is None


def test_calibrated_plan_reproduces_the_bench():
    cal = fit(parse_bench(bench()))
    b = parse_bench(bench())
    for c in b.clusters:
        assert predict_time(cal, b, c.nodes, c.expected_experts) == pytest.approx(
            c.time_per_token_s, rel=1e-9
        )
    # Eq. 1 with the fitted overheads on a model whose bytes are the bench's (the dbrx preset) agrees too.
    dbrx = presets.model_preset("dbrx")
    m2, net = presets.hardware_preset("m2-ultra-192"), presets.network_preset("10gbe")
    row = estimate(dbrx, m2, net, 3, [2.32], overheads=cal.overheads(apply_collective=True))
    assert row.time_s == pytest.approx(
        b.clusters[2].time_per_token_s, rel=2e-3
    )  # FLOPs bound is not the max


def test_round_trip_and_strictness():
    cal = fit(parse_bench(bench()), network="10gbe")
    data = cal.to_json()
    assert data["format"] == FORMAT
    assert parse_calibration(data) == cal
    with pytest.raises(CalibrationError, match="unknown field.*bogus"):
        parse_calibration({**data, "bogus": 1})
    with pytest.raises(CalibrationError, match="format"):
        parse_calibration({**data, "format": "other/9"})
    with pytest.raises(CalibrationError, match="bandwidth_Bps"):
        parse_calibration({**data, "bandwidth_Bps": 0})


def test_bad_bench_names_the_field():
    b = bench()
    del b["clusters"][1]["breakdown_s"]["collective_wait"]
    with pytest.raises(
        CalibrationError, match=r"clusters\[1\].breakdown_s: missing field 'collective_wait'"
    ):
        parse_bench(b, "b.json")
    b = bench()
    b["clusters"][0]["time_per_token_s"] = -1
    with pytest.raises(CalibrationError, match="time_per_token_s"):
        parse_bench(b)
    with pytest.raises(CalibrationError, match="'clusters' is empty"):
        parse_bench({**bench(), "clusters": []})
    with pytest.raises(CalibrationError, match="missing field 'model_bytes'"):
        parse_bench({"model": "m", "clusters": []})


def test_several_transports_are_fitted_one_at_a_time():
    """bench decode --transport mlx,envoy: the plan's fit refuses the mix; the bench fits each transport
    with the N = 1 points and recovers each one's collective cost."""
    from moe_cluster.coordinator.bench.decode_calibrate import calibrate

    both = bench()
    fast = bench(truth=dict(TRUTH, a=100e-6, b=10e-6))["clusters"]
    both["clusters"] += [dict(c, transport="mlx") for c in fast if c["nodes"] > 1]
    with pytest.raises(CalibrationError, match="several transports"):
        fit(parse_bench(both))
    cals = calibrate(both)
    assert sorted(cals) == ["envoy", "mlx"]
    assert cals["envoy"]["collective_base_s"] == pytest.approx(TRUTH["a"], rel=1e-9)
    assert cals["mlx"]["collective_base_s"] == pytest.approx(100e-6, rel=1e-9)
    assert [p["nodes"] for p in cals["mlx"]["points"]] == [1, 2, 3, 4]
    assert cals["mlx"]["max_abs_error"] < 1e-9


def test_a_collective_inside_the_graph_is_fitted_on_whole_tokens():
    """transport mlx all-reduces inside the step's graph: nothing times the collective, its cost
    shows in "other". The parts' fit cannot place it; the whole-token fit must, and say so."""
    b = bench()
    for c in b["clusters"]:
        parts = c["breakdown_s"]
        parts["other"] += parts["collective_wait"]
        parts["collective_wait"] = 0.0
    cal = fit(parse_bench(b))
    assert any("whole tokens" in n for n in cal.notes)
    for c in parse_bench(b).clusters:
        assert predict_time(cal, parse_bench(b), c.nodes, c.expected_experts) == pytest.approx(
            c.time_per_token_s, rel=0.02
        )
    assert cal.collective_base_s > 0


def test_timed_parts_that_fit_are_kept():
    cal = fit(parse_bench(bench()))
    assert not any("whole tokens" in n for n in cal.notes)


def test_each_point_is_also_predicted_from_a_fit_without_it():
    """bench decode --calibrate: beside the in-sample error (a fit with about as many terms as points
    reproduces them by construction), each point's error when the fit leaves it out."""
    from moe_cluster.coordinator.bench.decode_calibrate import calibrate

    exact = calibrate(bench())["envoy"]
    assert all(abs(p["held_out_error"]) < 1e-6 for p in exact["points"]), exact["points"]
    off = bench(noise=[0.0, 0.0, 0.0, 0.02])  # the 4-node point 20 ms slower than the model says
    cal = calibrate(off)["envoy"]
    last = cal["points"][-1]
    assert last["held_out_error"] == pytest.approx(
        off["clusters"][-1]["time_per_token_s"] / (off["clusters"][-1]["time_per_token_s"] - 0.02)
        - 1,
        rel=1e-6,
    )  # predicted from the three others
    assert abs(last["held_out_error"]) > abs(last["error"])
    assert cal["max_abs_held_out_error"] == max(abs(p["held_out_error"]) for p in cal["points"])
    two = calibrate(bench(nodes=(1, 2)))["envoy"]  # nothing left to fit once a point is out
    assert [p["held_out_error"] for p in two["points"]] == [None, None] and two[
        "max_abs_held_out_error"
    ] is None


def _link():
    from moe_cluster.coordinator.plan.link import AllReduce, LinkFit, RoundTrip, Transfer

    return LinkFit(
        ("a", "b"),
        hidden=1000,
        act_bytes=2,
        date="2026-12-06",
        round_trips=(
            RoundTrip("a", "b", 2000, 60e-6, 50e-6),
            RoundTrip("b", "a", 2000, 70e-6, 50e-6),
            RoundTrip("a", "b", 64000, 200e-6, 150e-6),
        ),
        transfers=(Transfer("a", "b", 10**9, 1.0), Transfer("b", "a", 10**9, 2.0)),
        allreduce=(
            AllReduce("envoy", 1, 100e-6, 200e-6),
            AllReduce("envoy", 32, 410e-6, 900e-6),
            AllReduce("mlx", 1, 150e-6, 300e-6),
        ),
    )


def test_a_measured_link_is_a_network_whose_one_token_all_reduce_is_what_was_measured():
    from moe_cluster.coordinator.plan.calibration import link_only

    link = _link()
    net = link.network()
    assert net.name == "measured" and net.bandwidth_Bps == pytest.approx(
        0.2e9
    )  # 31 x 2 KB / 310 us
    assert net.wire_latency_s == pytest.approx(
        30e-6 - 2000 / 0.5e9
    )  # half the fastest, its bytes out
    for transport, want in (("envoy", 100e-6), ("mlx", 150e-6)):
        assert net.latency_s(transport) + 2000 / net.bandwidth_Bps == pytest.approx(want)
    assert link.collective_s("envoy", 8) == pytest.approx(100e-6 + 7 * 10e-6)
    assert link.collective_s("mlx", 8) == pytest.approx(150e-6 + 7 * 2000 / 0.5e9)
    cal = link_only(link)
    back = parse_calibration(cal.to_json())
    assert back == cal and back.bandwidth_Bps is None
    bad = cal.to_json()
    bad["link"]["allreduce"][0]["transport"] = "carrier-pigeon"
    with pytest.raises(CalibrationError, match="carrier-pigeon"):
        parse_calibration(bad)
    bad["link"]["allreduce"][0] = {"transport": "envoy", "tokens": 1, "p50_s": 1e-4, "p99": 2}
    with pytest.raises(CalibrationError, match="unknown field.*p99"):
        parse_calibration(bad)


def test_a_link_replaces_the_all_reduce_in_the_collective_a_bench_fitted():
    cal = fit(parse_bench(bench()), network="10gbe")
    with_link = cal.with_link(_link())
    loopback = presets.network_preset("loopback").latency_s("envoy")
    assert with_link.collective_base_s == pytest.approx(TRUTH["a"] - loopback)
    assert with_link.bandwidth_Bps == cal.bandwidth_Bps and with_link.network == "measured"
    assert any("waiting for each other" in n for n in with_link.notes)
    assert parse_calibration(with_link.to_json()) == with_link
