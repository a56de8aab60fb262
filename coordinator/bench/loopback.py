"""A remote cluster on this machine, for the benchmarks of the coordinator's death: node agents on
loopback started on their own (as their services start them), a cluster.yaml that lists them
(`launch: remote`, static addresses, the secret in a file), and `up` (or `supervise`) run on it as a
process of its own, which a benchmark may kill.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ...common.ports import free_ports

READY = re.compile(r"moe-cluster ready: (http://\S+)")
SECRET = "loopback-bench-secret"


@dataclass
class Agent:
    name: str
    port: int
    envoy_port: int
    proc: subprocess.Popen

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@dataclass
class Loopback:
    workdir: Path
    agents: list[Agent]
    yaml: Path
    api_port: int
    env: dict = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def state(self) -> dict:
        """`up`'s state file (its URL and pid), {} while there is none."""
        try:
            return json.loads((self.workdir / "moe-cluster" / "up.json").read_text())
        except (OSError, ValueError):
            return {}


def cluster_yaml(
    agents: list[Agent], model: str, api_port: int, secret_file: Path, extra: str = ""
) -> str:
    nodes = "\n".join(
        f"  - name: {a.name}\n    address: {a.address}\n    envoy_port: {a.envoy_port}"
        for a in agents
    )
    return (
        f"name: loopback\nmodel: {model}\nlaunch: remote\nnodes:\n{nodes}\n"
        f"secret:\n  file: {secret_file}\napi:\n  port: {api_port}\n{extra}"
    )


@contextmanager
def loopback(workdir: Path, nodes: int, model: str, extra: str = "", start_s: float = 120.0):
    """`nodes` agents on loopback and a cluster.yaml for them in `workdir`; the agents end after."""
    workdir.mkdir(parents=True, exist_ok=True)
    secret = workdir / "secret"
    secret.write_text(SECRET + "\n")
    ports = free_ports(2 * nodes + 1)
    env = dict(os.environ, PYTHONUNBUFFERED="1", XDG_RUNTIME_DIR=str(workdir))
    env.pop("MOE_CLUSTER_SECRET", None)  # the file is the secret's only source
    agents = []
    try:
        for i in range(nodes):
            log = open(workdir / f"n{i}.log", "w")
            proc = subprocess.Popen(
                [sys.executable, "-m", "moe_cluster.coordinator.cli", "node", "--name", f"n{i}"]
                + ["--host", "127.0.0.1", "--port", str(ports[2 * i]), "--no-mdns"]
                + ["--secret-file", str(secret)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
            log.close()
            agents.append(Agent(f"n{i}", ports[2 * i], ports[2 * i + 1], proc))
        deadline = time.monotonic() + start_s
        while not all("ready on port" in (workdir / f"{a.name}.log").read_text() for a in agents):
            if time.monotonic() > deadline or any(a.proc.poll() is not None for a in agents):
                raise RuntimeError(
                    "node agents did not start: "
                    + "; ".join((workdir / f"{a.name}.log").read_text()[-300:] for a in agents)
                )
            time.sleep(0.1)
        yaml = workdir / "cluster.yaml"
        yaml.write_text(cluster_yaml(agents, model, ports[-1], secret, extra))
        yield Loopback(workdir, agents, yaml, ports[-1], env)
    finally:
        for a in agents:
            if a.proc.poll() is None:
                a.proc.terminate()
        for a in agents:
            try:
                a.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(a.proc.pid, signal.SIGKILL)
                a.proc.wait(timeout=10)


class Coordinator:
    """`moe-cluster up` (or `supervise`) on a Loopback, its output read on a thread: the time of
    its ready line, and each line."""

    def __init__(self, lb: Loopback, command: str = "up", log_name: str = "coordinator.log"):
        self.lb = lb
        self.lines: list[str] = []
        self.readies: list[float] = []  # time.monotonic() of each ready line
        self.ready = threading.Event()
        self.t_start = time.monotonic()
        self.log = open(lb.workdir / log_name, "a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moe_cluster.coordinator.cli", command, str(lb.yaml)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=lb.env,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            now = time.monotonic()
            self.lines.append(line.rstrip())
            self.log.write(f"{now - self.t_start:8.2f} {line}")
            self.log.flush()
            if READY.search(line):
                self.readies.append(now)
                self.ready.set()

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds from the start to the (first) ready line; RuntimeError past `timeout_s`."""
        if not self.ready.wait(timeout_s):
            raise RuntimeError(
                f"`up` not ready within {timeout_s:g} s (exit {self.proc.poll()}): "
                + " | ".join(self.lines[-8:])
            )
        return self.readies[0] - self.t_start

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM (`up` and `supervise` stop cleanly on it), then SIGKILL of its group."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self._reader.join(timeout=5)
        self.log.close()


def read_bytes(pid: int) -> int | None:
    """Bytes process `pid` read through read(2) and its kin since it started (/proc's rchar: a
    shard is read with readinto; sockets count too), None where /proc has no such figure."""
    try:
        for line in Path(f"/proc/{pid}/io").read_text().splitlines():
            if line.startswith("rchar:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None
