"""Records of `moe-cluster bench link`'s node RPCs (proto/node.proto's Link*): what the
coordinator asks a node to measure, and what the node measured."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class LinkListen:
    """A node's listener for one probe, and ports free there for an all-reduce's transports."""

    port: int
    token: bytes = field(repr=False)
    free_ports: tuple[int, ...] = ()


@dataclass(frozen=True)
class LinkProbeSpec:
    """Round trips at each payload size to a peer's listener, then one bulk transfer to it."""

    address: str  # host:port of the peer's LinkListen, as this node reaches it
    token: bytes = field(repr=False)
    payload_bytes: tuple[int, ...] = ()
    iters: int = 100
    transfer_bytes: int = 0


@dataclass(frozen=True)
class LinkProbeResult:
    round_trips: tuple[tuple[int, tuple[float, ...]], ...]  # (payload bytes, seconds of each)
    transfer_bytes: int
    transfer_s: float


@dataclass(frozen=True)
class LinkAllReduceSpec:
    """All-reduces of `tokens` x `hidden` values of `dtype` among the nodes, over `transport`
    (an EnvoySpec or an MlxSpec, with this node's own secret and TLS files)."""

    transport: Any
    rank: int
    hidden: int
    tokens: tuple[int, ...] = (1,)
    iters: int = 200
    warmup: int = 20
    timeout_s: float = 120.0
    dtype: str = "bfloat16"


DTYPES = {"bfloat16": 2, "float16": 2, "float32": 4}  # the activations' dtypes, bytes per value


@dataclass(frozen=True)
class LinkAllReduceResult:
    times: tuple[tuple[int, tuple[float, ...]], ...]  # (tokens, seconds of each all-reduce)
