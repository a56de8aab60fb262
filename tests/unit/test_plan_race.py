"""The race model (coordinator/plan/race.py): what each strategy reads and pays per step, checked
against hand arithmetic on a small made-up model and against the Qwen3-235B preset's shape."""

from __future__ import annotations

import pytest
from moe_cluster.coordinator.plan import presets, race
from moe_cluster.coordinator.plan.perfmodel import (
    HardwareSpec,
    ModelSpec,
    NetworkSpec,
    Overheads,
    requantized,
)

GB = 1e9


def _model() -> ModelSpec:
    # 4 decoder layers, all MoE; per layer one expert is 10 MB; replicated reads 40 MB
    return ModelSpec(
        name="toy",
        num_experts=8,
        top_k=2,
        layers=4,
        moe_layer_ids=(0, 1, 2, 3),
        hidden=1000,
        act_bytes=2,
        replicated_bytes=50_000_000,
        replicated_read_bytes=40_000_000,
        replicated_flops=1e6,
        expert_layer_bytes=(10_000_000,) * 4,
        expert_layer_flops=(1e6,) * 4,
    )


HW = HardwareSpec("hw", 10**12, 100 * GB, 1e30, 0.0)
NET = NetworkSpec("net", 100e-6, 1e30, 0.0)  # 100 us per collective, no transfer time


def test_each_strategy_reads_and_pays_what_the_arithmetic_says():
    m = _model()
    k = 2.0
    active = 40e6 + 4 * k * 10e6  # 120 MB
    pipe = race.race_point("pipeline", m, HW, NET, 4, 1, ours_experts=1.25, distinct_experts=k)
    tens = race.race_point("tensor", m, HW, NET, 4, 1, ours_experts=1.25, distinct_experts=k)
    ours = race.race_point("ours", m, HW, NET, 4, 1, ours_experts=1.25, distinct_experts=k)
    # pipeline: every active byte, one node after another, plus N - 1 hops
    assert pipe.read_s == pytest.approx(active / 100e9) and pipe.collectives == 3
    assert pipe.time_s == pytest.approx(active / 100e9 + 3 * 100e-6)
    assert pipe.bytes_per_node == pytest.approx(active / 4)
    # tensor: a quarter of every active byte at once, two all-reduces per layer
    assert tens.read_s == pytest.approx(active / 4 / 100e9) and tens.collectives == 8
    assert tens.time_s == pytest.approx(active / 4 / 100e9 + 8 * 100e-6)
    # ours: the replicated bytes and E[n] experts at once, one all-reduce per MoE layer
    assert ours.bytes_per_node == pytest.approx(40e6 + 4 * 1.25 * 10e6) and ours.collectives == 4
    assert ours.time_s == pytest.approx((40e6 + 50e6) / 100e9 + 4 * 100e-6)
    assert ours.tokens_per_s == pytest.approx(1 / ours.time_s)


def test_by_stream_reads_its_own_streams_kv_and_pays_two_collectives_of_its_rows():
    """With a context, each strategy reads (and holds) the KV of the streams it attends for: every
    stream on every node replicated, ceil(B/N) of them by stream; by stream pays a gather and a
    scatter per MoE layer, each moving a node's share of the rows."""
    from dataclasses import replace

    from moe_cluster.coordinator.plan.perfmodel import CacheSpec

    m = replace(_model(), caches=(CacheSpec(per_token_bytes=1000),) * 4)  # 4 KB a token
    kv = 4 * 1000 * 2048  # one stream's cache at 2,048 tokens
    slow = NetworkSpec("slow", 100e-6, 1e6, 0.0)
    kw = dict(ours_experts=4.0, distinct_experts=6.0, context=2048)
    ours = race.race_point("ours", m, HW, slow, 2, 8, **kw)
    mine = race.race_point("by-stream", m, HW, slow, 2, 8, **kw)
    bare = race.race_point("ours", m, HW, slow, 2, 8, ours_experts=4.0, distinct_experts=6.0)
    assert ours.bytes_per_node - bare.bytes_per_node == pytest.approx(8 * kv)
    assert mine.bytes_per_node - bare.bytes_per_node == pytest.approx(4 * kv)
    assert ours.memory_per_node_bytes - mine.memory_per_node_bytes == pytest.approx(4 * kv, abs=1)
    assert (ours.collectives, mine.collectives) == (4, 8)
    assert ours.comm_s == pytest.approx(4 * (100e-6 + 8 * 1000 * 2 / 1e6))
    assert mine.comm_s == pytest.approx(8 * (100e-6 + 4 * 1000 * 2 / 1e6))


