"""The envoy: its node's sidecar on the network.

It dials and authenticates the node's peers (the cluster secret on a gRPC stream per pair, a
one-time token on each data channel, TLS where configured), hands the node each peer's data
channel before the peer counts as connected (proto/envoy_link.py `CHANNEL`), keeps the streams up,
redials, and says when a peer is lost (`LOST`). The node writes and reads the frames on the
channels itself (node/collective/exchange.py). A plain TCP channel goes to the node as its socket;
a TLS one stays here (its TLS state does) and is relayed to the node through a socket pair, byte
for byte (envoy/data.py). The node asks over the link to begin a request (answered once every peer
is connected), to give up one (ABORT), or to redial a peer whose channel it dropped (BROKEN).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from dataclasses import dataclass, field

from ..proto import envoy_link as messages
from ..proto.errors import UserError
from ..proto.records import COLLECTIVE_TIMEOUT_S, MESH_CONNECT_TIMEOUT_S, TlsFiles
from .data import DataConnection
from .link import EnvoyLink
from .mesh import Mesh, MeshConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EnvoyConfig:
    rank: int
    addresses: tuple[str, ...]  # every rank's envoy "host:port", indexed by rank
    listen: str  # bind address; "" = addresses[rank]
    secret: str = field(repr=False)
    # a begin waits this long for a peer that was connected and is gone (seconds)
    timeout_s: float = COLLECTIVE_TIMEOUT_S
    connect_timeout_s: float = MESH_CONNECT_TIMEOUT_S  # ... and for a whole mesh the first time
    tls: TlsFiles | None = None
    link_fd: int | None = None  # the node's link; None: run the mesh alone (by hand)
    parent_pid: int = 0  # exit when this process is gone (0: no watch)
    data_port: int = 0  # the data channel's port; 0: any free port

    def __post_init__(self) -> None:
        if not 0 <= self.rank < len(self.addresses):
            raise UserError(
                f"rank {self.rank} is outside the {len(self.addresses)} addresses given"
            )
        if not 0 <= self.data_port <= 65535:
            raise UserError(
                f"--data-port {self.data_port} is not a port (1..65535, or 0: any free port)"
            )
        if not self.secret:
            raise UserError("the cluster secret is empty")


class Envoy:
    def __init__(self, config: EnvoyConfig):
        self.config = config
        self.mesh = Mesh(
            MeshConfig(
                config.rank,
                config.addresses,
                config.listen or config.addresses[config.rank],
                config.secret,
                config.tls,
                data_port=config.data_port,
            ),
            on_peer=self._on_peer,
            on_channel=self._on_channel,
        )
        self.link: EnvoyLink | None = None
        self._linked: asyncio.Event | None = None  # set once the node has READY: channels may go
        self._stopped: asyncio.Event | None = None
        self._stop_reason = ""
        self._begin: str | None = None  # the request whose begin waits for the mesh to be whole
        self._begin_deadline = 0.0  # time.monotonic() when it fails
        self._was_whole = False  # the mesh has been whole once: a peer missing now is lost
        self._aborted: str | None = None  # the last request the node aborted

    # -- lifecycle ---------------------------------------------------------------------------

    async def run(self) -> str:
        """Serve until the node closes the link, the parent dies, or SIGTERM; returns why it
        stopped."""
        loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        self._linked = asyncio.Event()
        cfg = self.config
        port = await self.mesh.start()
        try:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.stop, f"signal {sig.name}")
            if cfg.link_fd is not None:
                self.link = EnvoyLink(cfg.link_fd)
                loop.add_reader(self.link.fileno(), self._on_link)
                self.link.ready(port)
            self._linked.set()
            watchdog = loop.create_task(self._watchdog(), name="watchdog")
            try:
                await self._stopped.wait()
            finally:
                watchdog.cancel()
                await asyncio.gather(watchdog, return_exceptions=True)
        finally:
            await self.close()
        return self._stop_reason

    def stop(self, reason: str) -> None:
        if self._stopped is not None and not self._stopped.is_set():
            logger.info("envoy rank %s stopping: %s", self.config.rank, reason)
            self._stop_reason = reason
            self._stopped.set()

    async def close(self) -> None:
        if self.link is not None:
            try:
                asyncio.get_running_loop().remove_reader(self.link.fileno())
            except (ValueError, OSError):
                pass
            self.link.close()
            self.link = None
        await self.mesh.close()

    async def _watchdog(self) -> None:
        """Fails a begin past its deadline; stops the envoy if its node is gone."""
        cfg = self.config
        period = min(max(cfg.timeout_s / 20, 0.01), 0.1)  # seconds
        while True:
            await asyncio.sleep(period)
            if self._begin is not None and time.monotonic() > self._begin_deadline:
                self._fail_begin(
                    f"mesh not whole within {self._begin_wait():g} s: {self._absent()}"
                )
            if cfg.parent_pid and os.getppid() != cfg.parent_pid:
                self.stop(f"node process {cfg.parent_pid} is gone")

    # -- link (node) side --------------------------------------------------------------------

    def _on_link(self) -> None:
        got = self.link.read()
        if got is None:
            self.stop("node closed the link")
            return
        for kind, body in got:
            if kind == messages.BEGIN:
                self._on_begin(messages.unpack_text(body))
            elif kind == messages.ABORT:
                self._on_abort(messages.unpack_text(body))
            elif kind == messages.BROKEN:
                rank, why = messages.unpack_peer(body)
                self.mesh.drop(
                    rank, f"its node dropped the data channel: {why.decode(errors='replace')}"
                )
            elif kind == messages.CLOSE:
                self.stop("node asked to close")
            else:
                logger.error("envoy rank %s: unknown link message kind %r", self.config.rank, kind)

    def _on_begin(self, request_id: str) -> None:
        if request_id == self._aborted:
            self._fail(f"request {request_id} aborted: it failed on another node")
        elif self.mesh.whole:
            self._was_whole = True
            self.link.begun()
        else:
            self._begin = request_id
            self._begin_deadline = time.monotonic() + self._begin_wait()

    def _begin_wait(self) -> float:
        """Seconds a begin waits for the mesh: a peer that was connected and is gone (it died, or
        its envoy did) gets the step timeout, not connect_timeout_s, which held every request that
        long."""
        cfg = self.config
        return (
            min(cfg.timeout_s, cfg.connect_timeout_s) if self._was_whole else cfg.connect_timeout_s
        )

    def _on_abort(self, request_id: str) -> None:
        """The node gives up on a request that failed elsewhere (a peer lost): its begin, if it
        waits for the mesh, fails now rather than at its deadline, and so does a later one."""
        self._aborted = request_id
        if self._begin == request_id:
            self._fail_begin(f"request {request_id} aborted: it failed on another node")

    def _fail_begin(self, message: str) -> None:
        self._begin = None
        self._fail(message)

    def _fail(self, message: str) -> None:
        message = f"envoy rank {self.config.rank}: {message}"
        logger.warning("%s", message)
        if self.link is not None:
            self.link.fail(message)

    def _absent(self) -> str:
        """'rank 1 (addr) is not connected (reason); ...' for every absent peer."""
        parts = []
        for r in range(len(self.config.addresses)):
            if r != self.config.rank and r not in self.mesh.connected:
                why = self.mesh.last_error.get(r, "never connected")
                parts.append(f"{self.mesh.describe(r)} is not connected ({why})")
        return "; ".join(parts)

    # -- mesh (peer) side --------------------------------------------------------------------

    async def _on_channel(self, rank: int, channel: DataConnection) -> None:
        """Hand `rank`'s channel to the node, or a socket pair relayed to it (TLS), before the
        peer counts as up."""
        await self._linked.wait()
        link = self.link
        if link is None:  # by hand: nobody to hand it to; the mesh stands alone
            return
        # the relay ends with the channel, when the mesh closes it
        sock, extra = channel.detach() if channel.plain else (await channel.relay(), b"")
        try:
            link.channel(rank, sock, extra)
        finally:
            sock.close()  # the node has its copy; the connection stays up

    def _on_peer(self, rank: int, up: bool, reason: str) -> None:
        if up:
            if self.mesh.whole:
                self._was_whole = True
                if self._begin is not None and self.link is not None:
                    self._begin = None
                    self.link.begun()
            return
        if self.link is not None:
            self.link.lost(rank, reason)
