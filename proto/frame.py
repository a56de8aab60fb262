"""The envoys' wire: the gRPC stream's Hello, and the data channel's handshake and frames.

Each pair of envoys keeps one authenticated gRPC stream (envoy/mesh.py); its Hellos say who is
at each end, and the higher rank's offers its data channel (a port and a one-time token). The
dialer connects there and presents `handshake(rank, token)`; the listener answers `ACK_OK` and
from then on both directions carry frames, or `ACK_NO`, one line saying why, and closes. With
TLS configured the connection is TLS with the mesh's certificates (mutual), like the stream.
The envoy hands each channel to its node, which writes and reads the frames itself
(node/collective/exchange.py).

A frame is one rank's partial for one all-reduce step: `HEADER` (body length, step, layer, rank,
dtype code, ndim, request id length), then the request id (UTF-8), the shape (ndim x uint32) and
the payload, little-endian. No checksum: TCP's guards the wire (TLS's MAC where configured), as on
the Ship data channel; on 16 idle cores a CRC-32 on each side cost ~9 us of an ~100 us all-reduce.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field

from .errors import ErrorKind, MoeClusterError

PROTOCOL = "moe-cluster-envoy/3"  # 3: the stream carries only Hellos; frames take the data channel

# wire dtype name -> bytes per value; bfloat16 travels as its 16-bit patterns
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
DTYPE_CODES = {name: i for i, name in enumerate(sorted(ITEMSIZE))}
_DTYPE_NAMES = {i: name for name, i in DTYPE_CODES.items()}

MAGIC = b"MCE2"
HANDSHAKE = struct.Struct("<4sH32s")  # magic, the dialer's rank, its token (hex)
HANDSHAKE_TIMEOUT_S = 5.0  # a connection that has not presented its token by then is closed
ACK_OK, ACK_NO = b"+", b"-"
# body bytes after the header, step, layer, rank, dtype code, ndim, request id bytes
HEADER = struct.Struct("<IQiHBBH")
MAX_BODY = 1 << 31  # bytes; a header claiming more is a broken or hostile peer
_RANK_AT = struct.calcsize("<IQi")  # the rank's offset in HEADER
_RANK = struct.Struct("<H")


class FrameError(MoeClusterError, ValueError):
    """A frame that cannot be used (malformed, out of step, from the wrong rank): a peer's bug."""

    kind = ErrorKind.INTERNAL


@dataclass(frozen=True, slots=True)
class Frame:
    request_id: str
    step: int  # all-reduce number within the request, from 0
    layer: int  # MoE layer, or -1 (collective.TOKEN_LAYER) for the token/cancel agreement
    rank: int  # the sender
    dtype: str  # wire dtype name, a key of ITEMSIZE
    shape: tuple[int, ...]
    payload: bytes  # any buffer: bytes, memoryview or a contiguous numpy array


@dataclass(frozen=True, slots=True)
class Hello:
    """What each end of a new stream says first, and all it says: who is at the other end."""

    rank: int
    world_size: int
    protocol: str = PROTOCOL
    data_port: int = 0  # the answering side's data channel
    data_token: str = field(default="", repr=False)  # what the dialer's data connection presents


def handshake(rank: int, token: str) -> bytes:
    """What a dialer writes first on a data connection."""
    return HANDSHAKE.pack(MAGIC, rank, token.encode().ljust(32, b"\0")[:32])


def frame_head(
    rid: bytes, step: int, layer: int, rank: int, dtype: str, shape: tuple, nbytes: int
) -> bytes:
    """Everything of a frame before its payload of `nbytes` bytes (`rid`: the request id, UTF-8)."""
    dims = struct.pack(f"<{len(shape)}I", *shape)
    body = len(rid) + len(dims) + nbytes
    header = HEADER.pack(body, step, layer, rank, DTYPE_CODES[dtype], len(shape), len(rid))
    return header + rid + dims


def head_as(head: bytes, rank: int) -> bytes:
    """`frame_head`'s bytes with another sender's rank: how that rank's frame of the same step
    starts."""
    return head[:_RANK_AT] + _RANK.pack(rank) + head[_RANK_AT + _RANK.size :]


def encode(frame: Frame) -> bytes:
    """One frame as it goes on the data channel."""
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
    return head + payload


def _header(buf, start: int) -> tuple | None:
    """The header at `buf[start:]` (HEADER's fields), None until it is all in; FrameError for a
    header no node writes."""
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
    if nbytes != math.prod(shape) * ITEMSIZE[dtype]:
        raise FrameError(
            f"a frame from rank {rank} (step {step}) has {nbytes} payload bytes for shape "
            f"{list(shape)} of {dtype}"
        )
    view = memoryview(buf)
    rid = str(view[at : at + nid], "utf-8", "replace")
    payload = view[at + nid + 4 * ndim : end]
    if not view.readonly:  # a buffer its owner will change: the frame needs its own bytes
        payload = bytes(payload)
    return Frame(rid, step, layer, rank, dtype, shape, payload), end
