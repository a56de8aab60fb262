"""The data channel's frames on the wire (proto/frame.py), the stream's Hello, and the step
bookkeeping of one node's exchange (node/collective/steps.py)."""

from __future__ import annotations

import numpy as np
import pytest

from moe_cluster.node.collective.steps import StepError, StepTable
from moe_cluster.proto import convert
from moe_cluster.proto import frame as wire
from moe_cluster.proto.frame import PROTOCOL, Frame, FrameError, Hello


def make_frame(
    rank=1, step=0, layer=3, request="r1", payload=None, dtype="bfloat16", shape=None
) -> Frame:
    payload = np.arange(8, dtype=np.uint16) + rank if payload is None else payload
    shape = shape or (1, 1, payload.size)
    return Frame(request, step, layer, rank, dtype, shape, payload.tobytes())


# -- the stream's Hello ------------------------------------------------------------------------


def test_hello_round_trip():
    back = convert.hello_from_wire(convert.hello_to_wire(Hello(2, 4)))
    assert back == Hello(2, 4, PROTOCOL)


def test_hello_offers_the_data_channel_and_keeps_its_token_out_of_repr():
    hello = Hello(1, 2, data_port=40123, data_token="ab" * 16)
    assert convert.hello_from_wire(convert.hello_to_wire(hello)) == hello
    assert "ab" * 16 not in repr(hello)


# -- frames on the data channel ----------------------------------------------------------------


def test_data_channel_frames_round_trip_whole_split_and_several_at_once():
    frames = [
        make_frame(
            rank=r,
            step=s,
            request=f"req-{s}",
            payload=(np.arange(6, dtype=np.float32) * (r + s)),
            dtype="float32",
            shape=(2, 3),
        )
        for s in range(2)
        for r in range(2)
    ]
    wire_bytes = b"".join(wire.encode(f) for f in frames)
    got, at = [], 0
    while True:
        f, at = wire.decode(wire_bytes, at)
        if f is None:
            break
        got.append(f)
    assert at == len(wire_bytes)
    assert [(f.request_id, f.step, f.rank, f.dtype, f.shape, bytes(f.payload)) for f in got] == [
        (f.request_id, f.step, f.rank, f.dtype, f.shape, f.payload) for f in frames
    ]
    one = wire.encode(frames[0])
    for cut in (0, 5, wire.HEADER.size, len(one) - 1):  # an incomplete frame waits for more bytes
        assert wire.decode(one[:cut], 0) == (None, 0)
        # its size is known once its header is in
        want = len(one) if cut >= wire.HEADER.size else wire.HEADER.size
        assert wire.frame_size(one[:cut], 0) == want


def test_a_peers_header_is_this_nodes_with_its_rank():
    """What a node expects a peer's frame of the same step to start with, byte for byte."""
    mine = make_frame(rank=0, payload=np.zeros(8, np.uint16))
    theirs = make_frame(rank=2, payload=np.zeros(8, np.uint16))
    head = wire.encode(mine)[: -len(mine.payload)]
    assert wire.encode(theirs).startswith(wire.head_as(head, 2))


def test_a_malformed_data_channel_header_is_refused():
    good = bytearray(wire.encode(make_frame()))
    bad = bytearray(good)
    bad[0:4] = ((1 << 31) + 1).to_bytes(4, "little")  # a body past the limit
    with pytest.raises(FrameError, match="malformed"):
        wire.decode(bytes(bad), 0)
    bad = bytearray(good)
    bad[wire.HEADER.size - 4] = 200  # an unknown dtype code
    with pytest.raises(FrameError, match="dtype code 200"):
        wire.decode(bytes(bad), 0)


def test_a_data_channel_frame_whose_payload_disagrees_with_its_shape_is_refused():
    frame = make_frame(payload=np.arange(8, dtype=np.uint16), shape=(1, 1, 8))
    data = wire.encode(Frame(frame.request_id, 0, 3, 1, "bfloat16", (1, 1, 9), frame.payload))
    with pytest.raises(FrameError, match="16 payload bytes for shape \\[1, 1, 9\\] of bfloat16"):
        wire.decode(data, 0)


