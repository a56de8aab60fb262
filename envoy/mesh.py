"""Persistent links from one envoy to every peer: a gRPC Exchange stream and a data channel per pair.

The lower rank of each pair dials the higher one and keeps redialing while the envoy runs. Each
side sends a Hello first; the higher rank's offers its data channel (envoy/data.py) and a token
for it, and the dialer connects there presenting the token. A peer counts as connected once both
are up and its channel is in its node's hands, and is lost when either ends. The stream carries
nothing more: the frames take the channel, written and read by the nodes. A dialer that cannot
reach its peer's channel (a firewall that admits only the envoy's port) fails with one line naming
the address and port to open, and redials. Stream reads use explicit `read()` (an async-generator
handler costs about 3x the latency).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import ssl
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import grpc

from ..proto import CHANNEL_OPTIONS
from ..proto import convert
from ..proto.errors import UserError
from ..proto.records import TlsFiles
from . import data
from ..common.auth import (
    SecretInterceptor,
    call_metadata,
    channel_credentials,
    server_credentials,
    ssl_client_context,
    ssl_server_context,
)
from ..proto.frame import HANDSHAKE_TIMEOUT_S, PROTOCOL, Hello, handshake

logger = logging.getLogger(__name__)

_HELLO_TIMEOUT_S = 5.0  # seconds the other end has to answer Hello (a data connection too)


@dataclass(frozen=True)
class MeshConfig:
    rank: int
    addresses: tuple[str, ...]  # every rank's envoy, indexed by rank
    listen: str  # this envoy's bind address (port 0: any free port)
    secret: str = field(repr=False)
    tls: TlsFiles | None = None
    data_port: int = 0  # the data channel's port on the listen host; 0: any free port

    @property
    def world_size(self) -> int:
        return len(self.addresses)


def _host(address: str) -> str:
    """The host of "host:port" or "[v6]:port"."""
    return address.rsplit(":", 1)[0].strip("[]")


def _data_socket(host: str, port: int = 0) -> socket.socket:
    """One listening socket on `port` (0: a free port) of `host` (both IP versions for "::" where
    the system can), so the one port a Hello names is the one that listens."""
    if host in ("", "::") and socket.has_dualstack_ipv6():
        return socket.create_server(("::", port), family=socket.AF_INET6, dualstack_ipv6=True)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host or "0.0.0.0", port), family=family)


@dataclass
class Peer:
    """One live link to one peer: its stream's task, and its data channel."""

    rank: int
    channel: data.DataConnection
    task: asyncio.Task | None  # the task serving this stream


