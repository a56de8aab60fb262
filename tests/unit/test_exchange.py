"""The node's exchange of the frames (node/collective/exchange.py), over socket pairs in-process.

Each test joins PeerExchanges by socket pairs as an envoy would hand them over, or plays the peer
by hand with proto/frame.py's encoder, and checks the sums by content and the failures by message.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import numpy as np
import pytest

from moe_cluster.node.collective.exchange import Outgoing, PeerExchange
from moe_cluster.node.collective.reduce import Reducer
from moe_cluster.node.collective.steps import StepError
from moe_cluster.proto.frame import Frame, encode

ADDRESSES = ("10.0.0.1:7000", "10.0.0.2:7000", "10.0.0.3:7000")


class _Node:
    """One PeerExchange with a dummy link; records the channels it gives up."""

    def __init__(self, rank: int, world: int):
        self._link_r, self._link_w = os.pipe()
        self.broken: list[tuple[int, str]] = []
        self.x = PeerExchange(
            rank,
            ADDRESSES[:world],
            lambda: [],
            self._link_r,
            lambda kind, body: None,
            lambda r, why: self.broken.append((r, why)),
        )

    def close(self) -> None:
        self.x.close()
        os.close(self._link_r)
        os.close(self._link_w)


def _mesh(world: int) -> list[_Node]:
    nodes = [_Node(r, world) for r in range(world)]
    for a in range(world):
        for b in range(a + 1, world):
            sa, sb = socket.socketpair()
            nodes[a].x.install(b, os.dup(sa.fileno()), b"")
            nodes[b].x.install(a, os.dup(sb.fileno()), b"")
            sa.close()
            sb.close()
    return nodes


def _partial(rank: int, step: int, n: int) -> np.ndarray:
    return ((np.arange(n) + 7 * rank + step) % 61).astype(np.float32)


def _run(node: _Node, request: str, sizes: list[int], results: dict, limit_s: float = 10.0):
    try:
        node.x.begin(request)
        for step, n in enumerate(sizes):
            node.x.send(
                Outgoing(_partial(node.x.rank, step, n), "float32", (n,), step % 3), step, limit_s
            )
            results[(node.x.rank, step)] = node.x.collect().copy()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        results[(node.x.rank, "error")] = exc


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_the_rank_order_sum_and_large_frames_do_not_deadlock(world):
    """Decode-sized steps and 8 MB ones (far past a socket pair's buffers, sent both ways at once:
    the sends and reads interleave), every result equal to the rank-order sum."""
    sizes = [6144, 6144, 2 << 20, 16, 6144, 2 << 20, 6144]
    nodes = _mesh(world)
    results: dict = {}
    threads = [threading.Thread(target=_run, args=(n, "r", sizes, results)) for n in nodes]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not [k for k in results if k[1] == "error"], results
        for step, n in enumerate(sizes):
            want = Reducer()([_partial(r, step, n) for r in range(world)], "float32")
            for r in range(world):
                assert np.array_equal(results[(r, step)], want), (r, step)
    finally:
        for n in nodes:
            n.close()


def _peer(rank: int = 1):
    """A PeerExchange of rank 0 and the raw socket of its peer `rank`, played by the test."""
    node = _Node(0, 2)
    mine, theirs = socket.socketpair()
    node.x.install(rank, os.dup(mine.fileno()), b"")
    mine.close()
    node.x.begin("q")
    return node, theirs


def _frame(request: str, step: int, rank: int, values: np.ndarray, layer: int = 0) -> bytes:
    return encode(Frame(request, step, layer, rank, "float32", values.shape, values.tobytes()))


def test_frames_read_ahead_or_handed_with_the_channel_are_kept_for_their_step():
    """The envoy hands over what it read past the handshake (a frame and a half here); a peer's
    frame of the next step and of the next request wait for theirs; one of an ended request is
    dropped."""
    node = _Node(0, 2)
    mine, theirs = socket.socketpair()
    ones = np.ones(4, np.float32)
    first = _frame("q", 0, 1, ones)
    second = _frame("q", 1, 1, 2 * ones)
    node.x.install(1, os.dup(mine.fileno()), first + second[:10])
    mine.close()
    try:
        node.x.begin("q")
        theirs.sendall(second[10:] + _frame("next", 0, 1, 5 * ones))
        for step, factor in ((0, 1), (1, 2)):
            node.x.send(Outgoing(ones, "float32", (4,), 0), step, 5.0)
            assert node.x.collect().tolist() == [1 + factor] * 4
        node.x.begin("next")
        node.x.send(Outgoing(ones, "float32", (4,), 0), 0, 5.0)
        assert node.x.collect().tolist() == [6.0] * 4
        theirs.sendall(_frame("q", 2, 1, ones) + _frame("next", 1, 1, 3 * ones))  # "q" ended
        node.x.send(Outgoing(ones, "float32", (4,), 0), 1, 5.0)
        assert node.x.collect().tolist() == [4.0] * 4
        assert node.x.table.dropped == 1
    finally:
        theirs.close()
        node.close()


def test_a_frame_taken_where_it_was_read_stays_intact_until_the_next_steps_are_read():
    """A decode-sized frame that is all the stage holds is handed over as a view of the stage and
    the channel reads on into its other stage: each step's parts keep their values while the next
    step's frame arrives and is read (and the pooled frame buffers are not those stages)."""
    node, theirs = _peer()
    try:
        kept = []
        for step in range(4):
            values = np.full(6144, step + 1, np.float32)
            theirs.sendall(_frame("q", step, 1, values))
            node.x.send(Outgoing(np.zeros(6144, np.float32), "float32", (6144,), 0), step, 5.0)
            done = node.x.collect_parts()
            assert done.parts[1].tolist() == values.tolist()
            kept.append(done.parts[1])
            if step:  # the previous step's part, read into the other stage, is as it was
                assert kept[-2].tolist() == [float(step)] * 6144
            assert not node.x._free and not node.x._loans  # nothing of a stage in the pool
    finally:
        theirs.close()
        node.close()


