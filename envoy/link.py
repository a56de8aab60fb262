"""The node <-> envoy channel, both ends: payloads in shared memory, small messages on a socket pair.

The node writes its partial into the request area and sends a REDUCE message (a few dozen bytes:
step, layer, dtype, shape, ticket); the envoy answers once the sum is in the result area, or with
FAIL and a message. Nothing is pickled.

The answer also goes into a control block at the head of the segment: the ticket of the reduce
(a counter the node keeps) and a failed bit, written after the result. A node with idle cores
spins on that word for a bounded time instead of sleeping in `recv` (envoy/spin.py), and says
so in the block; the envoy then sends no DONE, which saves it a system call and the node a
wake-up. A node that sleeps says so first, and the envoy wakes it with DONE. FAIL always goes
on the socket too.

A float16 or bfloat16 sum comes back *widened*: the float32 sum, before its rounding, where it fits
the result area (`widened`). The node rounds it with MLX, lazily inside its step's graph, which is
the reference rounding by definition and takes two casting passes off the envoy's critical path.
A bfloat16 sum where envoy/_sum.c is built comes back rounded: the C sum rounds in the same pass,
and the node then copies half the bytes.

Every message on the socket: 4-byte little-endian body length, then the body, whose first byte
is the kind.
"""

from __future__ import annotations

import array
import functools
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass
from multiprocessing import shared_memory

import numpy as np

from . import trace
from .reduce import DTYPES, native_sums
from .spin import SpinPolicy, shared_memory_ordered
from ..proto.errors import ErrorKind, MoeClusterError

# node -> envoy
BEGIN = ord("B")  # request id (utf-8)
REDUCE = ord("R")  # _REDUCE, then ndim uint32 dims; the partial is in the request area
CLOSE = ord("C")
ABORT = ord("A")  # request id (utf-8): it failed elsewhere; fail its waiting and later steps now
# envoy -> node
READY = ord("Y")  # _READY: the envoy listens (pid, port)
BEGUN = ord("G")  # the mesh is whole and the request started
DONE = ord("D")  # _DONE: the sum is in the result area
FAIL = ord("F")  # _STEP, then a utf-8 message
# where the envoy runs direct (envoy/exchange.py): the node exchanges the frames itself
CHANNEL = ord("H")  # _PEER, then bytes read past the handshake; the peer's socket rides along
LOST = ord("L")  # _PEER, then why (utf-8): the peer's stream ended; the node closes its socket
BROKEN = ord("K")  # node -> envoy: _PEER, then why: the node dropped that channel; redial the peer

_LEN = struct.Struct("<I")
# kind, step, layer, dtype code, ndim, payload bytes, ticket, cold (1: the step may build kernels)
_REDUCE = struct.Struct("<BQiBBQQB")
_READY = struct.Struct("<BIHB")  # kind, pid, port, direct (1: CHANNEL messages will follow)
_PEER = struct.Struct("<BH")  # kind, rank
_FDS = socket.CMSG_SPACE(16 * 4)  # room for the descriptors a read may carry
_STEP = struct.Struct("<BQ")  # kind, step
_DONE = struct.Struct("<BQQ")  # kind, step, ticket
NO_STEP = 2**64 - 1  # FAIL of a begin, not of a step

# The control block: uint64 words at the head of the segment, then the request and result areas.
# Its first cache line holds the words below; the next three the stamps of a traced step
# (envoy/trace.py), apart from the line both processes poll.
_CTL_BYTES = 256
ANSWER = 0  # envoy: ticket << 1 | failed, written after the result
WHOLE = 1  # envoy: 1 while every peer's stream is up (a node spins only then)
SLEEPING = 2  # node: 1 while it may sleep in recv (the envoy must send DONE), 0 while it spins
NODE_SPIN_MAX_S = 1e-3  # seconds a node spins on the answer at most
_SPIN_BYTES = 1 << 20  # larger payloads are copied with non-temporal stores, which x86 may reorder
_RESPIN_S = 2e-3  # seconds: a node that stopped spinning looks at the answer word again after this

DTYPE_CODES = {"float32": 1, "float16": 2, "bfloat16": 3}
DTYPE_NAMES = {v: k for k, v in DTYPE_CODES.items()}


@functools.lru_cache(maxsize=None)
def _dims(ndim: int) -> struct.Struct:
    return struct.Struct(f"<{ndim}I")


class LinkError(MoeClusterError):
    """The other end of the link is gone or broke the protocol."""

    kind = ErrorKind.UNAVAILABLE


