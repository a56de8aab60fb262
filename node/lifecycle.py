"""A node's lifecycle as one pure state machine: `apply(state, event) -> state`, no I/O (as the
coordinator's health is: coordinator/serve/health.py). The agent's RPCs and its worker report
events; every answer about the node's state (Health, Status, Generate's refusal) reads one value.

idle -> loading -> ready <-> busy; loading -> failed (the load failed); ready|busy -> failed (its
envoy exited: it cannot all-reduce); failed -> loading (the coordinator reloads it); stopping
from anywhere, for good.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

PHASES = ("idle", "loading", "ready", "busy", "failed", "stopping")


@dataclass(frozen=True)
class NodeState:
    phase: str = "idle"
    failure: str = ""  # why it is failed; empty otherwise

    @property
    def serving(self) -> bool:
        return self.phase in ("ready", "busy")


@dataclass(frozen=True)
class Load:
    """A Load RPC began."""


@dataclass(frozen=True)
class Loaded:
    """The shard is loaded: requests may run."""


@dataclass(frozen=True)
class Failed:
    """The load failed, or a loaded node lost its transport."""

    reason: str


@dataclass(frozen=True)
class Busy:
    """The running batch has work."""


@dataclass(frozen=True)
class Idle:
    """The running batch went idle."""


@dataclass(frozen=True)
class Stop:
    """A Shutdown RPC, or the server is ending."""


Event = Union[Load, Loaded, Failed, Busy, Idle, Stop]


def apply(state: NodeState, event: Event) -> NodeState:
    """The state after `event`; an event that does not apply to the phase leaves it unchanged."""
    phase = state.phase
    if phase == "stopping":
        return state
    if isinstance(event, Stop):
        return NodeState("stopping")
    if isinstance(event, Load):
        return NodeState("loading")
    if isinstance(event, Loaded) and phase == "loading":
        return NodeState("ready")
    if isinstance(event, Failed) and phase in ("loading", "ready", "busy"):
        return NodeState("failed", event.reason)
    if isinstance(event, Busy) and phase == "ready":
        return NodeState("busy")
    if isinstance(event, Idle) and phase == "busy":
        return NodeState("ready")
    return state
