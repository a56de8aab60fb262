"""The cluster's health machine, without sockets: every event, every phase."""

from __future__ import annotations

from moe_cluster.coordinator.serve import health as h
from moe_cluster.proto.errors import ErrorKind


def _ready() -> h.ClusterHealth:
    s = h.initial([("node-a", "127.0.0.1:1"), ("node-b", "127.0.0.1:2")])
    s = h.apply(s, h.LoadStarted())
    for n in ("node-a", "node-b"):
        s = h.apply(h.apply(s, h.NodeLoading(n)), h.NodeLoaded(n))
    return h.apply(s, h.LoadDone())


def test_not_ready_until_every_node_loaded_and_warm():
    s = h.initial([("node-a", "a:1"), ("node-b", "b:1")])
    assert not s.ready and h.refusal(s).kind is ErrorKind.NOT_READY
    s = h.apply(s, h.LoadStarted())
    s = h.apply(h.apply(s, h.NodeLoading("node-a")), h.NodeLoaded("node-a"))
    assert h.apply(s, h.LoadDone()).phase == "loading"  # node-b not loaded: not ready
    s = _ready()
    assert s.ready and h.refusal(s) is None


def test_envoy_down_degrades_at_once_with_the_reason_and_a_retry_after():
    s = h.apply(_ready(), h.EnvoyDown("node-b", "envoy of rank 1 (pid 7, exit code -9) exited"))
    assert not s.ready and s.phase == "degraded" and s.node("node-b").state == "failed"
    err = h.refusal(s)
    assert err.kind is ErrorKind.UNAVAILABLE and err.retry_after_s > 0
    assert "node node-b" in str(err) and "exit code -9" in str(err) and "degraded" in str(err)
    assert h.can_rejoin(s, now=0.0)  # it answers: a reload restarts its envoy


def test_a_node_saying_failed_in_its_heartbeat_is_the_same_loss():
    s = h.apply(_ready(), h.HeartbeatOk("node-b", "failed", "envoy exited"))
    assert s.node("node-b").state == "failed" and s.phase == "degraded"
    assert type(h.refusal(s)) is type(h.refusal(h.apply(_ready(), h.EnvoyDown("node-b", "x"))))


def test_a_dead_node_waits_for_its_restart_before_a_rejoin():
    s = h.apply(_ready(), h.HeartbeatFailed("node-b", "not answering"))
    assert s.phase == "degraded" and s.node("node-b").state == "dead" and not h.can_rejoin(s, 100.0)
    assert "is down" in s.reason
    s = h.apply(s, h.HeartbeatOk("node-b", "idle"))
    assert s.node("node-b").state == "failed" and h.can_rejoin(s, 100.0)
    assert not s.ready


def test_an_rpc_failure_is_a_loss_before_the_heartbeat_sees_it():
    s = h.apply(_ready(), h.RpcFailed("node-b", "unreachable"))
    assert not s.ready and h.refusal(s).kind is ErrorKind.UNAVAILABLE


def test_a_restarted_node_that_answers_idle_is_lost():
    s = h.apply(_ready(), h.HeartbeatOk("node-b", "idle"))
    assert s.phase == "degraded" and "restarted" in s.node("node-b").reason


def test_heartbeats_of_a_healthy_cluster_change_nothing():
    s = _ready()
    for state in ("ready", "busy"):
        assert h.apply(s, h.HeartbeatOk("node-a", state)) == s


def test_rejoin_recovers_and_refuses_while_it_runs():
    s = h.apply(_ready(), h.EnvoyDown("node-b", "envoy exited"))
    s = h.apply(s, h.RejoinStarted())
    assert s.phase == "recovering" and not s.ready
    s = h.apply(h.apply(s, h.NodeLoading("node-a")), h.NodeLoading("node-b"))
    assert h.apply(s, h.HeartbeatOk("node-a", "loading")) == s  # loading is not a loss
    err = h.refusal(s)
    assert (
        err.kind is ErrorKind.UNAVAILABLE
        and "recovering" in str(err)
        and "envoy exited" in str(err)
    )
    assert not h.can_rejoin(s, 1e9)  # one rejoin at a time
    s = h.apply(h.apply(s, h.NodeLoaded("node-a")), h.NodeLoaded("node-b"))
    s = h.apply(s, h.RejoinSucceeded())
    assert s.ready and s.reason == "" and s.attempts == 0


def test_a_failed_rejoin_backs_off_doubling_and_shows_its_reason():
    s = h.apply(h.apply(_ready(), h.EnvoyDown("node-b", "envoy exited")), h.RejoinStarted())
    s = h.apply(s, h.RejoinFailed("node node-a: node is busy", at=10.0))
    assert s.phase == "degraded" and s.attempts == 1 and "node is busy" in s.reason
    assert not h.can_rejoin(s, 10.5) and h.can_rejoin(s, 11.0)
    s = h.apply(h.apply(s, h.RejoinStarted()), h.RejoinFailed("again", at=20.0))
    assert s.attempts == 2 and not h.can_rejoin(s, 21.5) and h.can_rejoin(s, 22.0)
    for i in range(10):
        s = h.apply(h.apply(s, h.RejoinStarted()), h.RejoinFailed("again", at=100.0))
    assert s.retry_at == 100.0 + h.BACKOFF_MAX_S
    assert "attempt 12" in s.reason


def test_a_node_lost_during_the_rejoin_keeps_it_degraded():
    s = h.apply(h.apply(_ready(), h.EnvoyDown("node-b", "envoy exited")), h.RejoinStarted())
    s = h.apply(s, h.HeartbeatFailed("node-a", "not answering"))
    assert s.phase == "degraded"
    assert not h.apply(s, h.RejoinSucceeded()).ready


def test_stopping_is_final():
    s = h.apply(_ready(), h.Stopping())
    assert (
        h.apply(s, h.RejoinSucceeded()).phase == "stopping"
        and h.refusal(s).kind is ErrorKind.UNAVAILABLE
    )


def test_the_lost_nodes_own_reason_replaces_unreachable():
    s = h.apply(_ready(), h.RpcFailed("node-b", "unreachable"))
    s = h.apply(s, h.HeartbeatOk("node-b", "failed", "envoy of rank 1 exited"))
    assert "envoy of rank 1 exited" in s.reason and s.node("node-b").state == "failed"
    s = h.apply(s, h.EnvoyDown("node-a", "another"))
    assert "node-b" in s.reason  # the first node's loss stays the reason


def test_a_node_that_only_missed_a_heartbeat_while_the_rejoin_loaded_it_is_ready():
    s = h.apply(h.apply(_ready(), h.EnvoyDown("node-b", "envoy exited")), h.RejoinStarted())
    s = h.apply(
        s, h.HeartbeatFailed("node-b", "not answering (deadline)")
    )  # busy importing, not dead
    s = h.apply(s, h.HeartbeatOk("node-b", "loading"))
    s = h.apply(h.apply(s, h.NodeLoaded("node-a")), h.NodeLoaded("node-b"))
    assert s.phase == "degraded" and not s.ready
    s = h.apply(
        s, h.RejoinSucceeded()
    )  # every node loaded by this rejoin, the warm-up ran through all
    assert s.ready and s.reason == ""
