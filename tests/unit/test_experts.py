"""ExpertShard on its own: exact compute, assembly of the partial output, keepalive counters."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.switch_layers import SwitchGLU

from moe_cluster.node.moe.experts import ExpertShard, ShardLinear, ShardState
from moe_cluster.node.moe.plan import Replicas
from moe_cluster.proto.placement import Placement

E, D, F, K = 8, 32, 48, 3


def _bank(seed=0):
    mx.random.seed(seed)
    bank = SwitchGLU(D, F, E)
    mx.eval(bank.parameters())
    return bank


def _shards(bank, placement: Placement, keepalive: str, dtype=mx.float32, linear=ShardLinear):
    world = placement.world_size
    holders = placement.holders(0, E)
    out = []
    for rank in range(world):
        local = list(placement.layers[0][rank])
        idx = mx.array(local)
        projs = {
            p: linear(getattr(bank, p).weight[idx].astype(dtype))
            for p in ("gate_proj", "up_proj", "down_proj")
        }
        state = ShardState(rank, world, keepalive)
        out.append(ExpertShard(0, local, holders, projs, "glu", bank.activation, state))
    return out


class _Recording(ShardLinear):
    """Notes each call's (output dim, slots multiplied): the weights it touches."""

    seen: list[tuple[int, tuple[int, ...]]] = []

    def __call__(self, x, slots, groups):
        _Recording.seen.append((self.weight.shape[1], tuple(np.array(slots).reshape(-1).tolist())))
        return super().__call__(x, slots, groups)


def _rank0_of_two(keepalive: str, monkeypatch):
    """Rank 0 of two (experts 0-3 here, 4-7 there), noting what it reads; the test fails where it
    reads the routing on the host."""
    _Recording.seen.clear()
    p = Placement.from_json({"layers": {"0": {"0": [0, 1, 2, 3], "1": [4, 5, 6, 7]}}}, 2)
    shard0 = _shards(_bank(3), p, keepalive, linear=_Recording)[0]
    monkeypatch.setattr(
        ShardState, "count_routed", lambda *a: pytest.fail("indices read on the host")
    )
    return shard0


def _counters(shard):
    shard.telemetry.settle()  # device-routed calls count lazily
    return dict(vars(shard.telemetry.counters[0]))


def _step(shards, x, inds):
    before = [_counters(s) for s in shards]
    ys = [s(x, inds) for s in shards]
    after = [_counters(s) for s in shards]
    delta = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]
    return ys, delta


def _on_the_host(shards):
    """The same shards taking the host path: indices read on the host, rows grouped by expert."""
    for s in shards:
        s.host_only()  # alone the host route is not offered (routes()): forced here to compare
    return shards


@pytest.mark.parametrize("keepalive", ["lru", "none"])  # none: decode routed on the device
@pytest.mark.parametrize("world", [1, 2, 3])
def test_partials_sum_to_the_full_bank(world, keepalive):
    bank = _bank()
    shards = _shards(bank, Placement.even({0: E}, world), keepalive)
    rng = np.random.default_rng(0)
    for tokens in (1, 5, 70):  # decode, small prefill, prefill past SwitchGLU's sort threshold
        x = mx.array(rng.standard_normal((1, tokens, D)).astype(np.float32))
        inds = mx.array(
            np.stack([rng.choice(E, K, replace=False) for _ in range(tokens)]).reshape(1, tokens, K)
        )
        ys, _ = _step(shards, x, inds)
        total = ys[0]
        for y in ys[1:]:
            total = total + y
        assert total.shape == (1, tokens, K, D)
        assert mx.allclose(total, bank(x, inds), atol=1e-5).item()


def test_replicated_expert_is_computed_once():
    bank = _bank(1)
    p = Placement.from_json(
        {"layers": {"0": {"0": [0, 1, 2, 3, 4, 5], "1": [2, 3, 4, 5, 6, 7]}}}, 2
    )
    shards = _shards(bank, p, "none")
    x = mx.ones((1, 1, D))
    inds = mx.array([[[2, 3, 4]]])
    ys, delta = _step(shards, x, inds)
    assert [d["selected"] for d in delta] in ([2, 1], [1, 2])
    assert mx.allclose(ys[0] + ys[1], bank(x, inds), atol=1e-5).item()


