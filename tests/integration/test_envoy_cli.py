"""`moe-cluster envoy` (one envoy by hand) and `moe-cluster bench allreduce`, as a user runs them."""

from __future__ import annotations

import json

import pytest
import os
import signal
import subprocess
import sys
import time

import grpc

from conftest import native_sum
from moe_cluster.common.ports import free_ports
from moe_cluster.coordinator.bench import allreduce
from moe_cluster.node.collective import trace
from moe_cluster.node.collective.envoy import EAGER_SUM_BYTES
from moe_cluster.proto import convert

CLI = [sys.executable, "-m", "moe_cluster.coordinator.cli"]


def test_envoy_by_hand_serves_health_and_stops_on_sigterm():
    (port,) = free_ports(1)
    address = f"127.0.0.1:{port}"
    env = dict(os.environ, MOE_CLUSTER_SECRET="hand-secret-123")
    proc = subprocess.Popen(
        [*CLI, "-v", "envoy", "--rank", "0", "--addresses", f"{address},127.0.0.1:9"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        health = None
        deadline = time.monotonic() + 30
        while health is None and time.monotonic() < deadline:
            with grpc.insecure_channel(address) as channel:
                call = channel.unary_unary(
                    convert.ENVOY_HEALTH,
                    request_serializer=convert.envoy_health_request_to_wire,
                    response_deserializer=convert.envoy_health_from_wire,
                )
                try:
                    health = call(
                        None, metadata=(("x-moe-cluster-secret", "hand-secret-123"),), timeout=2
                    )
                except grpc.RpcError:
                    time.sleep(0.1)
        assert health == {"rank": 0, "world_size": 2, "connected": [], "whole": False}
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
        assert proc.returncode == 0, err
        assert "cannot reach rank 1 (127.0.0.1:9)" in err and "hand-secret-123" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_envoy_without_a_secret_is_a_one_line_error():
    env = {k: v for k, v in os.environ.items() if k != "MOE_CLUSTER_SECRET"}
    r = subprocess.run(
        [*CLI, "envoy", "--rank", "0", "--addresses", "127.0.0.1:1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "moe-cluster envoy: error: no cluster secret on $MOE_CLUSTER_SECRET"
    ], r.stderr


def test_bench_allreduce_over_nccl_without_its_backend_is_a_one_line_error():
    import mlx.core as mx

    if mx.distributed.is_available("nccl") and mx.cuda.is_available():
        pytest.skip("this MLX has NCCL and a GPU: the path runs")
    r = subprocess.run(
        [*CLI, "bench", "allreduce", "--nodes", "2", "--paths", "mlx_nccl,mlx_ring"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "moe-cluster bench: error: --paths mlx_nccl needs MLX's CUDA build with its NCCL backend "
        "and a GPU per node (not here)"
    ], r.stderr


def test_bench_allreduce_reports_every_path():
    r = subprocess.run(
        [
            *CLI,
            "bench",
            "allreduce",
            "--nodes",
            "2",
            "--hidden",
            "256",
            "--tokens",
            "1,4",
            "--iters",
            "30",
            "--warmup",
            "5",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    cases = json.loads(r.stdout)["cases"]
    assert [(c["nodes"], c["tokens"]) for c in cases] == [(2, 1), (2, 4)]
    for c in cases:
        assert c["hidden"] == 256 and "sum" not in c, c  # the product's own sum (no --sum)
        assert 0 < c["envoy_p50_us"] <= c["envoy_p99_us"]  # its sum checked inside the bench
        assert 0 < c["mlx_ring_p50_us"] <= c["mlx_ring_p99_us"]
        assert c["envoy_over_ring"] == round(c["envoy_p50_us"] / c["mlx_ring_p50_us"], 2)
        assert "envoy_p50_by_round_us" not in c  # one round: nothing to list
        assert not [k for k in c if k.startswith(("floor", "relay", "grpc", "direct"))], c


def _bench_allreduce(*args: str, env: dict | None = None) -> list[dict]:
    """`bench allreduce ARGS --json`'s cases; it must succeed."""
    r = subprocess.run(
        [*CLI, "bench", "allreduce", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["cases"]


def test_bench_allreduce_rounds_alternate_the_paths_and_pool_their_samples():
    (c,) = _bench_allreduce(
        "--nodes", "2", "--hidden", "256", "--iters", "20", "--warmup", "5", "--paths", "envoy",
        "--rounds", "2",
    )  # fmt: skip
    assert c["rounds"] == 2
    by_round = c["envoy_p50_by_round_us"]
    assert len(by_round) == 2 and min(by_round) > 0, c
    # the pooled median lies between the rounds' own (equal-sized samples)
    assert min(by_round) - 0.1 <= c["envoy_p50_us"] <= max(by_round) + 0.1, c
    assert "mlx_ring_p50_us" not in c  # only the paths asked for


@pytest.mark.parametrize("sums", ["native", "numpy"])
def test_bench_allreduce_checks_the_envoys_bfloat16_sum_on_either_path(sums):
    """A node sums bfloat16 partials in node/collective/_sum.c where it was built, else a decode
    vector in numpy and 32 tokens in MLX (`--sum numpy`): the bench checks the sum, so a wrong one
    fails it."""
    if sums == "native":
        native_sum()
    cases = _bench_allreduce(
        "--nodes", "2", "--hidden", "1024", "--tokens", "1,32", "--iters", "20", "--warmup", "2",
        "--paths", "envoy", "--sum", sums,
    )  # fmt: skip
    # 32 tokens: 64 KB of partial, past the size a node without the module sums on the host
    assert 32 * 1024 * 2 > EAGER_SUM_BYTES
    assert [(c["tokens"], c["sum"], c["envoy_p50_us"] > 0) for c in cases] == [
        (1, sums, True),
        (32, sums, True),
    ]


def test_bench_allreduce_refuses_zero_rounds_in_one_line():
    r = subprocess.run(
        [*CLI, "bench", "allreduce", "--rounds", "0"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2 and "--rounds" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_bench_allreduce_trace_stamps_every_hop_on_one_clock():
    """Each node stamps its own hops; the table joins both ranks' by step."""
    iters, warmup = 40, 5
    (case,) = _bench_allreduce(
        "--nodes", "2", "--hidden", "256", "--tokens", "1", "--paths", "envoy", "--trace",
        "--iters", str(iters), "--warmup", str(warmup),
    )  # fmt: skip
    t = case["trace"]
    assert 0 < t["p50_us"] <= t["p99_us"]
    hops = {h["hop"]: h for h in t["hops"]}
    assert list(hops) == [name for name, _ in trace.HOPS]
    for h in hops.values():
        # every step of both ranks stamped (the warm-up left out), and no hop negative: both
        # nodes' stamps are on one clock and each hop starts where its cause precedes its end
        assert h["samples"] == 2 * iters, h
        assert 0 <= h["p50_us"] <= h["p90_us"], h
    assert hops["total"]["p50_us"] >= hops["after the last frame out"]["p50_us"]


def test_the_trace_table_prints_one_line_per_hop(capsys):
    hops = trace.table({"total": [10.0, 12.0]})
    allreduce._print_trace(
        {"nodes": 2, "tokens": 1, "trace": {"p50_us": 11.0, "p99_us": 12.0, "hops": hops}}
    )
    lines = capsys.readouterr().out.splitlines()
    assert "traced envoy p50 11.0 us" in lines[0] and len(lines) == 1 + len(trace.HOPS)
    assert lines[-1].split()[:4] == ["total", "p50", "11.0", "p90"]