@pytest.mark.parametrize(
    "fault,expect",
    [
        ("garbage", "malformed"),
        ("close", "disconnected (data channel"),  # closed, or reset: our frame was unread
        ("wrong-rank", "sent a frame as rank 2"),
        ("other-layer", "is out of step at step 0"),
    ],
)
def test_a_peer_that_breaks_the_protocol_fails_the_step_naming_it(fault, expect):
    node, theirs = _peer()
    ones = np.ones(4, np.float32)
    try:
        node.x.send(Outgoing(ones, "float32", (4,), 0), 0, 5.0)
        if fault == "garbage":
            theirs.sendall(b"\xff" * 64)
        elif fault == "close":
            theirs.close()
        elif fault == "wrong-rank":
            theirs.sendall(_frame("q", 0, 2, ones))
        else:
            theirs.sendall(_frame("q", 0, 1, ones, layer=5))
        with pytest.raises(StepError) as err:
            node.x.collect()
        message = str(err.value)
        assert message.startswith("envoy rank 0: ") and expect in message, message
        if fault != "other-layer":  # the stream is unusable: the envoy is told to redial
            assert "rank 1 (10.0.0.2:7000)" in message, message
            assert [r for r, _ in node.broken] == [1], node.broken
        with pytest.raises(StepError, match="already failed"):  # the request's later steps
            node.x.send(Outgoing(ones, "float32", (4,), 0), 1, 5.0)
    finally:
        theirs.close()
        node.close()


def test_a_silent_peer_times_out_naming_it_and_abort_ends_a_wait_at_once():
    node, theirs = _peer()
    ones = np.ones(4, np.float32)
    try:
        t = time.monotonic()
        node.x.send(Outgoing(ones, "float32", (4,), 7), 0, 0.3)
        with pytest.raises(
            StepError,
            match=r"no frame from rank 1 \(10.0.0.2:7000\) for step 0 "
            r"\(layer 7\) of request q within 0.3 s",
        ):
            node.x.collect()
        assert 0.25 < time.monotonic() - t < 2.0
        assert node.broken == []  # nothing was cut mid-frame: the channel stays

        node.x.begin("r")
        theirs.recv(1 << 16)  # step 0's frame of "q"
        node.x.send(Outgoing(ones, "float32", (4,), 0), 0, 30.0)
        threading.Timer(0.2, node.x.abort, args=("r",)).start()
        t = time.monotonic()
        with pytest.raises(StepError, match="request r aborted: it failed on another node"):
            node.x.collect()
        assert time.monotonic() - t < 2.0
    finally:
        theirs.close()
        node.close()


def test_a_peer_without_a_channel_fails_the_step_with_why():
    node = _Node(0, 3)
    a, b = socket.socketpair()
    node.x.install(1, os.dup(a.fileno()), b"")
    node.x.lost(2, "stream failed: UNAVAILABLE")
    try:
        node.x.begin("q")
        with pytest.raises(StepError) as err:
            node.x.send(Outgoing(np.ones(4, np.float32), "float32", (4,), 3), 0, 5.0)
        assert "rank 2 (10.0.0.3:7000) is not connected (stream failed: UNAVAILABLE)" in str(
            err.value
        ), err.value
    finally:
        a.close()
        b.close()
        node.close()


def test_a_peer_lost_after_writing_its_frame_still_counts_for_the_step():
    """A peer that finished its last step closes; its envoy's LOST can reach this node before the
    frame it wrote is read here: the frame still completes the step, and only a frame missing
    when the stream ends fails it."""
    nodes = _mesh(2)
    try:
        for node in nodes:
            node.x.begin("r")
        nodes[0].x.send(Outgoing(_partial(0, 0, 8), "float32", (8,), 0), 0, 5.0)
        nodes[1].x.send(Outgoing(_partial(1, 0, 8), "float32", (8,), 0), 0, 5.0)
        nodes[0].x.collect()
        nodes[0].x.lost(1, "node closing")  # rank 0 is done and gone
        nodes[1].x.peer_lost(0, "envoy closing")  # before rank 0's frame was read here
        assert np.array_equal(nodes[1].x.collect(), _partial(0, 0, 8) + _partial(1, 0, 8))
        # a step whose frame never came fails at the stream's end, naming the peer
        a, b = socket.socketpair()
        nodes[1].x.install(0, os.dup(a.fileno()), b"")
        a.close()
        nodes[1].x.send(Outgoing(_partial(1, 1, 8), "float32", (8,), 0), 1, 5.0)
        b.close()  # the peer goes without writing its frame
        with pytest.raises(StepError, match=r"rank 0 \(10.0.0.1:7000\) disconnected"):
            nodes[1].x.peer_lost(0, "envoy closing")
    finally:
        for node in nodes:
            node.close()
