"""The cluster's health as one pure state machine: `apply(state, event) -> state`, no I/O.

Every part of the coordinator that asks "can this cluster serve?" (/health, status, /metrics, the
API's 503s) reads one `ClusterHealth`; the heartbeat, the RPCs and the rejoin only report events.
The cluster is `ready` only while every node is ready: any node down (not answering), failed (it
says so, e.g. its envoy exited) or restarted without its shard makes it `degraded` at once, and
only a rejoin (every node loaded again and a warm-up step through the mesh) makes it ready again.
A rejoin that fails is retried after a backoff that doubles, up to `BACKOFF_MAX_S`.

Phases: starting -> loading -> ready <-> degraded <-> recovering; stopping from anywhere.
Node states: unknown | loading | ready | dead (not answering) | failed (answering, cannot serve).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Union

from ...proto.errors import ErrorKind, MoeClusterError

BACKOFF_S = 1.0  # seconds before the second rejoin attempt; doubles with each failure
BACKOFF_MAX_S = 30.0
RETRY_AFTER_S = (
    2  # seconds a refused client is told to wait while the cluster is degraded or recovering
)


class NodeLostError(MoeClusterError):
    """A node of the cluster is down or failed: requests are refused (503) until it rejoins."""

    kind = ErrorKind.UNAVAILABLE

    def __init__(self, message: str, retry_after_s: float = RETRY_AFTER_S):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NotLoadedError(MoeClusterError):
    """The cluster is starting or loading: nothing can run yet."""

    kind = ErrorKind.NOT_READY

    def __init__(self, message: str, retry_after_s: float = RETRY_AFTER_S):
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class NodeHealth:
    name: str
    address: str = ""
    state: str = "unknown"  # unknown | loading | ready | dead | failed
    reason: str = ""  # why it is dead or failed


@dataclass(frozen=True)
class ClusterHealth:
    nodes: tuple[NodeHealth, ...]
    phase: str = "starting"  # starting | loading | ready | degraded | recovering | stopping
    reason: str = ""  # why it is not ready (the first lost node, or the last rejoin's failure)
    attempts: int = 0  # rejoins failed in a row
    retry_at: float = 0.0  # time.monotonic() before which no rejoin starts
    cause: str = ""  # the node whose loss `reason` names (its later, finer reason replaces it)

    def node(self, name: str) -> NodeHealth:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    @property
    def ready(self) -> bool:
        return self.phase == "ready" and all(n.state == "ready" for n in self.nodes)


# -- events --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadStarted:
    pass


@dataclass(frozen=True)
class LoadDone:
    error: str = ""  # "" when every node loaded and the warm-up step ran


@dataclass(frozen=True)
class NodeLoading:
    node: str


@dataclass(frozen=True)
class NodeLoaded:
    node: str


@dataclass(frozen=True)
class HeartbeatOk:
    node: str
    node_state: str  # what the node says it is (proto.records.NODE_STATES)
    reason: str = ""  # the node's reason when it says failed


@dataclass(frozen=True)
class HeartbeatFailed:
    node: str
    reason: str


@dataclass(frozen=True)
class EnvoyDown:
    """A node reports its envoy exited (it answers, but cannot all-reduce)."""

    node: str
    reason: str


@dataclass(frozen=True)
class RpcFailed:
    """A call to a node failed as unreachable (gRPC UNAVAILABLE): lost until heartbeats say otherwise."""

    node: str
    reason: str


@dataclass(frozen=True)
class RejoinStarted:
    pass


@dataclass(frozen=True)
class RejoinSucceeded:
    pass


@dataclass(frozen=True)
class RejoinFailed:
    reason: str
    at: float  # time.monotonic() of the failure


@dataclass(frozen=True)
class Stopping:
    pass


Event = Union[
    LoadStarted,
    LoadDone,
    NodeLoading,
    NodeLoaded,
    HeartbeatOk,
    HeartbeatFailed,
    EnvoyDown,
    RpcFailed,
    RejoinStarted,
    RejoinSucceeded,
    RejoinFailed,
    Stopping,
]


def initial(nodes: list[tuple[str, str]]) -> ClusterHealth:
    """A cluster of (name, address) nodes, nothing loaded yet."""
    return ClusterHealth(tuple(NodeHealth(name, address) for name, address in nodes))


# -- the machine ---------------------------------------------------------------------------------


def _set_node(s: ClusterHealth, name: str, **changes) -> ClusterHealth:
    return replace(s, nodes=tuple(replace(n, **changes) if n.name == name else n for n in s.nodes))


def _lose(s: ClusterHealth, name: str, state: str, reason: str) -> ClusterHealth:
    """Node `name` cannot serve: the cluster is degraded (the first loss names the reason)."""
    n = s.node(name)
    if n.state == state and n.reason == reason and s.phase == "degraded":
        return s
    s = _set_node(s, name, state=state, reason=reason)
    if s.phase in ("ready", "recovering", "degraded"):
        lost = (
            f"node {name} ({n.address}) {'is down' if state == 'dead' else 'has failed'}: {reason}"
        )
        # the first cause (refined by its node's later reason), or the last rejoin's failure
        keep = s.phase == "degraded" and s.reason and s.cause != name
        s = s if keep else replace(s, reason=lost, cause=name)
        s = replace(s, phase="degraded")
    return s


def apply(s: ClusterHealth, e: Event) -> ClusterHealth:
    """The state after event `e`; events that do not apply in the current phase change nothing."""
    if s.phase == "stopping":
        return s
    if isinstance(e, Stopping):
        return replace(s, phase="stopping", reason="stopping")
    if isinstance(e, LoadStarted):
        return replace(s, phase="loading", reason="")
    if isinstance(e, LoadDone):
        if e.error:
            return replace(s, phase="degraded", reason=e.error)
        return (
            replace(s, phase="ready", reason="", cause="", attempts=0, retry_at=0.0)
            if _all_ready(s)
            else s
        )
    if isinstance(e, NodeLoading):
        return _set_node(s, e.node, state="loading", reason="")
    if isinstance(e, NodeLoaded):
        return _set_node(s, e.node, state="ready", reason="")
    if isinstance(e, HeartbeatFailed):
        return _lose(s, e.node, "dead", e.reason)
    if isinstance(e, RpcFailed):
        return _lose(s, e.node, "dead", e.reason)
    if isinstance(e, EnvoyDown):
        return _lose(s, e.node, "failed", e.reason)
    if isinstance(e, HeartbeatOk):
        return _heartbeat(s, e)
    if isinstance(e, RejoinStarted):
        return replace(s, phase="recovering") if s.phase == "degraded" else s
    if isinstance(e, RejoinSucceeded):
        # A node lost during the rejoin and not loaded since keeps it degraded (it rejoins again);
        # one that only missed a heartbeat while loading (a fresh process starved of CPU) and was
        # loaded by this rejoin, whose warm-up then ran through it, is ready.
        if s.phase not in ("recovering", "degraded") or not _all_ready(s):
            return s
        return replace(s, phase="ready", reason="", cause="", attempts=0, retry_at=0.0)
    if isinstance(e, RejoinFailed):
        if s.phase not in ("recovering", "degraded"):
            return s
        attempts = s.attempts + 1
        delay = min(BACKOFF_S * 2 ** (attempts - 1), BACKOFF_MAX_S)
        return replace(
            s,
            phase="degraded",
            attempts=attempts,
            retry_at=e.at + delay,
            cause="",
            reason=f"rejoin failed (attempt {attempts}, next in {delay:.0f} s): {e.reason}",
        )
    raise TypeError(f"not a health event: {e!r}")


def _all_ready(s: ClusterHealth) -> bool:
    return all(n.state == "ready" for n in s.nodes)


def _heartbeat(s: ClusterHealth, e: HeartbeatOk) -> ClusterHealth:
    n = s.node(e.node)
    if e.node_state == "failed":
        return _lose(s, e.node, "failed", e.reason or "the node reports it failed")
    if n.state == "ready" and e.node_state == "idle":
        return _lose(s, e.node, "failed", "restarted: its shard is not loaded")
    if n.state == "dead":
        # answering again (restarted): it can serve only after a rejoin loads it
        return _set_node(s, e.node, state="failed", reason="back, not loaded yet")
    return s


# -- what readers ask ----------------------------------------------------------------------------


def can_rejoin(s: ClusterHealth, now: float) -> bool:
    """A rejoin may start: degraded, every node answering, and the backoff has passed."""
    return s.phase == "degraded" and all(n.state != "dead" for n in s.nodes) and now >= s.retry_at


def refusal(s: ClusterHealth) -> MoeClusterError | None:
    """The error a new request gets now, or None when the cluster can serve it."""
    if s.ready:
        return None
    if s.phase in ("starting", "loading"):
        return NotLoadedError(f"cluster is {s.phase}")
    if s.phase == "recovering":
        return NodeLostError(f"cluster is degraded, recovering (reloading every node): {s.reason}")
    return NodeLostError(f"cluster is {s.phase}" + (f": {s.reason}" if s.reason else ""))