def test_a_batch_pays_the_collectives_once_per_step():
    m = _model()
    one = race.race_point("tensor", m, HW, NET, 2, 1, ours_experts=1.5, distinct_experts=2.0)
    eight = race.race_point("tensor", m, HW, NET, 2, 8, ours_experts=4.0, distinct_experts=6.0)
    assert eight.comm_s == one.comm_s
    assert eight.read_s == pytest.approx((40e6 + 4 * 6 * 10e6) / 2 / 100e9)
    assert eight.tokens_per_s == pytest.approx(8 / eight.time_s)
    # the link's bytes count where nothing was measured: B hidden vectors per collective
    slow = NetworkSpec("slow", 0.0, 1e6, 0.0)
    p = race.race_point("ours", m, HW, slow, 2, 8, ours_experts=4.0, distinct_experts=6.0)
    assert p.comm_s == pytest.approx(4 * 8 * 1000 * 2 / 1e6)
    # a measured collective replaces the link's figures
    q = race.race_point(
        "ours",
        m,
        HW,
        slow,
        2,
        8,
        ours_experts=4.0,
        distinct_experts=6.0,
        overheads=Overheads(collective_base_s=1e-3),
    )
    assert q.comm_s == pytest.approx(4e-3)


def test_qwen3_235b_on_mac_studios_the_link_decides():
    """At batch 1 over the paper's 10GbE (1 ms of gRPC per collective) 94 all-reduces lose to the
    pipeline's one hop; with this envoy's measured stack ours comes within reach of it; over TB5
    RDMA with 32 streams expert parallelism wins, by more on 4 nodes than on 2."""
    model = requantized(presets.model_preset("qwen3-235b-a22b"), 4)
    hw = presets.hardware_preset("m3-ultra-256")

    def tps(link, nodes, batch, transport="envoy"):
        net = presets.network_preset(race.LINKS.get(link, link))
        pts = race.race(model, hw, net, [nodes], [batch], transport=transport)
        return {p.strategy: p.tokens_per_s for p in pts}

    paper = tps("paper-10gbe", 2, 1)
    assert paper["pipeline"] > 3 * paper["ours"]
    ours = tps("10gbe", 2, 1)
    assert 0.7 * ours["pipeline"] < ours["ours"] and ours["ours"] > 3 * paper["ours"]
    fast2, fast4 = tps("tb5-rdma", 2, 32, "mlx"), tps("tb5-rdma", 4, 32, "mlx")
    assert (
        fast2["ours"] > 1.3 * fast2["pipeline"]
        and fast4["ours"] / fast4["pipeline"] > fast2["ours"] / fast2["pipeline"]
    )
    # batching helps the strategies that pay many collectives far more than the pipeline
    b1, b32 = tps("tb-ip", 4, 1), tps("tb-ip", 4, 32)
    assert b32["ours"] / b1["ours"] > 3 * (b32["pipeline"] / b1["pipeline"])


def test_check_recovers_the_bandwidth_and_reports_held_out_misses():
    m = _model()
    rows = []
    for name, batch in (("ours_mlx", 1), ("mlx_lm_pipeline", 1), ("mlx_lm_tensor", 4)):
        probe = race.MeasuredRow(name, 2, batch, 1.0, 200e-6)
        p = race.predict_row(m, HW, NET, probe, 25 * GB)  # "measured" on a 25 GB/s device
        rows.append(race.MeasuredRow(name, 2, batch, p.time_s, 200e-6))
    out = race.check(race.RaceRun(m, HW, NET, rows))
    assert out["bandwidth_Bps"] == pytest.approx(25 * GB) and "fitted" in out["bandwidth_source"]
    assert [r["held_out"] for r in out["rows"]] == [False, True, True]
    assert out["max_abs_held_out_miss"] == pytest.approx(0.0, abs=1e-9)
    # a row 1.5x slower than the model says is a -33% miss (the model predicts 1.5x its tok/s: +50%)
    slowed = rows[:2] + [race.MeasuredRow("mlx_lm_tensor", 2, 4, rows[2].step_s * 1.5, 200e-6)]
    out = race.check(race.RaceRun(m, HW, NET, slowed))
    assert out["rows"][2]["miss"] == pytest.approx(0.5) and out[
        "max_abs_held_out_miss"
    ] == pytest.approx(0.5)


def test_bad_strategy_and_sizes_are_refused():
    m = _model()
    with pytest.raises(race.PlanError, match="strategy"):
        race.race_point("ring", m, HW, NET, 2, 1, ours_experts=1.0, distinct_experts=2.0)
    with pytest.raises(race.PlanError, match="at least 1"):
        race.race_point("ours", m, HW, NET, 2, 0, ours_experts=1.0, distinct_experts=2.0)
    with pytest.raises(race.PlanError, match="MoE layers"):
        race.race_point("ours", m, HW, NET, 2, 1, ours_experts=[1.0, 2.0], distinct_experts=2.0)


