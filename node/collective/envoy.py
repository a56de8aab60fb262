"""The envoy transport: the node starts its envoy child and all-reduces over the channels it hands.

`EnvoyProcess` owns the child, the node end of the link and the node's exchange of the frames
(exchange.py; raw numpy payloads: the integration tests use it directly); `EnvoyCollective` is
the Collective on top (mx arrays). The envoy dials and authenticates the peers and hands the node
each peer's data channel; the node writes and reads the frames itself and sums them in rank
order: a small partial (and a bfloat16 one of any size, where _sum.c is built) on the host at
once, a larger one in MLX inside the step's graph. The envoy exits by itself when its node dies:
link EOF, a parent-pid watchdog, and on Linux PR_SET_PDEATHSIG.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from typing import Callable

import mlx.core as mx
import numpy as np

from ...proto import envoy_link as messages
from ...proto.records import COLD_WAITS, wait_bound
from . import trace
from .base import CollectiveError, HostCollective, from_wire, to_wire
from .exchange import Outgoing, PeerExchange
from .link import LinkError, NodeLink
from .reduce import DTYPES, Reducer, unbuilt_note
from .specs import EnvoySpec
from .steps import Complete, StepError

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 30.0  # seconds for the child to import grpc and bind
# A partial up to this size is summed on the host at once and handed back evaluated: an MLX op
# and its evaluation cost more than the numpy sum there (on 2 vCPUs: 42 against 60-90 us for a
# 6,144-value bfloat16 decode vector; at 32 tokens, 360 against 210). A bfloat16 partial of any
# size is, where _sum.c is built: at 32 tokens its sum and the copy into MLX take 93 + 23 us
# where the peer's copy and MLX's add took 212 (MLX's CPU backend widens a value at a time).
EAGER_SUM_BYTES = 32 << 10
_ANSWER_GRACE_S = 5.0  # seconds past the envoy's own bound before the node gives up on it


class EnvoyProcess:
    """One node's envoy child process and the node's exchange over the channels it hands over.

    Args:
        reduce: how `collect` sums (default: the C module where it was built).
    """

    def __init__(self, spec: EnvoySpec, rank: int, reduce: Reducer | None = None):
        self.spec = spec
        self.rank = rank
        self.world_size = spec.world_size
        self.link = NodeLink()
        self._step = 0
        self._request: str | None = None
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.exchange: PeerExchange | None = None
        try:
            self.proc = self._spawn()
            kind, body = self._answer(_START_TIMEOUT_S, "start")
            if kind != messages.READY:
                raise CollectiveError(f"envoy of rank {rank} sent {kind!r} instead of READY")
            self.pid, self.port = messages.unpack_ready(body)
            self.exchange = PeerExchange(
                rank,
                tuple(spec.addresses),
                self.link.messages,
                self.link.fileno(),
                self._on_message,
                self._broken,
                reduce,
            )
            self.exchange.stamps = spec.trace
        except BaseException:
            self.close()
            raise

    def _spawn(self) -> subprocess.Popen:
        spec, rank = self.spec, self.rank
        child_fd = self.link.child_sock.fileno()
        cmd = [
            sys.executable,
            "-m",
            "moe_cluster.envoy",
            "--rank",
            str(rank),
            "--addresses",
            ",".join(spec.addresses),
            "--listen",
            spec.listen or spec.addresses[rank],
            "--timeout",
            repr(spec.timeout_s),
            "--connect-timeout",
            repr(spec.connect_timeout_s),
            "--secret-stdin",
            "--link-fd",
            str(child_fd),
            "--parent-pid",
            str(os.getpid()),
            "--log-level",
            spec.log_level,
        ]
        if spec.tls is not None:
            cmd += ["--tls-cert", spec.tls.cert, "--tls-key", spec.tls.key, "--tls-ca", spec.tls.ca]
        if spec.data_port:
            cmd += ["--data-port", str(spec.data_port)]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, pass_fds=(child_fd,), close_fds=True)
        try:
            proc.stdin.write(spec.secret.encode() + b"\n")
            proc.stdin.close()
        except BrokenPipeError:
            pass  # it exited already; _answer reports how
        self.link.child_started()
        logger.info(
            "rank %s started envoy pid %s listening on %s",
            rank,
            proc.pid,
            spec.listen or spec.addresses[rank],
        )
        return proc

    def _gone(self) -> str:
        code = self.proc.poll()
        return f"envoy of rank {self.rank} (pid {self.proc.pid}" + (
            ")" if code is None else f", exit code {code})"
        )

    def _answer(self, timeout: float, what: str) -> tuple[int, bytes]:
        try:
            return self.link.recv(timeout)
        except LinkError as exc:
            try:
                self.proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass
            raise CollectiveError(f"{self._gone()} failed during {what}: {exc}") from exc

    def _on_message(self, kind: int, body: bytes) -> None:
        """A message about the peers' channels: one handed over, or one lost."""
        if kind == messages.CHANNEL:
            rank, extra = messages.unpack_peer(body)
            self.exchange.install(rank, self.link.take_fd(), extra)
        elif kind == messages.LOST:
            rank, why = messages.unpack_peer(body)
            self.exchange.peer_lost(rank, why.decode(errors="replace"))
        else:
            raise CollectiveError(f"envoy of rank {self.rank} sent {kind!r} during a step")

    def _broken(self, rank: int, why: str) -> None:
        try:
            self.link.broken(rank, why)
        except LinkError:
            pass  # the envoy is gone: the next step says so

    def begin(self, request_id: str) -> None:
        """Start a request; waits (up to connect_timeout_s) until every peer is connected."""
        self.link.begin(request_id)
        self._request = request_id
        self._step = 0
        deadline = time.monotonic() + self.spec.connect_timeout_s + _ANSWER_GRACE_S
        while True:
            kind, body = self._answer(
                max(deadline - time.monotonic(), 1e-3), f"begin of request {request_id}"
            )
            if kind not in (messages.CHANNEL, messages.LOST):
                break
            self._on_message(kind, body)
        if kind == messages.FAIL:
            raise CollectiveError(messages.unpack_text(body))
        if kind != messages.BEGUN:
            raise CollectiveError(f"envoy of rank {self.rank} answered begin with {kind!r}")
        self.exchange.begin(request_id)

    def all_reduce(self, out: Outgoing, cold: bool = False) -> np.ndarray:
        """Sum a raw 1-D payload over all ranks; returns the raw sum (of its dtype), a view valid
        until the next call. `cold`: this node or a peer may build kernels before it hands its
        partial over, so the wait is bounded by spec.cold_s instead of the timeout."""
        step = self.send(out, cold)
        return self._exchanged(step, self.exchange.collect)

    def send(
        self, out: Outgoing, cold: bool = False, each: dict[int, np.ndarray] | None = None
    ) -> int:
        """all_reduce's first half: write the payload (or `each` peer its own, PeerExchange.send)
        to every peer and return at once (its step number). One all-reduce is in flight at a
        time: `collect_parts` it before the next `send`."""
        if self._request is None:
            self.begin("default")
        step = self._step
        self._step += 1
        bound = wait_bound(self.spec.timeout_s, cold, self.spec.cold_s)
        self._exchanged(step, lambda: self.exchange.send(out, step, bound, each))
        return step

    def collect_parts(self, step: int) -> Complete:
        """all_reduce's second half, for a node that sums the partials itself: every rank's raw
        payload of step `step`, in rank order, views valid until the next `send`."""
        return self._exchanged(step, self.exchange.collect_parts)

    def _exchanged(self, step: int, call: Callable):
        """`call()` on the exchange, its failures as the Collective's (the step's, or the envoy's)."""
        try:
            return call()
        except StepError as exc:
            raise CollectiveError(str(exc)) from None
        except LinkError as exc:
            raise CollectiveError(f"{self._gone()} failed during step {step}: {exc}") from exc

    @property
    def next_step(self) -> int:
        """The step number the next all-reduce of this request takes."""
        return self._step

    def abort(self, request_id: str) -> None:
        """Fail the request's pending begin or step now, and its later steps (see Collective.abort)."""
        if self.exchange is not None:
            self.exchange.abort(request_id)
        try:
            self.link.abort(request_id)
        except LinkError:
            pass  # the envoy is gone: the step fails on its own

    def failure(self) -> str | None:
        """Why this envoy can no longer all-reduce (it exited: killed, crashed), or None while it runs."""
        if self.proc is None or self.proc.poll() is None:
            return None
        return f"{self._gone()} exited"

    def close(self) -> None:
        """Ask the envoy to exit; kill it if it does not within a few seconds."""
        if self.exchange is not None:
            self.exchange.close()
        self.link.close()
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                logger.warning("envoy pid %s did not exit; killing it", self.proc.pid)
                self.proc.kill()
                self.proc.wait(timeout=5)


