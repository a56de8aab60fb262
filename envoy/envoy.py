"""The envoy: joins its node's link to the mesh of peer envoys.

Direct (the default, `--direct`; envoy/exchange.py): the envoy authenticates each peer (the
cluster secret, TLS), keeps its gRPC stream and data channel up, redials it, and hands the data
channel's socket to its node, which writes and reads the frames itself; a peer over TLS or over
the stream alone is relayed to the node through a socket pair. The node learns over the link
when a peer is lost (LOST) and tells the envoy when it gave up a channel (BROKEN). One wake-up is
left on an all-reduce's critical path: a peer's frame arriving at the node.

Otherwise (the node's MOE_CLUSTER_ENVOY_DIRECT=0), the envoy reduces each step: the node's REDUCE
arrives on the link -> the partial (in shared memory) goes out to every peer as one serialized
frame -> peers' frames arrive -> once all are in, they are summed in rank order into the link's
result area -> the answer word (and DONE, if the node sleeps) wakes the node. All of it runs on
one event loop thread, in callbacks and the mesh's stream tasks; there is no other work queue.
Where cores are idle (envoy/spin.py) the loop keeps polling, without sleeping, for a bounded time
after its last work, so neither the node's REDUCE nor a peer's frame waits for this process to
wake up.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass, field

from ..proto import convert
from ..proto.errors import UserError
from ..proto.frame import Frame, FrameError
from . import data
from .link import (
    ABORT,
    BEGIN,
    BROKEN,
    CLOSE,
    NO_STEP,
    REDUCE,
    EnvoyLink,
    LinkError,
    unpack_peer,
    widened,
)
from ..proto.records import (
    COLD_STEP_S,
    COLLECTIVE_TIMEOUT_S,
    MESH_CONNECT_TIMEOUT_S,
    TlsFiles,
    wait_bound,
)
from .mesh import Mesh, MeshConfig
from .reduce import Reducer
from .spin import SpinPolicy
from .steps import Complete, StepError, StepTable
from .trace import EnvoyStamps

logger = logging.getLogger(__name__)

ENVOY_SPIN_MAX_S = 1e-3  # seconds the loop keeps polling after its last work, where cores are idle


@dataclass(frozen=True)
class EnvoyConfig:
    rank: int
    addresses: tuple[str, ...]  # every rank's envoy "host:port", indexed by rank
    listen: str  # bind address; "" = addresses[rank]
    secret: str = field(repr=False)
    timeout_s: float = (
        COLLECTIVE_TIMEOUT_S  # a step fails after this long without some peer's frame
    )
    connect_timeout_s: float = (
        MESH_CONNECT_TIMEOUT_S  # a begin fails after this long without a whole mesh
    )
    # a step its node marked cold (it may build kernels there or on a peer) fails after this long
    cold_timeout_s: float = COLD_STEP_S
    tls: TlsFiles | None = None
    link_fd: int | None = None  # the node's link; None: run the mesh alone (by hand)
    shm_name: str = ""
    max_bytes: int = 0
    parent_pid: int = 0  # exit when this process is gone (0: no watch)
    data_port: int = 0  # the data channel's port; 0: any free port
    trace: bool = False  # stamp every step for the node (envoy/trace.py)
    direct: bool = False  # hand the data channels to the node (envoy/exchange.py)

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
        if self.direct and (self.link_fd is None or self.trace):
            raise UserError("--direct needs a node's link (--link-fd) and no --trace")


class Envoy:
    def __init__(self, config: EnvoyConfig):
        self.config = config
        self.steps = StepTable(config.rank, len(config.addresses))
        self.mesh = Mesh(
            MeshConfig(
                config.rank,
                config.addresses,
                config.listen or config.addresses[config.rank],
                config.secret,
                config.tls,
                data_port=config.data_port,
                hand_off=config.direct,
            ),
            on_frame=self._on_frame,
            on_peer=self._on_peer,
            on_channel=self._on_channel if config.direct else None,
        )
        self.link: EnvoyLink | None = None
        # direct: a peer whose frames this envoy carries (over TLS, or on the stream), relayed to
        # the node through a socket pair, by rank
        self._relays: dict[int, data.DataConnection] = {}
        self._linked: asyncio.Event | None = None  # set once the node has READY: channels may go
        self._reduce = Reducer()
        self._stopped: asyncio.Event | None = None
        self._stop_reason = ""
        self._begin_deadline: float | None = None  # a begin waiting for the mesh to be whole
        self._was_whole = (
            False  # the mesh has been whole once: a peer missing now is lost, not starting
        )
        self._aborted: str | None = None  # the last request the node aborted
        self._limit = config.timeout_s  # seconds the pending step may wait (its REDUCE chose)
        self._spin = SpinPolicy(ENVOY_SPIN_MAX_S)
        self._hot_until = 0.0  # time.monotonic() until which the loop polls without sleeping
        self._polling = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._trace: EnvoyStamps | None = None  # chosen once: every stamp is skipped on this None

    # -- lifecycle ---------------------------------------------------------------------------

    async def run(self) -> str:
        """Serve until the node closes the link, the parent dies, or SIGTERM; returns why it stopped."""
        loop = self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        self._linked = asyncio.Event()
        cfg = self.config
        port = await self.mesh.start()
        try:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.stop, f"signal {sig.name}")
            if cfg.link_fd is not None:
                self.link = EnvoyLink(cfg.link_fd, cfg.shm_name, cfg.max_bytes)
                if cfg.trace:
                    self._trace = EnvoyStamps(self.link.trace_words(), len(cfg.addresses))
                loop.add_reader(self.link.fileno(), self._on_link)
                self.link.set_whole(self.mesh.whole)
                self.link.ready(port, cfg.direct)
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
        for rank in list(self._relays):
            self._relays.pop(rank).close()
        if self.link is not None:
            try:
                asyncio.get_running_loop().remove_reader(self.link.fileno())
            except (ValueError, OSError):
                pass
            self.link.close()
            self.link = None
        await self.mesh.close()

    async def _watchdog(self) -> None:
        """Fails steps and begins past their deadline; stops the envoy if its node is gone."""
        cfg = self.config
        period = min(max(cfg.timeout_s / 20, 0.01), 0.1)  # seconds
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            p = self.steps.pending
            if p is not None and now - p.started > self._limit:
                names = ", ".join(self.mesh.describe(r) for r in p.missing())
                self._fail(
                    p.step,
                    f"no frame from {names} for step {p.step} (layer {p.layer}) of request "
                    f"{p.request_id} within {self._limit:g} s: stalled or unreachable",
                )
            if self._begin_deadline is not None and now > self._begin_deadline:
                self._begin_deadline = None
                wait = (
                    min(cfg.timeout_s, cfg.connect_timeout_s)
                    if self._was_whole
                    else cfg.connect_timeout_s
                )
                self._fail_begin(f"mesh not whole within {wait:g} s: {self._absent()}")
            if cfg.parent_pid and os.getppid() != cfg.parent_pid:
                self.stop(f"node process {cfg.parent_pid} is gone")

    # -- polling where cores are idle ------------------------------------------------------

    def _keep_hot(self) -> None:
        """Keep the loop polling (no sleep in epoll) for a while: the next REDUCE or frame is near."""
        budget = self._spin.budget_s()
        if not budget or not self.mesh.whole:
            return
        self._hot_until = time.monotonic() + budget
        if not self._polling:
            self._polling = True
            self._loop.call_soon(self._poll)

    def _poll(self) -> None:
        # a ready callback makes the loop's next epoll_wait return at once instead of sleeping
        if time.monotonic() < self._hot_until and self.mesh.whole and not self._stopped.is_set():
            self._loop.call_soon(self._poll)
        else:
            self._polling = False

    # -- link (node) side --------------------------------------------------------------------

    def _on_link(self) -> None:
        assert self.link is not None
        if self._trace is not None:
            self._trace.link = time.perf_counter_ns()
        messages = self.link.read()
        if messages is None:
            self.stop("node closed the link")
            return
        for kind, body in messages:
            if kind == REDUCE:
                self._on_reduce(body)
            elif kind == BEGIN:
                self._on_begin(body[1:].decode())
            elif kind == ABORT:
                self._on_abort(body[1:].decode())
            elif kind == BROKEN:
                rank, why = unpack_peer(body)
                self.mesh.drop(
                    rank, f"its node dropped the data channel: {why.decode(errors='replace')}"
                )
            elif kind == CLOSE:
                self.stop("node asked to close")
            else:
                logger.error("envoy rank %s: unknown link message kind %r", self.config.rank, kind)

    def _on_abort(self, request_id: str) -> None:
        """The node gives up on a request that failed elsewhere (a peer lost): whatever of it waits
        for peers fails now rather than at the collective timeout, and so does the rest of it."""
        self._aborted = request_id
        if self.steps.current != request_id:
            return  # its begin has not come yet: it fails on arrival
        message = f"request {request_id} aborted: it failed on another node"
        p = self.steps.pending
        if self._begin_deadline is not None:
            self._begin_deadline = None
            self._fail_begin(message)
        elif p is not None:
            self._fail(p.step, message)
        else:
            self.steps.fail(f"envoy rank {self.config.rank}: {message}")

    def _on_begin(self, request_id: str) -> None:
        self.steps.begin(request_id)
        if request_id == self._aborted:
            self._fail_begin(f"request {request_id} aborted: it failed on another node")
            return
        if self.mesh.whole:
            self._was_whole = True
            self._begin_deadline = None
            self.link.begun()
        else:
            # A mesh that was whole lost a peer (it died, or its envoy did): waiting connect_timeout_s
            # (30 s) for it held every request that long; a lost peer gets the step timeout.
            wait = (
                min(self.config.timeout_s, self.config.connect_timeout_s)
                if self._was_whole
                else self.config.connect_timeout_s
            )
            self._begin_deadline = time.monotonic() + wait

    def _on_reduce(self, body: bytes) -> None:
        cfg = self.config
        link = self.link
        try:
            r = link.reduce_of(body)
            payload = link.partial(r)
            self.steps.admit(r.step)
            self._limit = wait_bound(cfg.timeout_s, r.cold, cfg.cold_timeout_s)
        except (StepError, LinkError) as exc:
            link.fail(_step_of(body), f"envoy rank {cfg.rank}: {exc}")
            return
        # out first (the peers wait on it), then the bookkeeping
        frame = Frame(
            self.steps.current, r.step, r.layer, cfg.rank, r.dtype, r.shape, None, payload
        )
        if self._trace is not None:
            self._trace.sent = time.perf_counter_ns()
        self.mesh.send_all(frame)
        try:
            done = self.steps.submit(r.step, r.layer, r.dtype, r.shape, payload)
        except (
            StepError,
            FrameError,
        ) as exc:  # an early frame that disagrees with this node's step
            self._fail(r.step, str(exc))
            return
        self._keep_hot()
        if done is not None:
            self._finish(done)
            return
        if self.mesh.whole:
            return
        gone = [rank for rank in self.steps.pending.missing() if rank not in self.mesh.connected]
        if gone:
            self._fail(
                r.step,
                f"{self._absent(gone)} (step {r.step}, layer {r.layer} of request {self.steps.current})",
            )

    def _finish(self, done: Complete) -> None:
        complete = time.perf_counter_ns() if self._trace is not None else 0
        if widened(done.dtype, done.nbytes, self.link.max_bytes):  # the node rounds it (link.py)
            self._reduce.sum_float32(
                done.parts, done.dtype, self.link.result_area("float32", 2 * done.nbytes)
            )
        else:
            self._reduce(done.parts, done.dtype, self.link.result_area(done.dtype, done.nbytes))
        if self._trace is not None:
            self._trace.publish(self.steps.current, done.step, complete, time.perf_counter_ns())
        self.link.done(done.step)
        self._keep_hot()

    def _fail(self, step: int, message: str) -> None:
        message = f"envoy rank {self.config.rank}: {message}"
        logger.warning("%s", message)
        self.steps.fail(message)
        if self.link is not None:
            self.link.fail(step, message)

    def _fail_begin(self, message: str) -> None:
        message = f"envoy rank {self.config.rank}: {message}"
        logger.warning("%s", message)
        self.steps.fail(message)
        if self.link is not None:
            self.link.fail(NO_STEP, message)

    def _absent(self, ranks: list[int] | None = None) -> str:
        """'rank 1 (addr) is not connected (reason), ...' for the given or all absent peers."""
        if ranks is None:
            ranks = [
                r
                for r in range(len(self.config.addresses))
                if r != self.config.rank and r not in self.mesh.connected
            ]
        parts = []
        for r in ranks:
            why = self.mesh.last_error.get(r, "never connected")
            parts.append(f"{self.mesh.describe(r)} is not connected ({why})")
        return "; ".join(parts)

    # -- mesh (peer) side --------------------------------------------------------------------

    async def _on_channel(self, rank: int, channel: data.DataConnection | None) -> None:
        """Direct: hand `rank`'s channel to the node, or a socket pair this envoy relays it over
        (a TLS channel, or frames on the stream), before the peer counts as up."""
        await self._linked.wait()
        link = self.link
        self._unrelay(rank)
        if link is None:
            return
        if channel is not None and channel.hand_off:
            sock, extra = channel.detach()
            try:
                link.channel(rank, sock, extra)
            finally:
                sock.close()  # the node has its copy; the connection stays up
            return
        mine, theirs = socket.socketpair()
        try:
            _, relay = await self._loop.connect_accepted_socket(
                lambda: data.DataConnection(opened=True), sock=mine
            )
            relay.attach(lambda frame: self._from_node(rank, frame))
            self._relays[rank] = relay
            link.channel(rank, theirs, b"")
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()

    def _from_node(self, rank: int, frame: Frame) -> None:
        """A frame the node wrote to the relay of `rank`: on to that peer."""
        if frame.rank != self.config.rank:
            logger.error(
                "envoy rank %s: its node sent a frame as rank %s", self.config.rank, frame.rank
            )
            return
        self.mesh.send_to(rank, frame)

    def _unrelay(self, rank: int) -> None:
        relay = self._relays.pop(rank, None)
        if relay is not None:
            relay.close()

    def _on_frame(self, frame: Frame) -> None:
        if self.config.direct:  # a relayed peer's frame: on to the node
            relay = self._relays.get(frame.rank)
            try:
                frame.verify()
            except FrameError as exc:
                logger.error("envoy rank %s: %s", self.config.rank, exc)
                self.mesh.drop(frame.rank, str(exc))
                return
            if relay is not None:
                relay.send(data.encode(frame))
            return
        if self._trace is not None:
            self._trace.arrived(frame.request_id, frame.step, frame.rank)
        try:
            done = self.steps.receive(frame)
        except (StepError, FrameError) as exc:
            p = self.steps.pending
            logger.error("envoy rank %s: %s", self.config.rank, exc)
            if p is not None:
                self._fail(p.step, str(exc))
            elif self.steps.current is not None:
                self.steps.fail(f"envoy rank {self.config.rank}: {exc}")
            return
        if done is not None:
            self._finish(done)
        else:
            self._keep_hot()

    def _on_peer(self, rank: int, up: bool, reason: str) -> None:
        if self.link is not None:
            self.link.set_whole(self.mesh.whole)
            if not up and self.config.direct:
                self._unrelay(rank)
                self.link.lost(rank, reason)
        if up:
            if self.mesh.whole:
                self._was_whole = True
            if self._begin_deadline is not None and self.mesh.whole and self.link is not None:
                self._begin_deadline = None
                self.link.begun()
            return
        p = self.steps.pending
        if p is not None and p.parts[rank] is None:
            self._fail(
                p.step,
                f"{self.mesh.describe(rank)} disconnected ({reason}) during step {p.step} "
                f"(layer {p.layer}) of request {p.request_id}",
            )


def _step_of(body: bytes) -> int:
    try:
        return EnvoyLink.parse_reduce(body).step
    except Exception:  # noqa: BLE001 - a message too broken to name its step
        return NO_STEP
