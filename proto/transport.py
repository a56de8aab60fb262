"""The transports a node can join, as frozen specs: which collective, and how to reach the peers.

Specs are picklable (the simulator hands them to spawned processes) and carry no live resources;
`node.collective.specs.make_collective(spec, rank)` builds the Collective from one.

- `ShmSpec`: processes of one machine through shared memory (simulate, tests).
- `EnvoySpec`: TCP between the nodes, an envoy child per node keeping the peers (the product).
- `MlxSpec`: `mx.distributed` (ring over TCP; JACCL over Thunderbolt 5 RDMA on macOS 26.2+).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import UserError
from .records import COLD_STEP_S, COLLECTIVE_TIMEOUT_S, MESH_CONNECT_TIMEOUT_S, TlsFiles


@dataclass(frozen=True)
class ShmSpec:
    """What a process needs to join a ShmCollective (picklable; semaphores from the spawn context)."""

    name: str
    world_size: int
    slot_bytes: int
    # sems[src][dst]: posted by src once per all-reduce for dst; None on the diagonal.
    sems: tuple
    timeout_s: float = 30.0


@dataclass(frozen=True)
class EnvoySpec:
    """Every node runs an envoy child, which keeps its peers (authenticated gRPC streams) and
    hands the node a data channel to each; the nodes exchange the partials on those."""

    addresses: tuple[str, ...]  # every rank's envoy "host:port", indexed by rank
    secret: str = field(default="", repr=False)  # the cluster secret; never logged
    listen: str = ""  # this rank's bind address; "" = addresses[rank]
    timeout_s: float = COLLECTIVE_TIMEOUT_S  # a step fails after this long without a peer's frame
    cold_s: float = COLD_STEP_S  # ... and a step that may build kernels (proto/records.py)
    connect_timeout_s: float = (
        MESH_CONNECT_TIMEOUT_S  # begin() waits this long for the mesh to be whole
    )
    tls: TlsFiles | None = None  # this node's envoy's files, paths on the node
    log_level: str = "WARNING"  # of the envoy process (stderr)
    data_port: int = 0  # this rank's data channel port (a firewall's second port); 0: any free port
    trace: bool = False  # stamp every all-reduce's hops (node/collective/trace.py; bench allreduce)

    def __post_init__(self) -> None:
        if len(self.addresses) < 1:
            raise UserError("envoy transport needs at least one address")
        if not 0 <= self.data_port <= 65535:
            raise UserError(
                f"envoy data_port {self.data_port} is not a port (1..65535, or 0: any free port)"
            )
        for a in self.addresses:
            host, sep, port = a.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise UserError(f"envoy address {a!r} must be host:port")
        if self.timeout_s <= 0:
            raise UserError(f"envoy timeout_s must be > 0 (got {self.timeout_s})")

    @property
    def world_size(self) -> int:
        return len(self.addresses)


MLX_BACKENDS = ("ring", "jaccl", "nccl")  # the mx.distributed backends a node can join


@dataclass(frozen=True)
class MlxSpec:
    """`mx.distributed` with a hostfile written for the nodes."""

    hosts: tuple[
        tuple[str, ...], ...
    ]  # ring: per rank, its "ip:port" addresses; nccl: rank 0's first is the rendezvous
    backend: str = "ring"  # "ring", "jaccl" or "nccl" (CUDA GPUs)
    timeout_s: float = 30.0  # an all-reduce that takes longer fails (the group is then unusable)
    jaccl_coordinator: str = ""  # jaccl: "ip:port" of rank 0
    jaccl_devices: tuple[
        tuple[str | None, ...], ...
    ] = ()  # jaccl: [rank][peer] RDMA device, None for self
    hostfile_dir: str = ""  # where the hostfile is written; "" = a temporary folder

    def __post_init__(self) -> None:
        if self.backend not in MLX_BACKENDS:
            raise UserError(
                f"mlx backend must be one of {', '.join(MLX_BACKENDS)} (got {self.backend!r})"
            )
        if self.backend == "ring" and any(not h for h in self.hosts):
            raise UserError("mlx ring backend needs at least one address per rank")
        if self.backend == "nccl":
            host, sep, port = (self.hosts[0][0] if self.hosts and self.hosts[0] else "").rpartition(
                ":"
            )
            if not sep or not host or not port.isdigit():
                raise UserError(
                    f"mlx nccl backend needs rank 0's address as host:port (got {self.hosts[:1]!r})"
                )

    @property
    def world_size(self) -> int:
        return len(self.hosts)
