"""The node <-> envoy link's messages, as both ends pack and read them: small, fixed layouts on a
Unix socket pair, nothing pickled.

The node asks its envoy to begin a request (the envoy answers once every peer is connected), to
give up one (ABORT), to redial a peer whose data channel it dropped (BROKEN), or to exit (CLOSE).
The envoy says it listens (READY), hands the node each peer's authenticated data channel
(CHANNEL: the socket's descriptor rides along with SCM_RIGHTS) and says when a peer is lost
(LOST). The frames themselves never cross the link: the node exchanges them on the channels.

Every message: 4-byte little-endian body length, then the body, whose first byte is its kind.
"""

from __future__ import annotations

import struct

# node -> envoy
BEGIN = ord("B")  # request id (UTF-8): BEGUN once every peer is connected, or FAIL
ABORT = ord("A")  # request id: it failed elsewhere; its waiting begin fails now, a later one too
BROKEN = ord("K")  # _PEER, then why: the node dropped that channel; end the stream and redial
CLOSE = ord("C")
# envoy -> node
READY = ord("Y")  # _READY: the envoy listens
BEGUN = ord("G")  # the mesh is whole: the request may start
FAIL = ord("F")  # why (UTF-8): the begin failed
CHANNEL = ord("H")  # _PEER, then the bytes read past the handshake; the peer's socket rides along
LOST = ord("L")  # _PEER, then why: the peer's stream or channel ended; the node closes its socket

LENGTH = struct.Struct("<I")
_READY = struct.Struct("<BIH")  # kind, pid, port
_PEER = struct.Struct("<BH")  # kind, rank


def message(kind: int, rest: bytes = b"") -> bytes:
    """One message of `kind` whose body goes on with `rest`, length first."""
    return LENGTH.pack(1 + len(rest)) + bytes([kind]) + rest


def text(kind: int, value: str) -> bytes:
    """A message carrying one string (BEGIN, ABORT, FAIL)."""
    return message(kind, value.encode())


def peer(kind: int, rank: int, rest: bytes = b"") -> bytes:
    """A message about one peer (CHANNEL, LOST, BROKEN)."""
    body = _PEER.pack(kind, rank) + rest
    return LENGTH.pack(len(body)) + body


def ready(pid: int, port: int) -> bytes:
    body = _READY.pack(READY, pid, port)
    return LENGTH.pack(len(body)) + body


def unpack_ready(body: bytes) -> tuple[int, int]:
    """(pid, port) of a READY body."""
    _, pid, port = _READY.unpack_from(body)
    return pid, port


def unpack_peer(body: bytes) -> tuple[int, bytes]:
    """(rank, the bytes after it) of a CHANNEL, LOST or BROKEN body."""
    _, rank = _PEER.unpack_from(body)
    return rank, body[_PEER.size :]


def unpack_text(body: bytes) -> str:
    """The string of a BEGIN, ABORT or FAIL body."""
    return body[1:].decode(errors="replace")


def split(data: bytes) -> tuple[list[tuple[int, bytes]], bytes]:
    """The whole messages at the start of `data` as (kind, body), and the bytes after them."""
    out = []
    at = 0
    while len(data) - at >= LENGTH.size:
        (n,) = LENGTH.unpack_from(data, at)
        if len(data) - at < LENGTH.size + n:
            break
        body = data[at + LENGTH.size : at + LENGTH.size + n]
        out.append((body[0] if body else 0, body))  # 0: no kind, which no end knows
        at += LENGTH.size + n
    return out, data[at:]
