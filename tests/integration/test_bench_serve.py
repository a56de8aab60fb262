"""`moe-cluster bench serve` end to end: a local cluster and mlx_lm.server on the demo model, real
HTTP clients at once, one JSON report."""

from __future__ import annotations

import json
import subprocess
import sys

REPORT = (
    "concurrency",
    "aggregate_tps",
    "ttft_p50_s",
    "ttft_p99_s",
    "itl_p50_s",
    "itl_p99_s",
    "failed",
)


def bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moe_cluster.coordinator.cli", "bench", "serve", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_bench_serve_measures_our_cluster_and_mlx_lm_server_alike():
    r = bench(
        "--model",
        "demo",
        "--nodes",
        "1",
        "--concurrency",
        "1,2",
        "--requests",
        "1",
        "--max-tokens",
        "8",
        "--speculative",
        "prompt-lookup",
        "--json",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert [(row["nodes"], row["concurrency"]) for row in out["rows"]] == [(1, 1), (1, 2)]
    assert [row["concurrency"] for row in out["mlx_lm_server"]] == [1, 2]
    for row in out["rows"] + out["mlx_lm_server"]:
        assert all(k in row for k in REPORT), row
        assert row["failed"] == 0, row["errors"]
        assert row["aggregate_tps"] > 0 and 0 < row["ttft_p50_s"] <= row["ttft_p99_s"]
        assert row["requests"] == row["concurrency"]
    assert all(row["vs_mlx_lm_server"] > 0 for row in out["rows"])
    # our cluster speculated (prompt lookup): its /metrics counted the drafts of these requests
    assert out["speculative"] == "prompt-lookup"
    for row in out["rows"]:  # a row's few tokens may hold no n-gram to look up: drafts counted
        assert 0 <= row["accepted"] <= row["drafted"], row
        assert 0 < row["allreduces_per_token"] < 8, row
    assert sum(row["drafted"] for row in out["rows"]) > 0, out["rows"]


def test_bad_counts_are_one_line():
    for args, why in (
        (("--concurrency", "0"), "--concurrency"),
        (("--nodes", "two"), "--nodes"),
        (("--overlap", "sometimes"), "--overlap"),
        (("--speculative", "prompt-lookup", "--draft-tokens", "40"), "--draft-tokens"),
        (("--model", "/nonexistent/model"), "nonexistent"),
    ):
        r = bench(*args, timeout=60)
        assert r.returncode == 2 and why in r.stderr and len(r.stderr.strip().splitlines()) == 1, (
            r.stderr
        )
