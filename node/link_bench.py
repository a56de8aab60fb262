"""The node's side of `moe-cluster bench link`: the path to another node, measured from here.

- `listen`: a TCP listener for one probe from a peer, behind a one-time token, served on a
  thread of its own with blocking sockets (nothing else on the path): each request is an
  8-byte header (what, bytes) and that many bytes; an echo sends them back, a sink answers one
  byte once all came.
- `probe`: round trips at each payload size to a peer's listener, then one bulk transfer.
- `allreduce`: the all-reduce among the nodes over a transport (the envoy or mx.distributed, as
  a Load builds it), in a process of its own: an MLX group cannot be rebuilt inside a process,
  and the node may hold a loaded model's.
"""

from __future__ import annotations

import hmac
import logging
import multiprocessing as mp
import queue
import secrets
import socket
import struct
import threading
import time

from ..common.ports import free_ports
from ..common.worker import Worker
from ..proto.errors import DeadlineError, UnavailableError
from ..proto.link import (
    LinkAllReduceResult,
    LinkAllReduceSpec,
    LinkListen,
    LinkProbeResult,
    LinkProbeSpec,
)

logger = logging.getLogger(__name__)

HEADER = struct.Struct("<IQ")  # what (ECHO, SINK, END), bytes that follow
ECHO, SINK, END = 1, 2, 3
TOKEN_BYTES = 16
ACCEPT_S = 60.0  # a listener waits this long for its probe
CHUNK = 1 << 20  # bytes per send or receive of a bulk transfer


class LinkBench:
    """The listeners this node opened and the one thread that probes or waits for an
    all-reduce's process; `close` ends them."""

    def __init__(self, host: str = "0.0.0.0"):
        self.host = host
        self._listeners: list[_Listener] = []
        self._worker: Worker | None = None

    def listen(self) -> LinkListen:
        self._listeners = [x for x in self._listeners if x.alive()]
        listener = _Listener(self.host)
        self._listeners.append(listener)
        return LinkListen(listener.port, listener.token, tuple(free_ports(2)))

    async def probe(self, spec: LinkProbeSpec) -> LinkProbeResult:
        return await self._work().call(lambda: probe(spec))

    async def allreduce(self, spec: LinkAllReduceSpec) -> LinkAllReduceResult:
        return await self._work().call(lambda: allreduce(spec))

    def _work(self) -> Worker:
        if self._worker is None:
            self._worker = Worker("link-bench")
        return self._worker

    def close(self) -> None:
        for x in self._listeners:
            x.close()
        if self._worker is not None:
            self._worker.close()


