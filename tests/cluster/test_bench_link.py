"""`moe-cluster bench link` between two hosts (network namespaces on a bridge), each sending
through a tbf-shaped link: the round trip and bandwidth it measures track the rate the hosts
were given, the calibration it writes is what `plan` plans with."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import netns

REASON = netns.available()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

RATE = 16_000_000  # bits/s each node may send
HIDDEN, ACT_BYTES = 128, 4  # the demo model's: float32 activations
SECRET = "bench-link-test-secret"


ENV = dict(os.environ, MOE_CLUSTER_SECRET=SECRET, PYTHONUNBUFFERED="1")


def _cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "moe_cluster.coordinator.cli", *args]
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=240)


def test_bench_link_measures_the_shaped_link_and_plan_reads_it(tmp_path):
    from moe_cluster.node.demo import MODEL_DIR

    with netns.hosts(["n1", "n2"]) as h:
        agents = []
        try:
            for name in ("n1", "n2"):
                ns, _ = h[name]
                netns.shape(ns, RATE)
                log = open(tmp_path / f"{name}.log", "w")
                agents.append(netns.agent(ns, name, log, ENV))
            cfg = tmp_path / "cluster.yaml"
            cfg.write_text(
                "name: lab\nmodel: demo\nlaunch: remote\nnodes:\n"
                + "".join(f"  - name: {n}\n    address: {h[n][1]}:7700\n" for n in ("n1", "n2"))
            )
            cal = tmp_path / "link.json"
            netns.wait_ready([tmp_path / f"{n}.log" for n in ("n1", "n2")])
            r = _cli(
                "bench",
                "link",
                str(cfg),
                "--iters",
                "30",
                "--transfer",
                "1000000",
                "--out",
                str(cal),
                "--json",
            )
            logs = "".join((tmp_path / f"{n}.log").read_text() for n in ("n1", "n2"))
            assert r.returncode == 0, r.stderr + logs
        finally:
            netns.stop(*agents)
    out = json.loads(r.stdout)
    link = out["link"]
    rate = RATE / 8  # bytes/s
    # each direction's bulk transfer: the rate given, less TCP/IP's headers (~5%)
    for t in link["transfers"]:
        assert 0.75 * rate < t["bytes"] / t["seconds"] < 1.1 * rate, t
    # a 32-token round trip waits for the bucket: about its bytes over the rate; 1 token does not
    big, small = 32 * HIDDEN * ACT_BYTES, HIDDEN * ACT_BYTES
    trips = {(x["src"], x["payload_bytes"]): x["p50_s"] for x in link["round_trips"]}
    for src in ("n1", "n2"):
        assert 0.4 * big / rate < trips[(src, big)] < 3 * big / rate, trips
        assert trips[(src, small)] < 0.5 * trips[(src, big)], trips
    reduces = {(a["transport"], a["tokens"]): a["p50_s"] for a in link["allreduce"]}
    assert set(reduces) == {(t, n) for t in ("envoy", "mlx") for n in (1, 32)}
    assert reduces[("envoy", 32)] > 0.4 * big / rate  # it crossed the shaped link
    assert "on this link an all-reduce costs" in out["advice_text"]

    # plan plans with the measured link: a 1-token all-reduce costs what was measured
    plan = _cli(
        "plan", "--model", str(MODEL_DIR), "--calibration", str(cal), "--nodes", "2", "--json"
    )
    assert plan.returncode == 0, plan.stderr
    got = json.loads(plan.stdout)
    net = got["networks"][0]
    assert net["name"] == "measured"
    row = got["rows"][0]
    moe_layers = got["model"]["moe_layers"]
    assert row["latency_s"] + row["transfer_s"] == pytest.approx(
        moe_layers * reduces[("envoy", 1)], rel=0.25
    )