class EnvoyCollective(HostCollective):
    """The Collective of `transport: envoy`.

    Args:
        reduce: how the partials are summed on the host (default: bfloat16 in the C module where
            it was built; `bench allreduce --sum numpy` passes numpy's to compare the two).
    """

    def __init__(self, spec: EnvoySpec, rank: int, reduce: Reducer | None = None):
        # where this node sums the partials on the host: small ones, bfloat16, the ride's slots
        super().__init__(rank, spec.world_size, reduce if reduce is not None else Reducer())
        self._envoy = EnvoyProcess(spec, rank, self._reduce)
        note = unbuilt_note()
        if note is not None:
            logger.warning("%s", note)
            print(f"moe-cluster node: rank {rank}: {note}", file=sys.stderr)
        self._eager_out: dict[str, np.ndarray] = {}
        self._cold = False  # the step being watched may build kernels (watch)
        self._reduced = 0  # all-reduces completed: the first COLD_WAITS are cold
        # one trace.py record per all-reduce where the spec traces (chosen once; else None)
        self.trace: list[tuple[int, ...]] | None = [] if spec.trace else None

    @property
    def envoy(self) -> EnvoyProcess:
        return self._envoy

    def begin(self, request_id: str) -> None:
        self._rider.clear()
        self._envoy.begin(request_id)

    def start(self, partial: mx.array, layer: int) -> Callable[[], mx.array]:
        """all_reduce in two halves (node/overlap.py): hand `partial` over now; the returned call
        waits for the sum. Call it before the next start or all_reduce."""
        if self.trace is not None:
            out = self._traced(partial, layer)
            return lambda: out
        payload, extra = self._rider.attach(partial, layer)
        raw, dtype = to_wire(payload)
        envoy = self._envoy
        out = Outgoing(raw.reshape(-1), dtype, tuple(payload.shape), layer)
        step = envoy.send(out, self._cold_now())
        return lambda: self._summed(envoy.collect_parts(step).parts, dtype, extra, partial)

    def _exchange(self, raw: np.ndarray, dtype: str, shape, layer: int) -> list[np.ndarray]:
        """Every rank's raw payload of one exchange (HostCollective): copies, in rank order."""
        envoy = self._envoy
        step = envoy.send(Outgoing(raw, dtype, shape, layer), self._cold_now())
        return [p.copy() for p in envoy.collect_parts(step).parts]

    def reduce_scatter(self, partial: mx.array, counts: tuple[int, ...], layer: int) -> mx.array:
        """This rank's rows of every rank's `partial` (sum(counts), D), summed in rank order: each
        peer is sent only its own rows of this node's partial (a frame per peer), and sends this
        node its rows of its own, so a node moves its share of the rows, not the whole partial."""
        raw, dtype = to_wire(partial)
        rows = raw.reshape(partial.shape[0], -1)
        starts = [sum(counts[:r]) for r in range(len(counts))]
        block = {r: rows[s : s + n] for r, (s, n) in enumerate(zip(starts, counts))}
        mine = block[self.rank]
        envoy = self._envoy
        step = envoy.send(Outgoing(mine, dtype, mine.shape, layer), self._cold_now(), each=block)
        parts = envoy.collect_parts(step).parts
        width = partial.shape[-1]
        out = self._reduce(
            [p.reshape(-1) for p in parts], dtype, np.empty(mine.size, DTYPES[dtype])
        )
        return from_wire(out, dtype, (counts[self.rank], width))

    def _summed(
        self, parts: list[np.ndarray], dtype: str, extra: int, partial: mx.array
    ) -> mx.array:
        """The rank-order float32 sum of every rank's partial, rounded once to the partial's dtype:
        on the host at once where that is cheaper (EAGER_SUM_BYTES, or the C module's bfloat16
        sum), else in MLX, inside the step's graph, the peers' raw partials copied in and this
        node's used where it is. The ride's slots are summed here."""
        if extra:
            tails = [p[-extra:] for p in parts]
            self._rider.detach(
                self._reduce.sum_float32(tails, dtype, np.empty(extra, np.float32)),
                "float32",
                extra,
            )
        n = partial.size
        if n * partial.itemsize <= EAGER_SUM_BYTES or self._reduce.native_sums(dtype):
            out = self._reduce([raw[:n] for raw in parts], dtype, self._eager(n, dtype))
            return from_wire(out, dtype, partial.shape)  # a copy: nothing left to evaluate
        xs = [
            partial.reshape(-1) if r == self.rank else from_wire(raw[:n], dtype, (n,))
            for r, raw in enumerate(parts)
        ]
        if len(xs) == 2:
            # Two float16/bfloat16 values' float32 sum is exact, or off by less than half their
            # ulp from the larger (whose rounding it then is): one add in their own dtype, rounded
            # once, gives the same bits as the float32 sum rounded, in one pass instead of four.
            return (xs[0] + xs[1]).reshape(partial.shape)
        total = xs[0].astype(mx.float32)
        for x in xs[1:]:
            total = total + x.astype(mx.float32)
        return total.astype(partial.dtype).reshape(partial.shape)

    def _eager(self, n: int, dtype: str) -> np.ndarray:
        buf = self._eager_out.get(dtype)
        if buf is None or buf.size < n:
            buf = self._eager_out[dtype] = np.empty(max(n, 4096), DTYPES[dtype])
        return buf[:n]

    def _cold_now(self) -> bool:
        """Whether the all-reduce about to start may wait on kernel builds (and counts it)."""
        self._reduced += 1
        return self._cold or self._reduced <= COLD_WAITS

    def _traced(self, partial: mx.array, layer: int) -> mx.array:
        """all_reduce with the node's stamps and the exchange's (trace.py)."""
        entered = time.perf_counter_ns()
        payload, extra = self._rider.attach(partial, layer)
        raw, dtype = to_wire(payload)
        on_host = time.perf_counter_ns()
        envoy = self._envoy
        exchange = envoy.exchange
        sent = Outgoing(raw.reshape(-1), dtype, tuple(payload.shape), layer)
        step = envoy.send(sent, self._cold_now())
        out = self._summed(envoy.collect_parts(step).parts, dtype, extra, partial)
        mx.eval(out)
        stamps = (
            entered,
            on_host,
            exchange.writing_ns,
            exchange.sent_ns,
            exchange.complete_ns,
            time.perf_counter_ns(),
        )
        self.trace.append(trace.record(step, stamps, exchange.arrivals(step)))
        return out

    def watch(self, what: str | None, cold: bool = False) -> None:
        # the exchange times out every all-reduce itself; a step that may build kernels (on this
        # node or a peer: the nodes run the same shapes) gets the cold bound there
        self._cold = cold and what is not None

    def abort(self, request_id: str) -> None:
        self._envoy.abort(request_id)

    def failure(self) -> str | None:
        return self._envoy.failure()

    def close(self) -> None:
        self._envoy.close()