@dataclass(frozen=True)
class Reduce:
    """One REDUCE message as the envoy reads it."""

    step: int
    layer: int
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    ticket: int
    cold: bool = False  # the node may build kernels for it: the step gets the cold bound


def _attach(name: str) -> shared_memory.SharedMemory:
    """Attach to a segment the node owns, without this process's resource tracker unlinking it at
    exit (Python < 3.13 registers attachments too)."""
    try:
        return shared_memory.SharedMemory(name=name, track=False)  # Python >= 3.13
    except TypeError:
        pass
    from multiprocessing import resource_tracker

    # Registering starts the tracker, a Python process of its own, only to be told to forget the
    # segment at once: skip the registration (the envoy attaches on its start, on one thread).
    register = resource_tracker.register
    resource_tracker.register = lambda name, rtype: None
    try:
        return shared_memory.SharedMemory(name=name)
    finally:
        resource_tracker.register = register


def unlink_segment(shm: shared_memory.SharedMemory) -> None:
    """Remove a segment's name; one already removed (by another process) is no error."""
    try:
        shm.unlink()
    except FileNotFoundError:
        pass


def widened(dtype: str, nbytes: int, max_bytes: int) -> bool:
    """Whether the sum of a `dtype` partial of `nbytes` comes back as float32 (see the module's doc).
    The node and its envoy decide alike: one install, and the envoy inherits the node's environment."""
    return dtype != "float32" and not native_sums(dtype) and 2 * nbytes <= max_bytes


