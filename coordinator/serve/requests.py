"""Requests on the nodes, as the coordinator runs them: admission and the queue, one run sent to
every node and their streams merged (rank 0's tokens), cancel, and resume after a lost node.

Each request is sent to every node (they run it in lock-step, beside the others in their running
batch) and rank 0's stream carries the tokens. A request that finds the cluster recovering waits for
it, and one whose run fails because a node was lost resumes where its stream stopped (`resume.py`),
at most `max_resumes` times; a wait is bounded by `recovery_wait`. The cluster (`cluster.py`) owns
the members and their health: a run reads that health, reports a failed RPC to it, and a cluster
that stops being ready fails every run in flight (`Requests.fail`).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, AsyncIterator, Sequence

import grpc

from ...proto.errors import (
    DeadlineError,
    ErrorKind,
    MoeClusterError,
    error_for,
    kind_from_grpc,
    kind_of,
)
from ...proto.records import GenerateDone, GeneratedTokens, GenerateRequest, NodeError
from . import health as H
from .client import ClusterError, describe_rpc_error
from .resume import MAX_RESUMES, RECOVERY_WAIT_S, continuation
from .streams import Owners

if TYPE_CHECKING:
    from .cluster import Cluster, Member

logger = logging.getLogger(__name__)

CANCEL_WAIT_S = (
    10.0  # seconds a cancelled request may take to end on every node (one step, or a prefill chunk)
)
LOST_BEATS, LOST_BEAT_S = 3, 0.05  # heartbeats (and seconds between) to find the node a peer lost


@dataclass
class Outcome:
    """How a request ended (filled in by `Cluster.generate`)."""

    tokens: list[int] = field(default_factory=list)
    done: GenerateDone | None = None  # the last run's (after a resume: the resumed run's)
    error: MoeClusterError | None = None  # its kind decides the HTTP status
    # seconds without a token at each resume: from the last token before the node was lost (or the
    # request's start) to the first one after the cluster recovered
    stalls: list[float] = field(default_factory=list)
    waiting: bool = False  # while it waits for the cluster to recover (a stream sends keep-alives)


class QueueFull(ClusterError):
    """Too many requests waiting."""

    kind = ErrorKind.BUSY


class Requests:
    """The requests on the nodes of one cluster: they run together in each node's batch (max_batch
    at once, the rest wait there in arrival order); past max_batch + queue_limit a request gets 429.
    """

    def __init__(
        self,
        cluster: Cluster,
        *,
        request_timeout_s: float = 600.0,
        queue_limit: int = 16,
        max_batch: int = 8,
        recovery_wait_s: float = RECOVERY_WAIT_S,
        max_resumes: int = MAX_RESUMES,
        attention: str = "replicated",
    ):
        self.cluster = cluster
        world = len(cluster.members)
        # who attends for each stream (serve/streams.py): with attention by stream, each node
        # runs max_batch streams of its own
        self.owners = Owners(attention, world)
        self.running_limit = max_batch * (world if attention != "replicated" else 1)
        self.request_timeout_s = request_timeout_s
        self.queue_limit = queue_limit
        self.recovery_wait_s = recovery_wait_s
        self.max_resumes = max_resumes
        self._running: set[str] = set()  # the ids of the runs on the nodes
        # of those, requests whose caller left (a client gone, a stop string): they still end on the
        # nodes (CANCEL_WAIT_S at most, a queued one when the nodes admit it) but hold no queue slot
        self._gone: set[str] = set()
        self._drained = (
            asyncio.Event()
        )  # set while no request is on the nodes (a rejoin waits for it)
        self._drained.set()
        self.waiting = 0  # requests waiting for a recovery before their first run
        self._attempts: dict[str, str] = {}  # a request's id -> the id of its run on the nodes now
        self._seq = (
            0  # admission order sent with each request; restarts with every load of the nodes
        )
        self._failed = (
            asyncio.Event()
        )  # set when a node dies during requests: every one of them fails

    def renumber(self) -> None:
        """A load of the nodes starts every node's running batch afresh: admission order too."""
        self._seq = 0

    def fail(self) -> None:
        """The cluster stopped being ready: every request in flight fails."""
        self._failed.set()

    async def drained(self) -> None:
        """Return once no request is on the nodes."""
        await self._drained.wait()

    @property
    def queue_depth(self) -> int:
        """Requests running or waiting for a caller."""
        return len(self._running) - len(self._gone)

    def _recovering(self) -> bool:
        """A request may wait for the cluster: a node was lost and the cluster is rebuilding (or
        waiting for the node), as opposed to starting, loading or stopping."""
        return self.recovery_wait_s > 0 and self.cluster.health.phase in ("degraded", "recovering")

    def check_ready(self) -> None:
        """Raise the health machine's refusal (503, with Retry-After) unless the cluster can serve,
        or a request may wait for it to recover (`generate` waits)."""
        error = H.refusal(self.cluster.health)
        if error is not None and not self._recovering():
            raise error

    async def _wait_ready(self, since: float, outcome: Outcome) -> None:
        """Wait until the cluster is ready, at most `recovery_wait_s` after `since`
        (time.monotonic()); past it, or when the cluster is not recovering, raise the health
        machine's refusal."""
        outcome.waiting = True
        try:
            while not self.cluster.health.ready:
                left = since + self.recovery_wait_s - time.monotonic()
                if not self._recovering() or left <= 0:
                    raise H.refusal(self.cluster.health) or H.NodeLostError("cluster is not ready")
                try:
                    await asyncio.wait_for(self.cluster.until_ready(), timeout=left)
                except asyncio.TimeoutError:
                    pass
        finally:
            outcome.waiting = False

    async def generate(self, req: GenerateRequest, outcome: Outcome) -> AsyncIterator[int]:
        """Run one request on every node (beside the others running there); yields rank 0's tokens.

        A request that finds the cluster recovering waits for it (`recovery_wait_s`); one whose run
        fails because a node was lost waits likewise, then resumes where its tokens stopped (at most
        `max_resumes` times), so its tokens are those of a run without the fault.
        Raises a MoeClusterError before the first token if the cluster is not ready (NotReadyError),
        degraded past the wait (ClusterError, also left in `outcome.error`) or the queue is full
        (QueueFull); afterwards failures end the stream and are reported in `outcome.error`.
        """
        if self.queue_depth + self.waiting >= self.running_limit + self.queue_limit:
            raise QueueFull(
                f"queue is full ({self.queue_limit} requests waiting) beside "
                f"{self.running_limit} running"
            )
        started = last = time.monotonic()
        if not self.cluster.health.ready:
            self.waiting += 1
            try:
                await self._wait_ready(started, outcome)
            except MoeClusterError as exc:
                outcome.error = exc
                raise
            finally:
                self.waiting -= 1
        req = self._seeded(req)
        attempt, stalled = 0, False
        try:
            while True:
                now = continuation(req, outcome.tokens, attempt)
                self._attempts[req.request_id] = now.request_id
                run = self.run(now, outcome)
                try:
                    async for token in run:
                        if stalled:
                            outcome.stalls.append(time.monotonic() - last)
                            stalled = False
                        last = time.monotonic()
                        yield token
                finally:
                    # When our consumer stops early (a stop string, a client gone) `run` must end
                    # here: left to the garbage collector it would still be stopping the nodes while
                    # later requests run.
                    await run.aclose()
                if stalled and outcome.error is None:  # the resumed run ended without a token (EOS)
                    outcome.stalls.append(time.monotonic() - last)
                lost = outcome.error
                if (
                    lost is not None
                    and lost.kind is ErrorKind.UNAVAILABLE
                    and len(outcome.tokens) >= req.sampling.max_tokens
                ):
                    outcome.error = None  # only its end was lost: every token came
                    return
                if not self._resumable(outcome, attempt):
                    return
                logger.warning(
                    "request %s lost its run after %d tokens (%s): resuming once the "
                    "cluster is ready",
                    req.request_id,
                    len(outcome.tokens),
                    lost,
                )
                outcome.error = None
                try:
                    await self._wait_ready(time.monotonic(), outcome)
                except MoeClusterError as exc:
                    outcome.error = exc  # why it cannot come back (or the loss, unresolved)
                    return
                attempt, stalled = attempt + 1, True
        finally:
            self._attempts.pop(req.request_id, None)

    def _resumable(self, outcome: Outcome, attempt: int) -> bool:
        """A run that failed because a node was lost (the cluster's 503) resumes, up to
        max_resumes times."""
        error = outcome.error
        lost = error is not None and error.kind is ErrorKind.UNAVAILABLE
        return lost and attempt < self.max_resumes

    def _seeded(self, req: GenerateRequest) -> GenerateRequest:
        """A sampled request without a seed gets one: every node must draw the same tokens, and a
        resumed run must go on with the draws of the run it continues."""
        sampling = req.sampling
        if sampling.temperature > 0 and sampling.seed is None:
            return replace(req, sampling=replace(sampling, seed=secrets.randbits(63)))
        return req

    async def cancel(self, request_id: str, abort: bool = False) -> None:
        """Stop a request on every node: at the next agreement, or at once with `abort` (it failed)."""
        # a resumed request's run now has an id of its own
        await self._cancel_run(self._attempts.get(request_id, request_id), abort)

    async def _cancel_run(self, run_id: str, abort: bool) -> None:
        await asyncio.gather(
            *(self._cancel_one(m, run_id, abort) for m in self.cluster.members),
            return_exceptions=True,
        )

    async def _cancel_one(self, m: Member, request_id: str, abort: bool) -> None:
        try:
            await m.client.cancel(request_id, abort)
        except grpc.RpcError:
            pass

    def _admit(self, req: GenerateRequest) -> GenerateRequest:
        """The request as the nodes get it: its place in the admission order and, for a sampled one
        without a seed, a seed (every node must draw the same tokens)."""
        if not self._running:
            self._failed.clear()
        self._running.add(req.request_id)
        self._drained.clear()
        self._seq += 1
        owner = self.owners.choose(req.request_id, req.prompt, req.sampling.max_tokens)
        return replace(self._seeded(req), seq=self._seq, owner=owner)

    def _leave(self, request_id: str, tokens: Sequence[int] = ()) -> None:
        """Run `request_id` ended on the nodes; `tokens`: its prompt and what it generated, which
        its owner's prompt cache now holds (empty where it failed)."""
        self.owners.ended(request_id, tokens)
        self._running.discard(request_id)
        self._gone.discard(request_id)
        if not self._running:
            self._drained.set()
        self.cluster.spawn(self.cluster.refresh(), "refresh")

    async def run(self, req: GenerateRequest, outcome: Outcome) -> AsyncIterator[int]:
        req = self._admit(req)
        queue: asyncio.Queue = asyncio.Queue()
        # only rank 0 streams its tokens; the others say how the request ended (every rank hands out
        # the same agreed tokens)
        tasks = [
            asyncio.create_task(
                self._pump(m, req if m.rank == 0 else replace(req, quiet=True), queue),
                name=f"gen-{m.name}",
            )
            for m in self.cluster.members
        ]
        failed_wait = asyncio.create_task(self._failed.wait())
        getter = None
        finished = 0
        got: list[int] = []  # this run's tokens
        try:
            while finished < len(tasks):
                getter = asyncio.create_task(queue.get())
                done, _ = await asyncio.wait(
                    {getter, failed_wait},
                    timeout=self.request_timeout_s,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if getter not in done:
                    if failed_wait in done:
                        outcome.error = H.refusal(self.cluster.health) or H.NodeLostError(
                            "a node died during the request"
                        )
                    else:
                        outcome.error = DeadlineError(
                            f"request timed out after {self.request_timeout_s:.0f} s"
                        )
                    break
                m, event = getter.result()
                if event is None:
                    finished += 1
                    continue
                if isinstance(event, NodeError):
                    lost = event.kind is ErrorKind.UNAVAILABLE  # a node or its envoy is gone
                    if not outcome.error and self.cluster.health.ready:
                        # A peer may have seen a loss first ("rank 1 disconnected"; over the mlx ring,
                        # an error of MLX's own on the survivor): heartbeat every node now, so the
                        # answer names the lost node and its cause, not the node that saw it (one
                        # health RPC: at once for a dead process, max(heartbeat, 1 s) for a stalled one).
                        # The envoys' data channel can see a killed process's sockets reset before
                        # the process is a zombie its node can reap: a few beats, LOST_BEAT_S apart.
                        for beat in range(LOST_BEATS):
                            await self.cluster.beat_all()
                            if not self.cluster.health.ready or beat == LOST_BEATS - 1:
                                break
                            await asyncio.sleep(LOST_BEAT_S)
                    if not outcome.error:
                        outcome.error = (
                            H.refusal(self.cluster.health)
                            if not self.cluster.health.ready
                            else None
                        )
                        if outcome.error is None and lost:
                            # every node still answers: the same 503, Retry-After included
                            outcome.error = H.NodeLostError(f"node {m.name}: {event.message}")
                        outcome.error = outcome.error or error_for(
                            event.kind, f"node {m.name}: {event.message}"
                        )
                    if lost:
                        break  # the others would only wait out the collective timeout
                    continue
                if m.rank != 0:
                    continue
                if isinstance(event, GeneratedTokens):
                    for t in event.ids:
                        outcome.tokens.append(t)
                        got.append(t)
                        yield t
                elif isinstance(event, GenerateDone):
                    outcome.done = event
        finally:
            failed_wait.cancel()
            if getter is not None:
                getter.cancel()
            if any(not t.done() for t in tasks):
                # Stopped early (client gone, stop string, failure): every node drops it at its next
                # step; wait until each has ended it, giving up on nodes that do not answer in time.
                # A failed request answers its client at once and ends on the nodes in the background,
                # still counted as running (a rejoin waits for it; a peer may wait out its collective
                # timeout first).
                if outcome.error is not None:
                    self.cluster.spawn(self._end(req, tasks, queue, None), f"end-{req.request_id}")
                else:
                    self._gone.add(req.request_id)  # its queue slot is free at once
                    await self._end(req, tasks, queue, outcome, [*req.prompt, *got])
            else:
                self._leave(req.request_id, [] if outcome.error else [*req.prompt, *got])

    async def _end(
        self,
        req: GenerateRequest,
        tasks: list[asyncio.Task],
        queue: asyncio.Queue,
        outcome: Outcome | None,
        tokens: Sequence[int] = (),
    ) -> None:
        """End run `req` on every node; `outcome` (None: the run failed, and a resumed run may
        fill the request's outcome meanwhile) gets rank 0's report of it."""
        try:
            # a failed request: the nodes still in it stop waiting for the lost peer now (a begin or a
            # step would wait out the collective timeout, holding the gate and so the rejoin)
            await self._cancel_run(req.request_id, abort=outcome is None)
            _, late = await asyncio.wait(tasks, timeout=CANCEL_WAIT_S)
            for t in late:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            while not queue.empty():  # rank 0's report of the request (cached tokens, timings)
                m, event = queue.get_nowait()
                if m.rank == 0 and isinstance(event, GenerateDone) and outcome is not None:
                    outcome.done = event
        finally:
            self._leave(req.request_id, tokens)

    async def _pump(self, m: Member, req: GenerateRequest, queue: asyncio.Queue) -> None:
        try:
            async for event in m.client.generate(req, timeout=self.request_timeout_s):
                await queue.put((m, event))
        except grpc.RpcError as exc:
            kind = kind_from_grpc(exc.code())
            if (
                kind is ErrorKind.UNAVAILABLE
            ):  # unreachable, or it says it failed: lost before a heartbeat sees it
                self.cluster.event(H.RpcFailed(m.name, describe_rpc_error(exc)))
            await queue.put((m, NodeError(kind, describe_rpc_error(exc), m.rank)))
        except Exception as exc:  # noqa: BLE001 - e.g. a request the wire cannot carry: the request's error, by kind
            await queue.put((m, NodeError(kind_of(exc), f"{type(exc).__name__}: {exc}", m.rank)))
        finally:
            await queue.put((m, None))
