"""The node's lifecycle (node/lifecycle.py): every phase under every event, as a table."""

from __future__ import annotations

import pytest

from moe_cluster.node.lifecycle import (
    PHASES,
    Busy,
    Failed,
    Idle,
    Load,
    Loaded,
    NodeState,
    Stop,
    apply,
)

EVENTS = {
    "load": Load(),
    "loaded": Loaded(),
    "failed": Failed("envoy exited"),
    "busy": Busy(),
    "idle": Idle(),
    "stop": Stop(),
}
# the phase after each event, from each phase (phase -> event -> phase)
TABLE = {
    "idle": {
        "load": "loading",
        "loaded": "idle",
        "failed": "idle",
        "busy": "idle",
        "idle": "idle",
        "stop": "stopping",
    },
    "loading": {
        "load": "loading",
        "loaded": "ready",
        "failed": "failed",
        "busy": "loading",
        "idle": "loading",
        "stop": "stopping",
    },
    "ready": {
        "load": "loading",
        "loaded": "ready",
        "failed": "failed",
        "busy": "busy",
        "idle": "ready",
        "stop": "stopping",
    },
    "busy": {
        "load": "loading",
        "loaded": "busy",
        "failed": "failed",
        "busy": "busy",
        "idle": "ready",
        "stop": "stopping",
    },
    "failed": {
        "load": "loading",
        "loaded": "failed",
        "failed": "failed",
        "busy": "failed",
        "idle": "failed",
        "stop": "stopping",
    },
    "stopping": {e: "stopping" for e in EVENTS},
}


@pytest.mark.parametrize("phase", PHASES)
def test_every_phase_under_every_event(phase):
    for name, event in EVENTS.items():
        got = apply(NodeState(phase, "why" if phase == "failed" else ""), event)
        assert got.phase == TABLE[phase][name], (phase, name, got)


def test_a_failure_keeps_its_reason_until_a_load_clears_it():
    s = apply(NodeState("ready"), Failed("envoy exited (code 9)"))
    assert (s.phase, s.failure, s.serving) == ("failed", "envoy exited (code 9)", False)
    assert apply(s, Busy()).failure == "envoy exited (code 9)"
    s = apply(s, Load())
    assert (s.phase, s.failure) == ("loading", "")
    assert apply(apply(s, Loaded()), Busy()).serving
