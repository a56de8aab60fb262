"""A node's Status reply: what the Status RPC reports of its state, load, memory and running
batch, read from the agent's parts (node/agent.py), no I/O."""

from __future__ import annotations

import os

from ..proto.records import (
    AllreduceHistogram,
    ExpertCacheLayer,
    LayerRouting,
    Memory,
    NodeStatus,
)


def node_status(
    state: str, load_spec, memory: Memory, device: str, sharded, runtime, uptime_s: float
) -> NodeStatus:
    """The Status record of a node in `state`; `load_spec`, `sharded` and `runtime` are None until
    a load gives them."""
    return NodeStatus(
        state=state,
        model=load_spec.model if load_spec else "",
        rank=load_spec.rank if load_spec else 0,
        world_size=load_spec.world_size if load_spec else 1,
        memory=memory,
        device=device,
        backend=transport_name(load_spec.transport) if load_spec else "",
        experts_per_layer=dict(sharded.info.experts_per_layer) if sharded else {},
        counters=sharded.state.report() if sharded else {},
        allreduce=allreduce_histogram(sharded.state) if sharded else None,
        routing=tuple(
            LayerRouting(layer, held, tokens)
            for layer, (held, tokens) in sharded.state.routing(fold=False).items()
        )
        if sharded
        else (),
        expert_cache=tuple(
            ExpertCacheLayer.of(layer, c) for layer, c in sorted(sharded.state.cache.items())
        )
        if sharded
        else (),
        route=sharded.state.route.route if sharded and sharded.state.route else "",
        route_us=dict(sharded.state.route.times_us) if sharded and sharded.state.route else {},
        speculative=runtime.batch.speculation() if runtime else "",
        micro_batches=runtime.batch.micro_batches() if runtime else "",
        route_host_from=(sharded.state.route.host_from or 0)
        if sharded and sharded.state.route
        else 0,
        uptime_s=uptime_s,
        pid=os.getpid(),
        queue_depth=sum(runtime.batch.running()) if runtime else 0,
        streams=runtime.batch.streams()[0] if runtime else 0,
        kv_bytes=runtime.batch.streams()[1] if runtime else 0,
        attention=load_spec.attention if load_spec else "",
    )


def allreduce_histogram(state) -> AllreduceHistogram:
    """The all-reduce latencies a loaded model's ShardState has counted, as the Status record."""
    from .moe.experts import ALLREDUCE_BUCKETS

    return AllreduceHistogram(
        tuple(ALLREDUCE_BUCKETS), tuple(state.allreduce_counts), state.allreduce_seconds
    )


def transport_name(spec) -> str:
    """The transport a LoadSpec names, as Status tells it (envoy, shm, mlx, local)."""
    name = type(spec).__name__.lower()
    return name[:-4] if name.endswith("spec") else name
