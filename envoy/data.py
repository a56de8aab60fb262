"""The envoys' data channel: partials over one plain TCP connection per pair, beside the gRPC stream.

The gRPC `Exchange` stream (envoy/mesh.py) authenticates the peer (the cluster secret, TLS) and
says it is there; the frames themselves take this connection. Measured on 16 idle cores
(`moe-cluster bench allreduce`), grpc.aio streams alone cost 9–10x a blocking socket's exchange,
more than the rest of the envoy's path together; uvloop's TCP transport writes a frame from the
callback that made it (no writer task, no HTTP/2 framing) and hands whole reads to one callback.

A connection starts with the dialing rank's `HANDSHAKE` (magic, rank, the token the higher rank's
Hello gave it over the authenticated stream); the listener answers `b"+"` and from then on both
directions carry frames, or `b"-"` and one line saying why, and closes. With TLS configured the
connection is TLS with the mesh's certificates (mutual), like the stream.

A frame on the wire: `HEADER` (body length, step, layer, rank, dtype code, ndim, request id length),
then the request id (UTF-8), the shape (ndim x uint32) and the payload, little-endian. No CRC-32,
unlike the stream's frames: TCP's checksum guards the wire (TLS's MAC where configured), as on
the Ship data channel; on 16 idle cores a CRC on each side cost ~9 us of an ~100 us all-reduce.
"""

from __future__ import annotations

import asyncio
import hmac
import math
import os
import socket
import struct
from typing import Callable

from ..proto.frame import Frame, FrameError
from .reduce import DTYPES

MAGIC = b"MCE2"
HANDSHAKE = struct.Struct("<4sH32s")  # magic, the dialer's rank, its token (hex)
HEADER = struct.Struct(
    "<IQiHBBH"
)  # body bytes after the header, step, layer, rank, dtype, ndim, id bytes
MAX_BODY = 1 << 31  # bytes; a header claiming more is a broken or hostile peer
DTYPE_CODES = {name: i for i, name in enumerate(sorted(DTYPES))}
_DTYPE_NAMES = {i: name for name, i in DTYPE_CODES.items()}
_ACK_OK, _ACK_NO = b"+", b"-"
HANDSHAKE_TIMEOUT_S = 5.0  # a connection that has not presented its token by then is closed


def encode(frame: Frame) -> bytes:
    """One frame as it goes on the data channel (one copy of the payload, into the result)."""
    return b"".join(encode_parts(frame))


def encode_parts(frame: Frame) -> tuple[bytes, memoryview]:
    """One frame as it goes on the data channel, in two pieces: everything before the payload,
    and the payload itself (a view of the frame's, not copied)."""
    payload = memoryview(frame.payload).cast("B")
    head = frame_head(
        frame.request_id.encode(),
        frame.step,
        frame.layer,
        frame.rank,
        frame.dtype,
        frame.shape,
        payload.nbytes,
    )
    return head, payload


def frame_head(
    rid: bytes, step: int, layer: int, rank: int, dtype: str, shape: tuple, nbytes: int
) -> bytes:
    """Everything of a frame before its payload of `nbytes` bytes (`rid`: the request id, UTF-8)."""
    dims = struct.pack(f"<{len(shape)}I", *shape)
    body = len(rid) + len(dims) + nbytes
    header = HEADER.pack(body, step, layer, rank, DTYPE_CODES[dtype], len(shape), len(rid))
    return header + rid + dims


_RANK_AT = struct.calcsize("<IQi")  # the rank's offset in HEADER
_RANK = struct.Struct("<H")


def head_as(head: bytes, rank: int) -> bytes:
    """`frame_head`'s bytes with another sender's rank: how that rank's frame of the same step starts."""
    return head[:_RANK_AT] + _RANK.pack(rank) + head[_RANK_AT + _RANK.size :]


def _header(buf, start: int) -> tuple | None:
    """The header at `buf[start:]` (HEADER's fields), None until it is all in; FrameError for a
    header no envoy writes."""
    if len(buf) - start < HEADER.size:
        return None
    header = body, _, _, _, code, ndim, nid = HEADER.unpack_from(buf, start)
    if body > MAX_BODY or nid + 4 * ndim > body or code not in _DTYPE_NAMES:
        raise FrameError(
            f"a frame header from the data channel is malformed (body {body}, dtype code {code}, "
            f"ndim {ndim}, id {nid} bytes)"
        )
    return header


def frame_size(buf, start: int) -> int:
    """Bytes the frame at `buf[start:]` takes, header included, once its header is in (else the
    header's size)."""
    header = _header(buf, start)
    return HEADER.size + (header[0] if header is not None else 0)


