"""The decode route (node/moe/route.py): chosen once at load from the times measured on each route,
or forced; every route computes the same partial outputs."""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np
import pytest

from moe_cluster.node.moe import kernels, route
from moe_cluster.proto.errors import UserError
from moe_cluster.proto.placement import Placement
from test_experts import D, E, F, K, _bank, _shards


def _two(keepalive="none", layers=1):
    """Rank 0 of two, `layers` MoE layers of the same bank."""
    return [_shards(_bank(), Placement.even({0: E}, 2), keepalive)[0] for _ in range(layers)]


def _timer(times, calls=None, wide=None):
    """Seconds by route for one row; `wide`: {rows: {route: seconds}} for batches (else the
    host read loses at every size)."""

    def timer(shard, r, top_k, tokens):
        if calls is not None:
            calls.append((r, top_k) if tokens == 1 else (r, top_k, tokens))
        if tokens == 1:
            return times[r]
        return (wide or {}).get(tokens, {}).get(r, 1.0 if r == "host" else 1e-3)

    return timer


@pytest.mark.parametrize(
    "times, want",
    [({"device": 2e-4, "host": 1e-4}, "host"), ({"device": 1e-4, "host": 2e-4}, "device")],
)
def test_the_choice_follows_the_measured_times(times, want):
    shards, calls = _two(layers=3), []
    choice = route.choose(shards, [3, 3, 3], "measure", timer=_timer(times, calls))
    assert choice.route == want and choice.how == "measured"
    assert choice.times_us == {r: t * 1e6 for r, t in times.items()}
    assert [s.route for s in shards] == [want] * 3  # one layer timed, every layer takes its choice
    assert [c for c in calls if len(c) == 2] == [("device", 3), ("host", 3)]
    assert f"{want}, measured" in choice.describe() and "µs" in choice.describe()
    if want == "host":  # nothing to hand over
        assert len(calls) == 2 and choice.host_from is None and not choice.handoff_us
    else:  # the host read never won a batch: only calls past twice the widest size timed go to it
        assert [c[2] for c in calls[2::2]] == list(route.HANDOFF_TOKENS)
        widest = 2 * route.HANDOFF_TOKENS[-1] * 3
        assert choice.host_from == widest and [s.host_from for s in shards] == [widest] * 3
        assert f"the host read from {widest} positions" in choice.describe()


def test_wide_calls_go_to_the_host_read_from_the_size_where_it_measured_faster():
    shards, calls = _two(layers=2), []
    wide = {8: {"device": 1e-3, "host": 2e-3}, 32: {"device": 3e-3, "host": 2e-3}}
    choice = route.choose(
        shards, [3, 3], "measure", timer=_timer({"device": 1e-4, "host": 2e-4}, calls, wide)
    )
    assert choice.route == "device" and choice.host_from == 32 * 3  # rows x top-k positions
    assert [s.host_from for s in shards] == [96, 96]
    assert [c for c in calls if len(c) == 3] == [
        ("device", 3, 8),
        ("host", 3, 8),
        ("device", 3, 32),
        ("host", 3, 32),
    ]  # the sizes above the crossover are not timed
    assert choice.handoff_us == {
        8: {"device": 1000.0, "host": 2000.0},
        32: {"device": 3000.0, "host": 2000.0},
    }
    assert "the host read from 96 positions" in choice.describe()


def test_a_call_takes_the_host_read_from_host_from_positions_with_the_same_partials():
    bank = _bank()
    rng = np.random.default_rng(5)
    x = mx.array(rng.standard_normal((8, 1, bank.gate_proj.weight.shape[-1])).astype(np.float32))
    inds = mx.array(np.stack([rng.choice(E, 3, replace=False) for _ in range(8)])[:, None])
    shard = _two()[0]
    want = np.array(shard(x, inds))  # 24 positions: under the default hand-off (64)
    seen, real = [], shard.host_rows
    shard.host_rows = lambda *a: seen.append(1) or real(*a)  # taken when the route is set
    for host_from, host_calls in ((None, 0), (24, 1), (25, 0), (64, 0)):
        seen.clear()
        shard.set_route("device", host_from)
        np.testing.assert_allclose(np.array(shard(x, inds)), want, atol=1e-6)
        assert len(seen) == host_calls, host_from


