"""Coordinator and 3 nodes on separate hosts (network namespaces on a bridge), found by mDNS on
those interfaces only; tokens equal stock mlx-lm's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import netns
from cluster_fixture import cluster, http, stock_tokens

pytestmark = pytest.mark.needs(netns.available(), netns.INSTALL)

PROMPT = "Friends, Romans, countrymen, lend me your ears;"


def test_remote_nodes_found_by_mdns(tmp_path):
    from moe_cluster.node.demo import MODEL_DIR

    secret = "multihost-test-secret"
    env = dict(os.environ, MOE_CLUSTER_SECRET=secret, PYTHONUNBUFFERED="1")
    with netns.hosts(["coord", "n1", "n2", "n3"]) as h:
        agents = []
        try:
            for name in ("n1", "n2", "n3"):
                ns, ip = h[name]
                log = open(tmp_path / f"{name}.log", "w")
                agents.append(
                    subprocess.Popen(
                        [
                            "ip",
                            "netns",
                            "exec",
                            ns,
                            sys.executable,
                            "-m",
                            "moe_cluster.coordinator.cli",
                            "node",
                            "--name",
                            name,
                            "--host",
                            "0.0.0.0",
                            "--port",
                            "7700",
                            "--cluster",
                            "lab",
                            "--interface",
                            "eth0",
                        ],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env,
                    )
                )
            coord_ns, coord_ip = h["coord"]
            yaml_text = f"""name: lab
model: demo
launch: remote
nodes:
  - name: n1
  - name: n2
  - name: n3
discovery:
  interfaces: [eth0]
api:
  host: {coord_ip}
timeouts:
  discovery: 30s
  collective: 3s
"""
            with cluster(
                tmp_path, yaml_text, netns=coord_ns, env={"MOE_CLUSTER_SECRET": secret}
            ) as (url, _, lines):
                status = http(url, "/v1/cluster/status")[1]
                assert sorted(n["address"].split(":")[0] for n in status["nodes"]) == [
                    h[n][1] for n in ("n1", "n2", "n3")
                ]
                code, out = http(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 20})
                assert code == 200, out
            assert out["moe_cluster"]["tokens"] == stock_tokens(
                MODEL_DIR, PROMPT, 20
            )  # never empty

            # a node that is not on the network: one error listing the missing and the seen
            missing = tmp_path / "missing.yaml"
            missing.write_text(
                yaml_text.replace("  - name: n3\n", "  - name: n3\n  - name: n9\n").replace(
                    "discovery: 30s", "discovery: 3s"
                )
            )
            r = subprocess.run(
                [
                    "ip",
                    "netns",
                    "exec",
                    coord_ns,
                    sys.executable,
                    "-m",
                    "moe_cluster.coordinator.cli",
                    "up",
                    str(missing),
                    "--api-port",
                    "0",
                ],
                capture_output=True,
                text=True,
                timeout=60,
                env=dict(env, XDG_RUNTIME_DIR=str(tmp_path)),
            )
            assert r.returncode == 2, r.stderr
            err = [line for line in r.stderr.splitlines() if "error" in line]
            assert len(err) == 1 and "n9" in err[0] and "seen: n1, n2, n3" in err[0], r.stderr
        finally:
            netns.stop(*agents)
