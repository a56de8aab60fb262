"""`launch: local`: start node agents on this machine, restart them if they die, stop them all.

Each agent runs in its own process group (its envoy is its child) and is told to exit with its
parent, so nothing outlives the coordinator, even after a SIGKILL.

Agents are started with subprocess.Popen on a thread, never with the event loop's own
subprocess_exec: uvloop's fork() runs every pthread_atfork handler and Python's at-fork hooks in the
child, gRPC's among them (its prefork stops and awaits gRPC's threads; its postfork resets the
poller in the child, where it can abort or hang), and libuv then blocks the loop thread until the
child has exec'd. A child stuck there left the coordinator answering nothing, /health included.
CPython's Popen (vfork, no preexec_fn) runs neither, and only that thread waits for the exec. It
is one owned thread that lives as long as the launcher: an agent's parent-death signal is tied to
the thread that started it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from ...common.auth import SECRET_ENV
from ...common.worker import Worker
from .client import ClusterError

logger = logging.getLogger(__name__)

READY = re.compile(rb"moe-cluster node (\S+) ready on port (\d+)")


@dataclass
class LocalNode:
    name: str
    port: int
    log_path: Path
    memory: int | None = None
    gpu: int | None = (
        None  # CUDA_VISIBLE_DEVICES of the agent (one GPU per node on a multi-GPU host)
    )
    process: AgentProcess | None = None


class AgentProcess:
    """A started agent as the launcher uses it: pid, returncode (None while it runs), its stdout as
    an asyncio stream, and `wait()`. Its exit is awaited on a thread of its own, which ends with it."""

    def __init__(self, popen: subprocess.Popen, stdout: asyncio.StreamReader):
        self._popen = popen
        self.pid = popen.pid
        self.stdout = stdout
        loop = asyncio.get_running_loop()
        self._exited: asyncio.Future[int] = loop.create_future()

        def reap() -> None:
            code = popen.wait()
            try:
                loop.call_soon_threadsafe(self._set_exited, code)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass

        threading.Thread(target=reap, name=f"reap-{self.pid}", daemon=True).start()

    def _set_exited(self, code: int) -> None:
        if not self._exited.done():
            self._exited.set_result(code)

    @property
    def returncode(self) -> int | None:
        return self._popen.returncode

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)


class Launcher:
    def __init__(
        self,
        secret: str,
        log_dir: Path,
        cluster: str,
        start_timeout_s: float = 60.0,
        tls=None,
        cache_root: Path | None = None,
    ):
        self.secret = secret
        self.tls = tls  # proto.records.TlsFiles: the agents' and envoys' certificate
        self.log_dir = log_dir
        self.cluster = cluster
        self.start_timeout_s = start_timeout_s
        self.nodes: dict[str, LocalNode] = {}
        self._closing = False
        self.cache_root = (
            cache_root  # shipped shards: each local node its own cache folder under it
        )
        self._spawner = Worker("launcher")  # starts every agent (see the module's docstring)

    def _command(self, node: LocalNode) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "moe_cluster.coordinator.cli",
            "node",
            "--name",
            node.name,
            "--host",
            "127.0.0.1",
            "--port",
            str(node.port),
            "--cluster",
            self.cluster,
            "--no-mdns",
            "--exit-with-parent",
        ]
        if node.memory:
            cmd += ["--memory", str(node.memory)]
        if self.cache_root is not None:
            cmd += ["--cache-dir", str(self.cache_root / node.name)]
        if self.tls is not None:
            cmd += ["--tls-cert", self.tls.cert, "--tls-key", self.tls.key, "--tls-ca", self.tls.ca]
        return cmd

    async def start(self, node: LocalNode) -> None:
        """Start one agent and wait for its ready line."""
        await self.spawn(node)
        await self.ready(node)

    async def spawn(self, node: LocalNode) -> None:
        """Start one agent's process (`ready` waits for it to serve)."""
        self.nodes[node.name] = node
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, **{SECRET_ENV: self.secret, "PYTHONUNBUFFERED": "1"})
        if node.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(node.gpu)
        node.process = await self._spawn(self._command(node), env, node.log_path)

    async def ready(self, node: LocalNode) -> None:
        """Wait for `spawn`'s agent to print its ready line; ClusterError if it exits or is late."""
        try:
            line = await asyncio.wait_for(self._ready_line(node), self.start_timeout_s)
        except asyncio.TimeoutError:
            await self.stop_one(node)
            raise ClusterError(
                f"node {node.name} did not start within {self.start_timeout_s:.0f} s "
                f"(see {node.log_path})"
            ) from None
        if line is None:
            code = await node.process.wait()
            tail = (
                node.log_path.read_text(errors="replace").strip().splitlines()[-1:]
                if node.log_path.exists()
                else []
            )
            raise ClusterError(
                f"node {node.name} exited with code {code} before it was ready"
                + (f": {tail[0]}" if tail else f" (see {node.log_path})")
            )
        asyncio.create_task(self._drain(node), name=f"stdout-{node.name}")
        logger.info("started node %s (pid %d) on port %d", node.name, node.process.pid, node.port)

    async def _spawn(self, cmd: list[str], env: dict[str, str], log_path: Path) -> AgentProcess:
        """Start `cmd` in a new session, stdout piped, stderr appended to `log_path`, on the
        launcher's thread."""
        if self._closing:  # its thread is ending: a job handed to it now would never run
            raise ClusterError("the launcher is closing: no agent is started")

        def start() -> subprocess.Popen:
            with open(log_path, "ab") as log:
                return subprocess.Popen(
                    cmd, stdout=subprocess.PIPE, stderr=log, env=env, start_new_session=True
                )

        popen = await self._spawner.call(start)
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(loop=loop)
        try:
            await loop.connect_read_pipe(
                lambda: asyncio.StreamReaderProtocol(reader, loop=loop), popen.stdout
            )
        except BaseException:
            popen.kill()
            raise
        return AgentProcess(popen, reader)

    async def _ready_line(self, node: LocalNode) -> bytes | None:
        assert node.process and node.process.stdout
        while True:
            line = await node.process.stdout.readline()
            if not line:
                return None
            if READY.search(line):
                return line

    async def _drain(self, node: LocalNode) -> None:
        proc = node.process
        if proc is None or proc.stdout is None:
            return
        with open(node.log_path, "ab") as log:
            while True:
                line = await proc.stdout.readline()
                if not line:
                    return
                log.write(line)

    def pid(self, name: str) -> int | None:
        node = self.nodes.get(name)
        return (
            node.process.pid if node and node.process and node.process.returncode is None else None
        )

    def respawn(self, name: str) -> asyncio.Task | None:
        """Restart an agent that stopped answering, in the background (called by the heartbeat).

        One still running is stalled (SIGSTOP, a machine that froze) or hung: it cannot shut down
        cleanly, and a SIGTERM left pending on a stopped process waited out the 5 s grace before the
        restart, so its process group (agent and envoy) is SIGKILLed at once. Its peers
        and the coordinator have already given up on it; a SIGCONT that comes later finds it gone."""
        node = self.nodes.get(name)
        if node is None or self._closing:
            return None

        async def restart():
            if node.process is not None and node.process.returncode is None:
                logger.warning(
                    "node %s (pid %d) is not answering: killing its process group",
                    name,
                    node.process.pid,
                )
                await self.stop_one(node, signals=(signal.SIGKILL,))
            for attempt in range(5):
                if self._closing:
                    return
                try:
                    await self.start(node)
                    return
                except (ClusterError, OSError) as exc:
                    logger.warning("restart of node %s failed (%s); retrying", name, exc)
                    await asyncio.sleep(0.5 * (attempt + 1))

        return asyncio.create_task(restart(), name=f"respawn-{name}")

    async def stop_one(
        self,
        node: LocalNode,
        grace_s: float = 5.0,
        signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGKILL),
    ) -> None:
        """Signal the agent's process group with each of `signals` in turn until it exits (SIGTERM
        waits `grace_s` seconds, SIGKILL 5)."""
        proc = node.process
        if proc is None or proc.returncode is not None:
            return
        for sig in signals:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                await asyncio.wait_for(proc.wait(), grace_s if sig == signal.SIGTERM else 5.0)
                return
            except asyncio.TimeoutError:
                continue

    async def close(self) -> None:
        self._closing = True
        try:
            await asyncio.gather(
                *(self.stop_one(n) for n in self.nodes.values()), return_exceptions=True
            )
        finally:
            self._spawner.close()
