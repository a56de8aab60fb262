"""`moe-cluster bench allreduce`: latency of one all-reduce, envoy path vs the floor vs MLX's ring.

For each (nodes, tokens) case, in one run on this machine, over loopback:
- envoy: N processes each with the real EnvoyCollective (mx array -> link -> envoy -> gRPC to
  every peer -> sum -> link -> mx array), what a node pays per MoE layer;
- floor: N processes exchanging the same bytes all-to-all over plain blocking TCP sockets, the
  least any transport across processes can cost here;
- relay: the floor with a relay process per node in between (node -> shared memory -> relay ->
  blocking TCP -> sum -> node), the least any design with an envoy process per node can cost;
- grpc: N processes exchanging the same bytes all-to-all over grpc.aio streams, one per pair,
  set up as the envoys' (uvloop, the same poller and channel options), and nothing else: no node
  hop, no reduction, no checksum. The least the envoy's gRPC hop alone can cost;
- mlx_ring: N processes running `mx.distributed.all_sum` on the ring backend;
- mlx_nccl: the same over NCCL, rank r on CUDA GPU r and its payload there (a host with N GPUs).
Latencies are per call, pooled over ranks, after a warm-up; `--rounds R` runs every path R times
in turn and pools those too.

`--trace` adds one more envoy run per case with every hop of every all-reduce stamped on one
clock across the processes (envoy/trace.py), and prints the p50 of each hop.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import queue
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

from ...proto.errors import UserError

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
PATHS = ("envoy", "direct", "floor", "relay", "grpc", "mlx_ring", "mlx_nccl")
DEFAULT_PATHS = PATHS[:-1]  # NCCL only where asked: it needs a GPU per rank


@dataclass(frozen=True)
class Case:
    nodes: int
    tokens: int
    hidden: int
    dtype: str
    iters: int
    warmup: int

    @property
    def values(self) -> int:
        return self.tokens * self.hidden

    @property
    def nbytes(self) -> int:
        return self.values * _ITEMSIZE[self.dtype]


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated whole numbers, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected numbers >= 1, got {text!r}")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=_int_list, default=[2], help="node counts, e.g. 2,4")
    p.add_argument("--hidden", type=int, default=6144, help="hidden size (DBRX: 6144)")
    p.add_argument("--tokens", type=_int_list, default=[1], help="tokens per all-reduce, e.g. 1,32")
    p.add_argument("--dtype", choices=sorted(_ITEMSIZE), default="bfloat16")
    p.add_argument("--iters", type=int, default=1000, help="timed all-reduces per case and path")
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every path this many times in turn, fresh processes each time, and pool their "
        "samples (a machine whose speed drifts over the run then weighs on every path alike)",
    )
    p.add_argument(
        "--paths",
        default=",".join(DEFAULT_PATHS),
        help=f"which to measure, comma-separated, of {', '.join(PATHS)} (mlx_nccl: one CUDA GPU "
        "per node)",
    )
    p.add_argument(
        "--timeout", type=float, default=300.0, help="seconds one path of one case may take"
    )
    p.add_argument(
        "--trace",
        action="store_true",
        help="also run the envoy with every hop stamped, and print where its time goes",
    )
    p.add_argument("--json", action="store_true")


# ---------------------------------------------------------------------------------------------
# Workers (spawned processes); each puts (rank, latencies in seconds) or (rank, error text)


def _payload(case: Case, rank: int):
    import mlx.core as mx

    dtype = getattr(mx, case.dtype)
    return (mx.random.normal((case.tokens, case.hidden), key=mx.random.key(rank)) * 0.01).astype(
        dtype
    )


def _rank_order_sum(case: Case):
    """What every path's all-reduce must give: every rank's payload in rank order, summed in
    float32 (a path that rounds to the payload's dtype compares with this rounded)."""
    import mlx.core as mx

    return sum(_payload(case, r).astype(mx.float32) for r in range(case.nodes))


def _timed(fn, case: Case) -> list[float]:
    for _ in range(case.warmup):
        fn()
    out = []
    for _ in range(case.iters):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def _envoy_worker(spec, rank: int, case: Case, results) -> None:
    try:
        import mlx.core as mx

        from ...node.collective.specs import make_collective

        collective = make_collective(spec, rank)
        try:
            x = _payload(case, rank)
            mx.eval(x)
            collective.begin("bench")
            # the sum checked once, rounded to the payload's dtype as the collective hands it back
            want = _rank_order_sum(case).astype(x.dtype)
            if not mx.array_equal(collective.all_reduce(x, 0), want).item():
                raise RuntimeError("the envoy's sum differs from the rank-order float32 sum")
            # evaluated, as the ring's is: a node may sum the partials lazily, in MLX
            latencies = _timed(lambda: mx.eval(collective.all_reduce(x, 0)), case)
            results.put(
                (rank, latencies if collective.trace is None else (latencies, collective.trace))
            )
        finally:
            collective.close()
    except Exception as exc:  # noqa: BLE001 - reported to the parent as a value
        results.put((rank, f"{type(exc).__name__}: {exc}"))


def _dial(connect):
    """`connect()`'s result, once the other side listens (retried for up to 30 s)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return connect()
        except (
            FileNotFoundError,
            ConnectionRefusedError,
        ):  # not bound (Unix socket) or not listening yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _unix_connection(path: str):
    import socket

    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
    except OSError:
        s.close()
        raise
    return s


class _Mesh:
    """One blocking TCP connection per pair of ranks, and an all-to-all exchange over them."""

    def __init__(self, ports: list[int], rank: int, nbytes: int):
        import socket

        n = len(ports)
        self.rank, self.nbytes = rank, nbytes
        listener = socket.create_server(("127.0.0.1", ports[rank]), backlog=n)
        peers: dict[int, socket.socket] = {}
        for r in range(rank + 1, n):  # lower ranks dial higher ones, as the envoys do
            s = _dial(lambda: socket.create_connection(("127.0.0.1", ports[r])))
            s.sendall(bytes([rank]))
            peers[r] = s
        while len(peers) < n - 1:
            s, _ = listener.accept()
            peers[s.recv(1)[0]] = s
        listener.close()
        for s in peers.values():
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * nbytes + (1 << 16))
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * nbytes + (1 << 16))
        self.peers = peers
        self.order = sorted(peers)
        room = min(
            s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
            + s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
            for s in peers.values()
        )
        # sending to everyone before reading could deadlock if a payload does not fit the buffers;
        # then pairs take turns (lower rank sends first), which is slower but still a floor
        self.turns = room < nbytes
        self.received = {
            r: bytearray(nbytes) for r in self.order
        }  # the latest payload of each peer

    def read_into(self, r: int, buf, start: int, end: int) -> memoryview:
        """Bytes start..end of `buf` from rank `r`'s connection; a view of `buf`."""
        view, got = memoryview(buf), start
        while got < end:
            k = self.peers[r].recv_into(view[got:end])
            if k == 0:
                raise ConnectionError(f"rank {r} closed its connection")
            got += k
        return view

    def _recv(self, r: int) -> None:
        self.read_into(r, self.received[r], 0, self.nbytes)

    def exchange(self, data) -> None:
        """Send `data` (nbytes) to every peer and receive every peer's into `received`."""
        if self.turns:
            for r in self.order:
                if self.rank < r:
                    self.peers[r].sendall(data)
                    self._recv(r)
                else:
                    self._recv(r)
                    self.peers[r].sendall(data)
            return
        for r in self.order:
            self.peers[r].sendall(data)
        for r in self.order:
            self._recv(r)

    def close(self) -> None:
        for s in self.peers.values():
            s.close()


def _floor_worker(ports: list[int], rank: int, case: Case, results) -> None:
    """All-to-all over one blocking TCP connection per pair: send to every peer, then read every peer."""
    try:
        mesh = _Mesh(ports, rank, case.nbytes)
        data = bytes(case.nbytes)
        results.put((rank, _timed(lambda: mesh.exchange(data), case)))
        mesh.close()
    except Exception as exc:  # noqa: BLE001
        results.put((rank, f"{type(exc).__name__}: {exc}"))


def _direct_worker(ports: list[int], rank: int, case: Case, results) -> None:
    """What a node would do with its peers' data channels in its own hands (an envoy keeping their
    setup, the secret and the faults): the envoy's frame to every peer, every peer's frame read and
    its step checked, the rank-order float32 sum the envoy hands its node, back in an mx.array, the
    node-side work of `envoy` included (the ride's slots, the copies). One wake-up on the critical
    path, where `envoy` has three: how far that design would close the gap to the ring."""
    try:
        import mlx.core as mx
        import numpy as np

        from ...envoy import data
        from ...envoy.reduce import DTYPES, Reducer
        from ...node.collective.base import Rider, from_wire, to_wire
        from ...proto.frame import Frame

        x = _payload(case, rank)
        mx.eval(x)
        rider, reducer = Rider(rank, case.nodes), Reducer()
        mesh = _Mesh(ports, rank, 2 * case.nbytes + 4096)
        bufs = {r: bytearray(data.HEADER.size + 256 + case.nbytes) for r in mesh.order}
        # the sum's buffer 64 bytes into its allocation: a large numpy buffer starts 16 bytes into a
        # page, where MLX's copy of it into a new array (whose data sit a few bytes further into
        # theirs) ran 10x slower here (4K aliasing: 227 against 22 us for 786 KB); the envoy's
        # result area starts 256 bytes into its pages
        out = np.empty(case.values + 16, np.float32)[16:]
        step = [0]

        def send(sock, head: bytes, body: memoryview) -> None:  # no copy of the payload
            sent = sock.sendmsg([head, body])
            if sent < len(head):
                sock.sendall(head[sent:])
                sent = len(head)
            if sent - len(head) < body.nbytes:
                sock.sendall(body[sent - len(head) :])

        def all_reduce() -> mx.array:
            payload, extra = rider.attach(x, 0)
            raw, dtype = to_wire(payload)
            frame = Frame("bench", step[0], 0, rank, dtype, tuple(payload.shape), None, raw)
            head, body = data.encode_parts(frame)
            for r in mesh.order:
                send(mesh.peers[r], head, body)
            parts = [None] * case.nodes
            parts[rank] = raw.reshape(-1)
            for r in mesh.order:
                view = mesh.read_into(r, bufs[r], 0, data.HEADER.size)
                n, got_step, _, got_rank, _, ndim, nid = data._header(bufs[r], 0)
                if got_step != step[0] or got_rank != r:
                    raise RuntimeError(f"rank {r} sent step {got_step} as rank {got_rank}")
                mesh.read_into(r, bufs[r], data.HEADER.size, data.HEADER.size + n)
                at = data.HEADER.size + nid + 4 * ndim
                parts[r] = np.frombuffer(view[at : data.HEADER.size + n], DTYPES[dtype])
            total = reducer.sum_float32(parts, dtype, out[: raw.size])
            # as EnvoyCollective hands it back: copied into MLX, rounded lazily in the step's graph
            y = from_wire(rider.detach(total, "float32", extra), "float32", x.shape)
            step[0] += 1
            return y

        # the sum checked once: every rank's payload in rank order, summed in float32
        want = _rank_order_sum(case)
        if not mx.array_equal(all_reduce(), want).item():
            raise RuntimeError("the direct exchange's sum differs from the rank-order float32 sum")
        results.put((rank, _timed(lambda: mx.eval(all_reduce().astype(x.dtype)), case)))
        mesh.close()
    except Exception as exc:  # noqa: BLE001
        results.put((rank, f"{type(exc).__name__}: {exc}"))


def _relay_worker(ports: list[int], folder: str, index: int, case: Case, results) -> None:
    """The least a relay process per node can cost: processes 0..N-1 relay, N..2N-1 are their nodes.

    A node hands its payload over in shared memory with a one-byte wake-up on a Unix socket; its
    relay exchanges it all-to-all over blocking TCP (the floor's mesh), sums in rank order with the
    envoy's reducer into shared memory, and wakes the node. No gRPC, no framing, no checksum, no
    event loop: what is left is the architecture's two extra process hops per all-reduce.
    Only nodes report latencies; a relay reports only a failure.
    """
    rank = index % case.nodes
    target = _relay if index < case.nodes else _relay_node
    try:
        target(ports, f"{folder}/relay-{rank}.sock", rank, case, results)
    except Exception as exc:  # noqa: BLE001
        results.put((rank, f"{target.__name__.strip('_')}: {type(exc).__name__}: {exc}"))


def _relay(ports: list[int], path: str, rank: int, case: Case, results) -> None:
    import socket
    from multiprocessing import shared_memory

    import numpy as np

    from ...envoy.reduce import DTYPES, Reducer

    shm = shared_memory.SharedMemory(create=True, size=2 * case.nbytes)
    try:
        with socket.socket(socket.AF_UNIX) as listener:
            listener.bind(path)
            listener.listen(1)
            listener.settimeout(30)
            link, _ = listener.accept()
        link.settimeout(None)
        link.sendall(shm.name.encode())
        mesh = _Mesh(ports, rank, case.nbytes)
        wire = DTYPES[case.dtype]
        request = np.ndarray((case.values,), wire, shm.buf, 0)
        result = np.ndarray((case.values,), wire, shm.buf, case.nbytes)
        peers = {r: np.frombuffer(buf, wire) for r, buf in mesh.received.items()}
        partials = [
            peers.get(r, request) for r in range(case.nodes)
        ]  # rank order, this node's in its place
        reduce = Reducer()
        while link.recv(1):  # the node closes its end when it is done
            mesh.exchange(shm.buf[: case.nbytes])
            reduce(partials, case.dtype, out=result)
            link.sendall(b"D")
        link.close()
        mesh.close()
        request = result = partials = None  # views into the segment go before it closes
    finally:
        shm.close()
        shm.unlink()


def _relay_node(ports: list[int], path: str, rank: int, case: Case, results) -> None:
    """The node side of the relay path: payload into shared memory, wake the relay, wait, copy out."""
    from multiprocessing import shared_memory

    import numpy as np

    from ...envoy.reduce import from_float32, reduce_sum

    link = _dial(lambda: _unix_connection(path))
    shm = shared_memory.SharedMemory(name=link.recv(256).decode())

    def payload_of(r: int) -> np.ndarray:
        values = np.random.default_rng(r).normal(0, 0.01, case.values).astype(np.float32)
        return from_float32(values, case.dtype)

    try:
        payload = payload_of(rank).view(np.uint8)
        request = np.ndarray((case.nbytes,), np.uint8, shm.buf, 0)
        result = np.ndarray((case.nbytes,), np.uint8, shm.buf, case.nbytes)

        def all_reduce() -> np.ndarray:
            np.copyto(request, payload)
            link.sendall(b"R")
            if not link.recv(1):
                raise ConnectionError("the relay went away")
            return result.copy()

        latencies = _timed(all_reduce, case)
        want = reduce_sum([payload_of(r) for r in range(case.nodes)], case.dtype).view(np.uint8)
        if not np.array_equal(all_reduce(), want):
            raise AssertionError(
                "the relay's sum differs from the rank-order sum of every rank's payload"
            )
        results.put((rank, latencies))
        link.close()
        request = result = None  # views into the segment go before it closes
    finally:
        shm.close()


_BENCH_EXCHANGE = "/moe_cluster.bench.Exchange/Exchange"


def _grpc_worker(addresses: list[str], rank: int, case: Case, results) -> None:
    """All-to-all over grpc.aio: one bidirectional stream per pair (the lower rank dials), raw bytes
    both ways; each call writes to every peer, then reads every peer."""
    try:
        from ...common.process import run_grpc_loop

        results.put((rank, run_grpc_loop(lambda: _grpc_exchange(addresses, rank, case))))
    except Exception as exc:  # noqa: BLE001
        results.put((rank, f"{type(exc).__name__}: {exc}"))


async def _grpc_exchange(addresses: list[str], rank: int, case: Case) -> list[float]:
    import asyncio

    import grpc

    from ...proto import CHANNEL_OPTIONS

    n = len(addresses)
    loop = asyncio.get_running_loop()
    streams: dict[int, tuple] = {}  # peer rank -> (read, write)
    all_up, done = loop.create_future(), asyncio.Event()

    def up(r: int, read, write) -> None:
        streams[r] = (read, write)
        if len(streams) == n - 1 and not all_up.done():
            all_up.set_result(None)

    async def accept(request_iterator, context):
        up((await context.read())[0], context.read, context.write)
        await done.wait()  # the stream lives as long as this handler: until this rank is done
        while await context.read() is not grpc.aio.EOF:  # and the dialer is, too
            pass

    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "moe_cluster.bench.Exchange",
                {"Exchange": grpc.stream_stream_rpc_method_handler(accept)},
            ),
        )
    )
    server.add_insecure_port(addresses[rank])
    await server.start()
    channels, calls = [], []
    try:
        for r in range(rank + 1, n):
            channel = grpc.aio.insecure_channel(addresses[r], options=CHANNEL_OPTIONS)
            channels.append(channel)
            call = channel.stream_stream(_BENCH_EXCHANGE)(wait_for_ready=True)
            await call.write(bytes([rank]))
            calls.append(call)
            up(r, call.read, call.write)
        await asyncio.wait_for(all_up, 30)
        order = sorted(streams)
        writes = [streams[r][1] for r in order]
        reads = [streams[r][0] for r in order]
        data = bytes(case.nbytes)

        async def exchange() -> None:
            for write in writes:
                await write(data)
            for read in reads:
                got = await read()
                if got is grpc.aio.EOF:
                    raise ConnectionError("a peer closed its stream")
                if len(got) != case.nbytes:
                    raise ConnectionError(f"a peer sent {len(got)} bytes, expected {case.nbytes}")

        for _ in range(case.warmup):
            await exchange()
        latencies = []
        for _ in range(case.iters):
            t = time.perf_counter()
            await exchange()
            latencies.append(time.perf_counter() - t)
        for call in calls:  # close each stream only once its other end is done with it
            await call.done_writing()
            while await call.read() is not grpc.aio.EOF:
                pass
        return latencies
    finally:
        done.set()
        for channel in channels:
            await channel.close()
        await server.stop(0.5)