class Mesh:
    """The streams to all peers, and the servers that accept the lower ranks' streams and data
    connections.

    `on_channel(rank, channel)` runs once a peer's stream and data channel are both up, before
    the peer counts as connected: the envoy hands the channel to its node there. `on_peer(rank,
    up, reason)` runs whenever a peer comes up or goes down.
    """

    def __init__(
        self,
        config: MeshConfig,
        on_peer: Callable[[int, bool, str], None],
        on_channel: Callable[[int, data.DataConnection], Awaitable[None]],
    ):
        self.config = config
        self._on_peer = on_peer
        self._on_channel = on_channel
        self._peers: dict[int, Peer] = {}
        self.last_error: dict[int, str] = {}  # rank -> why its stream is down (for error messages)
        self._refused: dict[int, str] = {}  # rank -> its refusal of our dial, until we reach it
        self._server: grpc.aio.Server | None = None
        self._dialers: list[asyncio.Task] = []
        self._closing = False
        self.port = 0
        self.data_port = 0  # 0: no data channel (rank 0: only lower ranks dial)
        self._data_server: asyncio.AbstractServer | None = None
        self._client_ssl = None  # the dialers' TLS context for data channels
        # lower rank -> (the token its data connection must present, the future it resolves)
        self._arriving: dict[int, tuple[str, asyncio.Future]] = {}

    # -- state -------------------------------------------------------------------------------

    @property
    def connected(self) -> set[int]:
        return set(self._peers)

    @property
    def whole(self) -> bool:
        return len(self._peers) == self.config.world_size - 1

    def describe(self, rank: int) -> str:
        return f"rank {rank} ({self.config.addresses[rank]})"

    def drop(self, rank: int, why: str) -> None:
        """End `rank`'s stream (its node gave up the channel); a dialer redials, as after any loss."""
        peer = self._peers.get(rank)
        if peer is not None and not peer.channel.lost.done():
            peer.channel.lost.set_result(why)

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> int:
        """Bind and start the servers, start dialing the higher ranks; returns the bound port."""
        cfg = self.config
        server = grpc.aio.server(
            options=CHANNEL_OPTIONS, interceptors=[SecretInterceptor(cfg.secret)]
        )
        handlers = {
            "Exchange": grpc.stream_stream_rpc_method_handler(
                self._exchange,
                request_deserializer=convert.hello_from_wire,
                response_serializer=convert.hello_to_wire,
            ),
            "Health": grpc.unary_unary_rpc_method_handler(
                self._health,
                request_deserializer=convert.envoy_health_request_from_wire,
                response_serializer=convert.envoy_health_to_wire,
            ),
        }
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(convert.ENVOY_SERVICE, handlers),)
        )
        try:
            if cfg.tls is not None:
                self.port = server.add_secure_port(
                    cfg.listen, server_credentials(cfg.tls.cert, cfg.tls.key, cfg.tls.ca)
                )
            else:
                self.port = server.add_insecure_port(cfg.listen)
        except RuntimeError as exc:
            raise UserError(f"envoy rank {cfg.rank} cannot listen on {cfg.listen}: {exc}") from exc
        loop = asyncio.get_running_loop()
        tls = cfg.tls
        # the dialers' TLS context, once: a certificate that cannot be read fails the start
        self._client_ssl = ssl_client_context(tls.ca, tls.cert, tls.key) if tls else None
        if cfg.rank > 0:  # only lower ranks dial, so rank 0 is never dialed
            # open before the gRPC server takes Hellos, so every Hello can offer it
            host = _host(cfg.listen)
            try:
                sock = _data_socket(host, cfg.data_port)
                self._data_server = await loop.create_server(
                    lambda: data.DataConnection(claim=self._claim),
                    sock=sock,
                    ssl=ssl_server_context(tls.cert, tls.key, tls.ca) if tls else None,
                    ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S if tls else None,
                )
            except OSError as exc:
                where = f"{host}:{cfg.data_port or 'any port'}"
                raise UserError(
                    f"envoy rank {cfg.rank} cannot open its data channel on {where}: "
                    f"{exc.strerror or exc}"
                ) from exc
            self.data_port = sock.getsockname()[1]
        await server.start()
        self._server = server
        self._dialers = [
            loop.create_task(self._dial(r), name=f"dial-{r}")
            for r in range(cfg.rank + 1, cfg.world_size)
        ]
        logger.info(
            "envoy rank %s listening on %s (port %s, data channel %s), dialing ranks %s",
            cfg.rank,
            cfg.listen,
            self.port,
            self.data_port or "none",
            list(range(cfg.rank + 1, cfg.world_size)),
        )
        return self.port

    async def close(self, grace_s: float = 0.5) -> None:
        """End every stream (dialed or accepted) here, then stop the server: no handler is left for
        grpc to cancel from outside."""
        self._closing = True
        streams = {*self._dialers, *(p.task for p in self._peers.values() if p.task is not None)}
        for t in streams:
            t.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        if self._data_server is not None:
            self._data_server.close()
        if self._server is not None:
            await self._server.stop(grace_s)

    # -- streams -----------------------------------------------------------------------------

    async def _serve_stream(
        self, rank: int, read: Callable[[], Awaitable], channel: data.DataConnection
    ) -> str:
        """Run one established stream and its data channel until either ends; returns why."""
        peer = Peer(rank, channel, asyncio.current_task())
        old = self._peers.get(rank)
        if old is not None:  # the peer restarted before its old stream was seen to die
            logger.warning(
                "envoy rank %s: a new stream from %s replaces the old one",
                self.config.rank,
                self.describe(rank),
            )
            if old.task is not None:
                old.task.cancel()
        reason = "stream ended"
        try:
            try:  # before the peer counts: a begin may follow at once
                await self._on_channel(rank, channel)
            except OSError as exc:  # out of descriptors, say: this stream ends, a dialer redials
                reason = self.last_error[rank] = f"its channel could not go to the node ({exc})"
                return reason
            self._peers[rank] = peer
            self.last_error.pop(rank, None)
            self._refused.pop(rank, None)
            self._on_peer(rank, True, "connected")
            item = await _first(read, channel.lost)
            if isinstance(item, str):  # the data channel ended: why
                reason = item
            elif item is grpc.aio.EOF:
                reason = "closed its stream"
            else:
                reason = "sent a second Hello"
        except grpc.aio.AioRpcError as exc:
            reason = f"stream failed: {exc.code().name}: {exc.details()}"
        except asyncio.CancelledError:
            reason = "envoy closing"
            raise
        finally:
            channel.close()
            if self._peers.get(rank) is peer:
                del self._peers[rank]
                self.last_error[rank] = reason
                self._on_peer(rank, False, reason)
        return reason

    async def _exchange(self, request_iterator, context: grpc.aio.ServicerContext):
        """Server side of a stream a lower rank opened."""
        cfg = self.config
        try:
            hello = await asyncio.wait_for(context.read(), _HELLO_TIMEOUT_S)
        except asyncio.TimeoutError:
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"no Hello within {_HELLO_TIMEOUT_S} s"
            )
        problem = _check_hello(hello, cfg, lower=True)
        if problem:
            logger.warning(
                "envoy rank %s refused a stream from %s: %s", cfg.rank, context.peer(), problem
            )
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
        # ready for the data connection before the Hello goes: the dialer connects as soon as it
        # reads it
        token = secrets.token_hex(16)
        arriving = asyncio.get_running_loop().create_future()
        self._arriving[hello.rank] = (token, arriving)
        await context.write(
            Hello(cfg.rank, cfg.world_size, data_port=self.data_port, data_token=token)
        )
        channel = None
        try:
            channel = await asyncio.wait_for(asyncio.shield(arriving), _HELLO_TIMEOUT_S)
        except asyncio.TimeoutError:
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"no data connection from rank {hello.rank} within {_HELLO_TIMEOUT_S} s",
            )
        finally:
            if self._arriving.get(hello.rank, (None, None))[1] is arriving:
                del self._arriving[hello.rank]
            if channel is None and arriving.done() and not arriving.cancelled():
                arriving.result().close()  # claimed, but this stream ended before taking it
        logger.info("envoy rank %s: stream from %s up", cfg.rank, self.describe(hello.rank))
        try:
            reason = await self._serve_stream(hello.rank, context.read, channel)
        except asyncio.CancelledError:  # close(), a newer stream from that peer, or grpc ending it
            # the handler returns and the RPC ends; a CancelledError raised out of a handler is
            # logged by grpc as "Exception not handled" with a traceback
            reason = "cancelled"
        logger.info(
            "envoy rank %s: stream from %s down: %s", cfg.rank, self.describe(hello.rank), reason
        )

    def _claim(self, rank: int, token: str, channel: data.DataConnection) -> str:
        """A data connection presents `token` as `rank`: "" takes it for that rank's stream, else
        why not."""
        expected, arriving = self._arriving.get(rank, ("", None))
        if arriving is None or arriving.done() or not data.token_ok(token, expected):
            logger.warning(
                "envoy rank %s refused a data connection as rank %s: wrong or stale token",
                self.config.rank,
                rank,
            )
            return (
                "wrong or stale data token (a data connection follows its own authenticated "
                "stream's Hello)"
            )
        arriving.set_result(channel)  # done: one connection per token
        return ""

    async def _health(self, request, context: grpc.aio.ServicerContext) -> dict:
        return {
            "rank": self.config.rank,
            "world_size": self.config.world_size,
            "connected": self.connected,
            "whole": self.whole,
        }

    def _channel(self, address: str) -> grpc.aio.Channel:
        tls = self.config.tls
        if tls is None:
            return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        return grpc.aio.secure_channel(
            address, channel_credentials(tls.ca, tls.cert, tls.key), options=CHANNEL_OPTIONS
        )

    async def _dial(self, rank: int) -> None:
        """Keep a stream to a higher rank up while the envoy runs (redial with backoff)."""
        cfg = self.config
        address = cfg.addresses[rank]
        backoff = 0.05  # seconds
        while not self._closing:
            channel = self._channel(address)
            started = time.monotonic()
            try:
                call = channel.stream_stream(
                    convert.ENVOY_EXCHANGE,
                    request_serializer=convert.hello_to_wire,
                    response_deserializer=convert.hello_from_wire,
                )(metadata=call_metadata(cfg.secret), wait_for_ready=False)
                await call.write(Hello(cfg.rank, cfg.world_size))
                hello = await asyncio.wait_for(call.read(), _HELLO_TIMEOUT_S)
                problem = _check_hello(hello, cfg, lower=False, expect=rank)
                if problem:
                    call.cancel()
                    raise ConnectionError(problem)
                try:
                    link = await self._open_channel(rank, hello)
                except ConnectionError:
                    call.cancel()
                    raise
                logger.info("envoy rank %s: stream to %s up", cfg.rank, self.describe(rank))
                reason = await self._serve_stream(rank, call.read, link)
                logger.info(
                    "envoy rank %s: stream to %s down: %s", cfg.rank, self.describe(rank), reason
                )
                call.cancel()
            except grpc.aio.AioRpcError as exc:
                refused = exc.code() in (
                    grpc.StatusCode.UNAUTHENTICATED,
                    grpc.StatusCode.FAILED_PRECONDITION,
                )
                self._note_failure(
                    rank, f"{exc.code().name}: {exc.details()}", loud=refused, refused=refused
                )
            except (asyncio.TimeoutError, ConnectionError) as exc:
                self._note_failure(rank, str(exc) or "no Hello in time", loud=True)
            finally:
                await channel.close()
            if time.monotonic() - started > 1.0:
                backoff = 0.05
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 1.0)

    async def _open_channel(self, rank: int, hello: Hello) -> data.DataConnection:
        """Connect to `rank`'s data channel and present the token its Hello gave; ConnectionError
        naming the address and port where it cannot be reached."""
        host = _host(self.config.addresses[rank])
        loop = asyncio.get_running_loop()
        tls = self._client_ssl
        try:
            _, channel = await asyncio.wait_for(
                loop.create_connection(
                    lambda: data.DataConnection(
                        hello=handshake(self.config.rank, hello.data_token)
                    ),
                    host,
                    hello.data_port,
                    ssl=tls,
                    server_hostname=host if tls else None,
                ),
                _HELLO_TIMEOUT_S,
            )
        except ssl.SSLError as exc:
            raise ConnectionError(
                f"TLS with its data channel at {host}:{hello.data_port} failed ({exc})"
            ) from None
        except (OSError, asyncio.TimeoutError) as exc:  # refused, or dropped on the way
            raise ConnectionError(
                f"cannot reach its data channel at {host}:{hello.data_port} "
                f"({exc or 'no answer in time'}): open TCP port {hello.data_port} on {host} "
                "to this host (envoy_data_port in cluster.yaml fixes the port)"
            ) from None
        try:
            return await asyncio.wait_for(channel.ready, _HELLO_TIMEOUT_S)
        except BaseException as exc:
            channel.close()
            if channel.ready.done() and not channel.ready.cancelled():
                channel.ready.exception()  # retrieved: the reason is in the error below
            if isinstance(exc, (OSError, asyncio.TimeoutError)):  # its refusal, or silence
                raise ConnectionError(
                    f"its data channel at {host}:{hello.data_port} did not take the connection "
                    f"({exc or 'no answer to the handshake in time'})"
                ) from None
            raise

    def _note_failure(self, rank: int, reason: str, loud: bool, refused: bool = False) -> None:
        """Keep why `rank` cannot be reached. A peer's refusal (a wrong secret, a bad Hello) stays
        in it until the peer is reached: gRPC may report the same refusal, raced with the dialer's
        first write, as "INTERNAL: Internal error from Core", and a later attempt that fails
        otherwise is named beside it."""
        if refused:
            self._refused[rank] = reason
        elif rank in self._refused:
            reason = f"{self._refused[rank]}; the latest attempt: {reason}"
        if self.last_error.get(rank) != reason:
            log = logger.warning if loud else logger.info
            log("envoy rank %s: cannot reach %s: %s", self.config.rank, self.describe(rank), reason)
        self.last_error[rank] = reason


