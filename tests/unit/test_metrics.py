"""Serving metrics computed from what the nodes report."""

from __future__ import annotations

import pytest

from moe_cluster.coordinator.serve.metrics import allreduce_histogram, prompt_tps
from moe_cluster.proto.records import AllreduceHistogram, GenerateDone, Timings


def test_prompt_throughput_counts_only_the_tokens_that_were_prefilled():
    miss = GenerateDone(
        "length",
        prompt_tokens=120,
        cached_tokens=0,
        generated_tokens=8,
        timings=Timings(prompt_s=2.0),
    )
    hit = GenerateDone(
        "length",
        prompt_tokens=120,
        cached_tokens=100,
        generated_tokens=8,
        timings=Timings(prompt_s=0.5),
    )
    assert prompt_tps(miss) == pytest.approx(60.0)
    assert prompt_tps(hit) == pytest.approx(40.0)  # 20 tokens in 0.5 s, not 120
    assert prompt_tps(GenerateDone("stop", 5, 0, 0)) == 0.0 and prompt_tps(None) == 0.0


def test_a_nodes_allreduce_histogram_becomes_prometheus_lines():
    h = allreduce_histogram(AllreduceHistogram((1e-3, 1e-2), (3, 1, 2), sum_s=0.5))
    assert h.lines("ar", 'node="n1"') == [
        'ar_bucket{node="n1",le="0.001"} 3',
        'ar_bucket{node="n1",le="0.01"} 4',
        'ar_bucket{node="n1",le="+Inf"} 6',
        'ar_sum{node="n1"} 0.5',
        'ar_count{node="n1"} 6',
    ]
    assert allreduce_histogram(None) is None  # no model loaded
    with pytest.raises(ValueError, match="2 bounds needs 3 counts"):
        AllreduceHistogram((1e-3, 1e-2), (3, 1))


def test_the_median_all_reduce_is_the_bound_of_its_bucket():
    def h(counts):
        return allreduce_histogram(AllreduceHistogram((1e-3, 1e-2), counts))

    assert h((3, 1, 2)).quantile(0.5) == 1e-3  # 3 of 6 within 1 ms
    assert h((2, 1, 3)).quantile(0.5) == 1e-2
    assert h((0, 0, 5)).quantile(0.5) == 1e-2  # past every bound: at least the last one
    assert h((0, 0, 0)).quantile(0.5) is None


def test_the_status_table_has_a_row_per_node_with_its_all_reduce():
    from moe_cluster.coordinator.serve.remote import status_table

    node = {
        "state": "ready",
        "address": "10.0.0.2:7700",
        "used_bytes": 2 << 30,
        "budget_bytes": 8 << 30,
        "experts": 64,
        "pid": None,
    }
    s = {
        "state": "ready",
        "reason": "",
        "model": "m",
        "transport": "envoy",
        "uptime_s": 12,
        "running": 1,
        "waiting": 2,
        "nodes": [
            {**node, "name": "a", "allreduce_p50_s": 0.0025},
            {**node, "name": "b", "allreduce_p50_s": None},
        ],
    }
    s["nodes"][0] |= {"streams": 3, "kv_bytes": 96 << 20}  # attention by stream: its own
    s["attention"] = "by-stream"
    lines = status_table(s).splitlines()
    assert "running 1, waiting 2, attention by-stream" in lines[0] and "all-reduce p50" in lines[1]
    assert "streams" in lines[1] and " 3 100.66 MB " in lines[2], lines
    assert lines[2].split()[0] == "a" and "<= 2.5 ms" in lines[2] and "64" in lines[2]
    assert lines[3].split()[0] == "b" and lines[3].split()[-2] == "-"
    assert "route" in lines[1] and lines[2].split()[-5] == "-"  # a node that has not said its route
    s["nodes"][0]["route"] = "host"
    assert status_table(s).splitlines()[2].split()[-5] == "host"


def test_the_decode_route_per_node_and_its_measured_times():
    from moe_cluster.coordinator.serve.metrics import route_lines

    lines = route_lines(
        [
            {"name": "a", "route": "host", "route_us": {"device": 250.0, "host": 120.5}},
            {"name": "b", "route": "device", "route_us": {}},
            {"name": "c"},
        ]
    )
    assert 'moe_cluster_node_route{node="a",route="host"} 1' in lines
    assert 'moe_cluster_node_route{node="b",route="device"} 1' in lines
    assert 'moe_cluster_node_route_seconds{node="a",route="device"} 0.00025' in lines
    assert 'moe_cluster_node_route_seconds{node="a",route="host"} 0.0001205' in lines
    assert not any(
        'node="c"' in line or ('node="b"' in line and "seconds" in line) for line in lines
    )
    assert route_lines([{"name": "a", "route": "", "route_us": {}}]) == []


def test_expert_cache_counters_per_node_and_layer():
    from moe_cluster.coordinator.serve.metrics import expert_cache_lines
    from moe_cluster.proto.records import ExpertCacheLayer

    cache = vars(
        ExpertCacheLayer(3, 4, 8, hits=30, misses=6, bytes_read=6 << 20, read_seconds=0.25)
    )
    lines = expert_cache_lines(
        [{"name": "a", "expert_cache": [cache]}, {"name": "b", "expert_cache": []}]
    )
    assert 'moe_cluster_expert_cache_hits_total{node="a",layer="3"} 30' in lines
    assert 'moe_cluster_expert_cache_misses_total{node="a",layer="3"} 6' in lines
    assert f'moe_cluster_expert_cache_bytes_read_total{{node="a",layer="3"}} {6 << 20}' in lines
    assert 'moe_cluster_expert_cache_read_seconds_total{node="a",layer="3"} 0.25' in lines
    assert 'moe_cluster_expert_cache_capacity{node="a",layer="3"} 4' in lines
    assert not any('node="b"' in line for line in lines)
    assert expert_cache_lines([{"name": "a", "expert_cache": []}]) == []  # no cache, no series