def test_a_skip_route_is_timed_where_the_kernel_applies_and_kept_when_fastest():
    shards = _two()
    for s in shards:
        s.use_skip(mx.float32)  # what enable_skip_gemv does where its check passes (CUDA only)
    assert shards[0].routes() == ("skip", "device", "host")
    choice = route.choose(
        shards, [3], "measure", timer=_timer({"skip": 5e-5, "device": 2e-4, "host": 1e-4})
    )
    assert choice.route == "skip" and shards[0].route == "skip"


def test_a_forced_route_is_honoured_and_only_its_hand_off_is_timed():
    shards = _two(layers=2)
    choice = route.choose(
        shards, [3, 3], "host", timer=lambda *a: pytest.fail("timed a forced host read")
    )
    assert (choice.route, choice.how) == ("host", "forced") and [s.route for s in shards] == [
        "host",
        "host",
    ]
    # a forced device route is not timed at one row, but wide calls still go to the host read
    # from the size where it measured faster
    calls = []
    wide = {8: {"device": 1e-3, "host": 2e-3}, 32: {"device": 3e-3, "host": 2e-3}}
    timer = _timer({"device": 1e-4, "host": 2e-4}, calls, wide)
    choice = route.choose(shards, [3, 3], "device", timer=timer)
    assert (choice.route, choice.how, choice.host_from) == ("device", "forced", 96)
    assert [s.route for s in shards] == ["device", "device"] and [s.host_from for s in shards] == [
        96,
        96,
    ]
    assert calls == [("device", 3, 8), ("host", 3, 8), ("device", 3, 32), ("host", 3, 32)]
    assert "device, forced; the host read from 96 positions" in choice.describe()
    with pytest.raises(UserError, match="route skip .*: no MoE layer of this node can take it"):
        route.choose(shards, [3, 3], "skip")  # float32 weights, no kernel here


def test_layers_without_the_fastest_route_take_their_next_fastest():
    device, busy = (
        _two()[0],
        _shards(_bank(), Placement.even({0: E}, 2), "busy")[0],
    )  # busy: host only
    assert busy.routes() == ("host",)
    route.choose([busy, device], [3, 3], "measure", timer=_timer({"device": 1e-4, "host": 2e-4}))
    assert (busy.route, device.route) == ("host", "device")


def test_alone_the_device_route_is_the_only_one():
    alone = _shards(_bank(), Placement.even({0: E}, 1), "lru")[0]
    assert alone.routes() == ("device",)
    assert (
        route.choose([alone], [3], "measure", timer=lambda *a: pytest.fail("timed")).how == "only"
    )


def test_timing_really_times_and_leaves_the_shard_as_it_was():
    shard = _two("lru")[0]
    stamp = np.array(shard.recency.stamp)
    choice = route.choose([shard], [3], "measure")
    assert set(choice.times_us) == {"device", "host"} and all(
        t > 0 for t in choice.times_us.values()
    )
    if choice.route == "device":  # then timed on batches too, each size on both
        assert choice.handoff_us and all(
            set(by) == {"device", "host"} and min(by.values()) > 0
            for by in choice.handoff_us.values()
        )
        assert shard.host_from == choice.host_from
    assert np.array_equal(np.array(shard.recency.stamp), stamp) and shard.recency.calls == 0
    shard.telemetry.settle()
    assert shard.telemetry.counters[0].calls == 0 and not shard.telemetry.routed[0].any()


def test_every_route_gives_the_same_partials():
    bank = _bank()
    rng = np.random.default_rng(4)
    x = mx.array(rng.standard_normal((1, 2, bank.gate_proj.weight.shape[-1])).astype(np.float32))
    inds = mx.array(np.stack([rng.choice(E, 3, replace=False) for _ in range(2)])[None])
    outs = {}
    for r in ("device", "host"):
        shards = _shards(bank, Placement.even({0: E}, 2), "none")
        for s in shards:
            s.set_route(r)
        outs[r] = [np.array(s(x, inds)) for s in shards]
    for a, b in zip(outs["device"], outs["host"]):
        np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("value", ["fast", "Host", "skip,host"])
def test_a_bad_route_is_refused_by_name(value):
    with pytest.raises(UserError, match="route must be one of skip, device, host, measure"):
        route.requested(value)
    assert route.requested(None) == "measure"
    assert route.requested("device") == "device"


