"""Real envoy processes on 127.0.0.1: soak, faults, the cluster secret and TLS.

Each test drives stand-in node processes (envoy_nodes.Cluster), each of which starts its own envoy
child exactly as a node does, and checks every all-reduce result by content.
"""

from __future__ import annotations

import dataclasses
import signal
import time

import grpc
import pytest

from tls_certs import make_tls

from envoy_nodes import Cluster, alive, all_ok, envoy_spec
from moe_cluster.proto import convert
from moe_cluster.proto.frame import HANDSHAKE_TIMEOUT_S, Hello, handshake

SOAK_STEPS = 5_000


# 5,000 steps, not 10,000: the suite is at its time budget, and a loss or a reordering shows in the
# first thousands of steps as in the last; 3 nodes added nothing 2 and 4 do not.
@pytest.mark.parametrize("nodes", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_soak_loses_duplicates_and_reorders_nothing(nodes):
    """5,000 all-reduces at 2 nodes (2,500 at 4), in several requests in a row, every sum checked."""
    total = SOAK_STEPS if nodes <= 2 else SOAK_STEPS // 2
    cluster = Cluster(envoy_spec(nodes))
    try:
        done = 0
        for request_id, steps in (("soak-a", 2_000), ("soak-b", 1), ("soak-c", total - 2_001)):
            replies = cluster.run(request_id, steps, timeout=300)
            all_ok(replies)
            assert {rep[1]["steps"] for rep in replies.values()} == {steps}
            done += steps
        assert done == total
        health = _health(
            cluster.spec.addresses[0], (("x-moe-cluster-secret", cluster.spec.secret),)
        )
        assert health["whole"] and health["connected"] == list(range(1, nodes)), health
    finally:
        cluster.close()


def _fails_naming(cluster: Cluster, ranks, peer: int, since: float, within: float) -> None:
    address = cluster.spec.addresses[peer]
    for r in ranks:
        kind, message, when = cluster.nodes[r].reply(within + 30)
        assert kind == "error", f"node {r} did not fail: {message}"
        assert f"rank {peer} ({address})" in message, message
        assert when - since < within, (
            f"node {r} failed {when - since:.1f} s after the fault: {message}"
        )


def test_a_dead_then_a_stalled_peer_fail_the_step_everywhere_then_the_mesh_heals():
    """Both faults on one mesh of 3 (a start and a close of 3 nodes and 3 envoys cost ~2 s): a dead
    peer, then a stalled one, each failing the step on the others within the step timeout, naming
    it, and the mesh serving again after each."""
    timeout = 2.0
    cluster = Cluster(envoy_spec(3, timeout_s=timeout, connect_timeout_s=20))
    try:
        _dead_peer_fails_the_step_everywhere_then_the_mesh_heals(cluster, timeout)
        _stalled_peer_times_out_naming_it(cluster, timeout)
    finally:
        cluster.close()


def _mid_run(cluster: Cluster, request_id: str) -> float:
    """Start an endless run on every node and let it get going; -> when the fault comes."""
    for r in range(3):
        cluster.nodes[r].send("run", request_id, 10**7)
    time.sleep(0.5)
    return time.monotonic()


def _dead_peer_fails_the_step_everywhere_then_the_mesh_heals(
    cluster: Cluster, timeout: float
) -> None:
    all_ok(cluster.run("before", 300))

    # the node process dies (kill -9): its envoy must exit by itself, the others fail at once
    orphan = cluster.nodes[2].envoy_pid
    t = _mid_run(cluster, "doomed-1")
    cluster.kill(2)
    _fails_naming(cluster, [0, 1], peer=2, since=t, within=timeout + 1.5)
    deadline = time.monotonic() + 5
    while alive(orphan) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(orphan), f"envoy {orphan} outlived its node"

    cluster.start(2)  # same address: the others redial it
    all_ok(cluster.run("after-1", 300))

    # the whole peer dies at once (node and envoy, kill -9)
    t = _mid_run(cluster, "doomed-2")
    cluster.kill(2, envoy_too=True)
    _fails_naming(cluster, [0, 1], peer=2, since=t, within=timeout + 1.5)

    cluster.start(2)
    all_ok(cluster.run("after-2", 300))


def _stalled_peer_times_out_naming_it(cluster: Cluster, timeout: float) -> None:
    all_ok(cluster.run("before-stall", 100))
    # the node and its envoy both, as a stopped machine
    stalled = (cluster.nodes[1].process.pid, cluster.nodes[1].envoy_pid)
    t = _mid_run(cluster, "stalled")
    import os

    for pid in stalled:
        os.kill(pid, signal.SIGSTOP)
    try:
        _fails_naming(cluster, [0, 2], peer=1, since=t, within=timeout + 1.5)
    finally:
        for pid in stalled:
            os.kill(pid, signal.SIGCONT)
    kind, message, _ = cluster.nodes[1].reply(timeout + 30)  # it fails too, once it runs again
    assert kind == "error" and "rank 1" in message, message
    all_ok(cluster.run("after", 300))  # frames of the aborted request are dropped, not mixed in


# -- the cluster secret --------------------------------------------------------------------------


def _health(address: str, metadata=(), credentials=None) -> dict:
    channel = (
        grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    )
    try:
        call = channel.unary_unary(
            convert.ENVOY_HEALTH,
            request_serializer=convert.envoy_health_request_to_wire,
            response_deserializer=convert.envoy_health_from_wire,
        )
        return call(None, metadata=metadata, timeout=5)
    finally:
        channel.close()


def test_callers_without_the_secret_get_unauthenticated_and_no_data(capfd):
    spec = envoy_spec(2, log_level="DEBUG", connect_timeout_s=3)
    cluster = Cluster(spec)
    try:
        address = spec.addresses[0]  # refusals come before any RPC runs, whole mesh or not
        for metadata in ((), (("x-moe-cluster-secret", "not-the-secret"),)):
            with pytest.raises(grpc.RpcError) as err:
                _health(address, metadata)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED

        # a stream opened with the wrong secret gets no Hello (no data channel), only the refusal
        channel = grpc.insecure_channel(address)
        try:
            exchange = channel.stream_stream(
                convert.ENVOY_EXCHANGE,
                request_serializer=convert.hello_to_wire,
                response_deserializer=convert.hello_from_wire,
            )
            received = []
            with pytest.raises(grpc.RpcError) as err:
                for hello in exchange(
                    iter([Hello(0, 2)]), metadata=(("x-moe-cluster-secret", "nope"),), timeout=5
                ):
                    received.append(hello)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and received == []
        finally:
            channel.close()

        all_ok(cluster.run("with-secret", 50))  # begin waits for the mesh to be whole
        health = _health(address, (("x-moe-cluster-secret", spec.secret),))
        assert health == {"rank": 0, "world_size": 2, "connected": [1], "whole": True}

        # a node configured with another secret never joins; the request fails naming it
        cluster.kill(1)
        cluster.start(1, spec=dataclasses.replace(spec, secret="some-other-secret"))
        replies = cluster.run("mixed-secrets", 10)
        kind, message, _ = replies[0]
        assert (
            kind == "error"
            and f"rank 1 ({spec.addresses[1]})" in message
            and "UNAUTHENTICATED" in message
        ), message
        assert replies[1][0] == "error"
    finally:
        cluster.close()
    captured = capfd.readouterr()
    logs = captured.out + captured.err
    assert "refused /moe_cluster.v1.Envoy/Health" in logs  # the envoys did log (at DEBUG), ...
    assert spec.secret not in logs and "some-other-secret" not in logs  # ... never the secret


def _data_answer(port: int, first: bytes) -> bytes:
    """What the data channel at `port` answers a connection that sends `first` (up to its newline)."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(first)
        answer = s.recv(1)
        if answer == b"-":
            answer += s.makefile("rb").readline()
        return answer


def test_the_data_channel_takes_only_the_token_its_stream_gave():
    """A data connection is accepted only with the token the higher rank's Hello handed the dialing
    rank over its authenticated stream, once; anything else is refused with a line saying why."""
    import threading

    spec = envoy_spec(2, connect_timeout_s=10)
    cluster = Cluster(spec, ranks=[1])  # rank 0 is missing: this test dials rank 1 as rank 0
    hold = threading.Event()
    channel = grpc.insecure_channel(spec.addresses[1])
    try:

        def hellos():
            yield Hello(0, 2)
            hold.wait(30)

        exchange = channel.stream_stream(
            convert.ENVOY_EXCHANGE,
            request_serializer=convert.hello_to_wire,
            response_deserializer=convert.hello_from_wire,
        )
        answers = exchange(hellos(), metadata=(("x-moe-cluster-secret", spec.secret),), timeout=30)
        offer = next(answers)
        assert (
            isinstance(offer, Hello)
            and offer.rank == 1
            and offer.data_port > 0
            and len(offer.data_token) == 32
        )
        assert "data_token" not in repr(offer)  # kept out of logs

        assert _data_answer(offer.data_port, b"GET / HTTP/1.1\r\n\r\n" + bytes(20)).startswith(
            b"-not the envoy data protocol"
        )
        wrong = "0" * 32 if offer.data_token != "0" * 32 else "1" * 32
        assert _data_answer(offer.data_port, handshake(0, wrong)).startswith(
            b"-wrong or stale data token"
        )
        assert _data_answer(offer.data_port, handshake(1, offer.data_token)).startswith(
            b"-wrong or stale"
        )  # not rank 1's
        assert _data_answer(offer.data_port, handshake(0, offer.data_token)) == b"+"
        assert _data_answer(offer.data_port, handshake(0, offer.data_token)).startswith(
            b"-wrong or stale"
        )  # once
        import socket

        with socket.create_connection(
            ("127.0.0.1", offer.data_port), timeout=HANDSHAKE_TIMEOUT_S + 5
        ) as idle:
            t0 = time.monotonic()  # says nothing: closed after the handshake timeout, with why
            assert idle.makefile("rb").readline() == b"-no handshake within 5 s\n"
            assert time.monotonic() - t0 < HANDSHAKE_TIMEOUT_S + 2
    finally:
        hold.set()
        channel.close()
    try:
        cluster.start(0)  # the real rank 0 dials, gets its own token, and the mesh works
        all_ok(cluster.run("after-refusals", 200))
        health = _health(spec.addresses[1], (("x-moe-cluster-secret", spec.secret),))
        assert health["connected"] == [0], health
    finally:
        cluster.close()


# -- TLS ------------------------------------------------------------------------------------------


def test_tls_mesh_and_refusals(tmp_path):
    pytest.importorskip(
        "cryptography", reason="the test extra makes its certificate with cryptography"
    )
    tls = make_tls(tmp_path)
    spec = envoy_spec(2, tls=tls)
    cluster = Cluster(spec)
    try:
        replies = cluster.run("over-tls", 500)
        all_ok(replies)
        # each node reads its frames from the socket pair its envoy relays the TLS channel over
        assert {rep[1]["frames_in"] for rep in replies.values()} == {500}, replies
        address, secret = spec.addresses[1], (("x-moe-cluster-secret", spec.secret),)
        ca, cert, key = (open(p, "rb").read() for p in (tls.ca, tls.cert, tls.key))
        with pytest.raises(grpc.RpcError) as err:  # plaintext to a TLS port
            _health(address, secret)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError) as err:  # TLS, but no client certificate
            _health(address, secret, grpc.ssl_channel_credentials(root_certificates=ca))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError) as err:  # a certificate, but no secret
            _health(address, (), grpc.ssl_channel_credentials(ca, key, cert))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        health = _health(address, secret, grpc.ssl_channel_credentials(ca, key, cert))
        assert health["whole"] and health["connected"] == [0], health
    finally:
        cluster.close()


def test_abort_fails_a_waiting_step_and_a_later_begin_at_once_then_the_next_request_runs():
    """A node's abort (its request failed elsewhere) ends the step waiting for a silent peer now,
    not at the 20 s step timeout; a begin of the aborted id fails on arrival; the mesh stays usable."""
    import threading

    from envoy_nodes import partial, step_layout
    from moe_cluster.node.collective.base import CollectiveError
    from moe_cluster.node.collective.envoy import EnvoyProcess
    from moe_cluster.node.collective.exchange import Outgoing

    step_timeout_s = 20.0
    # "at once" against "at the timeout": an abort with no effect ends the step only at the 20 s
    # timeout; a quarter of it leaves a loaded machine its margin and still tells the two apart
    at_once_s = step_timeout_s / 4
    spec = envoy_spec(2, timeout_s=step_timeout_s, connect_timeout_s=20.0)
    envoys = [EnvoyProcess(spec, r) for r in range(2)]
    try:
        layer, dtype, shape = step_layout(0)
        # both begin; only rank 0 reduces: its step waits for rank 1, which sends nothing
        other = threading.Thread(target=envoys[1].begin, args=("doomed",))
        other.start()
        caught: list = []
        begun = threading.Event()

        def reduce_alone():
            envoys[0].begin("doomed")
            begun.set()
            try:
                envoys[0].all_reduce(
                    Outgoing(partial(0, 0, (layer, dtype, shape)), dtype, shape, layer)
                )
            except CollectiveError as exc:
                caught.append((time.monotonic(), str(exc)))

        t = threading.Thread(target=reduce_alone)
        t.start()
        assert begun.wait(20), (
            "the mesh did not come up"
        )  # on a busy machine it can take over a second
        time.sleep(1.0)
        assert not caught, caught
        aborted = time.monotonic()
        envoys[0].abort("doomed")
        t.join(5)
        other.join(5)
        assert caught and caught[0][0] - aborted < at_once_s and "aborted" in caught[0][1], (
            caught,
            aborted,
        )

        envoys[0].abort("never-begun")
        t0 = time.monotonic()
        with pytest.raises(CollectiveError, match="aborted"):
            envoys[0].begin("never-begun")
        assert time.monotonic() - t0 < at_once_s

        _run_together(envoys, "after", 50)
    finally:
        for e in envoys:
            e.close()


def test_an_unreachable_data_channel_fails_in_one_line_naming_the_port_to_open(caplog):
    """A dialer that cannot reach its peer's data channel (here: closed right after it opened, as
    a firewall admitting only the envoy's port would leave it) does not count the peer as
    connected; why, the address and the port to open, is what a begin's failure names (the envoy's
    `last_error`) and what it logs, once."""
    import asyncio
    import secrets

    from moe_cluster.common.ports import free_ports
    from moe_cluster.envoy.mesh import Mesh, MeshConfig

    async def run() -> tuple[str, int, bool]:
        addresses = tuple(f"127.0.0.1:{p}" for p in free_ports(2))
        secret = secrets.token_hex(8)

        async def take(rank, channel):
            pass

        meshes = [
            Mesh(
                MeshConfig(r, addresses, addresses[r], secret),
                on_peer=lambda rank, up, why: None,
                on_channel=take,
            )
            for r in (0, 1)
        ]
        await meshes[1].start()
        meshes[1]._data_server.close()  # noqa: SLF001 - the port stays announced, nothing listens
        await meshes[1]._data_server.wait_closed()  # noqa: SLF001
        await meshes[0].start()
        try:
            deadline = time.monotonic() + 20
            while 1 not in meshes[0].last_error and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # a few redials more
            return meshes[0].last_error.get(1, ""), meshes[1].data_port, meshes[0].whole
        finally:
            for m in meshes:
                await m.close()

    why, port, whole = asyncio.run(run())
    assert not whole
    assert why.startswith(f"cannot reach its data channel at 127.0.0.1:{port} ("), why
    assert why.endswith(
        f"open TCP port {port} on 127.0.0.1 to this host (envoy_data_port in cluster.yaml fixes "
        "the port)"
    ), why
    logged = [
        r.getMessage() for r in caplog.records if "cannot reach its data channel" in r.message
    ]
    assert len(logged) == 1, logged  # once, however often it redials


def test_a_fixed_data_port_is_the_one_the_channel_takes_and_a_taken_one_is_one_line(capfd):
    """`envoy_data_port` (EnvoySpec.data_port): the envoy's data channel listens there, so a firewall
    can admit it, and the frames take it; a port already taken stops the envoy with one line."""
    import socket

    from moe_cluster.node.collective.base import CollectiveError
    from moe_cluster.node.collective.envoy import EnvoyProcess
    from moe_cluster.common.ports import free_ports

    spec = envoy_spec(2)
    (port,) = free_ports(1)
    fixed = dataclasses.replace(spec, data_port=port)
    with socket.create_server(("127.0.0.1", port)):
        with pytest.raises(CollectiveError):
            EnvoyProcess(fixed, 1)
    assert (
        f"cannot open its data channel on 127.0.0.1:{port}: Address already in use"
        in capfd.readouterr().err
    )
    envoys = [EnvoyProcess(spec, 0), EnvoyProcess(fixed, 1)]  # only ranks above 0 open a channel
    try:
        _run_together(envoys, "fixed", 40)
        health = _health(spec.addresses[1], (("x-moe-cluster-secret", spec.secret),))
        assert health["connected"] == [0], health
        with pytest.raises(OSError):  # rank 1's envoy listens on the port it was given
            socket.create_server(("127.0.0.1", port)).close()
    finally:
        for e in envoys:
            e.close()


def _run_together(envoys, request_id: str, steps: int) -> None:
    """One request of `steps` all-reduces on every envoy at once, each result checked."""
    import threading

    from envoy_nodes import run_request

    replies: dict = {}
    threads = [
        threading.Thread(
            target=lambda e=e: replies.__setitem__(e.rank, run_request(e, request_id, steps))
        )
        for e in envoys
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert {r: rep["steps"] for r, rep in replies.items()} == {e.rank: steps for e in envoys}, (
        replies
    )


def test_a_cold_step_waits_the_cold_bound_for_a_late_peer_and_a_warm_one_does_not():
    """A step its nodes mark cold (it may build kernels: minutes on a fresh CUDA host) waits for a
    peer past the step timeout; the steps after it fail at the timeout, naming the late peer."""
    import threading

    import numpy as np

    from envoy_nodes import expected, partial, step_layout
    from moe_cluster.node.collective.base import CollectiveError
    from moe_cluster.node.collective.envoy import EnvoyProcess
    from moe_cluster.node.collective.exchange import Outgoing

    # late past the node's own warm wait too (the timeout and its 5 s grace): both ends' bounds
    timeout_s, late_s = 1.0, 7.0
    spec = envoy_spec(2, timeout_s=timeout_s, cold_s=30.0, connect_timeout_s=20.0)
    envoys = [EnvoyProcess(spec, r) for r in range(2)]
    try:
        layer, dtype, shape = step_layout(0)
        replies: dict = {}

        def node(rank: int, cold: bool, delay_s: float) -> None:
            time.sleep(delay_s)
            try:
                raw = partial(0, rank, (layer, dtype, shape))
                out = envoys[rank].all_reduce(Outgoing(raw, dtype, shape, layer), cold=cold)
                replies[rank] = out.copy()
            except CollectiveError as exc:
                replies[rank] = str(exc)

        def step(cold: bool) -> dict:
            replies.clear()
            threads = [
                threading.Thread(target=node, args=(r, cold, late_s if r == 1 else 0.0))
                for r in range(2)
            ]
            for th in threads:
                th.start()
            for th in threads:
                th.join(40)
            return dict(replies)

        begins = [threading.Thread(target=e.begin, args=("late",)) for e in envoys]
        for th in begins:
            th.start()
        for th in begins:
            th.join(20)
        # the first two all-reduces of a node are cold by themselves (EnvoyCollective); marked here
        done = step(cold=True)
        want = expected(0, 2, (layer, dtype, shape))
        for r in range(2):
            assert not isinstance(done[r], str), done
            assert np.array_equal(done[r], want), r
        failed = step(cold=False)
        assert isinstance(failed[0], str), failed
        assert f"within {timeout_s:g} s" in failed[0] and "rank 1" in failed[0], failed[0]
    finally:
        for e in envoys:
            e.close()
