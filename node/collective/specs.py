"""Transports behind the collective interface, as plugins: a frozen spec says which and how.

`make_collective(spec, rank)` builds the Collective a node process uses. Specs are picklable (the
simulator hands them to spawned processes) and carry no live resources; each transport module
imports its heavy dependencies only when one is built.

- `ShmSpec`: processes of one machine through shared memory (simulate, tests).
- `EnvoySpec`: TCP between the nodes, an envoy child per node keeping the peers (the product).
- `MlxSpec`: `mx.distributed` (ring over TCP; JACCL over Thunderbolt 5 RDMA on macOS 26.2+).
"""

from __future__ import annotations

import importlib

from ...proto.errors import UserError

# The specs are records the coordinator sends and the node builds from: they live in proto, and
# this module is where a node turns one into its Collective.
from ...proto.transport import MLX_BACKENDS, EnvoySpec, MlxSpec, ShmSpec  # noqa: F401 - re-exported


# spec type -> "module:class" of its Collective, imported only when used
_IMPLEMENTATIONS = {
    ShmSpec: "moe_cluster.node.collective.shm:ShmCollective",
    EnvoySpec: "moe_cluster.node.collective.envoy:EnvoyCollective",
    MlxSpec: "moe_cluster.node.collective.mlx:MlxCollective",
}
_ALONE = "moe_cluster.node.collective.base:LocalCollective"


def make_collective(spec, rank: int):
    """The Collective for `spec` as seen from `rank`."""
    target = _IMPLEMENTATIONS.get(type(spec))
    if target is None:
        raise TypeError(
            f"no transport for spec {type(spec).__name__} (known: {', '.join(t.__name__ for t in _IMPLEMENTATIONS)})"
        )
    if not 0 <= rank < spec.world_size:
        raise UserError(f"rank {rank} is outside world size {spec.world_size}")
    if spec.world_size == 1:  # alone: the sum of one share is itself, no transport to start
        module, name = _ALONE.split(":")
        return getattr(importlib.import_module(module), name)()
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)(spec, rank)
