"""The Node service's Link calls (`bench link`): a node's listener, its round trips and transfer
to a peer, and an all-reduce over a transport of the cluster's, timed per size."""

from __future__ import annotations

from typing import Any

from .. import node_pb2 as npb
from .enums import ConvertError
from .load import transport_from_proto, transport_to_proto


def _seconds(pairs) -> list:
    return [npb.Seconds(size=size, seconds=list(s)) for size, s in pairs]


def _pairs(msgs) -> tuple:
    return tuple((m.size, tuple(m.seconds)) for m in msgs)


def link_listen_request_to_proto() -> npb.LinkListenRequest:
    return npb.LinkListenRequest()


def link_listen_to_proto(listen) -> npb.LinkListenReply:
    return npb.LinkListenReply(
        port=listen.port, token=listen.token, free_ports=list(listen.free_ports)
    )


def link_listen_from_proto(msg: npb.LinkListenReply):
    from ..link import LinkListen

    return LinkListen(msg.port, bytes(msg.token), tuple(msg.free_ports))


def link_probe_request_to_proto(spec) -> npb.LinkProbeRequest:
    return npb.LinkProbeRequest(
        address=spec.address,
        token=spec.token,
        payload_bytes=list(spec.payload_bytes),
        iters=spec.iters,
        transfer_bytes=spec.transfer_bytes,
    )


def link_probe_request_from_proto(msg: npb.LinkProbeRequest):
    from ..link import LinkProbeSpec

    if not msg.payload_bytes or msg.iters < 1:
        raise ConvertError(
            f"a link probe needs payload sizes and iters >= 1 (got {list(msg.payload_bytes)}, "
            f"{msg.iters})"
        )
    return LinkProbeSpec(
        msg.address, bytes(msg.token), tuple(msg.payload_bytes), msg.iters, msg.transfer_bytes
    )


def link_probe_reply_to_proto(result) -> npb.LinkProbeReply:
    return npb.LinkProbeReply(
        round_trips=_seconds(result.round_trips),
        transfer_bytes=result.transfer_bytes,
        transfer_s=result.transfer_s,
    )


def link_probe_reply_from_proto(msg: npb.LinkProbeReply):
    from ..link import LinkProbeResult

    return LinkProbeResult(_pairs(msg.round_trips), msg.transfer_bytes, msg.transfer_s)


def link_allreduce_request_to_proto(spec) -> npb.LinkAllReduceRequest:
    return npb.LinkAllReduceRequest(
        transport=transport_to_proto(spec.transport),
        rank=spec.rank,
        hidden=spec.hidden,
        tokens=list(spec.tokens),
        iters=spec.iters,
        warmup=spec.warmup,
        timeout_s=spec.timeout_s,
        dtype=spec.dtype,
    )


def link_allreduce_request_from_proto(
    msg: npb.LinkAllReduceRequest, *, secret: str = "", tls: Any = None
):
    from ..link import DTYPES, LinkAllReduceSpec

    dtype = msg.dtype or "bfloat16"
    if dtype not in DTYPES:
        raise ConvertError(f"a link all-reduce of dtype {dtype!r}: choose from {', '.join(DTYPES)}")
    if not msg.tokens or msg.iters < 1 or msg.hidden < 1:
        raise ConvertError(
            f"a link all-reduce needs tokens, hidden >= 1 and iters >= 1 (got "
            f"{list(msg.tokens)}, {msg.hidden}, {msg.iters})"
        )
    timeout_s = msg.timeout_s or 120.0
    return LinkAllReduceSpec(
        transport_from_proto(msg.transport, timeout_s=timeout_s, secret=secret, tls=tls),
        msg.rank,
        msg.hidden,
        tuple(msg.tokens),
        msg.iters,
        msg.warmup,
        timeout_s,
        dtype,
    )


def link_allreduce_reply_to_proto(result) -> npb.LinkAllReduceReply:
    return npb.LinkAllReduceReply(times=_seconds(result.times))


def link_allreduce_reply_from_proto(msg: npb.LinkAllReduceReply):
    from ..link import LinkAllReduceResult

    return LinkAllReduceResult(_pairs(msg.times))
