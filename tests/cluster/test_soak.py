"""`moe-cluster bench soak` as a user runs it, shortened: a 2-node cluster serving requests while a
node is killed every 6 s (the full soak, 10 minutes with a kill a minute, is in docs/bench/)."""

from __future__ import annotations

import json

import pytest

from conftest import cli


@pytest.mark.slow  # ~25 s on 2 vCPUs
def test_a_short_soak_fails_nothing_and_ends_ready():
    """Every request completes: those a kill cut resume, those sent during a recovery wait for it."""
    r = cli(
        "bench",
        "soak",
        "--minutes",
        "0.25",
        "--kill-every",
        "6",
        "--request-timeout",
        "20",
        "--json",
        timeout=120,
    )
    assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    out = json.loads(r.stdout)
    assert out["requests"]["failed"] == 0 and out["requests"]["hung"] == 0, out
    assert out["requests"]["ok"] >= 2 and out["latency_s"]["max"] < 20, out
    assert len(out["kills"]) >= 1 and out["undetected"] == 0 and out["unrecovered"] == 0, out[
        "kills"
    ]
    assert out["detect_s_max"] <= 2.0, out["kills"]
    assert out["final"] == {
        "ready": True,
        "request": "ok",
        "state": "ready",
        "nodes": {"bench-0": "ready", "bench-1": "ready"},
    }, out["final"]
