"""The node's exchange of the frames with its peers, on the data channels its envoy hands it.

The envoy keeps what it is there for (the gRPC streams, the cluster secret, TLS, the redials and
the peers' liveness) and hands each authenticated data channel's socket to its node
(proto/envoy_link.py `CHANNEL`); the node writes its frame to every peer and reads theirs
itself, so the one wake-up on an all-reduce's critical path is a peer's frame arriving. A peer reached over TLS comes as one
end of a socket pair, which its envoy relays to the TLS channel byte for byte: it looks the same
from here. Frames are proto/frame.py's, checked by steps.py's table and summed in rank order in
float32 (reduce.py).

The node is told over its link when a peer is lost (`LOST`: it closes its socket) and tells its
envoy when it dropped a channel (`BROKEN`: a peer that closed it, spoke garbage or could not take a
frame in time; the envoy then ends that peer's stream and redials). Sends and reads interleave, so
two nodes sending each other a frame larger than the sockets' buffers do not block each other.
"""

from __future__ import annotations

import os
import select
import socket
import time
from typing import Callable, NamedTuple

import numpy as np

from ...proto import frame as wire
from ...proto.frame import FrameError
from .reduce import DTYPES, Reducer
from .spin import SpinPolicy
from .steps import Complete, StepError, StepTable

_STAGE_BYTES = 1 << 16  # each channel reads into this much first: a small frame takes one recv
_IN, _OUT = select.POLLIN, select.POLLOUT
_GONE = select.POLLERR | select.POLLHUP | getattr(select, "POLLRDHUP", 0)
# A frame still half-written when its step fails leaves the stream cut mid-frame: the channel is
# dropped then, unless the rest goes within this long.
_FLUSH_S = 1.0


class Outgoing(NamedTuple):
    """This node's partial of one all-reduce as it goes to the peers (a tuple: made once per
    all-reduce, as steps.Complete): its raw payload, the wire dtype, the shape it stands for, and
    the MoE layer of the step (-1: the agreement). The step table checks each against the peers'."""

    raw: np.ndarray
    dtype: str
    shape: tuple[int, ...]
    layer: int


class _Channel:
    """One peer's socket: what is read of its next frame, and what is left to write of ours."""

    __slots__ = ("rank", "sock", "stage", "spare", "have", "body", "got", "out")

    def __init__(self, rank: int, sock: socket.socket):
        self.rank = rank
        self.sock = sock
        self.stage = bytearray(_STAGE_BYTES)
        # a frame that is all the stage holds is handed over where it lies, and the next reads go
        # to the other stage: the two take turns, a step's parts being read before the next send
        self.spare = bytearray(_STAGE_BYTES)
        self.have = 0  # bytes of `stage` read and not yet parsed
        self.body: np.ndarray | None = None  # a frame too large for the stage: read straight here
        self.got = 0  # bytes of `body` in
        self.out: list[memoryview] = []  # the rest of our latest frame to this peer