def _mlx_worker(spec, rank: int, case: Case, results) -> None:
    try:
        import os
        import tempfile

        if spec.backend == "nccl":  # before anything imports MLX (it opens the GPUs): one per rank
            os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
        from ...node.collective.mlx import write_hostfile

        with tempfile.TemporaryDirectory() as tmp:
            os.environ.update(write_hostfile(spec, tmp))
            os.environ["MLX_RANK"] = str(rank)
            import mlx.core as mx

            group = mx.distributed.init(strict=True, backend=spec.backend)
            x = _payload(case, rank)
            mx.eval(x)
            results.put(
                (rank, _timed(lambda: mx.eval(mx.distributed.all_sum(x, group=group)), case))
            )
    except Exception as exc:  # noqa: BLE001
        results.put((rank, f"{type(exc).__name__}: {exc}"))


# ---------------------------------------------------------------------------------------------


def _run_workers(
    target, make_args, case: Case, timeout_s: float, processes: int = 0
) -> list[float]:
    """Spawn `processes` (default: one per rank) running `target(*make_args(i), case, results)`;
    the latencies of the N ranks, pooled."""
    return [x for _, got in _gather(target, make_args, case, timeout_s, processes) for x in got]


def _gather(
    target, make_args, case: Case, timeout_s: float, processes: int = 0
) -> list[tuple[int, object]]:
    """What each of the N ranks reported, as (rank, report)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=target, args=(*make_args(i), case, results), daemon=True)
        for i in range(processes or case.nodes)
    ]
    for p in procs:
        p.start()
    reports: list[tuple[int, object]] = []
    try:
        deadline = time.monotonic() + timeout_s
        for _ in range(case.nodes):
            try:
                rank, got = results.get(timeout=max(deadline - time.monotonic(), 0.1))
            except queue.Empty:
                raise RuntimeError(
                    f"{target.__name__} with {case.nodes} nodes did not finish within {timeout_s:g} s"
                ) from None
            if isinstance(got, str):
                raise RuntimeError(f"{target.__name__} rank {rank}: {got}")
            reports.append((rank, got))
        return reports
    finally:
        from ..dev.simulate import stop_processes

        stop_processes(procs, grace_s=10.0)


def _percentiles(samples: list[float]) -> tuple[float, float]:
    import numpy as np

    p50, p99 = np.percentile(np.asarray(samples) * 1e6, [50, 99])
    return round(float(p50), 1), round(float(p99), 1)


def run_case(
    case: Case, paths: list[str], timeout_s: float, traced: bool = False, rounds: int = 1
) -> dict:
    row: dict = {
        "nodes": case.nodes,
        "tokens": case.tokens,
        "hidden": case.hidden,
        "dtype": case.dtype,
        "iters": case.iters,
        "rounds": rounds,
    }
    samplers = _samplers(case, timeout_s)
    chosen = [p for p in PATHS if p in paths]
    pooled: dict[str, list[float]] = {p: [] for p in chosen}
    for r in range(rounds):
        # every round runs each path once, so a drift of the machine's speed over the run (other
        # load, clocks) falls on every path alike: their samples are pooled over the rounds
        for path in chosen:
            got = samplers[path]()
            pooled[path].extend(got)
            if rounds > 1:
                row.setdefault(f"{path}_p50_by_round_us", []).append(_percentiles(got)[0])
    for path, samples in pooled.items():
        row[f"{path}_p50_us"], row[f"{path}_p99_us"] = _percentiles(samples)
    if traced:
        row["trace"] = _trace(case, timeout_s)
    for path in ("envoy", "direct", "relay", "grpc"):
        if row.get("floor_p50_us") and row.get(f"{path}_p50_us"):
            row[f"{path}_over_floor"] = round(row[f"{path}_p50_us"] / row["floor_p50_us"], 2)
    if row.get("envoy_p50_us") and row.get("mlx_ring_p50_us"):
        row["envoy_over_ring"] = round(row["envoy_p50_us"] / row["mlx_ring_p50_us"], 2)
    return row


def _samplers(case: Case, timeout_s: float) -> dict:
    """Per path, a call that runs it once (fresh processes, ports and secret) and returns its
    latencies in seconds, pooled over ranks."""
    import secrets

    from ...common.ports import free_ports
    from ...node.collective.specs import EnvoySpec, MlxSpec

    def envoy() -> list[float]:
        spec = EnvoySpec(
            tuple(f"127.0.0.1:{p}" for p in free_ports(case.nodes)),
            secret=secrets.token_hex(16),
            max_bytes=max(2 * case.nbytes, 1 << 16),
        )  # room to widen, as a node's 64 MiB link has
        return _run_workers(_envoy_worker, lambda r: (spec, r), case, timeout_s)

    def sockets(worker) -> Callable[[], list[float]]:
        def run() -> list[float]:
            ports = free_ports(case.nodes)
            return _run_workers(worker, lambda r: (ports, r), case, timeout_s)

        return run

    def relay() -> list[float]:
        ports = free_ports(case.nodes)
        with tempfile.TemporaryDirectory(prefix="moe-relay-") as folder:
            return _run_workers(
                _relay_worker,
                lambda i: (ports, folder, i),
                case,
                timeout_s,
                processes=2 * case.nodes,
            )

    def grpc() -> list[float]:
        addresses = [f"127.0.0.1:{p}" for p in free_ports(case.nodes)]
        return _run_workers(_grpc_worker, lambda r: (addresses, r), case, timeout_s)

    def mlx(backend: str) -> Callable[[], list[float]]:
        def run() -> list[float]:
            spec = MlxSpec(tuple((f"127.0.0.1:{p}",) for p in free_ports(case.nodes)), backend)
            return _run_workers(_mlx_worker, lambda r: (spec, r), case, timeout_s)

        return run

    return {
        "envoy": envoy,
        "direct": sockets(_direct_worker),
        "floor": sockets(_floor_worker),
        "relay": relay,
        "grpc": grpc,
        "mlx_ring": mlx("ring"),
        "mlx_nccl": mlx("nccl"),
    }


def _trace(case: Case, timeout_s: float) -> dict:
    """An envoy run with every hop stamped: the traced run's p50 and each hop's p50 and p90."""
    import secrets

    from ...envoy import trace
    from ...node.collective.specs import EnvoySpec
    from ...common.ports import free_ports

    spec = EnvoySpec(
        tuple(f"127.0.0.1:{p}" for p in free_ports(case.nodes)),
        secret=secrets.token_hex(16),
        max_bytes=max(2 * case.nbytes, 1 << 16),
        trace=True,
    )
    reports = _gather(_envoy_worker, lambda r: (spec, r), case, timeout_s)
    p50, p99 = _percentiles([x for _, (latencies, _) in reports for x in latencies])
    return {
        "p50_us": p50,
        "p99_us": p99,
        # the sum's check (_envoy_worker) and the warmup are steps the table leaves out
        "hops": _hops({rank: rows for rank, (_, rows) in reports}, 1 + case.warmup),
    }


def _hops(records: dict, skip: int) -> list[dict]:
    """The per-hop table of the traced run's records: the node's own exchange's hops where it
    read its frames itself (the default), the envoy's where its envoy did."""
    from ...envoy import trace

    if any(rows and rows[0][0] == trace.DIRECT for rows in records.values()):
        return trace.table(trace.direct_hops(records, skip), trace.DIRECT_HOPS)
    return trace.table(trace.hops(records, skip))


