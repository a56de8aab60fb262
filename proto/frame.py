"""What envoys exchange: one rank's partial for one all-reduce step, with its checksum."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

from .errors import ErrorKind, MoeClusterError

PROTOCOL = "moe-cluster-envoy/2"


class FrameError(MoeClusterError, ValueError):
    """A frame that cannot be used (corrupt, out of step, or from the wrong rank): a peer's bug."""

    kind = ErrorKind.INTERNAL


@dataclass(frozen=True, slots=True)
class Frame:
    request_id: str
    step: int  # all-reduce number within the request, from 0
    layer: int  # MoE layer, or -1 (collective.TOKEN_LAYER) for the token/cancel agreement
    rank: int  # the sender
    dtype: str  # wire dtype name, a key of envoy.reduce.DTYPES
    shape: tuple[int, ...]
    checksum: (
        int | None
    )  # CRC-32 of payload; None on the data channel, where TCP's (or TLS's) guards it
    payload: bytes

    def verify(self) -> None:
        if self.checksum is None:
            return
        got = checksum(self.payload)
        if got != self.checksum:
            raise FrameError(
                f"frame from rank {self.rank} (request {self.request_id}, step {self.step}, layer {self.layer}) "
                f"is corrupt: checksum {got:#010x}, header says {self.checksum:#010x}"
            )


@dataclass(frozen=True, slots=True)
class Hello:
    """The first frame each way on a new stream: who is at the other end."""

    rank: int
    world_size: int
    protocol: str = PROTOCOL
    data_port: int = (
        0  # the answering side's data channel (envoy/data.py); 0: frames stay on the stream
    )
    data_token: str = field(default="", repr=False)  # what the dialer's data connection presents


def checksum(payload) -> int:
    """CRC-32 of a payload (bytes, memoryview or a contiguous numpy array)."""
    return zlib.crc32(payload)