@pytest.mark.parametrize("keepalive", ["none", "lru", "busy"])
def test_keepalive_counters_every_step(keepalive):
    bank = _bank(2)
    world = 3
    placement = Placement.even({0: E}, world)
    shards = _shards(bank, placement, keepalive)
    local = [len(placement.layers[0][r]) for r in range(world)]
    rng = np.random.default_rng(1)
    for step in range(200):
        tokens = 1 if step % 10 else 4
        inds = mx.array(
            np.stack([rng.choice(E, K, replace=False) for _ in range(tokens)]).reshape(1, tokens, K)
        )
        _, delta = _step(shards, mx.zeros((1, tokens, D)), inds)
        cluster_max = max(d["selected"] for d in delta)
        for rank, d in enumerate(delta):
            assert d["cluster_max"] == cluster_max
            if keepalive == "none":
                assert d["computed"] == d["selected"] and d["filler"] == 0
            elif keepalive == "lru":
                assert d["computed"] == min(cluster_max, local[rank])
            else:
                assert d["computed"] == local[rank]
            assert d["computed"] == d["selected"] + d["filler"]


def test_lru_fillers_are_least_recently_used():
    bank = _bank(3)
    p = Placement.from_json({"layers": {"0": {"0": [0, 1, 2, 3], "1": [4, 5, 6, 7]}}}, 2)
    shard0 = _shards(bank, p, "lru")[0]
    # rank 1 is selected twice per step, rank 0 never: rank 0 pads with 2 fillers, rotating
    seen = []
    for i in range(4):
        before = list(shard0.lru)
        shard0(mx.zeros((1, 1, D)), mx.array([[[4, 5]]]))
        seen.append(before[:2])
    assert seen == [[0, 1], [2, 3], [0, 1], [2, 3]]


def test_lru_fillers_are_chosen_on_the_device(monkeypatch):
    """Keepalive lru at N > 1 decodes without reading the routing on the host: the positions another
    node computes are pointed at this node's least recently used experts, as many as the busiest
    node computes beyond ours, and the rest at an expert read anyway."""
    seen = _Recording.seen
    shard0 = _rank0_of_two("lru", monkeypatch)
    computed = []
    for _ in range(
        4
    ):  # rank 1 selects experts 4 and 5, rank 0 expert 1 (its slot 1): one filler a call
        seen.clear()
        y = shard0(mx.zeros((1, 1, D)), mx.array([[[4, 5, 1]]]))
        computed.append(set(seen[0][1]))  # gate_proj's slots: the experts this call reads
        assert mx.array_equal(
            y[..., :2, :], mx.zeros_like(y[..., :2, :])
        ).item()  # fillers' outputs left out
    monkeypatch.undo()
    assert computed == [
        {1, 0},
        {1, 2},
        {1, 3},
        {1, 0},
    ]  # slot 1 selected; the filler rotates, LRU first
    c = _counters(shard0)
    assert (c["selected"], c["filler"], c["computed"], c["cluster_max"]) == (4, 4, 8, 8)


def test_lru_order_survives_the_recency_count_restart(monkeypatch):
    from moe_cluster.node.moe import plan

    monkeypatch.setattr(plan, "_STAMP_SPAN", 8)  # restart every 8 calls instead of 65536
    p = Placement.from_json({"layers": {"0": {"0": [0, 1, 2, 3], "1": [4, 5, 6, 7]}}}, 2)
    shard0 = _shards(_bank(3), p, "lru")[0]
    orders = []
    for _ in range(20):
        orders.append(shard0.lru[:2])
        shard0(mx.zeros((1, 1, D)), mx.array([[[4, 5, 1]]]))
    assert shard0.recency.calls <= 8
    # slot 1 is selected every call; the one filler rotates over 0, 2, 3 through every restart
    assert orders[1:4] == [[2, 3], [3, 0], [0, 2]]
    assert all(orders[i] == orders[i + 3] for i in range(1, 17)), orders


def test_bfloat16_without_gather_mm_matches_float32():
    bank = _bank(4)
    shards = _shards(bank, Placement.even({0: E}, 2), "none", dtype=mx.bfloat16)
    x = mx.array(np.random.default_rng(2).standard_normal((1, 6, D)).astype(np.float32)).astype(
        mx.bfloat16
    )
    inds = mx.array(
        np.stack([np.random.default_rng(3).choice(E, K, replace=False) for _ in range(6)]).reshape(
            1, 6, K
        )
    )
    ys, _ = _step(shards, x, inds)
    total = ys[0].astype(mx.float32) + ys[1].astype(mx.float32)
    assert mx.allclose(total, bank(x.astype(mx.float32), inds), atol=0.05, rtol=0.05).item()


