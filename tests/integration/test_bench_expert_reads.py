"""`bench decode`'s expert bytes read per node per token, counted per decode route on a 4-bit
checkpoint at N = 2 (DecodeBench.route forces the route in the node processes): the redirected-rows
route reads one expert matrix per routed position, k per MoE layer on every node; the host read
reads only the experts a node computes, so the two nodes' reads add up to the k distinct experts a
token selects. Both give the same tokens."""

from __future__ import annotations

import pytest

from conftest import cli


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    out = tmp_path_factory.mktemp("q4") / "model"
    r = cli(
        "demo-model",
        "--arch",
        "qwen3_moe",
        "--hidden",
        "64",
        "--experts",
        "8",
        "--top-k",
        "2",
        "--layers",
        "2",
        "--quantize",
        "4",
        "--dtype",
        "bfloat16",
        "--out",
        str(out),
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return str(out)


def _row(model: str, route: str, monkeypatch) -> dict:
    from moe_cluster.coordinator.bench import decode_run as decode

    spec = decode.DecodeBench(
        model, nodes=(2,), keepalive=("none",), max_tokens=8, rounds=1, peers=False, route=route
    )
    (row,) = decode._cluster(spec, list(range(3, 14)), 2, "shm")
    return row


def test_expert_bytes_follow_the_route(quantized, monkeypatch):
    from moe_cluster.coordinator.bench.decode_run import model_bytes

    size = model_bytes(quantized)
    k, layers, one_expert = (
        size["top_k"],
        size["moe_layers"],
        size["expert"],
    )  # expert: summed over layers
    device = _row(quantized, "device", monkeypatch)
    host = _row(quantized, "host", monkeypatch)
    assert device["tokens"] == host["tokens"] and len(device["tokens"]) == 8
    for row, route in ((device, "device"), (host, "host")):
        reads = row["expert_reads"]
        assert [n["rank"] for n in reads["nodes"]] == [0, 1]
        for n in reads["nodes"]:
            assert n["routes"] == [route] and n["route"].startswith(f"{route}, forced"), n
    for n in device["expert_reads"]["nodes"]:  # every position reads a matrix: k per layer
        assert n["matrices_per_layer"] == k, n
        assert n["bytes_per_token"] == pytest.approx(k * one_expert), (n, one_expert, layers)
    nodes = host["expert_reads"]["nodes"]
    # each selected expert is read once, by the node that holds it; keepalive none reads no filler
    assert sum(n["matrices_per_layer"] for n in nodes) == pytest.approx(k), nodes
    assert sum(n["bytes_per_token"] for n in nodes) == pytest.approx(k * one_expert), nodes
    assert all(n["matrices_per_layer"] == pytest.approx(n["computed_per_layer"]) for n in nodes), (
        nodes
    )
    assert (
        host["expert_reads"]["max_bytes_per_token"] < device["expert_reads"]["max_bytes_per_token"]
    )
