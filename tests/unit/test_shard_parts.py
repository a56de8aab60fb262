"""An ExpertShard is a frozen config, a slot plan and a kernel chosen at load (and when its route
is set): a call is `kernel(x, plan(inds))` and decides nothing again."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

from moe_cluster.node.moe import experts, kernels, plan, route
from moe_cluster.node.moe.kernels import CountedRows, Gather, HostRows, Skip
from moe_cluster.node.moe.plan import Alone, CountedPlan, HostPlan, Replicas, ShardConfig, Table
from moe_cluster.proto.placement import Placement

from test_experts import _PARTLY, _TWO, D, E, K, _bank, _shards

EVEN2 = Placement.even({0: E}, 2)


@pytest.mark.parametrize(
    "placement, keepalive, want_plan, want_kernel, lru",
    [
        (Placement.even({0: E}, 1), "lru", Alone, Gather, False),
        (EVEN2, "none", Table, Gather, False),
        (EVEN2, "lru", Table, Gather, True),
        (_TWO, "lru", Replicas, Gather, True),
        (_PARTLY, "none", HostPlan, HostRows, False),  # replicas on 2 of 3: the host decides
        (EVEN2, "busy", HostPlan, HostRows, False),  # busy's fillers are the host's
    ],
    ids=["alone", "table", "table-lru", "replicas", "partly", "busy"],
)
def test_the_load_chooses_the_plan_and_the_kernel(
    placement, keepalive, want_plan, want_kernel, lru
):
    shard = _shards(_bank(), placement, keepalive)[0]
    assert type(shard.plan) is want_plan and type(shard.kernel) is want_kernel
    if want_plan in (Table, Replicas):  # keepalive lru wraps the plan with the shard's recency
        assert (shard.plan.recency is shard.recency) if lru else shard.plan.recency is None
    cfg = shard.config
    assert isinstance(cfg, ShardConfig) and cfg.global_ids == tuple(placement.layers[0][0])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.keepalive = "none"
    with pytest.raises(TypeError):
        cfg.holders[0] = (1,)
    with pytest.raises(dataclasses.FrozenInstanceError):
        shard.telemetry.config.rank = 1


def test_setting_the_route_swaps_the_kernel_and_keeps_the_plan():
    shard = _shards(_bank(), EVEN2, "none")[0]
    device = shard.plan
    shard.use_skip(mx.float32)
    assert shard.routes() == ("skip", "device", "host")
    # no CUDA here: the forced route's hand-off to the host read is timed by a stand-in
    route.choose([shard], [K], "skip", timer=lambda s, r, k, rows: 1.0 if r == "host" else 1e-3)
    assert type(shard.kernel) is Skip and shard.plan is device
    assert shard.kernel.fallback is shard.gather  # another input dtype takes gather_mm
    route.choose([shard], [K], "host")
    # the device plans this shard's calls: the host reads only how many rows are its own
    assert type(shard.kernel) is CountedRows and shard.plan is shard.host_plan
    assert type(shard.plan) is CountedPlan and shard.plan.device is device
    with shard.trying("device"):
        assert shard.kernel is shard.gather and shard.plan is device
    assert shard.route == "host" and type(shard.kernel) is CountedRows
    shard.host_only()  # the host plans every call: the numpy plan
    assert type(shard.plan) is HostPlan and type(shard.kernel) is HostRows


@pytest.mark.parametrize(
    "placement, keepalive, counted",
    [
        (EVEN2, "none", True),
        (_TWO, "none", True),  # replicas everywhere: the device assigns them (Replicas)
        (EVEN2, "lru", True),  # the device picks the fillers: a row each
        (_TWO, "lru", True),
        (_PARTLY, "none", False),  # replicas on 2 of 3: the host assigns them
        (EVEN2, "busy", False),  # busy's fillers are the host's
    ],
    ids=["table", "replicas", "lru", "replicas-lru", "partly", "busy"],
)
def test_the_host_read_is_counted_where_the_device_plans(placement, keepalive, counted):
    """Where the device plans a call, the host read takes only the count of this node's rows, and
    every node's partial is the numpy plan's to the bit, keepalive lru's fillers and recency the
    same: for calls of one token, a batch, a prompt, and calls that select none of this node's
    experts."""
    rng = np.random.default_rng(7)
    shards, planned = _shards(_bank(), placement, keepalive), _shards(_bank(), placement, keepalive)
    for shard, numpy_shard in zip(shards, planned):
        shard.set_route("host")
        assert (type(shard.plan) is CountedPlan) is counted, type(shard.plan)
        numpy_shard.host_only()
    theirs = [e for e in range(E) if e not in shards[0].global_ids]
    calls = [
        rng.choice(E, K, replace=False).reshape(1, 1, K),
        np.stack([rng.choice(E, K, replace=False) for _ in range(16)])[:, None],
        np.stack([rng.choice(E, K, replace=False) for _ in range(40)])[None],
        np.array(theirs[:K])[None, None],  # nothing here for rank 0 where no replica is
    ]
    for inds in calls:
        inds = mx.array(inds.astype(np.uint32))
        x = mx.array(rng.standard_normal(inds.shape[:-1] + (D,)).astype(np.float32))
        for shard, numpy_shard in zip(shards, planned):
            counted_y = np.array(shard(x, inds))
            np.testing.assert_array_equal(counted_y, np.array(numpy_shard(x, inds)))
            assert shard.lru == numpy_shard.lru  # the same experts computed, fillers included
            assert shard.telemetry.means() == numpy_shard.telemetry.means()
            assert counted_y.shape == tuple(inds.shape) + (shard.mlp.last.weight.shape[1],)


@pytest.mark.parametrize("keepalive", ["none", "lru"])
@pytest.mark.parametrize("route_name", ["device", "skip", "host"])
def test_a_call_is_the_kernel_of_the_plan_and_decides_nothing(route_name, keepalive, monkeypatch):
    """Once loaded, a call takes the plan and the kernel it was given, each once, the plan's answer
    handed to the kernel: whatever chose them at load now fails if it runs."""
    monkeypatch.setattr(kernels.skip_gemv, "skip_gemv", _reference_skip_gemv)
    shard = _shards(_bank(), EVEN2, keepalive)[0]
    shard.use_skip(mx.float32)
    shard.set_route(route_name)
    p, k = shard.plan, shard.kernel

    def fail(*a, **kw):
        pytest.fail("a call chose again what the load chose")

    for module, name in (
        (plan, "device_plan"),
        (plan, "everywhere_or_once"),
        (kernels, "_per_expert"),
        (kernels, "skip_fits"),
        (kernels, "_gather_mm_ok"),
        (experts, "device_plan"),
    ):
        monkeypatch.setattr(module, name, fail)
    monkeypatch.setattr(type(shard), "routes", fail)
    seen = []
    plan_call, kernel_call = type(p).__call__, type(k).__call__

    def planned(self, inds):
        out = plan_call(self, inds)
        seen.append(("plan", self, inds, out))
        return out

    def computed(self, x, r):
        seen.append(("kernel", self, x, r))
        return kernel_call(self, x, r)

    monkeypatch.setattr(type(p), "__call__", planned)
    monkeypatch.setattr(type(k), "__call__", computed)
    rng = np.random.default_rng(1)
    x = mx.array(rng.standard_normal((1, 1, D)).astype(np.float32))
    inds = mx.array(rng.choice(E, K, replace=False).reshape(1, 1, K).astype(np.uint32))
    y = shard(x, inds)
    assert [(s[0], s[1]) for s in seen] == [("plan", p), ("kernel", k)]
    assert seen[0][2] is inds and seen[1][2] is x and seen[1][3] is seen[0][3]
    assert y.shape == (1, 1, K, shard.mlp.last.weight.shape[1])


def test_an_expert_cache_wraps_the_host_plan():
    from moe_cluster.node.moe.expert_cache import CacheStats, LayerCache

    shard = _shards(_bank(), EVEN2, "lru")[0]
    views = [np.zeros((len(shard.global_ids), 4), dtype=np.uint8)]
    cache = LayerCache(
        0,
        len(shard.global_ids),
        views,
        lambda i: [],
        range(len(shard.global_ids)),
        [],
        CacheStats(),
    )
    shard.attach_cache(cache)
    assert shard.routes() == ("host",) and not shard.device_routed
    assert type(shard.plan) is HostPlan and shard.plan.cache is cache is shard.cache
    assert shard.plan.recency is shard.recency and type(shard.kernel) is HostRows


def _reference_skip_gemv(x, w, slots, per_x):
    rows = x[mx.arange(slots.shape[0]) // per_x]
    y = (w[mx.maximum(slots, 0)] @ rows[:, :, None])[:, :, 0]
    return mx.where((slots >= 0)[:, None], y, mx.zeros_like(y))