def test_warm_up_touches_every_local_expert():
    seen = _Recording.seen
    seen.clear()
    bank = _bank(5)
    shard = _shards(bank, Placement.even({0: E}, 2), "lru", linear=_Recording)[1]
    local = len(shard.global_ids)
    shard.warm_up()  # runs every local expert once; must not disturb the LRU order or counters
    # gate and up project D -> F, down F -> D: each ran over every local slot
    assert sorted(out for out, _ in seen) == [D, F, F], seen
    assert all(sorted(set(slots)) == list(range(local)) for _, slots in seen), seen
    assert list(shard.lru) == list(range(local))
    assert shard.telemetry.counters[0].calls == 0


def test_without_keepalive_other_nodes_positions_read_no_other_expert(monkeypatch):
    """Keepalive none routed on the device: the positions another node computes repeat an expert this
    node reads anyway, so the weights read are those of its selected experts (a CPU reads a repeated
    expert's bytes once), and slot 0 only where it selected none."""
    seen = _Recording.seen
    shard0 = _rank0_of_two("none", monkeypatch)
    for inds, read in (
        ([[[4, 2, 5]]], {2}),
        ([[[6, 3, 1], [7, 4, 5]]], {1, 3}),
        ([[[4, 5, 6]]], {0}),
    ):
        seen.clear()
        y = shard0(mx.ones((1, len(inds[0]), D)), mx.array(inds))
        assert set(seen[0][1]) == read  # gate_proj's slots: the experts this call reads
        theirs = mx.array(inds) >= 4
        assert mx.array_equal(mx.where(theirs[..., None], y, 0), mx.zeros_like(y)).item()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_device_routing_equals_the_host_path(world):
    """Decode steps routed on the device (no host sync) give the host path's outputs and counters."""
    bank = _bank()
    placement = Placement.even({0: E}, world)
    device, host = _shards(bank, placement, "none"), _on_the_host(_shards(bank, placement, "none"))
    assert all(s.device_routed for s in device)
    _assert_steps_agree(device, host, seed=1, atol=1e-6)


def _assert_steps_agree(shards, host, seed: int, atol: float) -> None:
    """Six decode-sized steps (1-3 tokens): the same partial outputs and counters on both sets."""
    rng = np.random.default_rng(seed)
    for step in range(6):
        tokens = 1 + step % 3
        x = mx.array(rng.standard_normal((1, tokens, D)).astype(np.float32))
        inds = mx.array(
            np.stack([rng.choice(E, K, replace=False) for _ in range(tokens)]).reshape(1, tokens, K)
        )
        ys_s, delta_s = _step(shards, x, inds)
        ys_h, delta_h = _step(host, x, inds)
        for a, b in zip(ys_s, ys_h):
            assert mx.allclose(a, b, atol=atol).item()
        assert delta_s == delta_h


@pytest.mark.parametrize(
    "tokens", [1, 30]
)  # decode, and past SwitchGLU's sort threshold (30 x 3 rows)
def test_alone_every_call_is_stocks_op_for_op(tokens, monkeypatch):
    """A lone node runs prompts on the device too, through SwitchGLU's own sorted path: its output is
    stock's to the bit (on a GPU the sorted kernel rounds differently from the unsorted one, and bf16
    near-ties turned a lone node's tokens), with no host read of the indices, and counted alike."""
    bank = _bank(3)
    (shard,) = _shards(bank, Placement.even({0: E}, 1), "none")
    monkeypatch.setattr(
        ShardState, "count_routed", lambda *a: pytest.fail("indices read on the host")
    )
    rng = np.random.default_rng(3)
    x = mx.array(rng.standard_normal((1, tokens, D)).astype(np.float32))
    sel = np.stack([rng.choice(E, K, replace=False) for _ in range(tokens)]).reshape(1, tokens, K)
    y = shard(x, mx.array(sel.astype(np.uint32)))
    assert mx.array_equal(y, bank(x, mx.array(sel.astype(np.uint32)))).item()
    monkeypatch.undo()
    assert shard.telemetry.routing()[0][1] == tuple(np.bincount(sel.reshape(-1), minlength=E))


