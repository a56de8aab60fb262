"""The Node service's Health, Status and Shutdown: what the coordinator asks a node about itself."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import node_pb2 as npb
from .enums import STATE_FROM_PB, STATE_TO_PB, lookup

if TYPE_CHECKING:
    from ..records import Health, NodeStatus


def health_request_to_proto() -> npb.HealthRequest:
    return npb.HealthRequest()


def status_request_to_proto() -> npb.StatusRequest:
    return npb.StatusRequest()


def shutdown_request_to_proto(grace_s: float) -> npb.ShutdownRequest:
    return npb.ShutdownRequest(grace_s=grace_s)


def shutdown_request_from_proto(msg: npb.ShutdownRequest) -> float:
    return msg.grace_s


def shutdown_reply_to_proto() -> npb.ShutdownReply:
    return npb.ShutdownReply()


def health_to_proto(h: Health) -> npb.HealthReply:
    return npb.HealthReply(
        ok=h.ok, state=lookup(STATE_TO_PB, h.state, "node state"), reason=h.reason
    )


def health_from_proto(msg: npb.HealthReply) -> Health:
    from ..records import Health

    return Health(msg.ok, lookup(STATE_FROM_PB, msg.state, "node state"), msg.reason)


def status_to_proto(s: NodeStatus) -> npb.NodeStatus:
    m = s.memory
    return npb.NodeStatus(
        state=lookup(STATE_TO_PB, s.state, "node state"),
        model=s.model,
        rank=s.rank,
        world_size=s.world_size,
        memory=npb.Memory(
            device_bytes=m.device_bytes,
            budget_bytes=m.budget_bytes,
            used_bytes=m.used_bytes,
            peak_bytes=m.peak_bytes,
        ),
        device=s.device,
        backend=s.backend,
        experts_per_layer=dict(s.experts_per_layer),
        counters=dict(s.counters),
        uptime_s=s.uptime_s,
        pid=s.pid,
        queue_depth=s.queue_depth,
        allreduce=npb.AllreduceHistogram(
            bounds=s.allreduce.bounds, counts=s.allreduce.counts, sum_s=s.allreduce.sum_s
        )
        if s.allreduce is not None
        else None,
        routing=[npb.LayerRouting(layer=r.layer, held=r.held, tokens=r.tokens) for r in s.routing],
        expert_cache=[npb.ExpertCacheLayer(**vars(c)) for c in s.expert_cache],
        route=s.route,
        route_us=dict(s.route_us),
        speculative=s.speculative,
        micro_batches=s.micro_batches,
        route_host_from=s.route_host_from,
        streams=s.streams,
        kv_bytes=s.kv_bytes,
        attention=s.attention,
    )


def status_from_proto(msg: npb.NodeStatus) -> NodeStatus:
    from ..records import AllreduceHistogram, ExpertCacheLayer, LayerRouting, Memory, NodeStatus

    m, a = msg.memory, msg.allreduce
    return NodeStatus(
        state=lookup(STATE_FROM_PB, msg.state, "node state"),
        model=msg.model,
        rank=msg.rank,
        world_size=msg.world_size,
        memory=Memory(m.device_bytes, m.budget_bytes, m.used_bytes, m.peak_bytes),
        device=msg.device,
        backend=msg.backend,
        experts_per_layer={int(k): int(v) for k, v in sorted(msg.experts_per_layer.items())},
        counters=dict(sorted(msg.counters.items())),
        uptime_s=msg.uptime_s,
        pid=msg.pid,
        queue_depth=msg.queue_depth,
        allreduce=AllreduceHistogram(tuple(a.bounds), tuple(a.counts), a.sum_s)
        if msg.HasField("allreduce")
        else None,
        routing=tuple(LayerRouting(r.layer, tuple(r.held), tuple(r.tokens)) for r in msg.routing),
        expert_cache=tuple(ExpertCacheLayer.of(c.layer, c) for c in msg.expert_cache),
        route=msg.route,
        route_us=dict(sorted(msg.route_us.items())),
        speculative=msg.speculative,
        micro_batches=msg.micro_batches,
        route_host_from=msg.route_host_from,
        streams=msg.streams,
        kv_bytes=msg.kv_bytes,
        attention=msg.attention,
    )