def test_check_with_two_batches_fits_bandwidth_and_a_cost_per_layer():
    m = _model()

    def row(name, batch):
        probe = race.MeasuredRow(name, 2, batch, 1.0, 200e-6)
        p = race.predict_row(
            m, HW, NET, probe, 25 * GB, layer_overhead_s=1e-3
        )  # 25 GB/s and 1 ms per layer
        return race.MeasuredRow(name, 2, batch, p.time_s, 200e-6)

    rows = [
        row("ours_mlx", 1),
        row("ours_mlx", 4),
        row("mlx_lm_pipeline", 4),
        row("mlx_lm_tensor", 1),
    ]
    out = race.check(race.RaceRun(m, HW, NET, rows))
    assert out["bandwidth_Bps"] == pytest.approx(25 * GB) and out[
        "layer_overhead_s"
    ] == pytest.approx(1e-3)
    assert [r["held_out"] for r in out["rows"]] == [False, False, True, True]
    assert out["max_abs_held_out_miss"] == pytest.approx(0.0, abs=1e-9)


def test_check_each_fits_costs_per_layer_and_per_token_per_row_kind_at_its_fewest_nodes():
    """Each kind's fixed cost per layer and cost per token per layer come from its rows at its
    fewest nodes; the other node counts are held out: a kind whose costs carry over predicts them
    exactly, one whose costs do not shows the miss."""
    m = _model()

    def row(name, nodes, batch, per_layer, per_token=0.0, slower=1.0):
        probe = race.MeasuredRow(name, nodes, batch, 1.0, 200e-6)
        cost = per_layer + per_token * batch
        p = race.predict_row(m, HW, NET, probe, HW.bandwidth_Bps, layer_overhead_s=cost)
        return race.MeasuredRow(name, nodes, batch, p.time_s * slower, 200e-6)

    rows = [
        row("ours_envoy", 2, 1, 2e-3, 0.3e-3),
        row("ours_envoy", 2, 8, 2e-3, 0.3e-3),
        row("ours_envoy", 4, 1, 2e-3, 0.3e-3),
        row("ours_envoy", 4, 8, 2e-3, 0.3e-3),
        row("mlx_lm_pipeline", 2, 1, 0.5e-3),
        row("mlx_lm_pipeline", 4, 1, 0.5e-3, slower=2.0),  # costs more than the fit carries
        row("mlx_lm_tensor", 2, 8, 1e-3),  # one batch: the fixed cost alone
    ]
    out = race.check_each(race.RaceRun(m, HW, NET, rows))
    assert out["layer_overhead_s"] == pytest.approx(
        {"ours_envoy": 2e-3, "mlx_lm_pipeline": 0.5e-3, "mlx_lm_tensor": 1e-3 + 0.0}
    )
    assert out["token_overhead_s"] == pytest.approx(
        {"ours_envoy": 0.3e-3, "mlx_lm_pipeline": 0.0, "mlx_lm_tensor": 0.0}
    )
    held = [r["held_out"] for r in out["rows"]]
    assert held == [False, False, True, True, False, True, False]
    misses = [r["miss"] for r in out["rows"]]
    assert misses[:5] == pytest.approx([0.0] * 5, abs=1e-9) and misses[6] == pytest.approx(0.0)
    assert misses[5] == pytest.approx(1.0) and out["max_abs_held_out_miss"] == pytest.approx(1.0)


def test_the_per_token_line_keeps_its_terms_physical():
    assert race._line([(1, 2.0)]) == (2.0, 0.0)
    assert race._line([(1, 1.0), (8, 8.0)]) == pytest.approx((0.0, 1.0))
    assert race._line([(1, 3.0), (8, 1.0)]) == (3.0, 0.0)  # a falling cost: the smallest's f
    assert race._line([(1, 0.1), (8, 8.0)]) == pytest.approx(
        (0.0, (0.1 + 64.0) / 65)
    )  # f < 0: through the origin