# Replicas: at N = 2 every replica is on both nodes; at N = 3, full copies, and copies on 2 of 3.
_TWO = Placement(2, {0: {0: (0, 1, 2, 3, 4, 5), 1: (2, 3, 4, 5, 6, 7)}})
_EVERYWHERE = Placement(3, {0: {0: (0, 1, 2, 6), 1: (0, 1, 3, 4), 2: (0, 1, 5, 7)}})
_PARTLY = Placement(3, {0: {0: (0, 1, 2, 6), 1: (0, 3, 4), 2: (1, 5, 7)}})


@pytest.mark.parametrize("keepalive", ["none", "lru"])
@pytest.mark.parametrize("placement", [_TWO, _EVERYWHERE], ids=["two", "everywhere"])
def test_replicas_held_everywhere_are_routed_on_the_device(placement, keepalive):
    """Every replica on every node: the replica rule runs as array operations (routing.ArrayRule),
    with no host read of the indices, and gives the host path's partial outputs and counters."""
    bank = _bank(5)
    device, host = (
        _shards(bank, placement, keepalive),
        _on_the_host(_shards(bank, placement, keepalive)),
    )
    assert all(isinstance(s.plan, Replicas) for s in device)
    _assert_steps_agree(device, host, seed=5, atol=1e-5)
    # the host path times its read of the indices; the device path has none to time
    assert all(s.telemetry.timers.attention_router == 0 for s in device)
    assert all(s.telemetry.timers.attention_router > 0 for s in host)


@pytest.mark.parametrize("keepalive", ["none", "lru"])
def test_with_replicas_a_node_reads_the_experts_it_computes(keepalive):
    """Device-routed with replicas: the distinct experts a node's call reads are those it computes
    (its own, plus lru's fillers up to the busiest node), never a replica another node computes
    beside them."""
    seen = _Recording.seen
    shards = _shards(_bank(6), _TWO, keepalive, linear=_Recording)
    rng = np.random.default_rng(6)
    for step in range(40):
        tokens = 1 + step % 2
        inds = mx.array(
            np.stack([rng.choice(E, K, replace=False) for _ in range(tokens)]).reshape(1, tokens, K)
        )
        for shard in shards:
            before = _counters(shard)
            seen.clear()
            mx.eval(shard(mx.ones((1, tokens, D)), inds))
            computed = _counters(shard)["computed"] - before["computed"]
            assert len(set(seen[0][1])) == max(computed, 1), (
                step,
                seen[0][1],
            )  # slot 0 where it computes none


def test_replicas_on_some_nodes_keep_the_host_path():
    """A replica on 2 of 3 nodes: assign's greedy pass has no array form here; the host decides."""
    assert all(not s.device_routed for s in _shards(_bank(), _PARTLY, "none"))


@pytest.mark.parametrize("world", [1, 3])
def test_routing_counts_every_selection_on_both_paths(world):
    """Each (token, slot) selection counts once for its expert, on every node alike (the heat map)."""
    placement = Placement.even({0: E}, world)
    device, host = (
        _shards(_bank(), placement, "none"),
        _on_the_host(_shards(_bank(), placement, "lru")),
    )
    assert device[0].device_routed
    rng = np.random.default_rng(2)
    want = np.zeros(E, dtype=np.int64)
    for tokens in (1, 4, 1):
        x = mx.array(rng.standard_normal((1, tokens, D)).astype(np.float32))
        sel = np.stack([rng.choice(E, K, replace=False) for _ in range(tokens)]).reshape(
            1, tokens, K
        )
        want += np.bincount(sel.reshape(-1), minlength=E)
        for s in device + host:
            mx.eval(s(x, mx.array(sel)))
    for rank, s in enumerate(device + host):
        held, tokens = s.telemetry.routing()[0]
        assert tokens == tuple(want) and held == placement.layers[0][rank % world]


