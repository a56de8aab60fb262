"""Frames on the wire (encode/decode, checksum) and the step bookkeeping of one envoy."""

from __future__ import annotations

import numpy as np
import pytest

from moe_cluster.envoy import data
from moe_cluster.proto.frame import PROTOCOL, Frame, FrameError, Hello, checksum
from moe_cluster.envoy.steps import StepError, StepTable
from moe_cluster.proto import convert
from moe_cluster.proto import envoy_pb2


def make_frame(
    rank=1, step=0, layer=3, request="r1", payload=None, dtype="bfloat16", shape=None
) -> Frame:
    payload = np.arange(8, dtype=np.uint16) + rank if payload is None else payload
    shape = shape or (1, 1, payload.size)
    return Frame(request, step, layer, rank, dtype, shape, checksum(payload), payload.tobytes())


# -- encode / decode ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype,np_dtype", [("bfloat16", np.uint16), ("float16", np.float16), ("float32", np.float32)]
)
def test_frame_round_trip(dtype, np_dtype):
    payload = (np.arange(32 * 6, dtype=np.float32) - 7).astype(np_dtype)
    frame = Frame(
        "req-7", 41, -1, 3, dtype, (32, 6), checksum(payload), payload
    )  # payload: any buffer
    wire = convert.frame_to_wire(frame)
    back = convert.frame_from_wire(wire)
    assert isinstance(back, Frame)
    assert (back.request_id, back.step, back.layer, back.rank, back.dtype, back.shape) == (
        "req-7",
        41,
        -1,
        3,
        dtype,
        (32, 6),
    )
    assert back.checksum == checksum(payload)
    np.testing.assert_array_equal(np.frombuffer(back.payload, np_dtype), payload)
    back.verify()


def test_wire_is_plain_protobuf():
    """The hand-appended payload field parses (and serializes) as protobuf's own encoding."""
    payload = np.arange(300, dtype=np.uint16)
    frame = Frame("r", 2, 5, 1, "bfloat16", (1, 300), checksum(payload), payload)
    ref = envoy_pb2.Frame(
        request_id="r",
        step=2,
        layer=5,
        rank=1,
        dtype=envoy_pb2.DTYPE_BFLOAT16,
        shape=[1, 300],
        checksum=checksum(payload),
        payload=payload.tobytes(),
    )
    assert convert.frame_to_wire(frame) == ref.SerializeToString()


def test_hello_round_trip():
    back = convert.frame_from_wire(convert.frame_to_wire(Hello(2, 4)))
    assert back == Hello(2, 4, PROTOCOL)


def test_hello_offers_the_data_channel_and_keeps_its_token_out_of_repr():
    hello = Hello(1, 2, data_port=40123, data_token="ab" * 16)
    assert convert.frame_from_wire(convert.frame_to_wire(hello)) == hello
    assert "ab" * 16 not in repr(hello)


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
    wire = b"".join(data.encode(f) for f in frames)
    got, at = [], 0
    while True:
        f, at = data.decode(wire, at)
        if f is None:
            break
        got.append(f)
    assert at == len(wire)
    assert [(f.request_id, f.step, f.rank, f.dtype, f.shape, f.payload) for f in got] == [
        (f.request_id, f.step, f.rank, f.dtype, f.shape, f.payload) for f in frames
    ]
    assert all(
        f.checksum is None for f in got
    )  # TCP guards the data channel; verify() has nothing to check
    got[0].verify()
    one = data.encode(frames[0])
    for cut in (0, 5, data.HEADER.size, len(one) - 1):  # an incomplete frame waits for more bytes
        assert data.decode(one[:cut], 0) == (None, 0)


def test_a_malformed_data_channel_header_is_refused():
    good = bytearray(data.encode(make_frame()))
    bad = bytearray(good)
    bad[0:4] = ((1 << 31) + 1).to_bytes(4, "little")  # a body past the limit
    with pytest.raises(FrameError, match="malformed"):
        data.decode(bytes(bad), 0)
    bad = bytearray(good)
    bad[data.HEADER.size - 4] = 200  # an unknown dtype code
    with pytest.raises(FrameError, match="dtype code 200"):
        data.decode(bytes(bad), 0)


def test_checksum_catches_corruption():
    frame = make_frame()
    frame.verify()
    corrupt = bytearray(frame.payload)
    corrupt[3] ^= 0x10
    bad = Frame(
        frame.request_id,
        frame.step,
        frame.layer,
        frame.rank,
        frame.dtype,
        frame.shape,
        frame.checksum,
        bytes(corrupt),
    )
    with pytest.raises(FrameError, match="from rank 1 .*request r1, step 0, layer 3.* is corrupt"):
        bad.verify()


def test_unknown_dtype_is_refused():
    wire = envoy_pb2.Frame(
        request_id="r", rank=2, dtype=envoy_pb2.DTYPE_UNSPECIFIED
    ).SerializeToString()
    with pytest.raises(convert.ConvertError, match="rank 2 has unknown dtype 0"):
        convert.frame_from_wire(wire)


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
    short = make_frame(
        rank=2
    )  # the shape agrees, the bytes do not (a data channel frame has no CRC)
    short = Frame(short.request_id, 0, 3, 2, "bfloat16", (1, 1, 8), None, short.payload[:-2])
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