class _Areas:
    def __init__(self, shm: shared_memory.SharedMemory, max_bytes: int):
        self.shm = shm
        self.max_bytes = max_bytes
        self.ctl = np.ndarray((_CTL_BYTES // 8,), dtype=np.uint64, buffer=shm.buf)
        buf = np.ndarray((2 * max_bytes,), dtype=np.uint8, buffer=shm.buf, offset=_CTL_BYTES)
        self.request = buf[:max_bytes]
        self.result = buf[max_bytes:]
        self._views: dict[tuple[int, str, int], np.ndarray] = {}  # a node uses a handful of shapes

    def view(self, area: np.ndarray, dtype: str, nbytes: int) -> np.ndarray:
        key = (id(area), dtype, nbytes)
        v = self._views.get(key)
        if v is None:
            if len(self._views) > 64:
                self._views.clear()
            v = self._views[key] = area[:nbytes].view(DTYPES[dtype])
        return v

    def close(self) -> None:
        self._views.clear()
        self.request = self.result = self.ctl = None  # type: ignore[assignment]
        try:
            self.shm.close()
        except BufferError:  # a view still exported; the mapping goes with the process
            pass


# ---------------------------------------------------------------------------------------------
# Node end (blocking)


class NodeLink:
    """The node's end: owns the shared memory and one socket of the pair."""

    def __init__(self, max_bytes: int, spin: SpinPolicy | None = None):
        self.max_bytes = max_bytes
        self._shm = shared_memory.SharedMemory(create=True, size=_CTL_BYTES + 2 * max_bytes)
        self._named = True  # the segment's name is still in /dev/shm (child_attached drops it)
        self._areas = _Areas(self._shm, max_bytes)
        self._ctl = self._areas.ctl
        self._ctl[:] = 0
        self._ctl[SLEEPING] = 1
        self._sock, self.child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._buf = bytearray(1 << 16)
        self._pending = b""
        self._fds: list[int] = []  # descriptors received (CHANNEL's), in order, not yet taken
        self._timeout: float | None = None
        self._send_lock = threading.Lock()  # abort() comes from another thread than begin/reduce
        self._spin = spin if spin is not None else SpinPolicy(NODE_SPIN_MAX_S)
        self._ordered = shared_memory_ordered()  # elsewhere the answer word could beat the result
        self._ticket = 0  # reduces sent
        self._answered = (
            0  # the latest ticket whose DONE the node has taken (from the word or the socket)
        )
        self._step = 0  # of the latest reduce
        self._spin_s = 0.0  # how long to spin on the latest reduce's answer
        self._typical_s = NODE_SPIN_MAX_S / 4  # moving average of answer times (seconds)
        self.sent_at = 0.0  # time.perf_counter() just before the latest REDUCE went on the link
        self.spun = 0  # answers seen while spinning (for tests and benchmarks)

    @property
    def shm_name(self) -> str:
        return self._shm.name

    def child_started(self) -> None:
        """The child holds its end now: drop ours, so its exit reads as EOF here."""
        self.child_sock.close()

    def child_attached(self) -> None:
        """The envoy mapped the segment (it does before READY): drop its name. The memory lives on
        while either process maps it, and nothing is left in /dev/shm however the two end — a node
        killed with its process group (its resource tracker too) left 128 MiB named segments behind."""
        self._unlink()

    def _unlink(self) -> None:
        """Drop the segment's name once (later, the name may be another segment's)."""
        if self._named:
            self._named = False
            unlink_segment(self._shm)

    def _send(self, body: bytes) -> None:
        try:
            with self._send_lock:
                self._sock.sendall(_LEN.pack(len(body)) + body)
        except OSError as exc:
            raise LinkError(f"envoy link is closed ({exc})") from exc

    def _set_timeout(self, timeout: float | None) -> None:
        """A kernel receive timeout (SO_RCVTIMEO) on the blocking socket: one syscall per recv,
        where Python's own socket timeout polls first."""
        if timeout == self._timeout:
            return
        sec = 0.0 if timeout is None else max(timeout, 1e-3)
        tv = struct.pack("@ll", int(sec), int((sec - int(sec)) * 1e6))  # struct timeval; 0 = none
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        self._timeout = timeout

    def recv(self, timeout: float | None) -> tuple[int, bytes]:
        """-> (kind, body) of the next message; LinkError on EOF or after `timeout` seconds.

        A DONE the node has taken already (it saw the answer in shared memory first) is skipped."""
        while True:
            kind, body = self._recv(timeout)
            if kind != DONE:
                return kind, body
            ticket = _DONE.unpack_from(body)[2]
            if ticket > self._answered:
                self._answered = ticket
                return kind, body

    def _recv(self, timeout: float | None) -> tuple[int, bytes]:
        self._set_timeout(timeout)
        while True:
            message = self._parsed()
            if message is not None:
                return message
            try:
                got = self._read(0)
            except (BlockingIOError, socket.timeout):  # EAGAIN: SO_RCVTIMEO expired
                raise LinkError(f"envoy did not answer within {timeout:.1f} s") from None
            except InterruptedError:
                continue
            except OSError as exc:
                raise LinkError(f"envoy link failed ({exc})") from exc
            if got == 0:
                raise LinkError("envoy closed the link (it exited)")

    def _parsed(self) -> tuple[int, bytes] | None:
        """The next whole message read so far, taken off the pending bytes."""
        data = self._pending
        if len(data) >= 4:
            (n,) = _LEN.unpack_from(data)
            if len(data) >= 4 + n:
                self._pending = data[4 + n :]
                return data[4], data[4 : 4 + n]
        return None

    def _read(self, flags: int) -> int:
        """One read into the pending bytes, keeping any descriptors that came with it."""
        got, ancillary, _, _ = self._sock.recvmsg_into([self._buf], _FDS, flags)
        for level, kind, cdata in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(cdata[: len(cdata) - len(cdata) % fds.itemsize])
                self._fds.extend(fds)
        if got:
            chunk = bytes(self._buf[:got])
            self._pending = self._pending + chunk if self._pending else chunk
        return got

    def messages(self) -> list[tuple[int, bytes]]:
        """Every whole message that has arrived, without waiting; LinkError on EOF."""
        out = []
        while True:
            message = self._parsed()
            if message is not None:
                out.append(message)
                continue
            try:
                got = self._read(socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return out
            except OSError as exc:
                raise LinkError(f"envoy link failed ({exc})") from exc
            if got == 0:
                raise LinkError("envoy closed the link (it exited)")

    def fileno(self) -> int:
        return self._sock.fileno()

    def take_fd(self) -> int:
        """The descriptor a CHANNEL message carried (they come in the messages' order)."""
        if not self._fds:
            raise LinkError("envoy sent a channel without its socket")
        return self._fds.pop(0)

    def broken(self, rank: int, why: str) -> None:
        """This node dropped its channel to `rank`: the envoy ends that peer's stream and redials."""
        self._send(_PEER.pack(BROKEN, rank) + why.encode())

    def begin(self, request_id: str) -> None:
        self._send(bytes([BEGIN]) + request_id.encode())

    def abort(self, request_id: str) -> None:
        self._send(bytes([ABORT]) + request_id.encode())

    def reduce(
        self,
        raw: np.ndarray,
        dtype: str,
        shape: tuple[int, ...],
        layer: int,
        step: int,
        cold: bool = False,
    ) -> None:
        """Put a raw 1-D payload into the request area and ask for its sum (`cold`: a step that may
        build kernels, on this node or a peer; the envoy waits COLD_STEP_S for it)."""
        nbytes = raw.nbytes
        if nbytes > self.max_bytes:
            raise LinkError(
                f"partial of {nbytes} bytes exceeds the envoy link's area ({self.max_bytes} bytes)"
            )
        self._areas.request[:nbytes] = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
        self._ticket += 1
        self._step = step
        ctl = self._ctl
        spin = 0.0
        if self._ordered and nbytes <= _SPIN_BYTES and ctl[WHOLE]:
            spin = min(self._spin.budget_s(), max(4 * self._typical_s, 100e-6))
        self._spin_s = spin
        ctl[SLEEPING] = 0 if spin else 1  # before the envoy can answer
        body = _REDUCE.pack(
            REDUCE, step, layer, DTYPE_CODES[dtype], len(shape), nbytes, self._ticket, cold
        )
        self.sent_at = time.perf_counter()
        self._send(body + _dims(len(shape)).pack(*shape))

    def _taken(self) -> tuple[int, bytes]:
        self._answered = self._ticket
        return DONE, _DONE.pack(DONE, self._step, self._ticket)

    def wait(self, timeout: float) -> tuple[int, bytes]:
        """-> (DONE or FAIL, body) for the latest reduce; LinkError on EOF or after `timeout` seconds.

        Spins on the answer word first where `reduce` allowed it (idle cores, every peer up, a
        bounded time), then sleeps in `recv`."""
        ctl, want = self._ctl, self._ticket << 1
        if self._spin_s:
            t0 = self.sent_at
            end = t0 + self._spin_s
            now = t0
            while now < end:
                answer = int(ctl[ANSWER])
                if answer == want:
                    self.spun += 1
                    self._typical_s += (now - t0 - self._typical_s) / 16
                    return self._taken()
                if answer == want | 1:  # failed: the message follows on the socket
                    break
                now = time.perf_counter()
            else:
                self._typical_s += (self._spin_s - self._typical_s) / 16
            ctl[SLEEPING] = 1
            # The envoy may have answered between the last look and SLEEPING (it then sent no DONE):
            # look again now, and once more a little later in case the two stores crossed.
            deadline = time.perf_counter() + timeout
            if int(ctl[ANSWER]) == want:
                return self._taken()
            try:
                return self.recv(min(_RESPIN_S, timeout))
            except LinkError:
                if int(ctl[ANSWER]) == want:
                    return self._taken()
                left = deadline - time.perf_counter()
                if left <= 0:
                    raise
                return self.recv(left)
        return self.recv(timeout)

    def trace_words(self) -> np.ndarray:
        """The envoy's stamps of the latest traced step (envoy/trace.py): read them after its answer."""
        return self._ctl[trace.TRACE : trace.TRACE + trace.WORDS]

    def result(self, dtype: str, nbytes: int) -> np.ndarray:
        """The sum in the result area (a view: copy it before the next reduce): float32 values where
        `widened(dtype, nbytes, ...)`, else raw `dtype` values."""
        if widened(dtype, nbytes, self.max_bytes):
            return self._areas.view(self._areas.result, "float32", 2 * nbytes)
        return self._areas.view(self._areas.result, dtype, nbytes)

    def close(self) -> None:
        try:
            self._send(bytes([CLOSE]))
        except LinkError:
            pass
        self._sock.close()
        try:
            self.child_sock.close()
        except OSError:
            pass
        self._ctl = None  # a view of the segment: it would keep the mapping open
        self._areas.close()
        self._unlink()


def unpack_step(body: bytes) -> int:
    return _STEP.unpack_from(body)[1]


def unpack_ready(body: bytes) -> tuple[int, int, bool]:
    """(pid, port, direct) of a READY."""
    _, pid, port, direct = _READY.unpack_from(body)
    return pid, port, bool(direct)


def unpack_peer(body: bytes) -> tuple[int, bytes]:
    """(rank, the bytes after it) of a CHANNEL (those read past the handshake), LOST or BROKEN (why)."""
    _, rank = _PEER.unpack_from(body)
    return rank, body[_PEER.size :]


def fail_message(body: bytes) -> str:
    return body[_STEP.size :].decode(errors="replace")


# ---------------------------------------------------------------------------------------------
# Envoy end (non-blocking, driven by the event loop)


class EnvoyLink:
    """The envoy's end: parses messages as they arrive and writes answers."""

    def __init__(self, fd: int, shm_name: str, max_bytes: int):
        self._sock = socket.socket(fileno=fd)
        self._sock.setblocking(False)
        self._areas = _Areas(_attach(shm_name), max_bytes)
        self._ctl = self._areas.ctl
        self.max_bytes = max_bytes
        self.ticket = 0  # of the latest REDUCE (reduce_of)
        self._data = b""

    def fileno(self) -> int:
        return self._sock.fileno()

    def read(self) -> list[tuple[int, bytes]] | None:
        """Messages that arrived; None once the node closed its end."""
        try:
            chunk = self._sock.recv(
                1 << 16
            )  # one copy (recv_into a bytearray, then bytes of it, took two)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            return None
        if not chunk:
            return None
        data = self._data + chunk if self._data else chunk
        out = []
        while len(data) >= 4:
            (n,) = _LEN.unpack_from(data)
            if len(data) < 4 + n:
                break
            body = data[4 : 4 + n]
            out.append((body[0], body))
            data = data[4 + n :]
        self._data = data
        return out

    @staticmethod
    def parse_reduce(body: bytes) -> Reduce:
        _, step, layer, code, ndim, nbytes, ticket, cold = _REDUCE.unpack_from(body)
        shape = _dims(ndim).unpack_from(body, _REDUCE.size)
        dtype = DTYPE_NAMES.get(code)
        if dtype is None:
            raise LinkError(f"node sent unknown dtype code {code}")
        return Reduce(step, layer, dtype, tuple(shape), nbytes, ticket, bool(cold))

    def reduce_of(self, body: bytes) -> Reduce:
        """Parse a REDUCE; its answer (done or fail) goes to its ticket."""
        self.ticket = _REDUCE.unpack_from(body)[6]
        return self.parse_reduce(body)

    def trace_words(self) -> np.ndarray:
        """Where the envoy writes a traced step's stamps (envoy/trace.py), before its answer."""
        return self._ctl[trace.TRACE : trace.TRACE + trace.WORDS]

    def set_whole(self, whole: bool) -> None:
        """Tell the node whether every peer is connected: it spins only then."""
        self._ctl[WHOLE] = 1 if whole else 0

    def partial(self, r: Reduce) -> np.ndarray:
        """The node's partial for `r` (a view of the request area)."""
        if r.nbytes > self.max_bytes:
            raise LinkError(
                f"partial of {r.nbytes} bytes exceeds the link's area ({self.max_bytes} bytes)"
            )
        return self._areas.view(self._areas.request, r.dtype, r.nbytes)

    def result_area(self, dtype: str, nbytes: int) -> np.ndarray:
        return self._areas.view(self._areas.result, dtype, nbytes)

    def _send(self, body: bytes) -> None:
        msg = _LEN.pack(len(body)) + body
        try:
            sent = self._sock.send(msg)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            return  # the node is gone; the envoy notices on its next read
        if sent < len(msg):  # answers are tiny and the node reads each before the next: rare
            self._sock.setblocking(True)
            try:
                self._sock.sendall(msg[sent:])
            except OSError:
                pass
            finally:
                self._sock.setblocking(False)

    def ready(self, port: int, direct: bool = False) -> None:
        self._send(_READY.pack(READY, os.getpid(), port, direct))

    def channel(self, rank: int, sock: socket.socket, extra: bytes) -> None:
        """Hand `rank`'s data channel to the node: a copy of its descriptor rides with the message."""
        msg = _LEN.pack(_PEER.size + len(extra)) + _PEER.pack(CHANNEL, rank) + extra
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [sock.fileno()]))]
        self._sock.setblocking(True)  # rare and small: the node reads its link at every request
        try:
            sent = self._sock.sendmsg([msg], rights)
            if sent < len(msg):
                self._sock.sendall(msg[sent:])
        except OSError:
            pass  # the node is gone; the envoy notices on its next read
        finally:
            self._sock.setblocking(False)

    def lost(self, rank: int, why: str) -> None:
        self._send(_PEER.pack(LOST, rank) + why.encode())

    def begun(self) -> None:
        self._send(bytes([BEGUN]))

    def done(self, step: int) -> None:
        """The sum is in the result area: publish the answer, and wake the node if it sleeps."""
        ctl = self._ctl
        ctl[ANSWER] = self.ticket << 1
        if ctl[SLEEPING]:
            self._send(_DONE.pack(DONE, step, self.ticket))

    def fail(self, step: int, message: str) -> None:
        if step != NO_STEP:
            self._ctl[ANSWER] = self.ticket << 1 | 1
        self._send(_STEP.pack(FAIL, step) + message.encode())

    def close(self) -> None:
        self._sock.close()
        self._ctl = None
        self._areas.close()
