"""Test harness: N stand-in node processes, each with a real envoy child, driven from the test.

A driver process owns one `EnvoyProcess` (the node end of the link plus the envoy child) and runs
requests on command. Every partial encodes (request, step, rank), so each result is checked
against the exact expected sum: a lost, duplicated or reordered frame shows up as a wrong value.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import signal
import time
import zlib
from dataclasses import dataclass

import numpy as np

HIDDEN = 512  # values per decode vector in these tests
CHUNK = 16  # tokens of the occasional prefill chunk


def step_layout(step: int) -> tuple[int, str, tuple[int, ...]]:  # (layer, dtype, shape)
    """(layer, dtype, shape) of a step: mostly decode vectors, some prefill chunks, and the
    per-token agreement (layer -1, float32) as the runtime does it."""
    if step % 10 == 9:
        return -1, "float32", (2,)
    if step % 50 == 24:
        return step % 40, "bfloat16", (CHUNK, HIDDEN)
    return step % 40, "bfloat16", (1, 1, HIDDEN)


def _offset(request_id: str, step: int) -> int:
    return (zlib.crc32(request_id.encode()) + step * 31) % 61


@functools.lru_cache(maxsize=4096)
def partial(offset: int, rank: int, layout: tuple) -> np.ndarray:
    """Rank `rank`'s payload: small whole numbers, exact in bfloat16 and in any sum of a few."""
    _, dtype, shape = layout
    vals = ((offset + rank * 7 + np.arange(int(np.prod(shape)))) % 61).astype(np.float32)
    return _raw(vals, dtype)


@functools.lru_cache(maxsize=4096)
def expected(offset: int, world_size: int, layout: tuple) -> np.ndarray:
    _, dtype, shape = layout
    n = int(np.prod(shape))
    total = sum(
        ((offset + r * 7 + np.arange(n)) % 61).astype(np.float32) for r in range(world_size)
    )
    return _raw(total.astype(np.float32), dtype)


def _raw(vals: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float32":
        return vals
    return (vals.view(np.uint32) >> 16).astype(np.uint16)  # exact: small integers


def run_request(envoy, request_id: str, steps: int) -> dict:
    """begin + `steps` all-reduces, every result checked; returns counts and timing."""
    from moe_cluster.node.collective.exchange import Outgoing

    t0 = time.perf_counter()
    envoy.begin(request_id)
    for step in range(steps):
        layout = step_layout(step)
        layer, dtype, shape = layout
        offset = _offset(request_id, step)
        out = envoy.all_reduce(Outgoing(partial(offset, envoy.rank, layout), dtype, shape, layer))
        want = expected(offset, envoy.world_size, layout)
        if not np.array_equal(out, want):
            bad = int(np.flatnonzero(out != want)[0])
            raise AssertionError(
                f"rank {envoy.rank}: request {request_id} step {step}: wrong sum at {bad} "
                f"({out[bad]} != {want[bad]})"
            )
    return {
        "steps": steps,
        "seconds": time.perf_counter() - t0,
        "frames_in": envoy.exchange.frames_in,  # peers' frames the node read, lifetime
    }


def driver(spec, rank: int, conn) -> None:
    """Process entry: one node stand-in. Commands: ("run", request_id, steps) and ("close",)."""
    from moe_cluster.node.collective.envoy import EnvoyProcess

    try:
        envoy = EnvoyProcess(spec, rank)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        conn.send(("error", f"{type(exc).__name__}: {exc}", 0.0))
        return
    conn.send(("ready", envoy.proc.pid))
    try:
        while True:
            cmd = conn.recv()
            if cmd[0] == "close":
                break
            _, request_id, steps = cmd
            try:
                conn.send(("ok", run_request(envoy, request_id, steps)))
            except Exception as exc:  # noqa: BLE001 - reported to the test, with when it happened
                conn.send(("error", f"{type(exc).__name__}: {exc}", time.monotonic()))
    finally:
        envoy.close()


@dataclass
class Node:
    rank: int
    process: mp.Process
    conn: object
    envoy_pid: int = 0

    def send(self, *cmd) -> None:
        self.conn.send(cmd)

    def reply(self, timeout: float = 60.0):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"node {self.rank} did not answer within {timeout} s")
        return self.conn.recv()


class Cluster:
    """N driver processes on loopback; `close()` stops them all and makes sure no envoy survives."""

    def __init__(self, spec, ranks=None):
        self.spec = spec
        self.ctx = mp.get_context("spawn")
        self.nodes: dict[int, Node] = {}
        self.envoy_pids: set[int] = set()
        for rank in ranks if ranks is not None else range(spec.world_size):
            self.start(rank, wait=False)
        for rank in list(self.nodes):
            self.wait_ready(rank)

    def start(self, rank: int, spec=None, wait: bool = True) -> Node:
        parent, child = self.ctx.Pipe()
        p = self.ctx.Process(
            target=driver, args=(spec or self.spec, rank, child), name=f"node-{rank}", daemon=True
        )
        p.start()
        child.close()
        self.nodes[rank] = Node(rank, p, parent)
        if wait:
            self.wait_ready(rank)
        return self.nodes[rank]

    def wait_ready(self, rank: int) -> None:
        node = self.nodes[rank]
        kind, *rest = node.reply(60)
        if kind != "ready":
            raise RuntimeError(f"node {rank} did not start: {rest}")
        node.envoy_pid = rest[0]
        self.envoy_pids.add(node.envoy_pid)

    def run(
        self, request_id: str, steps: int, ranks=None, timeout: float = 120.0
    ) -> dict[int, tuple]:
        ranks = list(self.nodes) if ranks is None else ranks
        for r in ranks:
            self.nodes[r].send("run", request_id, steps)
        return {r: self.nodes[r].reply(timeout) for r in ranks}

    def kill(self, rank: int, sig: int = signal.SIGKILL, envoy_too: bool = False) -> None:
        node = self.nodes.pop(rank)
        if envoy_too:
            _signal(node.envoy_pid, sig)
        _signal(node.process.pid, sig)
        node.process.join(10)

    def close(self) -> None:
        for node in self.nodes.values():
            try:
                node.send("close")
            except (BrokenPipeError, OSError):
                pass
        for node in self.nodes.values():
            node.process.join(15)
            if node.process.is_alive():
                node.process.kill()
                node.process.join(5)
        self.nodes.clear()
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in self.envoy_pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        leftover = [pid for pid in self.envoy_pids if alive(pid)]
        for pid in leftover:
            _signal(pid, signal.SIGKILL)
        assert not leftover, f"envoy processes outlived their nodes: {leftover}"


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie, dead but not reaped by its parent, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (macOS)
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False


def envoy_spec(n: int, **kw):
    """An EnvoySpec for `n` envoys on free loopback ports, with a fresh secret."""
    import secrets

    from moe_cluster.node.collective.specs import EnvoySpec
    from moe_cluster.common.ports import free_ports

    kw.setdefault("secret", secrets.token_hex(16))
    return EnvoySpec(tuple(f"127.0.0.1:{p}" for p in free_ports(n)), **kw)


def all_ok(replies: dict) -> None:
    bad = {r: rep for r, rep in replies.items() if rep[0] != "ok"}
    assert not bad, f"nodes failed: {bad}"