def main(args: argparse.Namespace) -> int:
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    unknown = sorted(set(paths) - set(PATHS))
    if unknown:
        raise UserError(f"--paths: unknown {', '.join(unknown)} (expected {', '.join(PATHS)})")
    if "mlx_nccl" in paths:
        from ...node.collective.mlx import mlx_backend

        if mlx_backend(True) != "nccl":
            raise UserError(
                "--paths mlx_nccl needs MLX's CUDA build with its NCCL backend and a GPU per node "
                "(not here)"
            )
    if args.iters < 1 or args.warmup < 0 or args.rounds < 1:
        raise UserError(
            f"--iters and --rounds must be >= 1 and --warmup >= 0 (got {args.iters}, "
            f"{args.rounds}, {args.warmup})"
        )
    if min(args.nodes) < 2:
        raise UserError(f"--nodes: an all-reduce needs at least 2 nodes (got {args.nodes})")
    cases = [
        Case(n, t, args.hidden, args.dtype, args.iters, args.warmup)
        for n in args.nodes
        for t in args.tokens
    ]
    rows = []
    for case in cases:
        rows.append(run_case(case, paths, args.timeout, traced=args.trace, rounds=args.rounds))
        if not args.json:
            _print_row(rows[-1], header=len(rows) == 1)
            if args.trace:
                _print_trace(rows[-1])
    if args.json:
        print(json.dumps({"cases": rows}))
    return 0