def test_check_split_recovers_costs_per_layer_and_per_token_and_carries_them_to_the_peers():
    """Rows made with known costs (fixed, attention, an expert pass, ours' own per token, per
    layer) and ours' synced pass growing by those shares: the fit on ours at one node count gives
    the costs back, and every held-out row (the pipeline, tensor parallelism, ours at other node
    counts) is predicted exactly; a peer slower than its share shows as a miss."""
    m = _model()
    costs = dict(
        layer_overhead_s=0.5e-3,
        token_attention_s=20e-6,
        token_expert_s=5e-6,
        token_ours_s=10e-6,
    )

    def row(name, nodes, batch, slower=1.0):
        probe = race.MeasuredRow(name, nodes, batch, 1.0, 200e-6)
        p = race.predict_row(m, HW, NET, probe, HW.bandwidth_Bps, **costs)
        synced = None
        if name == "ours_mlx":  # what the synced pass timed, per step: only the growth matters
            per_layer = {
                "attention_router": 1e-4 + batch * costs["token_attention_s"],
                "experts": 2e-4 + batch * costs["token_expert_s"] * m.top_k / nodes,
                "collective_wait": 1e-4 + batch * 4e-6,
                "other": 1e-4 + batch * 6e-6,
            }
            synced = {k: v * m.layers for k, v in per_layer.items()}
        return race.MeasuredRow(name, nodes, batch, p.time_s * slower, 200e-6, synced)

    rows = [
        row("ours_mlx", 2, 1),
        row("ours_mlx", 2, 8),
        row("ours_mlx", 4, 8),  # another node count: held out
        row("mlx_lm_pipeline", 2, 4),
        row("mlx_lm_tensor", 4, 8),
        row("mlx_lm_tensor", 2, 8, slower=1.25),
    ]
    out = race.check_split(race.RaceRun(m, HW, NET, rows))
    assert out["layer_overhead_s"] == pytest.approx(costs["layer_overhead_s"])
    assert out["token_costs_s"] == pytest.approx(
        {k: v for k, v in costs.items() if k != "layer_overhead_s"}
    )
    assert [r["held_out"] for r in out["rows"]] == [False, False, True, True, True, True]
    misses = [r["miss"] for r in out["rows"]]
    assert misses[:5] == pytest.approx([0.0] * 5, abs=1e-9)
    assert misses[5] == pytest.approx(0.25) and out["max_abs_held_out_miss"] == pytest.approx(0.25)
    assert "synced pass from 1 to 8 streams" in out["bandwidth_source"]

    # without a synced pass the cost per token is split by FLOPs, and none of it is ours' own
    bare = [race.MeasuredRow(r.name, r.nodes, r.batch, r.step_s, r.collective_s) for r in rows]
    out = race.check_split(race.RaceRun(m, HW, NET, bare))
    assert out["token_costs_s"]["token_ours_s"] == 0.0 and "FLOPs" in out["bandwidth_source"]
    assert [r["miss"] for r in out["rows"][:2]] == pytest.approx([0.0, 0.0], abs=1e-9)
    # rows faster than their bytes at the hardware's bandwidth: it is raised until they fit
    slow = HardwareSpec("slow", 10**12, 0.1 * GB, 1e30, 0.0)
    out = race.check_split(race.RaceRun(m, slow, NET, rows[:2]))
    assert "raised" in out["bandwidth_source"] and out["bandwidth_Bps"] > 0.1 * GB
    # one batch: a fixed cost alone; no ours rows: nothing fitted
    out = race.check_split(race.RaceRun(m, HW, NET, [rows[1], rows[3]]))
    assert "one batch" in out["bandwidth_source"] and out["rows"][0]["miss"] == pytest.approx(0.0)
    out = race.check_split(race.RaceRun(m, HW, NET, rows[3:]))
    assert "nothing fitted" in out["bandwidth_source"] and all(r["held_out"] for r in out["rows"])


def test_each_transport_pays_its_own_stack_and_mlx_lm_always_mx_distributed():
    net = NetworkSpec("net", 10e-6, 1e30, 100e-6, mlx_stack_s=300e-6)
    m, one = _model(), dict(ours_experts=2.0, distinct_experts=2.0)
    envoy = race.race_point("ours", m, HW, net, 2, 1, **one)
    mlx = race.race_point("ours", m, HW, net, 2, 1, transport="mlx", **one)
    tensor = race.race_point("tensor", m, HW, net, 2, 1, transport="envoy", **one)
    assert envoy.comm_s == pytest.approx(4 * 110e-6) and envoy.transport == "envoy"
    assert mlx.comm_s == pytest.approx(4 * 310e-6) and mlx.transport == "mlx"
    assert tensor.transport == "mlx" and tensor.comm_s == pytest.approx(2 * 4 * 310e-6)


def test_the_advice_says_how_it_moves_with_the_link_cost():
    """Qwen3-235B at batch 1 on 2 M4 Max over 10GbE is close: a link twice as dear hands it to the
    pipeline (one hop a token), one twice as cheap to a strategy that all-reduces."""
    model = requantized(presets.model_preset("qwen3-235b-a22b"), 4)
    hw, net = presets.hardware_preset("m4-max-128"), presets.network_preset("10gbe")
    moved = race.link_sensitivity(model, hw, net, 2, 1)
    assert set(moved) == {2.0, 0.5}
    dear, cheap = moved[2.0][0], moved[0.5][0]
    assert dear.strategy == "pipeline" and cheap.strategy != "pipeline"
    assert (
        dear.time_s
        > race.race_point(
            "pipeline", model, hw, net, 2, 1, ours_experts=8.0, distinct_experts=8.0
        ).time_s
    )
    best, lead = race.lead(race.race(model, hw, net, [2], [1]))
    assert lead > 1.0 and best.strategy in race.STRATEGIES
