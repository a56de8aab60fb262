"""ConvertError, and the tables between the domain's names and the wire's enums that every message
family shares: keepalive, node state, finish reason and error kind (with the error record)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import node_pb2 as npb
from ..errors import ErrorKind, UserError

if TYPE_CHECKING:
    from ..records import NodeError


class ConvertError(UserError):
    """A message that does not make a valid domain record; names the field."""


def lookup(table: dict, key, what: str):
    try:
        return table[key]
    except KeyError:
        raise ConvertError(
            f"unknown {what} {key!r} (expected one of {', '.join(map(str, table))})"
        ) from None


KEEPALIVE_TO_PB = {
    "none": npb.KEEPALIVE_NONE,
    "lru": npb.KEEPALIVE_LRU,
    "busy": npb.KEEPALIVE_BUSY,
}
KEEPALIVE_FROM_PB = {v: k for k, v in KEEPALIVE_TO_PB.items()}
STATE_TO_PB = {
    "idle": npb.NODE_STATE_IDLE,
    "loading": npb.NODE_STATE_LOADING,
    "ready": npb.NODE_STATE_READY,
    "busy": npb.NODE_STATE_BUSY,
    "failed": npb.NODE_STATE_FAILED,
    "stopping": npb.NODE_STATE_STOPPING,
}
STATE_FROM_PB = {v: k for k, v in STATE_TO_PB.items()}
FINISH_TO_PB = {
    "stop": npb.FINISH_REASON_STOP,
    "length": npb.FINISH_REASON_LENGTH,
    "cancelled": npb.FINISH_REASON_CANCELLED,
    "error": npb.FINISH_REASON_ERROR,
}
FINISH_FROM_PB = {v: k for k, v in FINISH_TO_PB.items()}
# ErrorKind <-> its wire enum, by name; UNSPECIFIED (a sender that set none) reads as INTERNAL
KIND_TO_PB = {k: npb.ErrorKind.Value(f"ERROR_KIND_{k.name}") for k in ErrorKind}
KIND_FROM_PB = {v: k for k, v in KIND_TO_PB.items()} | {
    npb.ERROR_KIND_UNSPECIFIED: ErrorKind.INTERNAL
}


def error_to_proto(error: NodeError) -> npb.Error:
    return npb.Error(kind=KIND_TO_PB[error.kind], message=error.message, rank=error.rank)


def error_from_proto(msg: npb.Error) -> NodeError:
    from ..records import NodeError

    return NodeError(KIND_FROM_PB.get(msg.kind, ErrorKind.INTERNAL), msg.message, msg.rank)