def test_the_handshake_carries_the_rank_and_the_token():
    magic, rank, token = wire.HANDSHAKE.unpack(wire.handshake(3, "k" * 32))
    assert (magic, rank, token) == (wire.MAGIC, 3, b"k" * 32)


# -- step table --------------------------------------------------------------------------------


def own(rank=0, n=8):
    return np.arange(n, dtype=np.uint16) + rank


def test_step_completes_in_rank_order_whatever_the_arrival_order():
    t = StepTable(rank=1, world_size=3)
    t.begin("r1")
    assert t.receive(make_frame(rank=2)) is None  # early: this node has not submitted step 0
    assert t.submit(0, 3, "bfloat16", (1, 1, 8), own(1)) is None
    done = t.receive(make_frame(rank=0))
    assert done is not None and done.step == 0 and t.pending is None and t.next_step == 1
    for r, part in enumerate(done.parts):
        np.testing.assert_array_equal(part, own(r))


def test_peer_one_step_ahead_is_kept():
    t = StepTable(rank=0, world_size=3)
    t.begin("r1")
    t.submit(0, 3, "bfloat16", (1, 1, 8), own(0))
    t.receive(make_frame(rank=1, step=0))
    assert t.receive(make_frame(rank=1, step=1, layer=4)) is None  # rank 1 finished step 0 already
    assert t.receive(make_frame(rank=2, step=0)) is not None
    assert t.submit(1, 4, "bfloat16", (1, 1, 8), own(0)) is None
    assert t.pending.missing() == [2]


def test_frames_of_an_ended_request_are_dropped_and_the_next_request_is_kept():
    t = StepTable(rank=0, world_size=2)
    t.begin("r1")
    t.submit(0, 3, "bfloat16", (1, 1, 8), own(0))
    t.fail("rank 1 stalled")
    with pytest.raises(StepError, match="request r1 already failed: rank 1 stalled"):
        t.submit(1, 3, "bfloat16", (1, 1, 8), own(0))
    t.receive(make_frame(rank=1, request="r2"))  # the peer began r2 first
    t.begin("r2")
    assert t.receive(make_frame(rank=1, request="r1")) is None  # late frame of the aborted request
    assert t.dropped == 1
    assert t.submit(0, 3, "bfloat16", (1, 1, 8), own(0)) is not None  # r2's early frame was kept


def test_duplicates_and_disagreements_fail_the_request():
    t = StepTable(rank=0, world_size=3)
    t.begin("r1")
    t.submit(0, 3, "bfloat16", (1, 1, 8), own(0))
    t.receive(make_frame(rank=1))
    with pytest.raises(StepError, match="rank 1 sent step 0 of request r1 twice"):
        t.receive(make_frame(rank=1))
    with pytest.raises(
        StepError, match="rank 2 is out of step at step 0 .*layer 4 bfloat16.*layer 3 bfloat16"
    ):
        t.receive(make_frame(rank=2, layer=4))
    with pytest.raises(StepError, match="rank 2 is ahead: it sent step 2"):
        t.receive(make_frame(rank=2, step=2))
    with pytest.raises(StepError, match="claims rank 5"):
        t.receive(make_frame(rank=5))
    short = make_frame(rank=2)  # the shape agrees, the bytes do not (the frame has no CRC)
    short = Frame(short.request_id, 0, 3, 2, "bfloat16", (1, 1, 8), short.payload[:-2])
    with pytest.raises(
        StepError, match="rank 2 sent 14 bytes for step 0 of request r1, this node has 16"
    ):
        t.receive(short)


def test_submit_out_of_order_is_refused():
    t = StepTable(rank=0, world_size=2)
    with pytest.raises(StepError, match="no request begun"):
        t.submit(0, 0, "float32", (1,), np.zeros(1, np.float32))
    t.begin("r")
    with pytest.raises(StepError, match="submitted step 3 of request r, expected step 0"):
        t.submit(3, 0, "float32", (1,), np.zeros(1, np.float32))


def test_early_frames_are_bounded():
    t = StepTable(rank=0, world_size=2, max_early=3)
    t.begin("r0")
    for i in range(5):  # a peer ran requests this node never began
        t.receive(make_frame(rank=1, request=f"other-{i}"))
    assert t.evicted == 2