async def _first(read: Callable[[], Awaitable], lost: asyncio.Future):
    """The stream's next item, or why the data channel ended if that comes first."""
    if lost.done():
        return lost.result()
    reading = asyncio.ensure_future(read())
    try:
        await asyncio.wait((reading, lost), return_when=asyncio.FIRST_COMPLETED)
        if reading.done():
            return reading.result()
        return lost.result()
    finally:
        if not reading.done():
            reading.cancel()


def _check_hello(hello, cfg: MeshConfig, *, lower: bool, expect: int | None = None) -> str:
    """Why a Hello is unacceptable, or "" if it is fine."""
    if hello is grpc.aio.EOF or not isinstance(hello, Hello):
        return "the stream ended before its Hello"
    if hello.protocol != PROTOCOL:
        return f"protocol {hello.protocol!r}, expected {PROTOCOL!r}"
    if hello.world_size != cfg.world_size:
        return f"rank {hello.rank} has world size {hello.world_size}, this envoy {cfg.world_size}"
    if expect is not None and hello.rank != expect:
        return f"{cfg.addresses[expect]} answered as rank {hello.rank}, expected rank {expect}"
    if lower and not hello.rank < cfg.rank:
        return f"rank {hello.rank} dialed rank {cfg.rank}; only lower ranks dial higher ones"
    if not lower and not hello.data_port:
        return f"rank {hello.rank} offered no data channel"
    return ""
