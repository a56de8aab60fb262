"""Faults through real processes: a node killed, its envoy killed, a node stopped (SIGSTOP, a
stalled peer) then continued, and a node's network link taken down then up; each while idle,
during a prefill and while eight streams decode (see faults.py). Every request completes with the
tokens it gets without the fault: the ones in flight resume, the ones that arrive meanwhile wait.
The three faults of a local node share one cluster (module fixture `local`): each starts from a
cluster found ready and serving and leaves it so; the link test runs its own remote cluster.

Each phase prints its detect / client answer / recovery times (seconds after the fault) and the
streams' stalls; docs/reliability.md's table comes from these lines
(`pytest -s tests/cluster/test_faults.py`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import netns
from cluster_fixture import cluster, http, stock_tokens, yaml_for
from faults import FAST_YAML, SENTENCE, RECOVERY_TOKENS, Phases, greedy_tokens, recovered


def _envoy_of(agent_pid: int) -> int:
    children = []
    for task in Path(f"/proc/{agent_pid}/task").iterdir():
        children += (task / "children").read_text().split()
    envoys = [
        int(p) for p in children if b"moe_cluster.envoy" in Path(f"/proc/{p}/cmdline").read_bytes()
    ]
    assert len(envoys) == 1, f"envoy children of {agent_pid}: {envoys}"
    return envoys[0]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def _victim(url: str) -> dict:
    return http(url, "/v1/cluster/status")[1]["nodes"][1]


@pytest.mark.needs(netns.available(), netns.INSTALL)
def test_a_node_whose_link_goes_down_and_up_rejoins(tmp_path):
    """Two remote nodes, each in its own network namespace; node n2's link goes down, then up once
    the cluster saw it: the coordinator waits for it (it cannot restart a remote node), the requests
    wait too, and the cluster is rebuilt when it answers again."""
    secret = "faults-link-secret"
    env = dict(os.environ, MOE_CLUSTER_SECRET=secret, PYTHONUNBUFFERED="1")
    with netns.hosts(["n1", "n2"]) as h:
        agents = []
        try:
            for name in ("n1", "n2"):
                ns, _ = h[name]
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
                            "--no-mdns",
                        ],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env,
                    )
                )
            for name in ("n1", "n2"):  # as a user would: the agents run before `up` looks for them
                deadline = time.monotonic() + 60
                while (
                    "ready on port" not in (tmp_path / f"{name}.log").read_text()
                    and time.monotonic() < deadline
                ):
                    time.sleep(0.1)
            nodes = "".join(f"  - name: {n}\n    address: {h[n][1]}:7700\n" for n in ("n1", "n2"))
            yaml_text = (
                f"name: lab\nmodel: demo\nlaunch: remote\nnodes:\n{nodes}"
                f"timeouts:\n  collective: 3s\n  heartbeat: 0.5s\n  discovery: 30s\n{FAST_YAML}"
            )
            ns2 = h["n2"][0]

            def link(state: str):
                subprocess.run(
                    ["ip", "netns", "exec", ns2, "ip", "link", "set", "eth0", state], check=True
                )

            with cluster(tmp_path, yaml_text, env={"MOE_CLUSTER_SECRET": secret}) as (
                url,
                _,
                lines,
            ):
                Phases(
                    url,
                    "n2's link down (up once detected)",
                    "n2",
                    "link down",
                    lambda: link("down"),
                    lambda: link("up"),
                    recover_from="restore",
                    log=lines,
                ).run()
        finally:
            netns.stop(*agents)


# The local faults, after the link test: the shared cluster runs from here to the module's end.
@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """One cluster of two local nodes for the local faults (a start and a stop cost ~5 s each on
    2 vCPUs); yields (url, the coordinator's output lines so far)."""
    from moe_cluster.node.demo import MODEL_DIR

    with cluster(tmp_path_factory.mktemp("faults"), yaml_for(2, extra=FAST_YAML)) as (
        url,
        proc,
        lines,
    ):
        want = greedy_tokens(url)
        assert want == stock_tokens(MODEL_DIR, SENTENCE, RECOVERY_TOKENS)
        yield url, lines, want


@pytest.fixture
def ready(local):
    """The shared cluster, checked ready and serving stock's tokens before a fault (as a fresh one
    would be); yields (url, the coordinator's output lines)."""
    url, lines, want = local
    recovered(url, want)
    return url, lines


def test_a_killed_node_is_restarted_idle_in_prefill_and_in_decode(ready):
    url, lines = ready
    killed = []

    def inject():
        killed.append(_victim(url)["pid"])
        os.kill(killed[-1], signal.SIGKILL)

    Phases(url, "node-1 SIGKILLed", "node-1", "node killed", inject, log=lines).run()
    pids = [n["pid"] for n in http(url, "/v1/cluster/status")[1]["nodes"]]
    assert len(set(killed)) == 3 and not set(killed) & set(pids), (killed, pids)


def test_a_killed_envoy_is_a_lost_node_then_the_cluster_rebuilds_itself(ready):
    url, lines = ready
    before = len(lines)  # the cause must be logged for this fault, not an earlier one
    agent = _victim(url)["pid"]
    Phases(
        url,
        "node-1's envoy SIGKILLed",
        "node-1",
        "envoy killed",
        lambda: os.kill(_envoy_of(agent), signal.SIGKILL),
        log=lines,
    ).run()
    assert _victim(url)["pid"] == agent, "an envoy's death needs no new node process"
    assert any("node-1" in line and "envoy" in line for line in lines[before:]), (
        "the coordinator logs the cause"
    )


def test_a_stalled_node_is_restarted_and_its_late_continue_changes_nothing(ready):
    """SIGSTOP of a local node's process group (agent and envoy): it stops answering, so the
    coordinator kills and restarts it at once, without waiting for a SIGCONT that may never come;
    the SIGCONT sent once the cluster is ready again finds it gone and disturbs nothing."""
    url, lines = ready
    stopped = []

    def inject():
        stopped.append(_victim(url)["pid"])
        os.killpg(stopped[-1], signal.SIGSTOP)

    def restore():
        for pid in stopped[-1:]:
            try:
                os.killpg(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    Phases(
        url,
        "node-1 SIGSTOPped (SIGCONT once ready again)",
        "node-1",
        "node stopped",
        inject,
        restore,
        restore_after="ready",
        log=lines,
    ).run()
    assert not any(_alive(p) for p in stopped), f"stopped nodes left behind: {stopped}"


@pytest.mark.slow
def test_a_node_killed_while_eight_streams_decode_on_three_nodes(tmp_path):
    """The 8-stream phase on a 3-node cluster: the restarted node rejoins the two survivors, and
    every stream resumes with the tokens it gets without the fault."""
    with cluster(tmp_path, yaml_for(3, extra=FAST_YAML)) as (url, proc, lines):
        victim = _victim(url)
        Phases(
            url,
            "node-1 of 3 SIGKILLed",
            victim["name"],
            "node killed",
            lambda: os.kill(victim["pid"], signal.SIGKILL),
            log=lines,
        ).decode()
