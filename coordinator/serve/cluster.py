"""The running cluster as the coordinator sees it: members, their health, loading, and requests.

One request runs at a time; it is sent to every node (they run in lock-step) and rank 0's stream
carries the tokens. Heartbeats watch every node: a dead node fails the request in flight, turns
the cluster `degraded` (new requests are refused with the reason), and when its agent comes back
its placement is loaded on it again and the cluster is `ready` once a warm-up step succeeds.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Sequence

import grpc

from ...proto.errors import (DeadlineError, ErrorKind, MoeClusterError, NotReadyError, error_for, kind_from_grpc,
                             kind_of)
from ...proto.records import GenerateDone, GeneratedTokens, LoadSpec, NodeError
from ...proto.records import GenerateRequest
from .client import ClusterError, NodeClient, describe_rpc_error

logger = logging.getLogger(__name__)

CANCEL_WAIT_S = 10.0  # seconds a cancelled request may take to end on every node (one step, or a prefill chunk)


@dataclass
class Member:
    """One node of the cluster and what the coordinator knows about it."""

    name: str
    client: NodeClient
    rank: int
    spec: LoadSpec | None = None
    state: str = "unknown"  # unknown | loading | ready | dead
    memory_bytes: int = 0
    budget_bytes: int = 0
    used_bytes: int = 0
    device: str = ""
    backend: str = ""
    experts: int = 0
    last_seen: float = 0.0
    error: str = ""
    load_done: int = 0
    load_total: int = 0

    @property
    def address(self) -> str:
        return self.client.address


@dataclass
class Outcome:
    """How a request ended (filled in by `Cluster.generate`)."""

    tokens: list[int] = field(default_factory=list)
    done: GenerateDone | None = None
    error: MoeClusterError | None = None  # its kind decides the HTTP status


class Cluster:
    def __init__(self, members: Sequence[Member], *, model: str, transport: str, heartbeat_s: float = 1.0,
                 load_timeout_s: float = 600.0, request_timeout_s: float = 600.0, queue_limit: int = 16,
                 respawn: Callable[[Member], None] | None = None,
                 pid_of: Callable[[str], int | None] | None = None):
        self.members = list(members)
        self.model = model
        self.transport = transport
        self.heartbeat_s = heartbeat_s
        self.load_timeout_s = load_timeout_s
        self.request_timeout_s = request_timeout_s
        self.queue_limit = queue_limit
        self.state = "starting"
        self.reason = ""
        self.started = time.monotonic()
        self._respawn = respawn
        self._pid_of = pid_of  # pids of the nodes this machine launched
        self._gate = asyncio.Lock()  # one request at a time
        self._waiting = 0
        self._current: str | None = None
        self._failed = asyncio.Event()  # set when a node dies during a request
        self._monitor: asyncio.Task | None = None
        self._reloading: set[str] = set()
        self._tasks: set[asyncio.Task] = set()  # background work this cluster owns
        self.allreduce_histograms: dict = {}  # node name -> metrics.Histogram, refreshed after requests

    def _spawn(self, coro, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- loading -------------------------------------------------------------------------------

    async def _load_member(self, m: Member, on_progress: Callable[[Member], None] | None) -> None:
        m.state = "loading"
        m.error = ""
        try:
            async for p in m.client.load(m.spec, timeout=self.load_timeout_s):
                m.load_done, m.load_total = p.bytes_loaded, p.bytes_total
                if on_progress:
                    on_progress(m)
                if p.error is not None:
                    raise error_for(p.error.kind, f"node {m.name} failed to load: {p.error.message}")
                if p.done:
                    break
        except grpc.RpcError as exc:
            kind = kind_from_grpc(exc.code())
            m.state = "dead" if kind is ErrorKind.UNAVAILABLE else "unknown"
            raise error_for(kind, f"node {m.name} ({m.address}) failed to load: {describe_rpc_error(exc)}") from None
        except MoeClusterError:
            m.state = "unknown"
            raise
        m.state = "ready"
        m.last_seen = time.monotonic()
        await self._refresh(m)

    async def load(self, on_progress: Callable[[Member], None] | None = None) -> None:
        """Load every member's shard, then run one warm-up step through the whole mesh."""
        self.state = "loading"
        results = await asyncio.gather(*(self._load_member(m, on_progress) for m in self.members),
                                       return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self.state, self.reason = "degraded", str(errors[0])
            raise errors[0]  # typed by its kind; anything else is a bug and stays one
        await self._warm_up()
        self.state, self.reason = "ready", ""

    async def _warm_up(self) -> None:
        """A one-token request through every node: the mesh is up and every expert path is warm."""
        from ...proto.records import Sampling

        req = GenerateRequest(f"warmup-{uuid.uuid4().hex[:8]}", (0,), Sampling(max_tokens=1))
        outcome = Outcome()
        async for _ in self._run(req, outcome):
            pass
        if outcome.error:
            raise error_for(outcome.error.kind, f"warm-up step failed: {outcome.error}")

    async def _refresh(self, m: Member) -> None:
        try:
            s = await m.client.status()
        except grpc.RpcError:
            return
        # budget_bytes stays what placement gave the node (`up`), not the memory the node reports
        m.memory_bytes, m.used_bytes = s.memory.device_bytes, s.memory.used_bytes
        m.device, m.backend = s.device, s.backend
        m.experts = sum(s.experts_per_layer.values())
        from .metrics import allreduce_histogram

        hist = allreduce_histogram(s.allreduce)
        if hist is not None:
            self.allreduce_histograms[m.name] = hist

    # -- requests ------------------------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        return self._waiting + (1 if self._current else 0)

    def check_ready(self) -> None:
        if self.state == "ready":
            return
        message = f"cluster is {self.state}" + (f": {self.reason}" if self.reason else "")
        raise NotReadyError(message) if self.state in ("starting", "loading") else ClusterError(message)

    async def generate(self, req: GenerateRequest, outcome: Outcome) -> AsyncIterator[int]:
        """Run one request on every node; yields rank 0's tokens as they come.

        Raises a MoeClusterError before the first token if the cluster is not ready (NotReadyError),
        degraded (ClusterError) or the queue is full (QueueFull);
        afterwards failures end the stream and are reported in `outcome.error`.
        """
        self.check_ready()
        if self._waiting >= self.queue_limit:
            raise QueueFull(f"queue is full ({self.queue_limit} requests waiting)")
        self._waiting += 1
        try:
            await self._gate.acquire()
        finally:
            self._waiting -= 1
        try:
            self.check_ready()
            run = self._run(req, outcome)
            try:
                async for token in run:
                    yield token
            finally:
                # When our consumer stops early (a stop string, a client gone) `run` must end here,
                # before the gate opens: left to the garbage collector it would still be stopping the
                # nodes while the next request starts.
                await run.aclose()
        finally:
            self._gate.release()

    async def cancel(self, request_id: str) -> None:
        await asyncio.gather(*(self._cancel_one(m, request_id) for m in self.members), return_exceptions=True)

    async def _cancel_one(self, m: Member, request_id: str) -> None:
        try:
            await m.client.cancel(request_id)
        except grpc.RpcError:
            pass

    async def _run(self, req: GenerateRequest, outcome: Outcome) -> AsyncIterator[int]:
        self._current = req.request_id
        self._failed.clear()
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(self._pump(m, req, queue), name=f"gen-{m.name}") for m in self.members]
        failed_wait = asyncio.create_task(self._failed.wait())
        getter = None
        finished = 0
        try:
            while finished < len(tasks):
                getter = asyncio.create_task(queue.get())
                done, _ = await asyncio.wait({getter, failed_wait}, timeout=self.request_timeout_s,
                                             return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    if failed_wait in done:
                        outcome.error = ClusterError(self.reason or "a node died during the request")
                    else:
                        outcome.error = DeadlineError(f"request timed out after {self.request_timeout_s:.0f} s")
                    break
                m, event = getter.result()
                if event is None:
                    finished += 1
                    continue
                if isinstance(event, NodeError):
                    if not outcome.error:
                        outcome.error = error_for(event.kind, f"node {m.name}: {event.message}")
                    continue
                if m.rank != 0:
                    continue
                if isinstance(event, GeneratedTokens):
                    for t in event.ids:
                        outcome.tokens.append(t)
                        yield t
                elif isinstance(event, GenerateDone):
                    outcome.done = event
        finally:
            failed_wait.cancel()
            if getter is not None:
                getter.cancel()
            if any(not t.done() for t in tasks):
                # Stopped early (client gone, stop string, failure): every node stops at its next
                # agreement. Wait until each has ended the request, so the next one does not find a
                # node still busy with this one; give up on nodes that do not answer in time.
                await self.cancel(req.request_id)
                _, late = await asyncio.wait(tasks, timeout=CANCEL_WAIT_S)
                for t in late:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                while not queue.empty():  # rank 0's report of the request (cached tokens, timings)
                    m, event = queue.get_nowait()
                    if m.rank == 0 and isinstance(event, GenerateDone):
                        outcome.done = event
            self._current = None
            self._spawn(self.refresh(), "refresh")

    async def refresh(self) -> None:
        """Update every live member's memory, experts and all-reduce histogram."""
        await asyncio.gather(*(self._refresh(m) for m in self.members if m.state == "ready"),
                             return_exceptions=True)

    async def _pump(self, m: Member, req: GenerateRequest, queue: asyncio.Queue) -> None:
        try:
            async for event in m.client.generate(req, timeout=self.request_timeout_s):
                await queue.put((m, event))
        except grpc.RpcError as exc:
            await queue.put((m, NodeError(kind_from_grpc(exc.code()), describe_rpc_error(exc), m.rank)))
        except Exception as exc:  # noqa: BLE001 - e.g. a request the wire cannot carry: the request's error, by kind
            await queue.put((m, NodeError(kind_of(exc), f"{type(exc).__name__}: {exc}", m.rank)))
        finally:
            await queue.put((m, None))

    # -- health --------------------------------------------------------------------------------

    def start_monitor(self) -> None:
        if self._monitor is None:
            self._monitor = asyncio.create_task(self._watch(), name="heartbeat")

    async def _watch(self) -> None:
        while self.state != "stopping":
            await asyncio.gather(*(self._beat(m) for m in self.members), return_exceptions=True)
            dead = [m for m in self.members if m.state == "dead"]
            if dead and self.state == "ready":
                self.state = "degraded"
                self.reason = "node " + ", ".join(f"{m.name} ({m.address})" for m in dead) + " is down"
                logger.warning("cluster degraded: %s", self.reason)
                self._failed.set()
            await asyncio.sleep(self.heartbeat_s)

    async def _beat(self, m: Member) -> None:
        if m.name in self._reloading:
            return
        try:
            h = await m.client.health(timeout=max(self.heartbeat_s, 1.0))
        except grpc.RpcError:
            if m.state != "dead":
                logger.warning("node %s (%s) stopped answering", m.name, m.address)
                m.state = "dead"
                m.error = "not answering"
                if self._respawn is not None:
                    self._respawn(m)  # the launcher owns the restart task
            return
        m.last_seen = time.monotonic()
        if m.state == "dead" or (h.state == "idle" and m.state == "ready"):
            # the agent is back (restarted: nothing loaded): give it its placement again
            logger.info("node %s is back; loading its shard again", m.name)
            self._reloading.add(m.name)
            self._spawn(self._rejoin(m), f"rejoin-{m.name}")

    async def _rejoin(self, m: Member) -> None:
        try:
            await self._load_member(m, None)
            if all(x.state == "ready" for x in self.members):
                await self._warm_up()
                self.state, self.reason = "ready", ""
                logger.info("cluster ready again")
        except (MoeClusterError, grpc.RpcError) as exc:
            m.error = str(exc)
            logger.warning("rejoin of %s failed: %s", m.name, exc)
        finally:
            self._reloading.discard(m.name)

    # -- status and shutdown -------------------------------------------------------------------

    def status(self) -> dict:
        return {
            "state": self.state,
            "reason": self.reason,
            "model": self.model,
            "transport": self.transport,
            "uptime_s": round(time.monotonic() - self.started, 1),
            "queue_depth": self.queue_depth,
            "nodes": [
                {"name": m.name, "rank": m.rank, "state": m.state, "address": m.address,
                 "memory_bytes": m.memory_bytes, "budget_bytes": m.budget_bytes, "used_bytes": m.used_bytes,
                 "experts": m.experts, "device": m.device, "pid": self._pid_of(m.name) if self._pid_of else None, "error": m.error,
                 "last_seen_s": round(time.monotonic() - m.last_seen, 1) if m.last_seen else None}
                for m in self.members
            ],
        }

    async def close(self, shutdown_nodes: bool) -> None:
        self.state = "stopping"
        pending = [t for t in [self._monitor, *self._tasks] if t is not None]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if shutdown_nodes:
            await asyncio.gather(*(m.client.shutdown() for m in self.members), return_exceptions=True)
        await asyncio.gather(*(m.client.close() for m in self.members), return_exceptions=True)


class QueueFull(ClusterError):
    """Too many requests waiting."""

    kind = ErrorKind.BUSY