class PeerExchange:
    """All-reduces over the peers' sockets (`install`ed as the envoy hands them), in this thread.

    `send` writes this node's frame to every peer and returns; `collect` waits for the step's sum
    (raw values of the partial's dtype, a view valid until the next step) and `collect_parts` for
    every rank's partial, for the caller to sum. `abort` may come from any thread.
    `messages` reads the link while a step waits, so a peer the envoy saw go fails the step at once.
    """

    def __init__(
        self,
        rank: int,
        addresses: tuple[str, ...],
        messages: Callable[[], list[tuple[int, bytes]]],
        link_fd: int,
        on_message: Callable[[int, bytes], None],
        broken: Callable[[int, str], None],
        reduce: Reducer | None = None,
    ):
        self.rank = rank
        self.addresses = addresses
        self.world_size = len(addresses)
        self.table = StepTable(rank, self.world_size)
        self._messages = messages
        self._on_message = on_message
        self._broken = broken
        self._channels: dict[int, _Channel] = {}
        self._by_fd: dict[int, _Channel] = {}
        self._why: dict[int, str] = {}  # why a peer has no channel
        self._poll = select.poll()
        self._link_fd = link_fd
        self._poll.register(link_fd, _IN)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poll.register(self._wake_r, _IN)
        self._aborted: str | None = None
        self._reduce = reduce if reduce is not None else Reducer()
        self._spin = SpinPolicy()
        self._free: list[np.ndarray] = []  # frame buffers to reuse
        self._loans: dict[tuple[str, int, int], np.ndarray] = {}  # a kept frame's buffer
        self._sums: dict[str, np.ndarray] = {}  # by dtype: collect's result buffer
        self._pending: tuple[int, int, float] | None = (
            None  # (step, layer, limit s) being collected
        )
        self._done: Complete | None = None
        self._sent_at = 0.0
        self._rid = b""  # the current request's id, as frames carry it
        self._expect: dict[int, bytes] = {}  # rank -> how its frame for the pending step starts
        self.frames_in = self.frames_out = 0  # for tests and benchmarks
        # `bench allreduce --trace` (trace.py): perf_counter_ns stamps of the
        # latest step (this node's frame out, the step's last partial in) and of each frame read
        self.stamps = False
        self.writing_ns = self.sent_ns = self.complete_ns = 0
        self._arrived: dict[tuple[str, int, int], int] = {}

    def describe(self, rank: int) -> str:
        return f"rank {rank} ({self.addresses[rank]})"

    # -- the channels --------------------------------------------------------------------------

    def install(self, rank: int, fd: int, extra: bytes) -> None:
        """The envoy handed over `rank`'s channel (`extra`: bytes it read past the handshake)."""
        self.lost(rank, "replaced by a new channel")
        sock = socket.socket(fileno=fd)
        sock.setblocking(False)
        ch = _Channel(rank, sock)
        self._channels[rank] = ch
        self._by_fd[sock.fileno()] = ch
        self._why.pop(rank, None)
        self._poll.register(sock.fileno(), _IN)
        if extra:
            ch.stage[: len(extra)] = extra
            if len(extra) > _STAGE_BYTES:
                ch.stage = bytearray(extra)
            ch.have = len(extra)
            self._parse(ch)

    def lost(self, rank: int, why: str) -> None:
        """The peer is gone (its stream ended, or this node dropped it): close the socket."""
        ch = self._channels.pop(rank, None)
        self._why[rank] = why
        if ch is None:
            return
        self._by_fd.pop(ch.sock.fileno(), None)
        try:
            self._poll.unregister(ch.sock.fileno())
        except (KeyError, ValueError):
            pass
        ch.sock.close()

    def _drop(self, ch: _Channel, why: str) -> None:
        """This node gives up the channel: close it, and have the envoy redial the peer."""
        self.lost(ch.rank, why)
        self._broken(ch.rank, why)

    # -- requests ------------------------------------------------------------------------------

    def begin(self, request_id: str) -> None:
        self.table.begin(request_id)
        self._rid = request_id.encode()
        self._loans = {k: v for k, v in self._loans.items() if k[0] == request_id}
        self._pending = self._done = None

    def abort(self, request_id: str) -> None:
        """Fail `request_id`'s step now if it waits, and its later steps (any thread)."""
        self._aborted = request_id
        try:
            os.write(self._wake_w, b"!")
        except (BlockingIOError, OSError):
            pass  # a byte is waiting already, or the exchange is closed

    def send(
        self,
        out: Outgoing,
        step: int,
        limit_s: float,
        each: dict[int, np.ndarray] | None = None,
    ) -> None:
        """Write this node's partial `out` for `step` to every peer (what a socket does not take
        now goes in `collect`); its raw payload must stay as it is until then. `each`: a payload per
        peer instead (a reduce-scatter: each peer gets its own rows of this node's partial), shaped
        as the raw payload is, which is what each peer sends this node in turn (the step table
        checks it)."""
        raw, dtype, shape, layer = out
        table = self.table
        if self._aborted is not None and self._aborted == table.current:
            table.fail(f"request {table.current} aborted: it failed on another node")
        table.admit(step)
        if len(self._channels) < self.world_size - 1:
            missing = [
                r for r in range(self.world_size) if r != self.rank and r not in self._channels
            ]
            names = "; ".join(
                f"{self.describe(r)} is not connected ({self._why.get(r, 'never connected')})"
                for r in missing
            )
            raise self._fail(f"{names} (step {step}, layer {layer} of request {table.current})")
        payload = raw.reshape(-1)
        body = memoryview(payload).cast("B")
        shape = tuple(shape)
        head = wire.frame_head(self._rid, step, layer, self.rank, dtype, shape, body.nbytes)
        # what each peer's frame for this step starts with, byte for byte: a frame that does is
        # taken without parsing it (`_expected`)
        self._expect = {r: wire.head_as(head, r) for r in self._channels}
        self._sent_at = time.monotonic()
        self._pending = (step, layer, limit_s)
        total = len(head) + body.nbytes
        if self.stamps:
            self.writing_ns = time.perf_counter_ns()
        for ch in list(self._channels.values()):
            if each is not None:
                body = memoryview(each[ch.rank].reshape(-1)).cast("B")
                head = wire.frame_head(
                    self._rid,
                    step,
                    layer,
                    self.rank,
                    dtype,
                    tuple(each[ch.rank].shape),
                    body.nbytes,
                )
                total = len(head) + body.nbytes
            try:
                sent = ch.sock.sendmsg((head, body))
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                self._drop(ch, f"data channel failed ({exc})")
                raise self._fail(self._disconnected(ch.rank, f"data channel failed ({exc})"))
            if sent < total:
                ch.out = (
                    [memoryview(head)[sent:], body]
                    if sent < len(head)
                    else [body[sent - len(head) :]]
                )
                self._poll.modify(ch.sock.fileno(), _IN | _OUT)
            self.frames_out += 1
        if self.stamps:
            self.sent_ns = time.perf_counter_ns()
        try:
            self._done = table.submit(step, layer, dtype, shape, payload)
        except (StepError, FrameError) as exc:
            raise self._fail(str(exc)) from None

    def collect(self) -> np.ndarray:
        """Wait for the sum of the step `send` started (see the class); StepError naming the peer
        if it fails."""
        return self._sum_into(self.collect_parts())

    def collect_parts(self) -> Complete:
        """Wait for every peer's partial of the step `send` started: the raw payloads in rank order
        (this node's is the one it sent), views valid until the next `send`, for the caller to sum
        (envoy.py sums them, on the host or in MLX inside the step's graph)."""
        assert self._pending is not None, "collect without send"
        step, layer, limit_s = self._pending
        deadline = self._sent_at + limit_s
        for ch in list(self._channels.values()):
            if self._done is None:
                self._read(ch)
        if self._done is None and len(self._channels) == 1:
            spin = self._spin.budget_s()
            if spin:  # idle cores: poll the socket a while rather than sleep (spin.py)
                ch = next(iter(self._channels.values()))
                end = time.perf_counter() + spin
                while self._done is None and self._channels.get(ch.rank) is ch:
                    self._read(ch)
                    if time.perf_counter() > end:
                        break
        while self._done is None or self._unsent():
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._fail(self._stalled(step, layer, limit_s))
            events = self._poll.poll(max(int(left * 1000) + 1, 1))
            for fd, ev in events:
                ch = self._by_fd.get(fd)
                if ch is not None:
                    if ev & _OUT and ch.out:
                        self._write(ch)
                    if self._channels.get(ch.rank) is ch and ev & (_IN | _GONE):
                        self._read(ch)
                elif fd == self._wake_r:
                    self._woken()
                elif fd == self._link_fd:
                    self._from_link()
        done, self._done, self._pending = self._done, None, None
        if self.stamps:
            self.complete_ns = time.perf_counter_ns()
        # the buffers go back to the pool now: nothing reads into them before the next send
        if self._loans:
            for r in range(self.world_size):
                buf = self._loans.pop((self.table.current, done.step, r), None)
                if buf is not None:
                    self._free.append(buf)
        return done

    def _unsent(self) -> bool:
        for ch in self._channels.values():
            if ch.out:
                return True
        return False

    def _sum_into(self, done: Complete) -> np.ndarray:
        n = done.nbytes // DTYPES[done.dtype].itemsize
        out = self._sums.get(done.dtype)
        if out is None or out.size < n:
            # 64 bytes into the allocation: a large buffer from numpy starts 16 bytes into a page,
            # where MLX's copy out of it ran 10x slower (4K aliasing; docs/envoy.md)
            raw = np.empty(done.nbytes + 64, np.uint8)[64:]
            out = self._sums[done.dtype] = raw.view(DTYPES[done.dtype])
        return self._reduce(done.parts, done.dtype, out[:n])

    # -- inside --------------------------------------------------------------------------------

    def _read(self, ch: _Channel) -> None:
        """Everything `ch`'s socket has now, its frames handed to the step table."""
        while self._channels.get(ch.rank) is ch:
            try:
                if ch.body is not None:
                    k = ch.sock.recv_into(memoryview(ch.body)[ch.got :])
                else:
                    k = ch.sock.recv_into(memoryview(ch.stage)[ch.have :])
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._gone(ch, f"data channel failed ({exc})")
                return
            if k == 0:
                self._gone(ch, "data channel closed")
                return
            if ch.body is not None:
                ch.got += k
                if ch.got == len(ch.body):
                    body, ch.body = ch.body, None
                    self._frame(ch, body, len(body))
            else:
                ch.have += k
                self._parse(ch)
            if self._done is not None and self._pending is not None:
                return  # what else is there waits for the next step

    def _parse(self, ch: _Channel) -> None:
        """Frames out of `ch.stage`; a frame larger than what is left continues into its own buffer."""
        stage, at = ch.stage, 0
        try:
            while ch.have - at >= wire.HEADER.size:
                expect = self._expect.get(ch.rank)
                if expect is not None and stage.startswith(expect, at):
                    size = wire.HEADER.size + wire.HEADER.unpack_from(stage, at)[0]
                    if at == 0 and size == ch.have:  # all the stage holds: no copy (_Channel)
                        ch.stage, ch.spare, ch.have = ch.spare, stage, 0
                        buf = np.frombuffer(stage, np.uint8, size)
                        self._expected(ch, buf, len(expect), size, pooled=False)
                        return
                    if ch.have - at >= size:
                        buf = self._buffer(size)
                        buf[:size] = np.frombuffer(stage, np.uint8, size, at)
                        at += size
                        self._expected(ch, buf, len(expect), size)
                        continue
                size = wire.frame_size(stage, at)
                if ch.have - at >= size:
                    buf = self._buffer(size)
                    buf[:size] = np.frombuffer(stage, np.uint8, size, at)
                    at += size
                    self._frame(ch, buf, size)
                    if self._channels.get(ch.rank) is not ch:
                        return
                else:
                    buf = self._buffer(size)
                    part = ch.have - at
                    buf[:part] = np.frombuffer(stage, np.uint8, part, at)
                    ch.body, ch.got = buf[:size], part
                    at = ch.have
                    break
        except FrameError as exc:
            self._gone(ch, str(exc))
            return
        rest = ch.have - at
        if rest and at:
            stage[:rest] = stage[at : ch.have]
        ch.have = rest

    def _buffer(self, size: int) -> np.ndarray:
        for i, buf in enumerate(self._free):
            if size <= buf.size <= 4 * size + 4096:
                return self._free.pop(i)
        return np.empty(max(size, 4096), np.uint8)

    def _expected(
        self, ch: _Channel, buf: np.ndarray, start: int, size: int, pooled: bool = True
    ) -> None:
        """`ch`'s frame for the pending step, its header as `send` expected (no parsing); `buf`
        a pooled buffer, or (`pooled` False) a view of the stage it was read into."""
        self.frames_in += 1
        del self._expect[ch.rank]
        p = self.table.pending
        if self.stamps:
            self._stamp(p.request_id, p.step, ch.rank)
        part = buf[start:size].view(DTYPES[p.dtype])
        if pooled:
            self._loans[(p.request_id, p.step, ch.rank)] = buf
        done = self.table.take(ch.rank, part)
        if done is not None:
            self._done = done

    def _frame(self, ch: _Channel, buf: np.ndarray, size: int) -> None:
        expect = self._expect.get(ch.rank)
        if expect is not None and buf[: len(expect)].tobytes() == expect:
            self._expected(ch, buf, len(expect), size)
            return
        self.frames_in += 1
        try:
            frame, _ = wire.decode(memoryview(buf)[:size].toreadonly(), 0)
            if frame.rank != ch.rank:
                raise FrameError(f"{self.describe(ch.rank)} sent a frame as rank {frame.rank}")
        except FrameError as exc:
            self._gone(ch, str(exc))
            return
        if self.stamps:
            self._stamp(frame.request_id, frame.step, frame.rank)
        dropped = self.table.dropped
        try:
            done = self.table.receive(frame)
        except (StepError, FrameError) as exc:
            self._free.append(buf)
            if self._pending is not None:
                raise self._fail(str(exc)) from None
            self.table.fail(str(exc))
            return
        if self.table.dropped != dropped:
            self._free.append(buf)
            return
        self._loans[(frame.request_id, frame.step, frame.rank)] = buf
        if done is not None:
            self._done = done

    def _stamp(self, request_id: str, step: int, rank: int) -> None:
        if len(self._arrived) > 256:  # frames of steps that never finished here
            self._arrived.clear()
        self._arrived[(request_id, step, rank)] = time.perf_counter_ns()

    def arrivals(self, step: int) -> list[int]:
        """When each rank's frame of `step` (of the current request) was read here (0: not stamped)."""
        rid = self.table.current
        return [self._arrived.pop((rid, step, r), 0) for r in range(self.world_size)]

    def _write(self, ch: _Channel) -> None:
        try:
            sent = ch.sock.sendmsg(ch.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._gone(ch, f"data channel failed ({exc})")
            return
        while sent and ch.out:
            first = ch.out[0]
            if sent >= first.nbytes:
                sent -= first.nbytes
                ch.out.pop(0)
            else:
                ch.out[0] = first[sent:]
                sent = 0
        if not ch.out:
            self._poll.modify(ch.sock.fileno(), _IN)

    def _gone(self, ch: _Channel, why: str) -> None:
        """`ch` closed or broke: drop it, and have the envoy redial the peer; the step fails if it
        still needed the peer (its frame, or the rest of ours to it)."""
        needed = self._needs(ch)
        self._drop(ch, why)
        if needed:
            raise self._fail(self._disconnected(ch.rank, why))

    def peer_lost(self, rank: int, why: str) -> None:
        """The envoy saw the peer go (`LOST`): close its socket; the step fails if it needed it.
        What the socket holds is read first: a peer that finished its last step wrote its frame
        before it closed, and its envoy's news can come before the frame is read here."""
        ch = self._channels.get(rank)
        end = time.monotonic() + _FLUSH_S
        while ch is not None and self._needs(ch) and not ch.out and time.monotonic() < end:
            select.select([ch.sock], [], [], max(end - time.monotonic(), 0))
            self._read(ch)  # the frame, or the end of the stream (the step fails naming it)
            ch = self._channels.get(rank)
        needed = ch is not None and self._needs(ch)
        self.lost(rank, why)
        if needed:
            raise self._fail(self._disconnected(rank, why))

    def _needs(self, ch: _Channel) -> bool:
        """Whether the step being collected still waits on `ch`'s peer."""
        if self._pending is None:
            return False
        if ch.out:
            return True
        p = self.table.pending
        return self._done is None and p is not None and p.parts[ch.rank] is None

    def _disconnected(self, rank: int, why: str) -> str:
        step, layer, _ = self._pending or (self.table.next_step, -1, 0.0)
        return (
            f"{self.describe(rank)} disconnected ({why}) during step {step} (layer {layer}) "
            f"of request {self.table.current}"
        )

    def _stalled(self, step: int, layer: int, limit_s: float) -> str:
        p = self.table.pending
        waiting = [r for r in (p.missing() if p is not None else [])]
        if waiting:
            names = ", ".join(self.describe(r) for r in waiting)
            return (
                f"no frame from {names} for step {step} (layer {layer}) of request "
                f"{self.table.current} within {limit_s:g} s: stalled or unreachable"
            )
        names = ", ".join(self.describe(ch.rank) for ch in self._channels.values() if ch.out)
        return (
            f"{names} took no frame for step {step} (layer {layer}) of request "
            f"{self.table.current} within {limit_s:g} s: stalled or unreachable"
        )

    def _woken(self) -> None:
        try:
            while os.read(self._wake_r, 64):
                pass
        except (BlockingIOError, OSError):
            pass
        if self._aborted is not None and self._aborted == self.table.current:
            raise self._fail(f"request {self.table.current} aborted: it failed on another node")

    def _from_link(self) -> None:
        for kind, body in self._messages():
            self._on_message(kind, body)

    def _fail(self, message: str) -> StepError:
        """The step fails with `message`, its rank first; later steps of the request fail at once.
        A frame left half-written is finished or its channel dropped."""
        message = f"envoy rank {self.rank}: {message}"
        self.table.fail(message)
        self._pending = self._done = None
        for ch in [ch for ch in self._channels.values() if ch.out]:
            self._flush(ch)
        return StepError(message)

    def _flush(self, ch: _Channel) -> None:
        end = time.monotonic() + _FLUSH_S
        while ch.out and self._channels.get(ch.rank) is ch and time.monotonic() < end:
            select.select([], [ch.sock], [], max(end - time.monotonic(), 0))
            try:
                self._write(ch)
            except StepError:
                return
        if ch.out and self._channels.get(ch.rank) is ch:
            ch.out = []
            self._drop(ch, "a frame to it was cut off by a failed step")

    def close(self) -> None:
        for rank in list(self._channels):
            self.lost(rank, "node closing")
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