def test_set_route_refuses_a_route_the_layer_cannot_take():
    shard = _two()[0]
    with pytest.raises(UserError, match="cannot take the 'skip' route"):
        shard.set_route("skip")


class _FirstTouch:
    """A shard stand-in whose call is slow where it reads an expert for the first time (a GPU's
    managed memory migrating a page on its first read), fast after."""

    COLD, WARM = 0.02, 0.0005

    def __init__(self, experts: int = 64):
        self.experts, self.read = experts, set()

    def decode_sample(self, top_k, count, tokens=1):
        rng = np.random.default_rng(0)
        draws = [rng.choice(self.experts, (tokens, top_k), replace=False) for _ in range(count)]
        return mx.zeros((tokens, 1, 4)), [mx.array(d[:, None]) for d in draws]

    def trying(self, route_name):
        import contextlib

        return contextlib.nullcontext(self)

    def __call__(self, x, inds):
        new = set(np.array(inds).reshape(-1).tolist()) - self.read
        self.read |= new
        time.sleep(self.COLD if new else self.WARM)
        return x


def test_a_route_timed_first_does_not_pay_for_the_experts_it_reads_first():
    shard = _FirstTouch()
    first = route.time_route(shard, "device", 4)
    second = route.time_route(shard, "host", 4)  # the same draws: nothing new to read
    assert first < 10 * _FirstTouch.WARM and second < 10 * _FirstTouch.WARM, (first, second)


def test_routes_forced_in_turn_share_the_loads_hand_off(monkeypatch):
    """bench decode --routes forces routes round by round (sim.force_route): each hands wide calls
    to the host read where the load's choice did, whatever was forced before it; where the load
    chose the host read itself, the first forced route measures the hand-off and the others keep it."""
    from moe_cluster.node.collective.mlx import GraphOnly
    from moe_cluster.node.moe.load import load_shard
    from moe_cluster.node.sim import force_route

    calls = []

    def timer(shard, r, top_k, tokens, host_at_one=False):
        calls.append((r, tokens))
        if tokens == 1:
            return {"device": 2e-4 if host_at_one else 1e-4, "host": 1.5e-4}[r]
        return {"device": 1e-3 * tokens / 8, "host": 2.5e-3}[r]  # the host read wins from 32 rows

    def load(host_at_one):
        monkeypatch.setattr(route, "time_route", lambda *a: timer(*a, host_at_one=host_at_one))
        calls.clear()
        return load_shard(
            "demo", None, 0, collective=GraphOnly(0, 2), warm_up=False, route="measure"
        )

    sharded = load(host_at_one=False)
    top_k = sharded.layers[0].description.top_k
    assert (sharded.state.route.route, sharded.state.route.host_from) == ("device", 32 * top_k)
    calls.clear()
    for forced, host_from in (("device", 32 * top_k), ("host", None), ("device", 32 * top_k)):
        force_route(sharded, forced)
        assert (sharded.state.route.route, sharded.state.route.host_from) == (forced, host_from)
    assert calls == []  # the load's hand-off, not timed again

    sharded = load(host_at_one=True)
    assert (sharded.state.route.route, sharded.state.route.host_from) == ("host", None)
    calls.clear()
    force_route(sharded, "device")  # measured once here ...
    assert sharded.state.route.host_from == 32 * top_k and calls and all(t > 1 for _, t in calls)
    calls.clear()
    force_route(sharded, "host")
    force_route(sharded, "device")  # ... and kept
    assert sharded.state.route.host_from == 32 * top_k and calls == []


def _slice_timer(sliced_s, whole_s, calls=None):
    """Seconds of a batch call by how the timed shard's down projection is stored; one row: the
    routes tie (the device route is kept)."""

    def timer(shard, r, top_k, tokens):
        if tokens == 1:
            return 1e-4
        if tokens != route.SLICE_TOKENS:
            return 1.0 if r == "host" else 1e-3  # the hand-off: the host read never wins
        if calls is not None:
            calls.append(shard.mlp.last.slices)
        return sliced_s if shard.mlp.last.slices > 1 else whole_s

    return timer


