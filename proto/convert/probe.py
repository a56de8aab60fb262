"""The Node service's Probe (the load-time check): float32 arrays as raw little-endian bytes."""

from __future__ import annotations

from .. import node_pb2 as npb
from ..errors import UserError


def _f32(shape, data: bytes, what: str):
    import numpy as np

    shape = tuple(int(d) for d in shape)
    if len(shape) != 2 or len(data) != 4 * shape[0] * shape[1]:
        raise UserError(f"{what}: {len(data)} bytes do not hold a float32 array of shape {shape}")
    return np.frombuffer(data, dtype="<f4").reshape(shape)


def probe_request_to_proto(layer: int, x) -> npb.ProbeRequest:
    import numpy as np

    x = np.ascontiguousarray(x, dtype="<f4")
    return npb.ProbeRequest(layer=layer, shape=list(x.shape), x=x.tobytes())


def probe_request_from_proto(msg: npb.ProbeRequest):
    """(layer, x (tokens, hidden) float32)."""
    return int(msg.layer), _f32(msg.shape, msg.x, "probe input")


def probe_reply_to_proto(y) -> npb.ProbeReply:
    import numpy as np

    y = np.ascontiguousarray(y, dtype="<f4")
    return npb.ProbeReply(shape=list(y.shape), y=y.tobytes())


def probe_reply_from_proto(msg: npb.ProbeReply):
    return _f32(msg.shape, msg.y, "probe reply")