def decode(buf, start: int) -> tuple[Frame | None, int]:
    """The frame at `buf[start:]` and the offset after it, or (None, start) while it is incomplete.
    The payload is a view of `buf` where `buf` is immutable (bytes), else a copy out of it."""
    header = _header(buf, start)
    if header is None or len(buf) < start + HEADER.size + header[0]:
        return None, start
    body, step, layer, rank, code, ndim, nid = header
    end = start + HEADER.size + body
    at = start + HEADER.size
    shape = struct.unpack_from(f"<{ndim}I", buf, at + nid)
    nbytes = end - (at + nid + 4 * ndim)
    dtype = _DTYPE_NAMES[code]
    if nbytes != math.prod(shape) * DTYPES[dtype].itemsize:
        raise FrameError(
            f"a frame from rank {rank} (step {step}) has {nbytes} payload bytes for shape "
            f"{list(shape)} of {dtype}"
        )
    view = memoryview(buf)
    rid = str(view[at : at + nid], "utf-8", "replace")
    payload = view[at + nid + 4 * ndim : end]
    if not view.readonly:  # a buffer its owner will change: the frame needs its own bytes
        payload = bytes(payload)
    return Frame(rid, step, layer, rank, dtype, shape, None, payload), end


class DataConnection(asyncio.Protocol):
    """One end of a data connection. The dialer passes `hello` (its handshake); the listener passes
    `claim(rank, token) -> str` ("" accepts; else why not) and learns the rank from the handshake.

    `ready` resolves to this connection once the handshake is through (or fails with why not);
    `lost` resolves to why the connection ended. Until `attach(on_frame)`, frames are kept in order.
    """

    def __init__(
        self,
        *,
        hello: bytes | None = None,
        claim: Callable[[int, str, "DataConnection"], str] | None = None,
        hand_off: bool = False,
        opened: bool = False,
    ):
        loop = asyncio.get_running_loop()
        self._hello = hello
        self._claim = claim
        self.ready: asyncio.Future = loop.create_future()
        self.lost: asyncio.Future = loop.create_future()
        self.rank: int | None = None
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()  # bytes of the handshake, until it is through
        self._parts: list = []  # the reads (bytes, or views of them) holding an incomplete frame
        self._have = 0  # bytes in _parts
        self._need = 0  # bytes _parts must hold before their frame can be complete
        self._on_frame: Callable[[Frame], None] | None = None
        self._held: list[Frame] = []
        self._open = opened  # a relay's end (envoy/envoy.py): no handshake
        # the node takes a plain TCP connection over once it is through its handshake (`detach`):
        # this end reads nothing past it
        self.hand_off = hand_off
        self._direct: socket.socket | None = (
            None  # the connection's socket (a copy of its fd), plain TCP only
        )

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
                self._direct = socket.socket(fileno=os.dup(sock.fileno()))
                self._direct.setblocking(False)
        if self._hello is not None:
            transport.write(self._hello)
        elif self._open:
            pass
        else:  # the listener: nobody holds a connection open without presenting a token
            asyncio.get_running_loop().call_later(HANDSHAKE_TIMEOUT_S, self._unpresented)

    def data_received(self, data: bytes) -> None:
        """Frames straight from the reads, their payloads views of them (the reads are immutable
        bytes): a frame in one read is not copied at all, one in several is joined once, when its
        last piece is in (nothing is re-parsed before)."""
        if not self._open:
            self._buf += data
            if not self._handshake() or self.hand_off:
                return
            data, self._buf = bytes(self._buf), bytearray()  # what followed the handshake
        if self._have:
            self._parts.append(data)
            self._have += len(data)
            if self._have < self._need:
                return
            data = b"".join(self._parts)
            self._parts, self._have = [], 0
        at = self._frames(data)
        if at < len(data):
            self._parts, self._have = [memoryview(data)[at:]], len(data) - at

    def connection_lost(self, exc) -> None:
        self._close_direct()
        why = f"data channel closed ({exc})" if exc else "data channel closed"
        self._not_ready(why)
        if not self.lost.done():
            self.lost.set_result(why)

    # -- use ---------------------------------------------------------------------------------

    def attach(self, on_frame: Callable[[Frame], None]) -> None:
        """From now on every frame goes to `on_frame`, those kept so far first."""
        self._on_frame = on_frame
        held, self._held = self._held, []
        for frame in held:
            on_frame(frame)

    def send(self, wire: bytes) -> None:
        """Write one encoded frame. A connection already lost takes nothing (uvloop raises on a
        closed transport): the mesh marks the peer down on its next turn of the loop, which fails
        the step naming it."""
        if not self.transport.is_closing():
            self.transport.write(wire)

    def send_parts(self, head: bytes, payload: memoryview) -> None:
        """Write one frame given as `encode_parts` gives it. The payload may change once this
        returns (it is the node's shared memory): where nothing waits in the transport, the frame
        goes to the socket at once, the payload uncopied, and only what the socket did not take
        goes to the transport, as a copy; over TLS, or behind queued bytes, it is joined first."""
        transport = self.transport
        if transport.is_closing():
            return
        direct = self._direct
        if direct is None or transport.get_write_buffer_size():
            transport.write(b"".join((head, payload)))
            return
        try:
            sent = direct.sendmsg((head, payload))
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:  # broken: the transport finds out on its own write, and reports the loss
            sent = 0
        if sent < len(head):
            transport.write(b"".join((head[sent:], payload)))
        elif sent < len(head) + len(payload):
            transport.write(bytes(payload[sent - len(head) :]))

    def detach(self) -> tuple[socket.socket, bytes]:
        """For the node (`hand_off`): a copy of the connection's socket and the bytes read past the
        handshake. This end reads no more; it stays open until `close`, which leaves the copy's
        connection up."""
        assert self.hand_off and self._direct is not None
        sock, self._direct = self._direct, None
        extra, self._buf = bytes(self._buf), bytearray()
        return sock, extra

    def close(self) -> None:
        self._close_direct()
        if self.transport is not None:
            self.transport.close()

    def _close_direct(self) -> None:
        if self._direct is not None:
            self._direct.close()  # the copy of the fd only: the transport's socket stays
            self._direct = None

    # -- inside ------------------------------------------------------------------------------

    def _handshake(self) -> bool:
        """Consume the handshake (listener) or the answer to it (dialer); True once frames may follow."""
        buf = self._buf
        if self._claim is None:  # the dialer: b"+", or b"-" and why
            if buf[:1] == _ACK_OK:
                del buf[:1]
                return self._opened()
            if buf[:1] == _ACK_NO and b"\n" in buf:
                self._refused(buf[1 : buf.index(b"\n")].decode(errors="replace"))
            elif buf[:1] not in (b"", _ACK_NO):
                self._refused("it answered something other than the envoy data protocol")
            return False
        if len(buf) < HANDSHAKE.size:
            return False
        magic, rank, token = HANDSHAKE.unpack_from(buf)
        del buf[: HANDSHAKE.size]
        why = (
            "not the envoy data protocol"
            if magic != MAGIC
            else self._claim(rank, token.decode(errors="replace"), self)
        )
        if why:
            self.transport.write(_ACK_NO + why.encode()[:1000].replace(b"\n", b" ") + b"\n")
            self._refused(why)
            return False
        self.rank = rank
        self.transport.write(_ACK_OK)
        return self._opened()

    def _unpresented(self) -> None:
        if not self._open and not self.transport.is_closing():
            why = f"no handshake within {HANDSHAKE_TIMEOUT_S:g} s"
            self.transport.write(_ACK_NO + why.encode() + b"\n")
            self._refused(why)

    def _opened(self) -> bool:
        self._open = True
        if self.hand_off and self._direct is not None:  # what followed the handshake stays in _buf
            self.transport.pause_reading()
        else:
            self.hand_off = False
        if not self.ready.done():
            self.ready.set_result(self)
        return True

    def _refused(self, why: str) -> None:
        self._not_ready(why)
        self.transport.close()

    def _not_ready(self, why: str) -> None:
        """`ready` fails with why; only the dialer waits on it (a listener's connection is handed over
        by `claim`), so only the dialer's carries the exception."""
        if not self.ready.done():
            if self._claim is None:
                self.ready.set_exception(ConnectionError(why))
            else:
                self.ready.set_result(None)

    def _frames(self, buf) -> int:
        """Hand on every whole frame in `buf`; returns where the rest starts, and notes in `_need`
        how much of the next frame must be in before it is worth looking again."""
        at = 0
        try:
            while True:
                frame, at = decode(buf, at)
                if frame is None:  # what is left is kept (in _parts): the frame, from its start
                    self._need = frame_size(buf, at)
                    return at
                if self._on_frame is not None:
                    self._on_frame(frame)
                else:
                    self._held.append(frame)
        except (
            FrameError
        ) as exc:  # a peer speaking garbage cannot be resynchronised: drop the connection
            if not self.lost.done():
                self.lost.set_result(str(exc))
            self.transport.close()
            return len(buf)


KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 5, 2, 3
USER_TIMEOUT_MS = 15_000  # unacknowledged data this long ends the connection (Linux)


def _tune(sock: socket.socket) -> None:
    """No Nagle delay; and a path that drops packets without a reset (a firewall, a NAT, a peer
    gone from the network) ends the connection within ~15 s, as the stream's keepalive would: the
    stream alone does not see a dead data channel. Each option where the system has it."""
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


def handshake(rank: int, token: str) -> bytes:
    """What a dialer sends first."""
    return HANDSHAKE.pack(MAGIC, rank, token.encode().ljust(32, b"\0")[:32])


def token_ok(given: str, expected: str) -> bool:
    return bool(expected) and hmac.compare_digest(given.rstrip("\0").encode(), expected.encode())
