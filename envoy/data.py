"""One data connection between two envoys, up to its handshake; then the node's.

The gRPC `Exchange` stream (envoy/mesh.py) authenticates the peer (the cluster secret, TLS) and
says it is there; the frames take one plain TCP connection per pair beside it (proto/frame.py's
handshake and frames). Measured on 16 idle cores (`moe-cluster bench allreduce`), grpc.aio streams
alone cost 9–10x a blocking socket's exchange, more than the rest of the path together.

A connection here only gets through the handshake: the dialer presents the token the higher
rank's Hello gave it, the listener checks it (`claim`). Then the node takes it: a plain TCP
connection stops being read and its socket goes to the node as it is (`detach`); a TLS one
cannot leave this process (the TLS state lives here), so the envoy relays it to the node through
one end of a socket pair, byte for byte (`relay`): the frames are the nodes' business, read and
checked by them, and the relay parses none.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import socket
from typing import Callable

from ..proto.frame import ACK_NO, ACK_OK, HANDSHAKE, HANDSHAKE_TIMEOUT_S, MAGIC


class DataConnection(asyncio.Protocol):
    """One end of a data connection. The dialer passes `hello` (its handshake); the listener passes
    `claim(rank, token, connection) -> str` ("" accepts; else why not) and learns the rank from
    the handshake.

    `ready` resolves to this connection once the handshake is through (or fails with why not);
    `lost` resolves to why the connection ended. What arrives past the handshake is kept for the
    node until `detach` or `relay` takes it.
    """

    def __init__(
        self,
        *,
        hello: bytes | None = None,
        claim: Callable[[int, str, "DataConnection"], str] | None = None,
    ):
        loop = asyncio.get_running_loop()
        self._hello = hello
        self._claim = claim
        self.ready: asyncio.Future = loop.create_future()
        self.lost: asyncio.Future = loop.create_future()
        self.rank: int | None = None
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()  # the handshake until it is through; then what follows it
        self._open = False
        self._sink: _Pipe | None = None  # where a relayed connection's bytes go (`relay`)
        # a copy of a plain TCP connection's socket: what the node takes (`detach`)
        self._plain: socket.socket | None = None

    @property
    def plain(self) -> bool:
        """Plain TCP: the node can take the socket itself (else: TLS, relayed)."""
        return self._plain is not None

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            _tune(sock)
            if (
                transport.get_extra_info("sslcontext") is None
                and transport.get_extra_info("ssl_object") is None
            ):
                self._plain = socket.socket(fileno=os.dup(sock.fileno()))
        if self._hello is not None:
            transport.write(self._hello)
        else:  # the listener: nobody holds a connection open without presenting a token
            asyncio.get_running_loop().call_later(HANDSHAKE_TIMEOUT_S, self._unpresented)

    def data_received(self, data: bytes) -> None:
        if self._sink is not None:
            self._sink.forward(data)
            return
        self._buf += data
        if not self._open:
            self._handshake()

    def connection_lost(self, exc) -> None:
        self._close_plain()
        why = f"data channel closed ({exc})" if exc else "data channel closed"
        self._not_ready(why)
        if not self.lost.done():
            self.lost.set_result(why)
        if self._sink is not None:
            self._sink.close()

    def pause_writing(self) -> None:  # the peer reads slower than the node writes: hold the node
        if self._sink is not None:
            self._sink.transport.pause_reading()

    def resume_writing(self) -> None:
        if self._sink is not None:
            self._sink.transport.resume_reading()

    # -- the node's ----------------------------------------------------------------------------

    def detach(self) -> tuple[socket.socket, bytes]:
        """For the node: a copy of a plain connection's socket and the bytes read past the
        handshake. This end reads no more; it stays open until `close`, which leaves the copy's
        connection up."""
        assert self._open and self._plain is not None
        sock, self._plain = self._plain, None
        extra, self._buf = bytes(self._buf), bytearray()
        return sock, extra

    async def relay(self) -> socket.socket:
        """For the node, where the connection is TLS: the node's end of a socket pair whose other
        end this envoy joins to the connection, every byte either way as it comes."""
        assert self._open and self._sink is None
        mine, theirs = socket.socketpair()
        try:
            _, pipe = await asyncio.get_running_loop().connect_accepted_socket(
                lambda: _Pipe(self), sock=mine
            )
        except BaseException:
            mine.close()
            theirs.close()
            raise
        self._sink = pipe
        if self._buf:
            pipe.forward(bytes(self._buf))
            self._buf = bytearray()
        if self.transport.is_closing():
            pipe.close()
        else:
            self.transport.resume_reading()
        return theirs

    def close(self) -> None:
        self._close_plain()
        if self._sink is not None:
            self._sink.close()
        if self.transport is not None:
            self.transport.close()

    def _close_plain(self) -> None:
        if self._plain is not None:
            self._plain.close()  # the copy of the fd only: the transport's socket stays
            self._plain = None

    # -- the handshake -------------------------------------------------------------------------

    def _handshake(self) -> None:
        """Consume the handshake (listener) or the answer to it (dialer)."""
        buf = self._buf
        if self._claim is None:  # the dialer: ACK_OK, or ACK_NO and why
            if buf[:1] == ACK_OK:
                del buf[:1]
                self._opened()
            elif buf[:1] == ACK_NO and b"\n" in buf:
                self._refused(buf[1 : buf.index(b"\n")].decode(errors="replace"))
            elif buf[:1] not in (b"", ACK_NO):
                self._refused("it answered something other than the envoy data protocol")
            return
        if len(buf) < HANDSHAKE.size:
            return
        magic, rank, token = HANDSHAKE.unpack_from(buf)
        del buf[: HANDSHAKE.size]
        why = (
            "not the envoy data protocol"
            if magic != MAGIC
            else self._claim(rank, token.decode(errors="replace"), self)
        )
        if why:
            self.transport.write(ACK_NO + why.encode()[:1000].replace(b"\n", b" ") + b"\n")
            self._refused(why)
            return
        self.rank = rank
        self.transport.write(ACK_OK)
        self._opened()

    def _unpresented(self) -> None:
        if not self._open and not self.transport.is_closing():
            why = f"no handshake within {HANDSHAKE_TIMEOUT_S:g} s"
            self.transport.write(ACK_NO + why.encode() + b"\n")
            self._refused(why)

    def _opened(self) -> None:
        """Through: nothing more is read here until the node takes the connection (what followed
        the handshake waits in `_buf`)."""
        self._open = True
        self.transport.pause_reading()
        if not self.ready.done():
            self.ready.set_result(self)

    def _refused(self, why: str) -> None:
        self._not_ready(why)
        self.transport.close()

    def _not_ready(self, why: str) -> None:
        """`ready` fails with why; only the dialer waits on it (a listener's connection is handed
        over by `claim`), so only the dialer's carries the exception."""
        if not self.ready.done():
            if self._claim is None:
                self.ready.set_exception(ConnectionError(why))
            else:
                self.ready.set_result(None)


