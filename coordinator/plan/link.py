"""A link as `moe-cluster bench link` measured it between running nodes, and what `plan`
predicts with from it.

The measurement, per direction of each pair of nodes: round trips at the payloads one MoE layer
sends (1 and 32 tokens of the model's hidden size), a bulk transfer's bandwidth; and per
transport, the all-reduce between all the nodes at 1 and 32 tokens. `plan`'s table charges a step
of B tokens the all-reduce measured, linear in B between the two sizes (`collective_s`); the race
takes the link as a network record (`network`): the wire's one-way latency (half the fastest
1-token round trip), a bandwidth (the bulk transfer's, or the envoy's all-reduce's growth from 1
to 32 tokens where that is slower: copies cost bytes too), and each transport's stack, so that a
1-token all-reduce costs what was measured.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .perfmodel import TRANSPORTS, NetworkSpec, PlanError

MEASURED = "measured"  # the network's name in `plan` (`--network measured`, `--link measured`)


@dataclass(frozen=True)
class RoundTrip:
    src: str  # the node that sent and timed
    dst: str
    payload_bytes: int
    p50_s: float
    min_s: float


@dataclass(frozen=True)
class Transfer:
    src: str
    dst: str
    bytes: int
    seconds: float

    @property
    def bandwidth_Bps(self) -> float:
        return self.bytes / self.seconds


@dataclass(frozen=True)
class AllReduce:
    transport: str  # "envoy" or "mlx"
    tokens: int
    p50_s: float
    p99_s: float


@dataclass(frozen=True)
class LinkFit:
    """What `bench link` measured between `nodes` (a calibration file's `link`)."""

    nodes: tuple[str, ...]
    hidden: int
    act_bytes: int
    date: str  # ISO date of the measurement
    round_trips: tuple[RoundTrip, ...]
    transfers: tuple[Transfer, ...]
    allreduce: tuple[AllReduce, ...]

    @property
    def token_bytes(self) -> int:
        return self.hidden * self.act_bytes

    @property
    def bandwidth_Bps(self) -> float:
        """The slower direction's bulk bandwidth, bytes/s."""
        return min(t.bandwidth_Bps for t in self.transfers)

    def allreduce_s(self, transport: str, tokens: int = 1) -> float | None:
        got = [a.p50_s for a in self.allreduce if (a.transport, a.tokens) == (transport, tokens)]
        return got[0] if got else None

    def collective_s(self, transport: str, tokens: int) -> float | None:
        """One all-reduce of `tokens` tokens over `transport`: measured at 1 and 32, linear in the
        tokens between (and past) them; None where `transport` was not measured."""
        one = self.allreduce_s(transport, 1)
        if one is None:
            return None
        many = self.allreduce_s(transport, 32)
        per_token = (
            (many - one) / 31 if many is not None and many > one else 0.0
        ) or self.token_bytes / self.bandwidth_Bps
        return one + per_token * (tokens - 1)

    def collective_bandwidth_Bps(self) -> float:
        """Bytes/s of an all-reduce's growth with its payload: the bulk transfer's, or the
        envoy's 1-to-32-token growth where that is slower."""
        one, many = self.allreduce_s("envoy", 1), self.allreduce_s("envoy", 32)
        bulk = self.bandwidth_Bps
        if one is None or many is None or many <= one:
            return bulk
        return min(bulk, 31 * self.token_bytes / (many - one))

    def wire_latency_s(self) -> float:
        """One way, seconds: half the fastest round trip of the smallest payload, less its bytes."""
        small = min(r.payload_bytes for r in self.round_trips)
        rtt = min(r.p50_s for r in self.round_trips if r.payload_bytes == small)
        return max(0.0, rtt / 2 - small / self.bandwidth_Bps)

    def network(self) -> NetworkSpec:
        """The measured link as `plan` predicts with it: a 1-token all-reduce over each transport
        costs what it measured (its stack is what is left of it past the wire and the bytes)."""
        wire, bw = self.wire_latency_s(), self.collective_bandwidth_Bps()
        stacks = {}
        for t in TRANSPORTS:
            a = self.allreduce_s(t, 1)
            stacks[t] = None if a is None else max(0.0, a - wire - self.token_bytes / bw)
        if stacks["envoy"] is None and stacks["mlx"] is None:
            raise PlanError(f"the link between {', '.join(self.nodes)} has no all-reduce measured")
        envoy = stacks["envoy"] if stacks["envoy"] is not None else stacks["mlx"]
        return NetworkSpec(
            MEASURED,
            wire,
            bw,
            envoy,
            0.0,
            f"measured by `bench link` between {', '.join(self.nodes)} on {self.date}",
            mlx_stack_s=stacks["mlx"],
        )

    def to_json(self) -> dict:
        d = asdict(self)
        for key in ("nodes", "round_trips", "transfers", "allreduce"):
            d[key] = list(d[key])
        return d


def _record(cls, obj: Any, where: str, get):
    names = [f for f in cls.__dataclass_fields__]
    if not isinstance(obj, dict):
        raise PlanError(f"{where}: expected an object with {', '.join(names)}")
    unknown = sorted(set(obj) - set(names))
    if unknown:
        raise PlanError(f"{where}: unknown field(s) {', '.join(unknown)}")
    kinds = {k: cls.__dataclass_fields__[k].type for k in names}
    kind = {"str": str, "int": int, "float": float}
    return cls(**{k: get(obj, k, kind[kinds[k]], where) for k in names})


def parse_link(obj: Any, where: str, get) -> LinkFit:
    """A calibration file's `link`, strictly (`get`: calibration._get, which names the bad field)."""
    if not isinstance(obj, dict):
        raise PlanError(f"{where}: expected an object")
    fields = {"nodes", "hidden", "act_bytes", "date", "round_trips", "transfers", "allreduce"}
    unknown = sorted(set(obj) - fields)
    if unknown:
        raise PlanError(f"{where}: unknown field(s) {', '.join(unknown)}")
    nodes = get(obj, "nodes", list, where)
    if len(nodes) < 2 or not all(isinstance(n, str) for n in nodes):
        raise PlanError(f"{where}: 'nodes' should name two nodes or more, got {nodes!r}")
    parts = {
        key: tuple(
            _record(cls, x, f"{where}.{key}[{i}]", get)
            for i, x in enumerate(get(obj, key, list, where))
        )
        for key, cls in (
            ("round_trips", RoundTrip),
            ("transfers", Transfer),
            ("allreduce", AllReduce),
        )
    }
    for a in parts["allreduce"]:
        if a.transport not in TRANSPORTS:
            raise PlanError(
                f"{where}: allreduce transport {a.transport!r} is not one of {TRANSPORTS}"
            )
    for t in parts["transfers"]:
        if t.seconds <= 0 or t.bytes <= 0:
            raise PlanError(f"{where}: a transfer of {t.bytes} bytes in {t.seconds} s")
    if not parts["round_trips"] or not parts["transfers"]:
        raise PlanError(f"{where}: needs round_trips and transfers")
    return LinkFit(
        tuple(nodes),
        get(obj, "hidden", int, where),
        get(obj, "act_bytes", int, where),
        get(obj, "date", str, where),
        parts["round_trips"],
        parts["transfers"],
        parts["allreduce"],
    )