def test_folding_many_device_routed_calls_at_once_counts_as_one_at_a_time():
    """settle() folds its calls in one numpy pass: the counters and routing counts are those of
    folding each call alone, across layers with different placements and calls of several tokens."""
    rng = np.random.default_rng(4)
    tables = {layer: rng.integers(0, 3, 16) for layer in range(5)}
    calls = [
        (
            int(rng.integers(0, 5)),
            mx.array(rng.integers(0, 16, (1, int(rng.integers(1, 4)), 4)).astype(np.uint32)),
        )
        for _ in range(300)
    ]
    together, alone = ShardState(1, 3, "none"), ShardState(1, 3, "none")
    for state in (together, alone):
        state.routed = {layer: np.zeros(16, dtype=np.int64) for layer in tables}
    for layer, inds in calls:
        together.pending.append((layer, inds, tables[layer]))
        alone.pending.append((layer, inds, tables[layer]))
        alone.settle()
    together.settle()
    assert (
        together.counters == alone.counters and sum(c.calls for c in alone.counters.values()) == 300
    )
    assert all((together.routed[layer] == alone.routed[layer]).all() for layer in tables)
    # and both are the counts made by hand: per call its distinct experts, by the rank computing them
    for layer, table in tables.items():
        mine = biggest = positions = calls_here = 0
        heat = np.zeros(16, dtype=np.int64)
        for lay, inds in calls:
            if lay != layer:
                continue
            ids = np.array(inds).reshape(-1)
            per_rank = np.bincount(table[np.unique(ids)], minlength=3)
            calls_here, positions = calls_here + 1, positions + ids.size
            mine, biggest = mine + per_rank[1], biggest + per_rank.max()
            heat += np.bincount(ids, minlength=16)
        c = together.counters[layer]
        assert (c.calls, c.selected, c.computed, c.cluster_max, c.positions) == (
            calls_here,
            mine,
            mine,
            biggest,
            positions,
        )
        assert (together.routed[layer] == heat).all()


def _reference_skip_gemv(x, w, slots, per_x):
    """skip_gemv's contract in plain MLX ops (the kernel itself needs CUDA): position r is
    x[r // per_x] @ w[slots[r]].T, zeros where slots[r] < 0."""
    rows = x[mx.arange(slots.shape[0]) // per_x]
    y = (w[mx.maximum(slots, 0)] @ rows[:, :, None])[:, :, 0]
    return mx.where((slots >= 0)[:, None], y, mx.zeros_like(y))


@pytest.mark.parametrize("keepalive", ["none", "lru"])
@pytest.mark.parametrize("world", [2, 3])
def test_the_skipping_decode_step_equals_the_host_path(world, keepalive, monkeypatch):
    """Decode at N > 1 through skip_gemv (positions another node computes read nothing; lru's fillers
    are read and zeroed) gives the host path's partial outputs and counters."""
    from moe_cluster.node.moe import skip_gemv

    monkeypatch.setattr(skip_gemv, "skip_gemv", _reference_skip_gemv)
    bank = _bank()
    placement = Placement.even({0: E}, world)
    skipping, host = (
        _shards(bank, placement, keepalive),
        _on_the_host(_shards(bank, placement, keepalive)),
    )
    for s in skipping:
        s.use_skip(mx.float32)  # what enable_skip_gemv does where the kernel checks out (CUDA only)
        s.set_route("skip")
    _assert_steps_agree(skipping, host, seed=2, atol=1e-5)


def test_skip_gemv_stays_off_without_cuda_and_says_why_where_it_cannot_apply():
    from moe_cluster.node.moe import skip_gemv

    assert not skip_gemv.available()  # this CPU build: the step keeps gather_mm
    bank = _bank()
    alone = _shards(bank, Placement.even({0: E}, 1), "none")[0]
    assert "not routed on the device at N > 1" in alone.enable_skip_gemv()
    pair = _shards(bank, Placement.even({0: E}, 2), "none")[0]
    w = pair.up_proj.weight
    assert skip_gemv.fits(w.astype(mx.bfloat16)) and skip_gemv.fits(w.astype(mx.float16))
    # float32 keeps gather_mm (stock's logits within 1e-4); and the kernel loads 8 inputs at a time
    assert not skip_gemv.fits(w) and not skip_gemv.fits(mx.zeros((2, 4, 6), dtype=mx.bfloat16))
    assert "float32" in pair.enable_skip_gemv()  # this bank's weights


def test_skip_gemv_is_checked_once_per_dtype_and_shape(monkeypatch):
    """The load-time check compiles and runs the kernel: every layer's projections share a few shapes,
    so each is asked once (here it fails: no CUDA, and the reason is kept)."""
    from moe_cluster.node.moe import skip_gemv

    calls = []
    monkeypatch.setattr(skip_gemv, "_checked", {})
    monkeypatch.setattr(skip_gemv, "_check", lambda w: calls.append(w.shape) or "no CUDA here")
    for _ in range(3):
        assert skip_gemv.check(mx.zeros((4, 8, 16))) == "no CUDA here"
    skip_gemv.check(mx.zeros((4, 16, 8)))
    skip_gemv.check(mx.zeros((4, 8, 16), dtype=mx.bfloat16))
    assert calls == [(4, 8, 16), (4, 16, 8), (4, 8, 16)]