def _print_trace(row: dict) -> None:
    t = row["trace"]
    print(
        f"  trace of {row['nodes']} nodes, {row['tokens']} token(s): traced envoy p50 {t['p50_us']} us, "
        f"p99 {t['p99_us']} us; per hop (microseconds, pooled over ranks; hops overlap, see docs/envoy.md):"
    )
    for h in t["hops"]:
        print(f"    {h['hop']:<34} p50 {h['p50_us']:>8}  p90 {h['p90_us']:>8}   {h['covers']}")
    sys.stdout.flush()


def _print_row(row: dict, header: bool) -> None:
    cols = [
        ("nodes", "nodes"),
        ("tokens", "tokens"),
        ("envoy_p50_us", "envoy p50"),
        ("envoy_p99_us", "envoy p99"),
        ("direct_p50_us", "direct p50"),
        ("floor_p50_us", "floor p50"),
        ("relay_p50_us", "relay p50"),
        ("grpc_p50_us", "grpc p50"),
        ("mlx_ring_p50_us", "mlx ring p50"),
        ("mlx_nccl_p50_us", "mlx nccl p50"),
        ("envoy_over_floor", "envoy/floor"),
        ("envoy_over_ring", "envoy/ring"),
    ]
    if header:
        print("  ".join(f"{title:>12}" for _, title in cols) + "   (microseconds)")
    print("  ".join(f"{row.get(key, '-'):>12}" for key, _ in cols), flush=True)
    sys.stdout.flush()
