"""The running cluster as the coordinator sees it: members, their health, loading, and requests.

Each request is sent to every node (they run it in lock-step, beside the others in their running
batch) and rank 0's stream carries the tokens. Heartbeats, RPC failures and the nodes' own reports
(an envoy that exited) feed one health machine (`health.py`): a lost node fails the requests in
flight on the nodes and turns the cluster `degraded`; once every node answers, the cluster is
rebuilt (every node loaded again, then a warm-up step) once those requests have ended on the
nodes, so a rejoin never races a request; a rejoin that fails is retried with backoff. The requests themselves
go on (`resume.py`): each waits for the cluster to be ready again and resumes where its stream
stopped, at most `max_resumes` times; new requests wait too. A wait is bounded by `recovery_wait`,
past which the request gets the 503 (or stream error) with the reason and Retry-After.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Callable, Sequence

import grpc

from ...proto.errors import (
    DeadlineError,
    ErrorKind,
    MoeClusterError,
    NotReadyError,
    error_for,
    kind_from_grpc,
    kind_of,
)
from ...proto.records import GenerateDone, GeneratedTokens, LoadSpec, NodeError
from ...proto.records import GenerateRequest
from . import health as H
from .client import ClusterError, NodeClient, describe_rpc_error
from .resume import MAX_RESUMES, RECOVERY_WAIT_S, continuation
from .streams import Owners

logger = logging.getLogger(__name__)

CANCEL_WAIT_S = (
    10.0  # seconds a cancelled request may take to end on every node (one step, or a prefill chunk)
)
# Seconds a local node that is not serving (restarted and not loaded yet, or loading) may go without
# answering a heartbeat before it is restarted: a fresh process importing mlx-lm on a busy machine
# misses the 1 s heartbeat deadline (seen at load 13 on 2 vCPUs), and restarting it then only
# restarted the rejoin. A serving node that stops answering is restarted at once.
LOADING_STALL_S = 10.0
LOST_BEATS, LOST_BEAT_S = 3, 0.05  # heartbeats (and seconds between) to find the node a peer lost


@dataclass
class Member:
    """One node of the cluster and what the coordinator knows about it."""

    name: str
    client: NodeClient
    rank: int
    spec: LoadSpec | None = None
    memory_bytes: int = 0
    budget_bytes: int = 0
    used_bytes: int = 0
    device: str = ""
    backend: str = ""
    experts: int = 0
    last_seen: float = 0.0
    load_done: int = 0
    load_total: int = 0
    routing: tuple = ()  # proto.records.LayerRouting by layer, from the node's last Status
    expert_cache: tuple = ()  # proto.records.ExpertCacheLayer by layer, from the node's last Status
    route: str = (
        ""  # the node's decode route and the µs per MoE layer it measured per route (Status)
    )
    route_us: dict = field(default_factory=dict)
    speculative: str = ""  # what the node's batch does of serving.speculative (Status)
    micro_batches: str = ""  # what the node's batch does of serving.overlap (Status)
    route_host_from: int = 0  # positions from which its calls take the host read; 0: none
    kv_bytes: int = 0  # KV reserved for the streams it attends for (Status)

    @property
    def address(self) -> str:
        return self.client.address


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


class Cluster:
    def __init__(
        self,
        members: Sequence[Member],
        *,
        model: str,
        transport: str,
        heartbeat_s: float = 1.0,
        load_timeout_s: float = 600.0,
        request_timeout_s: float = 600.0,
        queue_limit: int = 16,
        max_batch: int = 8,
        recovery_wait_s: float = RECOVERY_WAIT_S,
        max_resumes: int = MAX_RESUMES,
        respawn: Callable[[Member], None] | None = None,
        pid_of: Callable[[str], int | None] | None = None,
        attention: str = "replicated",
    ):
        self.members = list(members)
        # who attends for each stream (serve/streams.py): with attention by stream, each node
        # runs max_batch streams of its own
        self.owners = Owners(attention, len(self.members))
        self.running_limit = max_batch * (len(self.members) if attention != "replicated" else 1)
        self.model = model
        self.transport = transport
        self.heartbeat_s = heartbeat_s
        self.load_timeout_s = load_timeout_s
        self.request_timeout_s = request_timeout_s
        self.queue_limit = queue_limit
        self.max_batch = max_batch
        self.recovery_wait_s = recovery_wait_s
        self.max_resumes = max_resumes
        self.health = H.initial([(m.name, m.address) for m in self.members])
        self.started = time.monotonic()
        self._respawn = respawn
        self._pid_of = pid_of  # pids of the nodes this machine launched
        # Requests on the nodes: they run together in each node's batch (max_batch at once, the rest
        # wait there in arrival order); past max_batch + queue_limit a request gets 429.
        self._running: set[str] = set()
        # of those, requests whose caller left (a client gone, a stop string): they still end on the
        # nodes (CANCEL_WAIT_S at most, a queued one when the nodes admit it) but hold no queue slot
        self._gone: set[str] = set()
        self._drained = (
            asyncio.Event()
        )  # set while no request is on the nodes (a rejoin waits for it)
        self._drained.set()
        self._ready = asyncio.Event()  # set while the health machine says ready
        self._waiting = 0  # requests waiting for a recovery before their first run
        self._attempts: dict[str, str] = {}  # a request's id -> the id of its run on the nodes now
        self._seq = (
            0  # admission order sent with each request; restarts with every load of the nodes
        )
        self._failed = (
            asyncio.Event()
        )  # set when a node dies during requests: every one of them fails
        self._monitor: asyncio.Task | None = None
        self._rejoin_task: asyncio.Task | None = None
        self._restarting: set[str] = set()  # nodes found not answering, handed to `respawn`
        self._loading: set[str] = set()  # nodes with a Load in flight
        self._unanswered: dict[
            str, float
        ] = {}  # node -> time.monotonic() of its first unanswered heartbeat
        self._tasks: set[asyncio.Task] = set()  # background work this cluster owns
        self.allreduce_histograms: dict = {}  # node name -> metrics.Histogram, refreshed after requests

    def _spawn(self, coro, name: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- health --------------------------------------------------------------------------------

    @property
    def state(self) -> str:
        return self.health.phase

    @property
    def reason(self) -> str:
        return self.health.reason

    def node_state(self, m: Member) -> str:
        return self.health.node(m.name).state

    def _event(self, event: H.Event) -> None:
        """Apply one health event; a cluster that stops being ready fails the request in flight."""
        before = self.health
        self.health = H.apply(before, event)
        if self.health.ready:
            self._ready.set()
        else:
            self._ready.clear()
        if before.ready and not self.health.ready:
            logger.warning("cluster %s: %s", self.health.phase, self.health.reason)
            self._failed.set()
        elif self.health.ready and not before.ready and before.phase in ("degraded", "recovering"):
            logger.info("cluster ready again")

    # -- loading -------------------------------------------------------------------------------

    async def _load_member(self, m: Member, on_progress: Callable[[Member], None] | None) -> None:
        self._loading.add(m.name)
        try:
            await self._load_one(m, on_progress)
        finally:
            self._loading.discard(m.name)

    async def _load_one(self, m: Member, on_progress: Callable[[Member], None] | None) -> None:
        self._event(H.NodeLoading(m.name))
        try:
            async for p in m.client.load(m.spec, timeout=self.load_timeout_s):
                m.load_done, m.load_total = p.bytes_loaded, p.bytes_total
                if on_progress:
                    on_progress(m)
                if p.error is not None:
                    raise error_for(
                        p.error.kind, f"node {m.name} failed to load: {p.error.message}"
                    )
                if p.done:
                    break
        except grpc.RpcError as exc:
            kind = kind_from_grpc(exc.code())
            if kind is ErrorKind.UNAVAILABLE:
                self._event(H.RpcFailed(m.name, describe_rpc_error(exc)))
            raise error_for(
                kind, f"node {m.name} ({m.address}) failed to load: {describe_rpc_error(exc)}"
            ) from None
        self._event(H.NodeLoaded(m.name))
        m.last_seen = time.monotonic()
        await self._refresh(m)

    async def load(self, on_progress: Callable[[Member], None] | None = None) -> None:
        """Load every member's shard, then run one warm-up step through the whole mesh."""
        self._event(H.LoadStarted())
        self._seq = 0  # a load starts every node's running batch afresh
        self.owners.clear()  # and every prompt cache
        results = await asyncio.gather(
            *(self._load_member(m, on_progress) for m in self.members), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self._event(H.LoadDone(error=str(errors[0])))
            raise errors[0]  # typed by its kind; anything else is a bug and stays one
        await self._warm_up()
        self._event(H.LoadDone())

    async def adopt(self) -> dict[str, MoeClusterError]:
        """Keep what every node has loaded where its load is what its spec says (node/adopt.py
        says what must match), then one warm-up step through the whole mesh: {} and the cluster
        is ready. All or none: where one node cannot (nothing loaded: NOT_FOUND; it restarted, its
        model or the plan differ, its transport failed) no node changed, and the refusals by node
        say to load them all (`load`). Each node first drops the sequences still running there:
        their coordinator is gone."""
        self._event(H.LoadStarted())
        self._seq = 0  # the running batches are idle: admission numbers start again
        self.owners.clear()
        results = await asyncio.gather(
            *(self._adopt_one(m) for m in self.members), return_exceptions=True
        )
        refused = {}
        for m, why in zip(self.members, results):
            if isinstance(why, grpc.RpcError):
                why = error_for(
                    kind_from_grpc(why.code()), f"node {m.name}: {describe_rpc_error(why)}"
                )
            elif isinstance(why, BaseException) and not isinstance(why, MoeClusterError):
                raise why  # a bug stays one
            if why is not None:
                logger.info("node %s not adopted: %s", m.name, why)
                refused[m.name] = why
        if refused:
            return refused
        try:
            await self._warm_up()
        except MoeClusterError as exc:
            logger.warning("adopted nodes failed their warm-up (%s): loading them afresh", exc)
            return {"warm-up": error_for(exc.kind, f"the warm-up step failed: {exc}")}
        self._event(H.LoadDone())
        return {}

    async def _adopt_one(self, m: Member) -> None:
        self._event(H.NodeLoading(m.name))
        async for p in m.client.load(replace(m.spec, adopt=True), timeout=self.load_timeout_s):
            if p.error is not None:
                raise error_for(p.error.kind, f"node {m.name}: {p.error.message}")
            if p.done:
                break
        m.load_done, m.load_total = p.bytes_loaded, p.bytes_total
        self._event(H.NodeLoaded(m.name))
        m.last_seen = time.monotonic()
        await self._refresh(m)

    async def _warm_up(self) -> None:
        """A one-token request through every node: the mesh is up and every expert path is warm."""
        from ...proto.records import Sampling

        req = GenerateRequest(f"warmup-{uuid.uuid4().hex[:8]}", (0,), Sampling(max_tokens=1))
        outcome = Outcome()
        async for _ in self._run(req, outcome):
            pass
        if outcome.error:
            raise error_for(outcome.error.kind, f"warm-up step failed: {outcome.error}")

    async def time_allreduce(self, tokens: int = 16) -> tuple[float, float, int] | None:
        """A short request through every node once loaded (as the warm-up's): (seconds its decode
        steps waited per MoE-layer all-reduce on rank 0, its decode tok/s, MoE layers); None
        where it had no decode step to time."""
        from ...proto.records import Sampling

        req = GenerateRequest(
            f"allreduce-{uuid.uuid4().hex[:8]}", (0,), Sampling(max_tokens=tokens)
        )
        outcome = Outcome()
        async for _ in self._run(req, outcome):
            pass
        d = outcome.done
        if outcome.error or d is None:
            return None
        steps, layers = d.counters.get("decode_steps", 0.0), int(d.counters.get("moe_layers", 0))
        if not steps or not layers or not d.timings.generation_s:
            return None
        tps = max(len(outcome.tokens) - 1, 1) / d.timings.generation_s
        return d.timings.collective_s / (steps * layers), tps, layers

    async def _refresh(self, m: Member) -> None:
        try:
            s = await m.client.status()
        except grpc.RpcError:
            return
        # budget_bytes stays what placement gave the node (`up`), not the memory the node reports
        m.memory_bytes, m.used_bytes = s.memory.device_bytes, s.memory.used_bytes
        m.device, m.backend = s.device, s.backend
        m.experts = sum(s.experts_per_layer.values())
        m.routing, m.expert_cache = s.routing, s.expert_cache
        m.route, m.route_us = s.route, dict(s.route_us)
        m.speculative, m.micro_batches = s.speculative, s.micro_batches
        m.route_host_from = s.route_host_from
        m.kv_bytes = s.kv_bytes
        from .metrics import allreduce_histogram

        hist = allreduce_histogram(s.allreduce)
        if hist is not None:
            self.allreduce_histograms[m.name] = hist

    # -- requests ------------------------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        """Requests running or waiting for a caller."""
        return len(self._running) - len(self._gone)

    def _recovering(self) -> bool:
        """A request may wait for the cluster: a node was lost and the cluster is rebuilding (or
        waiting for the node), as opposed to starting, loading or stopping."""
        return self.recovery_wait_s > 0 and self.health.phase in ("degraded", "recovering")

    def check_ready(self) -> None:
        """Raise the health machine's refusal (503, with Retry-After) unless the cluster can serve,
        or a request may wait for it to recover (`generate` waits)."""
        error = H.refusal(self.health)
        if error is not None and not self._recovering():
            raise error

    async def _wait_ready(self, since: float, outcome: Outcome) -> None:
        """Wait until the cluster is ready, at most `recovery_wait_s` after `since`
        (time.monotonic()); past it, or when the cluster is not recovering, raise the health
        machine's refusal."""
        outcome.waiting = True
        try:
            while not self.health.ready:
                left = since + self.recovery_wait_s - time.monotonic()
                if not self._recovering() or left <= 0:
                    raise H.refusal(self.health) or H.NodeLostError("cluster is not ready")
                try:
                    await asyncio.wait_for(self._ready.wait(), timeout=left)
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
        if self.queue_depth + self._waiting >= self.running_limit + self.queue_limit:
            raise QueueFull(
                f"queue is full ({self.queue_limit} requests waiting) beside "
                f"{self.running_limit} running"
            )
        started = last = time.monotonic()
        if not self.health.ready:
            self._waiting += 1
            try:
                await self._wait_ready(started, outcome)
            except MoeClusterError as exc:
                outcome.error = exc
                raise
            finally:
                self._waiting -= 1
        req = self._seeded(req)
        attempt, stalled = 0, False
        try:
            while True:
                now = continuation(req, outcome.tokens, attempt)
                self._attempts[req.request_id] = now.request_id
                run = self._run(now, outcome)
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
            *(self._cancel_one(m, run_id, abort) for m in self.members), return_exceptions=True
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
        self._spawn(self.refresh(), "refresh")

    async def _run(self, req: GenerateRequest, outcome: Outcome) -> AsyncIterator[int]:
        req = self._admit(req)
        queue: asyncio.Queue = asyncio.Queue()
        # only rank 0 streams its tokens; the others say how the request ended (every rank hands out
        # the same agreed tokens)
        tasks = [
            asyncio.create_task(
                self._pump(m, req if m.rank == 0 else replace(req, quiet=True), queue),
                name=f"gen-{m.name}",
            )
            for m in self.members
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
                        outcome.error = H.refusal(self.health) or H.NodeLostError(
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
                    if not outcome.error and self.health.ready:
                        # A peer may have seen a loss first ("rank 1 disconnected"; over the mlx ring,
                        # an error of MLX's own on the survivor): heartbeat every node now, so the
                        # answer names the lost node and its cause, not the node that saw it (one
                        # health RPC: at once for a dead process, max(heartbeat, 1 s) for a stalled one).
                        # The envoys' data channel can see a killed process's sockets reset before
                        # the process is a zombie its node can reap: a few beats, LOST_BEAT_S apart.
                        for beat in range(LOST_BEATS):
                            await self._beat_all()
                            if not self.health.ready or beat == LOST_BEATS - 1:
                                break
                            await asyncio.sleep(LOST_BEAT_S)
                    if not outcome.error:
                        outcome.error = H.refusal(self.health) if not self.health.ready else None
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
                    self._spawn(self._end(req, tasks, queue, None), f"end-{req.request_id}")
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

    async def refresh(self) -> None:
        """Update every live member's memory, experts and all-reduce histogram."""
        await asyncio.gather(
            *(self._refresh(m) for m in self.members if self.node_state(m) == "ready"),
            return_exceptions=True,
        )

    async def _pump(self, m: Member, req: GenerateRequest, queue: asyncio.Queue) -> None:
        try:
            async for event in m.client.generate(req, timeout=self.request_timeout_s):
                await queue.put((m, event))
        except grpc.RpcError as exc:
            kind = kind_from_grpc(exc.code())
            if (
                kind is ErrorKind.UNAVAILABLE
            ):  # unreachable, or it says it failed: lost before a heartbeat sees it
                self._event(H.RpcFailed(m.name, describe_rpc_error(exc)))
            await queue.put((m, NodeError(kind, describe_rpc_error(exc), m.rank)))
        except Exception as exc:  # noqa: BLE001 - e.g. a request the wire cannot carry: the request's error, by kind
            await queue.put((m, NodeError(kind_of(exc), f"{type(exc).__name__}: {exc}", m.rank)))
        finally:
            await queue.put((m, None))

    # -- heartbeats and rejoin -----------------------------------------------------------------

    def start_monitor(self) -> None:
        if self._monitor is None:
            self._monitor = asyncio.create_task(self._watch(), name="heartbeat")

    async def _watch(self) -> None:
        while self.state != "stopping":
            await self._beat_all()
            if self._rejoin_task is None and H.can_rejoin(self.health, time.monotonic()):
                self._rejoin_task = self._spawn(self._rejoin(), "rejoin")
            await asyncio.sleep(self.heartbeat_s)

    async def _beat_all(self) -> None:
        await asyncio.gather(*(self._beat(m) for m in self.members), return_exceptions=True)

    async def _beat(self, m: Member) -> None:
        try:
            h = await m.client.health(timeout=max(self.heartbeat_s, 1.0))
        except grpc.RpcError as exc:
            serving = self.node_state(m) in ("ready", "dead") and m.name not in self._loading
            self._event(H.HeartbeatFailed(m.name, f"not answering ({describe_rpc_error(exc)})"))
            since = self._unanswered.setdefault(m.name, time.monotonic())
            # A process that is gone, or a serving one that stalls, is restarted at once; one that is
            # there but slow while it is not serving anyway gets LOADING_STALL_S.
            slow = exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and not serving
            if slow and time.monotonic() - since < LOADING_STALL_S:
                return
            if m.name not in self._restarting:  # once per death (an RPC may have seen it first)
                logger.warning("node %s (%s) stopped answering", m.name, m.address)
                self._restarting.add(m.name)
                if self._respawn is not None:
                    self._respawn(m)  # the launcher owns the restart task
            return
        self._unanswered.pop(m.name, None)
        self._restarting.discard(m.name)
        m.last_seen = time.monotonic()
        before = self.node_state(m)
        self._event(H.HeartbeatOk(m.name, h.state, h.reason))
        if before != "failed" and self.node_state(m) == "failed":
            logger.warning("node %s: %s", m.name, self.health.node(m.name).reason)

    async def _rejoin(self) -> None:
        """Rebuild the cluster: every node loaded again (a failed envoy is restarted by its node's
        load), then a warm-up step. Every request that failed ends on the nodes first, and none
        starts until the rejoin is over (the cluster is not ready meanwhile)."""
        try:
            await asyncio.wait_for(self._drained.wait(), timeout=self.request_timeout_s)
            self._seq = 0  # the load starts every node's running batch afresh
            self._event(H.RejoinStarted())
            if self.state != "recovering":
                return
            logger.info("rejoin: loading every node again (%s)", self.reason)
            results = await asyncio.gather(
                *(self._load_member(m, None) for m in self.members), return_exceptions=True
            )
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                raise errors[0]
            await self._warm_up()
            self._event(H.RejoinSucceeded())
        except asyncio.TimeoutError:
            self._event(
                H.RejoinFailed("failed requests did not end on the nodes", time.monotonic())
            )
        except (MoeClusterError, grpc.RpcError) as exc:
            logger.warning("rejoin failed: %s", exc)
            self._event(H.RejoinFailed(str(exc), time.monotonic()))
        finally:
            self._rejoin_task = None

    # -- status and shutdown -------------------------------------------------------------------

    def status(self) -> dict:
        load = self.owners.load()
        return {
            "state": self.state,
            "reason": self.reason,
            "rejoin_attempts": self.health.attempts,
            "model": self.model,
            "transport": self.transport,
            "uptime_s": round(time.monotonic() - self.started, 1),
            "queue_depth": self.queue_depth,
            "running": min(self.queue_depth, self.running_limit),
            "waiting": max(0, self.queue_depth - self.running_limit),
            "attention": self.owners.mode,
            "waiting_for_recovery": self._waiting,  # arrived while a lost node is rebuilt
            "nodes": [
                {
                    "name": m.name,
                    "rank": m.rank,
                    "state": self.node_state(m),
                    "address": m.address,
                    "memory_bytes": m.memory_bytes,
                    "budget_bytes": m.budget_bytes,
                    "used_bytes": m.used_bytes,
                    "experts": m.experts,
                    "device": m.device,
                    "pid": self._pid_of(m.name) if self._pid_of else None,
                    "error": self.health.node(m.name).reason,
                    # seconds; the bucket bound of the median all-reduce since the node loaded (None: none yet)
                    "allreduce_p50_s": self.allreduce_histograms[m.name].quantile(0.5)
                    if m.name in self.allreduce_histograms
                    else None,
                    "last_seen_s": round(time.monotonic() - m.last_seen, 1)
                    if m.last_seen
                    else None,
                    "expert_cache": [vars(c) for c in m.expert_cache],
                    "route": m.route,
                    "route_us": dict(m.route_us),
                    # a device route hands calls of this many positions on to the host read
                    "route_host_from": m.route_host_from or None,
                    "speculative": m.speculative,
                    "micro_batches": m.micro_batches,
                    # the running streams it attends for (the coordinator's count, live) and the
                    # KV its own batch reserved for them at its last status
                    "streams": load[m.rank].streams,
                    "kv_tokens": load[m.rank].tokens,
                    "kv_bytes": m.kv_bytes,
                }
                for m in self.members
            ],
        }

    def experts(self) -> dict:
        """Every MoE layer's experts: the router's selections of each since the load (rank 0's count;
        the router is replicated, so every node counts the same) and the nodes holding each."""
        layers: dict[int, dict] = {}
        for m in sorted(self.members, key=lambda m: m.rank):
            for r in m.routing:
                entry = layers.setdefault(
                    r.layer,
                    {"layer": r.layer, "tokens": list(r.tokens), "holders": [[] for _ in r.tokens]},
                )
                for e in r.held:
                    if e < len(entry["holders"]):
                        entry["holders"][e].append(m.name)
        return {
            "nodes": [m.name for m in self.members],
            "layers": [layers[k] for k in sorted(layers)],
        }

    async def close(self, shutdown_nodes: bool) -> None:
        self._event(H.Stopping())
        pending = [t for t in [self._monitor, *self._tasks] if t is not None]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if shutdown_nodes:
            await asyncio.gather(
                *(m.client.shutdown() for m in self.members), return_exceptions=True
            )
        await asyncio.gather(*(m.client.close() for m in self.members), return_exceptions=True)


class QueueFull(ClusterError):
    """Too many requests waiting."""

    kind = ErrorKind.BUSY