def _read(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the other end closed the connection")
        got += n


class _Listener:
    """One probe's listener on its own thread; it ends when the probe does, or after ACCEPT_S."""

    def __init__(self, host: str):
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self._sock = socket.create_server((host, 0))
        self._sock.settimeout(ACCEPT_S)
        self.port = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, name="link-listener", daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        self._sock.close()
        self._thread.join(timeout=5)

    def _serve(self) -> None:
        try:
            conn, peer = self._sock.accept()
        except OSError:  # closed, or nobody came within ACCEPT_S
            return
        finally:
            self._sock.close()
        with conn:
            conn.settimeout(ACCEPT_S)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                self._answer(conn)
            except (OSError, ConnectionError) as exc:
                logger.warning("link probe from %s ended: %s", peer, exc)

    def _answer(self, conn: socket.socket) -> None:
        token = bytearray(TOKEN_BYTES)
        _read(conn, memoryview(token))
        if not hmac.compare_digest(bytes(token), self.token):
            raise ConnectionError("wrong token: the probe was not the one this listener was for")
        head, buf = bytearray(HEADER.size), bytearray(CHUNK)
        while True:
            _read(conn, memoryview(head))
            what, n = HEADER.unpack(head)
            if what == END:
                return
            if what == ECHO:
                if n > len(buf):
                    buf = bytearray(n)
                _read(conn, memoryview(buf)[:n])
                conn.sendall(memoryview(buf)[:n])
            elif what == SINK:
                left = n
                while left:
                    k = conn.recv_into(buf, min(left, len(buf)))
                    if k == 0:
                        raise ConnectionError("the probe closed its transfer")
                    left -= k
                conn.sendall(b"\1")
            else:
                raise ConnectionError(f"unknown request {what} from the probe")


def probe(spec: LinkProbeSpec) -> LinkProbeResult:
    """Round trips of each payload size (`iters` each, after a few unrecorded), then one
    transfer of `transfer_bytes` from here to the peer."""
    host, _, port = spec.address.rpartition(":")
    try:
        sock = socket.create_connection((host, int(port)), timeout=30)
    except OSError as exc:
        raise UnavailableError(f"link probe: cannot reach {spec.address}: {exc}") from None
    with sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(120)
        try:
            sock.sendall(spec.token)
            trips = tuple((n, _round_trips(sock, n, spec.iters)) for n in spec.payload_bytes)
            seconds = _transfer(sock, spec.transfer_bytes) if spec.transfer_bytes else 0.0
            sock.sendall(HEADER.pack(END, 0))
        except (OSError, ConnectionError) as exc:
            raise UnavailableError(f"link probe to {spec.address} failed: {exc}") from None
    return LinkProbeResult(trips, spec.transfer_bytes, seconds)


def _round_trips(sock: socket.socket, n: int, iters: int) -> tuple[float, ...]:
    out = bytearray(HEADER.pack(ECHO, n)) + bytes(n)
    back = memoryview(bytearray(n))
    times = []
    for i in range(iters + max(2, iters // 10)):  # the first few warm the path, unrecorded
        t = time.perf_counter()
        sock.sendall(out)
        _read(sock, back)
        if i >= iters // 10 and len(times) < iters:
            times.append(time.perf_counter() - t)
    return tuple(times[:iters])


def _transfer(sock: socket.socket, n: int) -> float:
    chunk = memoryview(bytes(min(n, CHUNK)))
    t = time.perf_counter()
    sock.sendall(HEADER.pack(SINK, n))
    left = n
    while left:
        k = min(left, len(chunk))
        sock.sendall(chunk[:k])
        left -= k
    _read(sock, memoryview(bytearray(1)))
    return time.perf_counter() - t


def allreduce(spec: LinkAllReduceSpec) -> LinkAllReduceResult:
    """`_allreduce_child` in a fresh process; its result, or its error as this node's."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_allreduce_child, args=(spec, results), daemon=True)
    proc.start()
    try:
        kind, value = results.get(timeout=spec.timeout_s)
    except queue.Empty:
        raise DeadlineError(
            f"link all-reduce as rank {spec.rank} did not finish within {spec.timeout_s:g} s"
        ) from None
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)
    if kind != "ok":
        raise UnavailableError(f"link all-reduce as rank {spec.rank}: {value}")
    return LinkAllReduceResult(value)


def _allreduce_child(spec: LinkAllReduceSpec, results) -> None:
    try:
        import mlx.core as mx

        from .collective.specs import make_collective

        collective = make_collective(spec.transport, spec.rank)
        try:
            collective.begin("bench-link")
            out = []
            for tokens in spec.tokens:
                x = mx.random.normal((tokens, spec.hidden), key=mx.random.key(spec.rank))
                x = (x * 0.01).astype(getattr(mx, spec.dtype))
                mx.eval(x)
                for _ in range(spec.warmup):
                    mx.eval(collective.all_reduce(x, 0))
                times = []
                for _ in range(spec.iters):
                    t = time.perf_counter()
                    mx.eval(collective.all_reduce(x, 0))  # evaluated: a node's sum may be lazy
                    times.append(time.perf_counter() - t)
                out.append((tokens, tuple(times)))
            results.put(("ok", tuple(out)))
        finally:
            collective.close()
    except Exception as exc:  # noqa: BLE001 - reported to the node as a value
        results.put(("error", f"{type(exc).__name__}: {exc}"))
