"""Transports behind the collective interface, as plugins: a frozen spec says which and how.

`make_collective(spec, rank)` builds the Collective a node process uses. Specs are picklable (the
simulator hands them to spawned processes) and carry no live resources; each transport module
imports its heavy dependencies only when one is built.

- `ShmSpec`: processes of one machine through shared memory (simulate, tests).
- `EnvoySpec`: the envoy child process per node, gRPC between envoys (the product).
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
        raise TypeError(f"no transport for spec {type(spec).__name__} (known: {', '.join(t.__name__ for t in _IMPLEMENTATIONS)})")
    if not 0 <= rank < spec.world_size:
        raise UserError(f"rank {rank} is outside world size {spec.world_size}")
    if spec.world_size == 1:  # alone: the sum of one share is itself, no transport to start
        module, name = _ALONE.split(":")
        return getattr(importlib.import_module(module), name)()
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)(spec, rank)


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct TCP ports free on `host` right now (for clusters launched on one machine)."""
    import socket

    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def check_port_free(host: str, port: int, hint: str = "") -> None:
    """Raise a one-line OSError if `host:port` cannot be listened on (0: any port, always fine)."""
    import socket

    if port == 0:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise OSError(f"cannot listen on {host}:{port}: {exc.strerror}" + (f" ({hint})" if hint else "")) from None