class _Pipe(asyncio.Protocol):
    """The envoy's end of the socket pair a TLS connection is relayed over: what the node writes
    goes to the connection, what the connection brings goes to the node; each side's backlog
    pauses the other's reading."""

    def __init__(self, channel: DataConnection):
        self._channel = channel
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if not self._channel.transport.is_closing():
            self._channel.transport.write(data)

    def connection_lost(self, exc) -> None:  # the node dropped the channel: so does the envoy
        self._channel.close()

    def pause_writing(self) -> None:  # the node reads slower than the peer writes
        self._channel.transport.pause_reading()

    def resume_writing(self) -> None:
        self._channel.transport.resume_reading()

    def forward(self, data: bytes) -> None:
        if not self.transport.is_closing():
            self.transport.write(data)

    def close(self) -> None:
        self.transport.close()


KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 5, 2, 3
USER_TIMEOUT_MS = 15_000  # unacknowledged data this long ends the connection (Linux)


def _tune(sock: socket.socket) -> None:
    """No Nagle delay; and a path that drops packets without a reset (a firewall, a NAT, a peer
    gone from the network) ends the connection within ~15 s, as the stream's keepalive would: the
    stream alone does not see a dead data channel. Each option where the system has it. The node
    keeps these options with the socket it takes."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle = getattr(socket, "TCP_KEEPIDLE", getattr(socket, "TCP_KEEPALIVE", None))  # Linux, macOS
    for option, value in (
        (idle, KEEPALIVE_IDLE_S),
        (getattr(socket, "TCP_KEEPINTVL", None), KEEPALIVE_INTERVAL_S),
        (getattr(socket, "TCP_KEEPCNT", None), KEEPALIVE_PROBES),
        (getattr(socket, "TCP_USER_TIMEOUT", None), USER_TIMEOUT_MS),
    ):
        if option is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, option, value)
            except OSError:
                pass


def token_ok(given: str, expected: str) -> bool:
    return bool(expected) and hmac.compare_digest(given.rstrip("\0").encode(), expected.encode())