@pytest.fixture
def any_size(monkeypatch):
    """Experts of any size are timed for slices (these tests' are far below the floor)."""
    monkeypatch.setattr(route, "SLICE_FROM_BYTES", 0)


@pytest.mark.parametrize("sliced_s, want", [(0.9e-3, route.SLICES), (0.97e-3, 1)])
def test_the_down_projection_is_sliced_where_it_measured_faster(sliced_s, want, any_size):
    shards, calls = _two(layers=3), []
    before = [np.array(s.mlp.last.weight) for s in shards]
    choice = route.choose(shards, [3] * 3, "measure", timer=_slice_timer(sliced_s, 1e-3))
    choice = route.choose_slices(shards, [3] * 3, choice, timer=_slice_timer(sliced_s, 1e-3, calls))
    # one layer timed, whole and sliced in turn; every layer stored as chosen
    assert calls == [1, route.SLICES] * route.SLICE_ROUNDS
    assert choice.slices == want and [s.mlp.last.slices for s in shards] == [want] * 3
    assert choice.slices_us == {1: 1000.0, route.SLICES: round(sliced_s * 1e6, 1)}
    kept = f"in {want} slices" if want > 1 else "whole"
    assert f"the down projection {kept} (µs at {route.SLICE_TOKENS} tokens" in choice.describe()
    if want == 1:  # whole again: the weights as they were, to the bit
        for s, w in zip(shards, before):
            assert np.array_equal(np.array(s.mlp.last.weight), w)
    for s in shards:  # gate and up stay whole
        assert s.mlp.projections[0].slices == s.mlp.projections[1].slices == 1


def test_nothing_is_sliced_or_timed_where_no_layer_can_be(any_size):
    alone = _shards(_bank(), Placement.even({0: E}, 1), "lru")[0]
    quantized = _two()[0]
    quantized.mlp.last.quant = {"group_size": 32, "bits": 4, "mode": "affine"}
    for shard in (alone, quantized):
        choice = route.RouteChoice("device", "measured")
        got = route.choose_slices([shard], [3], choice, timer=lambda *a: pytest.fail("timed"))
        assert got is choice and shard.mlp.last.slices == 1
        assert shard.slice_inputs(route.SLICES) is False


def test_experts_below_the_floor_are_not_timed_and_stay_whole(monkeypatch):
    """A down projection of fewer bytes an expert than SLICE_FROM_BYTES is not timed, one at the
    floor is."""
    shard = _two()[0]
    per_expert = D * F * 4  # float32 (E, D, F)
    choice = route.RouteChoice("device", "measured")
    monkeypatch.setattr(route, "SLICE_FROM_BYTES", per_expert + 1)
    got = route.choose_slices([shard], [3], choice, timer=lambda *a: pytest.fail("timed"))
    assert got is choice and shard.mlp.last.slices == 1
    monkeypatch.setattr(route, "SLICE_FROM_BYTES", per_expert)
    got = route.choose_slices([shard], [3], choice, timer=_slice_timer(0.5e-3, 1e-3))
    assert got.slices == route.SLICES and shard.mlp.last.slices == route.SLICES


@pytest.mark.parametrize("tokens", [1, 6, 200])
@pytest.mark.parametrize("r", ["device", "host"])
def test_a_sliced_down_projection_gives_the_same_partials(r, tokens):
    """Decode sizes (every row and slice in one call) and a prompt's (slice by slice, sorted)."""
    bank = _bank()
    rng = np.random.default_rng(5)
    x = mx.array(rng.standard_normal((1, tokens, D)).astype(np.float32))
    inds = mx.array(np.stack([rng.choice(E, K, replace=False) for _ in range(tokens)])[None])
    shards = _shards(bank, Placement.even({0: E}, 2), "none")
    whole = []
    for s in shards:
        s.set_route(r, None)
        whole.append(np.array(s(x, inds)))
    for s, want in zip(shards, whole):
        assert s.slice_inputs(route.SLICES)
        assert s.mlp.last.weight.shape == (E // 2 * route.SLICES, D, F // route.SLICES)
        np.testing.assert_allclose(np.array(s(x, inds)), want, rtol=1e-5, atol=1e-6)
    if tokens == 200:  # wide enough for the slice-by-slice form
        assert tokens * K // 2 >= kernels.SLICED_AS_ONE_BELOW
