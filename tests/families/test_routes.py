"""Every decode route (node/moe/route.py) gives stock mlx-lm's tokens, |Δlogit| <= 1e-4 in float32,
on families of every bank kind at N = 2; the route a node takes is the one forced in its environment
or the fastest it measured at load, and its load log says which, with the times."""

from __future__ import annotations

import logging

import pytest

import sweep
import tiny
from moe_cluster.node.moe import route as decode_route
from moe_cluster.node.moe.load import load_in_process
from moe_cluster.proto.errors import UserError
from test_sweep import (
    _quantized_reference,
)  # skips, with the reason, where a GPU gives no stable one

pytestmark = pytest.mark.integration

# a stacked GLU bank, DBRX's per-expert list, biased experts (gpt_oss), shared experts (deepseek_v3)
FAMILIES = ["qwen3_moe", "dbrx", "gpt_oss", "deepseek_v3"]


def _routes(sm) -> set[str]:
    return {layer.shard.route for rank in _ranks(sm) for layer in rank}


def _ranks(sm):
    """Every rank's ClusterMoE layers of an in-process cluster, by rank."""
    from moe_cluster.node.moe.layer import InProcessCluster

    clusters = [m for m in sm.model.modules() if isinstance(m, InProcessCluster)]
    return list(zip(*(c.ranks for c in clusters)))


@pytest.mark.parametrize("route", ["device", "host"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_route_gives_stocks_tokens(family, route, tmp_path):
    path = sweep.checkpoint(family, tmp_path)
    ref = tiny.stock_tokens(path, sweep.PROMPT, sweep.STEPS)
    for keepalive in ("lru", "none"):
        got = sweep.check(path, 2, ref, keepalive, route=route)
        assert got["tokens_match"], (family, route, keepalive, got)
        assert got["max_abs_logit_diff"] <= sweep.TOLERANCE, (
            family,
            route,
            keepalive,
            got["max_abs_logit_diff"],
        )


@pytest.mark.parametrize("route", ["device", "host"])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_every_route_gives_stocks_tokens_quantized(family, route, tmp_path):
    path = sweep.checkpoint(family, tmp_path, sweep.quant_mode(family))
    got = sweep.check(path, 2, _quantized_reference(path), route=route)
    assert got["tokens_match"], (family, route, got)
    assert got["max_abs_logit_diff"] <= sweep.QUANT_TOLERANCE, (
        family,
        route,
        got["max_abs_logit_diff"],
    )


def test_the_route_is_forced_from_the_environment(tmp_path, monkeypatch, caplog):
    path = sweep.checkpoint("qwen3_moe", tmp_path)
    timed = []

    def timer(shard, route, top_k, tokens):
        # a forced route is not timed at one row; where its wide calls go (a batch against the
        # host read) is measured, as for a chosen route
        assert tokens > 1, ("a forced route timed at one row", route)
        timed.append(route)
        return 1e-3 if route == "host" else 1e-4

    monkeypatch.setattr(decode_route, "time_route", timer)
    for forced in ("host", "device"):
        timed.clear()
        with caplog.at_level(logging.INFO, logger="moe_cluster.node.moe.load"):
            sm = load_in_process(str(path), 2, keepalive="none", route=forced)
        assert _routes(sm) == {forced}
        assert f"decode route: {forced}, forced" in caplog.text
        assert set(timed) == (set() if forced == "host" else {"device", "host"}), timed
    # float32 weights: no kernel takes them (gather_mm stays)
    with pytest.raises(
        UserError,
        match="route skip .*cluster.yaml's route.*: no MoE layer of this node can take it",
    ):
        load_in_process(str(path), 2, route="skip")
    with pytest.raises(UserError, match="route must be one of"):
        load_in_process(str(path), 2, route="fastest")


@pytest.mark.parametrize("fast", ["host", "device"])
def test_a_node_keeps_the_route_it_measured_fastest_and_logs_the_times(
    fast, tmp_path, monkeypatch, caplog
):
    path = sweep.checkpoint("qwen3_moe", tmp_path)
    timed = []

    def fake(shard, r, top_k, tokens):
        if tokens == 1:
            timed.append((r, top_k))
        return 1e-4 if r == fast else 3e-4

    monkeypatch.setattr(decode_route, "time_route", fake)
    with caplog.at_level(logging.INFO, logger="moe_cluster.node.moe.load"):
        sm = load_in_process(str(path), 2, keepalive="none", route=None)
    assert _routes(sm) == {fast}
    assert sorted(timed) == sorted(
        [("device", tiny.TOP_K), ("host", tiny.TOP_K)] * 2
    )  # one layer per rank, the router's top-k
    other = "device" if fast == "host" else "host"
    assert f"decode route: {fast}, measured" in caplog.text and f"{fast} 100.0 µs" in caplog.text
    assert f"{other} 300.0 µs" in caplog.text
    assert sm.state.route.times_us == {
        "device": 100.0 if fast == "device" else 300.0,
        "host": 100.0 if fast == "host" else 300.0,
    }
    tokens, _ = tiny.decode(sm.model, sweep.PROMPT, sweep.STEPS)  # timing calls left nothing behind
    assert tokens == tiny.stock_tokens(path, sweep.PROMPT, sweep.STEPS)[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_down_projection_kept_in_slices_gives_stocks_tokens(
    family, tmp_path, monkeypatch, caplog
):
    """Where the slices measure faster, every layer is sliced (DBRX's experts too: the shard stacks
    its per-expert list) and the tokens and logits stay stock's."""
    path = sweep.checkpoint(family, tmp_path)

    def fake(shard, r, top_k, tokens):
        if tokens != decode_route.SLICE_TOKENS:
            return 1e-4 if r == "device" else 3e-4
        return 1e-4 if shard.mlp.last.slices > 1 else 3e-4

    monkeypatch.setattr(decode_route, "time_route", fake)
    monkeypatch.setattr(decode_route, "SLICE_FROM_BYTES", 0)  # these experts are far below it
    with caplog.at_level(logging.INFO, logger="moe_cluster.node.moe.load"):
        sm = load_in_process(str(path), 2, keepalive="none", route=None)
    sliced = {layer.shard.mlp.last.slices for rank in _ranks(sm) for layer in rank}
    assert sliced == {decode_route.SLICES}, sliced
    assert f"the down projection in {decode_route.SLICES} slices" in caplog.text
    ref_tokens, ref_logits = tiny.stock_tokens(path, sweep.PROMPT, sweep.STEPS)
    tokens, logits = tiny.decode(sm.model, sweep.PROMPT, sweep.STEPS)
    assert tokens == ref_tokens
    assert float(abs(logits - ref_logits).max()) <= sweep.TOLERANCE