def test_a_frame_sent_on_a_lost_data_channel_is_dropped_not_raised():
    """uvloop raises on a write to a closed transport: a peer whose connection was reset, before the
    mesh has marked it down, must not take the envoy's callback (and its answer to the node) with it."""
    import asyncio

    uvloop = pytest.importorskip("uvloop")

    async def run() -> str:
        loop = asyncio.get_running_loop()
        accepted: list = []

        def claim(rank, token, conn):
            accepted.append(conn)
            return "" if data.token_ok(token, "t" * 32) else "wrong"

        server = await loop.create_server(lambda: data.DataConnection(claim=claim), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        _, dialer = await loop.create_connection(
            lambda: data.DataConnection(hello=data.handshake(0, "t" * 32)), "127.0.0.1", port
        )
        await asyncio.wait_for(dialer.ready, 5)
        accepted[0].transport.abort()  # the peer's end resets
        why = await asyncio.wait_for(dialer.lost, 5)
        dialer.send(data.encode(make_frame()))  # must not raise
        server.close()
        return why

    assert "data channel closed" in uvloop.run(run())


class _Transport:
    """What a DataConnection uses of an asyncio transport."""

    def __init__(self):
        self.written = bytearray()
        self.closed = False

    def get_extra_info(self, name):
        return None

    def write(self, data):
        self.written += data

    def is_closing(self):
        return self.closed

    def close(self):
        self.closed = True


@pytest.mark.parametrize("piece", [1, 7, 4096, 1 << 20])
def test_the_data_channel_reassembles_reads_of_any_size(piece):
    """Handshake and frames in reads of 1 byte to 1 MiB (split and coalesced): every frame arrives
    whole, in order, the ones before attach() included; a 3 MiB frame among small ones too."""
    import asyncio

    big = make_frame(
        step=1, payload=np.arange(3 << 19, dtype=np.float32), dtype="float32", shape=(3 << 19,)
    )
    frames = [make_frame(step=0), big, make_frame(step=2, rank=1)]
    wire = data.handshake(0, "k" * 32) + b"".join(data.encode(f) for f in frames)

    async def run():
        got: list = []
        conn = data.DataConnection(
            claim=lambda rank, token, c: "" if data.token_ok(token, "k" * 32) else "no"
        )
        transport = _Transport()
        conn.connection_made(transport)
        for at in range(0, len(wire), piece):
            if at >= len(wire) // 2 and conn._on_frame is None:  # noqa: SLF001 - attach half-way
                conn.attach(got.append)
            conn.data_received(wire[at : at + piece])
        if conn._on_frame is None:  # noqa: SLF001
            conn.attach(got.append)
        return got, bytes(transport.written), conn.rank

    got, answered, rank = asyncio.run(run())
    assert answered == b"+" and rank == 0
    assert [(f.step, f.rank, f.shape, f.payload) for f in got] == [
        (f.step, f.rank, tuple(f.shape), f.payload) for f in frames
    ]


def test_a_data_channel_frame_whose_payload_disagrees_with_its_shape_is_refused():
    frame = make_frame(payload=np.arange(8, dtype=np.uint16), shape=(1, 1, 8))
    wire = data.encode(Frame(frame.request_id, 0, 3, 1, "bfloat16", (1, 1, 9), None, frame.payload))
    with pytest.raises(FrameError, match="16 payload bytes for shape \\[1, 1, 9\\] of bfloat16"):
        data.decode(wire, 0)


def test_a_frame_sent_from_changing_memory_arrives_as_it_was_when_sent():
    """send_parts writes the payload (the node's shared memory, rewritten for the next step as soon
    as the answer comes) to the socket uncopied; what the socket cannot take at once must be copied,
    or the peer would read the next step's bytes. Frames far larger than the socket's buffers,
    each followed at once by a scribble over its payload, arrive intact and in order."""
    import asyncio

    uvloop = pytest.importorskip("uvloop")
    big = (6 << 20) // 4  # values per frame: 6 MiB, past what the kernel takes in one send

    async def run() -> tuple[list, int]:
        loop = asyncio.get_running_loop()
        accepted: list = []
        got: list = []

        def claim(rank, token, conn):
            accepted.append(conn)
            return ""

        server = await loop.create_server(lambda: data.DataConnection(claim=claim), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        _, dialer = await loop.create_connection(
            lambda: data.DataConnection(hello=data.handshake(0, "t" * 32)), "127.0.0.1", port
        )
        await asyncio.wait_for(dialer.ready, 5)
        while not accepted or not accepted[0]._open:  # noqa: SLF001 - the handshake's answer is on its way
            await asyncio.sleep(0.01)
        accepted[0].attach(
            lambda f: got.append((f.step, np.frombuffer(f.payload, np.float32).copy()))
        )
        shared = np.empty(big, np.float32)  # one buffer, as the link's request area
        partial_sends = 0
        for step in range(3):
            shared[:] = step + 1
            dialer.send_parts(
                *data.encode_parts(Frame("r", step, 0, 0, "float32", (big,), None, shared))
            )
            partial_sends += dialer.transport.get_write_buffer_size() > 0
            shared[:] = -1  # the next step's partial lands at once
        while len(got) < 3:
            await asyncio.sleep(0.01)
        dialer.close()
        server.close()
        return got, partial_sends

    got, partial_sends = uvloop.run(run())
    assert partial_sends > 0  # the socket did not take every frame whole: the copy was needed
    assert [step for step, _ in got] == [0, 1, 2]
    for step, values in got:
        assert values.size == big and np.all(values == step + 1), (step, np.unique(values)[:5])
