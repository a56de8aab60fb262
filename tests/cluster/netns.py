"""Several hosts on one machine: network namespaces joined by a bridge that lives in a namespace.

Everything is created by the test and removed afterwards; no traffic leaves these namespaces
(plus one veth from the test's own namespace into the bridge, so the test can reach the API).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from contextlib import contextmanager

# One /24 per test process: two runs at once on one machine (several worktrees, CI beside a developer)
# each put SUBNET.1 on a veth of the root namespace, and with one subnet for all the kernel routed one
# run's traffic into the other's bridge ("unreachable").
SUBNET = f"10.213.{20 + os.getpid() % 200}"


# what a machine needs for these hosts (tests/conftest.py `require` says it where they are missing)
INSTALL = "run the tests as root on Linux, with iproute2 (apt-get install iproute2)"


def available() -> str | None:
    """None if namespaces can be made here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "not root, which network namespaces need"
    if shutil.which("ip") is None:
        return "no iproute2 `ip` on PATH"
    probe = f"mcprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", "netns", "exec", ns, "ip", *args] if ns else ["ip", *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(ns: str) -> None:
    pids = subprocess.run(
        ["ip", "netns", "pids", ns], capture_output=True, text=True
    ).stdout.split()
    for pid in pids:
        subprocess.run(["kill", "-9", pid], capture_output=True)
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _sweep_stale() -> None:
    """Remove the hosts of a test run that was killed before its clean-up: its host-side veth holds
    SUBNET.1 and its route, which would send this run's traffic into a dead bridge."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split(
        "\n"
    )
    stale = set()
    for line in listed:
        m = re.match(r"(mc(\d+))(br|\d+)\b", line)
        if m and not _alive(int(m[2])):
            stale.add(m[1])
            _remove(m[0])
    for tag in stale:
        subprocess.run(["ip", "link", "del", f"{tag}h"], capture_output=True)


@contextmanager
def hosts(names: list[str]):
    """Namespaces {name: (namespace, ip)} on one bridge; this process gets SUBNET.1."""
    _sweep_stale()
    tag = f"mc{os.getpid() % 100000}"
    bridge = f"{tag}br"
    made, links = [], []
    out = {}
    try:
        _ip("netns", "add", bridge)
        made.append(bridge)
        _ip("link", "add", "br0", "type", "bridge", ns=bridge)
        _ip("link", "set", "br0", "up", ns=bridge)
        # the test's own end
        host_if = f"{tag}h"
        _ip("link", "add", host_if, "type", "veth", "peer", "name", "p0", "netns", bridge)
        links.append(host_if)
        _ip("addr", "add", f"{SUBNET}.1/24", "dev", host_if)
        _ip("link", "set", host_if, "up")
        _ip("link", "set", "p0", "master", "br0", ns=bridge)
        _ip("link", "set", "p0", "up", ns=bridge)
        for i, name in enumerate(names, start=1):
            ns = f"{tag}{i}"
            _ip("netns", "add", ns)
            made.append(ns)
            _ip(
                "link",
                "add",
                f"{tag}v{i}",
                "type",
                "veth",
                "peer",
                "name",
                f"p{i}",
                "netns",
                bridge,
            )
            _ip("link", "set", f"{tag}v{i}", "netns", ns)
            _ip("link", "set", f"{tag}v{i}", "name", "eth0", ns=ns)
            ip = f"{SUBNET}.{10 + i}"
            _ip("addr", "add", f"{ip}/24", "dev", "eth0", ns=ns)
            _ip("link", "set", "eth0", "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)
            _ip("link", "set", f"p{i}", "master", "br0", ns=bridge)
            _ip("link", "set", f"p{i}", "up", ns=bridge)
            out[name] = (ns, ip)
        yield out
    finally:
        for link in links:
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        for ns in reversed(made):
            _remove(ns)


def agent(ns: str, name: str, log, env: dict, port: int = 7700) -> subprocess.Popen:
    """`moe-cluster node NAME` in namespace `ns` on `port`, no mDNS, its output to `log`."""
    cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "moe_cluster.coordinator.cli", "node"]
    cmd += ["--name", name, "--host", "0.0.0.0", "--port", str(port), "--no-mdns"]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def wait_ready(logs: list, timeout: float = 90.0) -> None:
    """Until every agent's log (a path) says it is ready, at most `timeout` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while not all("ready on port" in open(p).read() for p in logs):
        if time.monotonic() > deadline:
            raise AssertionError("agents not ready:\n" + "".join(open(p).read() for p in logs))
        time.sleep(0.2)


def shape(ns: str, rate_bps: int, burst_bytes: int = 4096, dev: str = "eth0") -> None:
    """A token bucket (tc's tbf) on what `ns` sends through `dev`: `rate_bps` bits/s on average,
    bursts of `burst_bytes`. It limits the rate, not each packet (netem, which delays packets, is
    not in this kernel): a packet after a pause passes at once."""
    subprocess.run(
        ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf"]
        + ["rate", f"{rate_bps}bit", "burst", str(burst_bytes), "latency", "500ms"],
        check=True,
        capture_output=True,
        text=True,
    )


def stop(*procs: subprocess.Popen) -> None:
    """End processes a test started (node agents in namespaces): SIGTERM, then SIGKILL after 10 s."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)
