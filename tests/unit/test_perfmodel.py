"""Eq. 1 against the paper's Table 6 and its RDMA projection, and the model's bookkeeping."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from moe_cluster.coordinator.plan import presets
from moe_cluster.coordinator.plan.perfmodel import (
    CacheSpec,
    ModelSpec,
    Overheads,
    PlanError,
    estimate,
    requantized,
)

# Table 6 of Chen et al. (RACS '24): nodes -> (load, compute, latency, transfer, time, tok/s);
# compute printed as "<0.001" is given as None.
TABLE_6 = {
    2: (0.061, 0.001, 0.040, 0.002, 0.103, 9.7),
    3: (0.055, 0.001, 0.040, 0.002, 0.096, 10.4),
    4: (0.040, 0.001, 0.040, 0.002, 0.081, 12.3),
    6: (0.031, None, 0.040, 0.002, 0.072, 13.9),
    8: (0.029, None, 0.040, 0.002, 0.070, 14.2),
}
MEASURED_E = {
    2: 2.65,
    3: 2.32,
    4: 1.57,
    6: 1.11,
    8: 1.01,
}  # Table 1 (and the paper's 6, 8 node inputs)


@pytest.fixture(scope="module")
def dbrx():
    return presets.model_preset("dbrx")


@pytest.fixture(scope="module")
def m2():
    return presets.hardware_preset("m2-ultra-192")


@pytest.mark.parametrize("nodes", sorted(TABLE_6))
def test_table_6_rows(dbrx, m2, nodes):
    row = estimate(dbrx, m2, presets.network_preset("paper-10gbe"), nodes, [MEASURED_E[nodes]])
    load, compute, latency, transfer, time, tps = TABLE_6[nodes]
    assert row.load_s == pytest.approx(load, abs=0.001)
    if compute is None:
        assert row.compute_s < 0.001
    else:
        assert row.compute_s == pytest.approx(compute, abs=0.001)
    assert row.latency_s == pytest.approx(latency, abs=0.001)
    assert row.transfer_s == pytest.approx(transfer, abs=0.001)
    assert row.time_s == pytest.approx(time, abs=0.001)
    assert row.tokens_per_s == pytest.approx(tps, abs=0.1)
    assert row.overhead_s == 0


def test_table_1_inputs(dbrx, m2):
    # The preset holds Table 1's inputs, not Table 6's outputs.
    assert dbrx.replicated_read_bytes == 7e9
    assert dbrx.replicated_flops == 14e9
    assert dbrx.expert_bytes == 6144 * 10752 * 3 * 40 * 2 == pytest.approx(16e9, rel=0.01)
    assert sum(dbrx.expert_layer_flops) == pytest.approx(16e9, rel=0.01)
    assert dbrx.comm_bytes == 6144 * 4 * 40 * 2 == pytest.approx(2e6, rel=0.02)
    assert (dbrx.num_experts, dbrx.top_k, dbrx.layers, dbrx.moe_layers) == (16, 4, 40, 40)
    assert (m2.bandwidth_Bps, m2.flops, m2.price_usd) == (800e9, 54e12, 6599)
    ten = presets.network_preset("paper-10gbe")
    assert ten.latency_per_layer_s == pytest.approx(1e-3)
    assert ten.bandwidth_Bps == 1.25e9
    assert ten.stack_s > 100 * ten.wire_latency_s  # the 1 ms is the software stack, not the wire


@pytest.mark.parametrize("network", ["rocev2", "infiniband"])
def test_rdma_two_node_bound(dbrx, m2, network):
    # Paper: 9.7 -> 16.3 tok/s for 2 nodes; Eq. 1 with E = 2.65 gives 16.0-16.4.
    net = presets.network_preset(network)
    row = estimate(dbrx, m2, net, 2, [2.65])
    assert 16.0 <= row.tokens_per_s <= 16.4
    assert row.latency_s == pytest.approx(net.wire_latency_s * 40)


def test_rdma_nic_figures():
    roce, ib = presets.network_preset("rocev2"), presets.network_preset("infiniband")
    assert (roce.wire_latency_s, roce.bandwidth_Bps, roce.stack_s, roce.price_per_node_usd) == (
        750e-9,
        25e9 / 8,
        0,
        339,
    )
    assert (ib.wire_latency_s, ib.bandwidth_Bps, ib.stack_s, ib.price_per_node_usd) == (
        600e-9,
        200e9 / 8,
        0,
        1267,
    )


def test_cost_efficiency_as_table_5(dbrx, m2):
    row = estimate(dbrx, m2, presets.network_preset("paper-10gbe"), 2, [2.65])
    assert row.price_per_node_usd == 6599
    assert row.tokens_per_s_per_usd == pytest.approx(row.tokens_per_s / (2 * 6599))
    # Table 5 divides the measured 5.9 tok/s by 2 x $6,599 (0.000447); the model's own figure is the
    # same quotient of its Table 6 prediction (9.7 tok/s at 2 nodes), both numbers from the paper
    assert row.tokens_per_s_per_usd == pytest.approx(9.7 / (2 * 6599), rel=0.01)
    roce = estimate(dbrx, m2, presets.network_preset("rocev2"), 2, [2.65])
    assert roce.price_per_node_usd == 6599 + 339
    one = estimate(dbrx, m2, presets.network_preset("rocev2"), 1, [4])
    assert one.price_per_node_usd == 6599  # one node needs no NIC
    given = estimate(dbrx, m2, presets.network_preset("rocev2"), 2, [2.65], price_per_node_usd=5000)
    assert given.price_per_node_usd == 5000


def test_one_node_has_no_communication(dbrx, m2):
    row = estimate(dbrx, m2, presets.network_preset("paper-10gbe"), 1, [4])
    assert row.latency_s == row.transfer_s == 0
    assert row.time_s == pytest.approx((7e9 + 4 * dbrx.expert_bytes) / 800e9)


def test_compute_bound_when_flops_are_scarce(dbrx, m2):
    slow = replace(m2, flops=0.5e12)
    row = estimate(dbrx, slow, presets.network_preset("paper-10gbe"), 2, [2.65])
    assert row.compute_s > row.load_s
    assert row.time_s == pytest.approx(row.compute_s + row.latency_s + row.transfer_s)


def test_memory_per_node_and_fit(dbrx, m2):
    net = presets.network_preset("paper-10gbe")
    row = estimate(dbrx, m2, net, 2, [2.65])
    assert row.memory_per_node_bytes == dbrx.replicated_bytes + 8 * dbrx.expert_bytes
    assert row.fits  # the paper ran DBRX on 2 nodes
    assert row.usable_memory_bytes == int(192 * 2**30 * 0.75)
    one = estimate(dbrx, m2, net, 1, [4])
    assert not one.fits and one.memory_per_node_bytes == dbrx.total_bytes
    uneven = estimate(dbrx, m2, net, 3, [2.3])
    assert uneven.expert_shard_bytes == 6 * dbrx.expert_bytes  # 6/5/5: the fullest node
    slots = [[8, 10]] * dbrx.moe_layers  # rank 1 holds two replicas
    repl = estimate(dbrx, m2, net, 2, [2.5], expert_slots=slots)
    assert repl.expert_shard_bytes == 10 * dbrx.expert_bytes


def test_published_totals_match_presets():
    published = {
        "dbrx": 132e9,
        "mixtral-8x7b": 46.7e9,
        "mixtral-8x22b": 141e9,
        "qwen3-235b-a22b": 235e9,
        "deepseek-v3": 671e9,
        "qwen3-coder-next": 80e9,
    }
    for name, params in published.items():
        m = presets.model_preset(name)
        assert m.total_bytes == pytest.approx(2 * params, rel=0.01), name
        assert 0 < m.replicated_read_bytes < m.replicated_bytes <= m.total_bytes, name
        assert m.kv_cache_bytes(1000) > 0, name


def _toy(**kw) -> ModelSpec:
    base = dict(
        name="toy",
        num_experts=8,
        top_k=2,
        layers=4,
        moe_layer_ids=(0, 1, 2, 3),
        hidden=64,
        act_bytes=2,
        replicated_bytes=1000,
        replicated_read_bytes=800,
        replicated_flops=1600.0,
        expert_layer_bytes=(100,) * 4,
        expert_layer_flops=(200.0,) * 4,
    )
    base.update(kw)
    return ModelSpec(**base)


def test_shared_experts_are_computed_by_their_owner():
    m = _toy(shared_layer_bytes=(50, 60, 70, 80), shared_layer_flops=(1.0,) * 4)
    assert m.shared_max(1) == (260, 4.0)
    assert m.shared_max(2) == (60 + 80, 2.0)  # layers 1 and 3 on rank 1
    assert m.shared_max(4) == (80, 1.0)
    hw = presets.hardware_preset("m4-pro-64")
    net = presets.network_preset("tb5")
    two = estimate(m, hw, net, 2, [1.5])
    assert two.load_s == pytest.approx((800 + 140 + 4 * 100 * 1.5) / hw.bandwidth_Bps)


def test_kv_cache_counts_in_memory_and_load():
    caches = (CacheSpec(per_token_bytes=10),) * 2 + (
        CacheSpec(per_token_bytes=10, max_tokens=100),
        CacheSpec(per_token_bytes=0, fixed_bytes=500),
    )
    m = _toy(caches=caches)
    assert m.kv_cache_bytes(0) == 500
    assert m.kv_cache_bytes(1000) == 2 * 10_000 + 1000 + 500
    hw, net = presets.hardware_preset("m4-pro-64"), presets.network_preset("tb5")
    a = estimate(m, hw, net, 2, [1.0], context=0)
    b = estimate(m, hw, net, 2, [1.0], context=1000)
    assert b.memory_per_node_bytes - a.memory_per_node_bytes == 21_000
    assert (b.load_s - a.load_s) * hw.bandwidth_Bps == pytest.approx(21_000)


def test_per_layer_expected_experts_weigh_per_layer_bytes():
    m = _toy(expert_layer_bytes=(100, 200, 100, 100))
    hw, net = presets.hardware_preset("m4-pro-64"), presets.network_preset("tb5")
    row = estimate(m, hw, net, 2, [1.0, 2.0, 1.0, 1.0])
    assert row.load_s * hw.bandwidth_Bps == pytest.approx(800 + 100 + 400 + 100 + 100)
    assert row.expected_experts == 1.25


def test_calibrated_overheads():
    dbrx = presets.model_preset("dbrx")
    m2, net = presets.hardware_preset("m2-ultra-192"), presets.network_preset("paper-10gbe")
    ov = Overheads(
        bandwidth_Bps=600e9,
        layer_overhead_s=1e-4,
        collective_base_s=5e-4,
        collective_per_node_s=1e-4,
    )
    row = estimate(dbrx, m2, net, 4, [1.57], overheads=ov)
    assert row.load_s == pytest.approx((7e9 + 1.57 * dbrx.expert_bytes) / 600e9)
    assert row.overhead_s == pytest.approx(40 * 1e-4)
    assert row.latency_s + row.transfer_s == pytest.approx(40 * (5e-4 + 2 * 1e-4))


def test_requantized_bytes():
    m = requantized(presets.model_preset("mixtral-8x7b"), 4, 64)
    base = presets.model_preset("mixtral-8x7b")
    assert m.expert_bytes == pytest.approx(base.expert_bytes * 4.5 / 16, rel=1e-6)
    assert m.weights == "4-bit affine g64"
    assert m.replicated_flops == base.replicated_flops
    with pytest.raises(PlanError, match="already quantized"):
        requantized(m, 4)
    with pytest.raises(PlanError, match="7"):
        requantized(base, 7)


@pytest.mark.parametrize(
    "kind, lookup",
    [
        ("model", presets.model_preset),
        ("hardware", presets.hardware_preset),
        ("network", presets.network_preset),
    ],
)
def test_unknown_preset_names_the_value(kind, lookup):
    with pytest.raises(PlanError, match=f"unknown {kind} preset 'nope'"):
        lookup("nope")


def test_bad_inputs(dbrx, m2):
    net = presets.network_preset("paper-10gbe")
    with pytest.raises(PlanError, match=r"at least 1 \(got 0\)"):
        estimate(dbrx, m2, net, 0, [1.0])
    with pytest.raises(PlanError, match="3 expected-expert values for 40"):
        estimate(dbrx, m2, net, 2, [1.0, 2.0, 3.0])
    with pytest.raises(PlanError, match="17"):
        estimate(dbrx, m2, net, 2, [17])
    with pytest.raises(PlanError, match="-5"):
        estimate(dbrx, m2, net, 2, [2.0], context=-5)
    with pytest.raises(PlanError, match="top-k 9"):
        _toy(top_k=9)
    with pytest.raises(PlanError, match="3 entries for 4"):
        _toy(expert_layer_bytes=(1, 2, 3))
    assert math.isfinite(estimate(dbrx, m2, net, 2, [0.0]).tokens_per_s)
