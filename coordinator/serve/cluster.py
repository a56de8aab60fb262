"""The running cluster as the coordinator sees it: members, their health, loading and rejoin; the
requests on it are `requests.py`'s.

Heartbeats, RPC failures and the nodes' own reports
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
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Callable, Sequence

import grpc

from ...proto.errors import ErrorKind, MoeClusterError, error_for, kind_from_grpc
from ...proto.records import GenerateRequest, LoadSpec
from . import health as H
from .client import NodeClient, describe_rpc_error
from .requests import Outcome, Requests
from .resume import MAX_RESUMES, RECOVERY_WAIT_S

logger = logging.getLogger(__name__)

# Seconds a local node that is not serving (restarted and not loaded yet, or loading) may go without
# answering a heartbeat before it is restarted: a fresh process importing mlx-lm on a busy machine
# misses the 1 s heartbeat deadline (seen at load 13 on 2 vCPUs), and restarting it then only
# restarted the rejoin. A serving node that stops answering is restarted at once.
LOADING_STALL_S = 10.0


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
        self.model = model
        self.transport = transport
        self.heartbeat_s = heartbeat_s
        self.load_timeout_s = load_timeout_s
        self.request_timeout_s = request_timeout_s
        self.health = H.initial([(m.name, m.address) for m in self.members])
        self.started = time.monotonic()
        self._respawn = respawn
        self._pid_of = pid_of  # pids of the nodes this machine launched
        self._ready = asyncio.Event()  # set while the health machine says ready
        self._monitor: asyncio.Task | None = None
        self._rejoin_task: asyncio.Task | None = None
        self._restarting: set[str] = set()  # nodes found not answering, handed to `respawn`
        self._loading: set[str] = set()  # nodes with a Load in flight
        self._unanswered: dict[
            str, float
        ] = {}  # node -> time.monotonic() of its first unanswered heartbeat
        self._tasks: set[asyncio.Task] = set()  # background work this cluster owns
        self.allreduce_histograms: dict = {}  # node name -> metrics.Histogram, refreshed after requests
        self.requests = Requests(
            self,
            request_timeout_s=request_timeout_s,
            queue_limit=queue_limit,
            max_batch=max_batch,
            recovery_wait_s=recovery_wait_s,
            max_resumes=max_resumes,
            attention=attention,
        )

    def spawn(self, coro, name: str) -> asyncio.Task:
        """A background task this cluster owns (`close` cancels it)."""
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

    def event(self, event: H.Event) -> None:
        """Apply one health event; a cluster that stops being ready fails the request in flight."""
        before = self.health
        self.health = H.apply(before, event)
        if self.health.ready:
            self._ready.set()
        else:
            self._ready.clear()
        if before.ready and not self.health.ready:
            logger.warning("cluster %s: %s", self.health.phase, self.health.reason)
            self.requests.fail()
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
        self.event(H.NodeLoading(m.name))
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
                self.event(H.RpcFailed(m.name, describe_rpc_error(exc)))
            raise error_for(
                kind, f"node {m.name} ({m.address}) failed to load: {describe_rpc_error(exc)}"
            ) from None
        self.event(H.NodeLoaded(m.name))
        m.last_seen = time.monotonic()
        await self._refresh(m)

    async def load(self, on_progress: Callable[[Member], None] | None = None) -> None:
        """Load every member's shard, then run one warm-up step through the whole mesh."""
        self.event(H.LoadStarted())
        self.requests.renumber()  # a load starts every node's running batch afresh
        self.requests.owners.clear()  # and every prompt cache
        results = await asyncio.gather(
            *(self._load_member(m, on_progress) for m in self.members), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self.event(H.LoadDone(error=str(errors[0])))
            raise errors[0]  # typed by its kind; anything else is a bug and stays one
        await self._warm_up()
        self.event(H.LoadDone())

    async def adopt(self) -> dict[str, MoeClusterError]:
        """Keep what every node has loaded where its load is what its spec says (node/adopt.py
        says what must match), then one warm-up step through the whole mesh: {} and the cluster
        is ready. All or none: where one node cannot (nothing loaded: NOT_FOUND; it restarted, its
        model or the plan differ, its transport failed) no node changed, and the refusals by node
        say to load them all (`load`). Each node first drops the sequences still running there:
        their coordinator is gone."""
        self.event(H.LoadStarted())
        self.requests.renumber()  # the running batches are idle: admission numbers start again
        self.requests.owners.clear()
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
        self.event(H.LoadDone())
        return {}

    async def _adopt_one(self, m: Member) -> None:
        self.event(H.NodeLoading(m.name))
        async for p in m.client.load(replace(m.spec, adopt=True), timeout=self.load_timeout_s):
            if p.error is not None:
                raise error_for(p.error.kind, f"node {m.name}: {p.error.message}")
            if p.done:
                break
        m.load_done, m.load_total = p.bytes_loaded, p.bytes_total
        self.event(H.NodeLoaded(m.name))
        m.last_seen = time.monotonic()
        await self._refresh(m)

    async def _warm_up(self) -> None:
        """A one-token request through every node: the mesh is up and every expert path is warm."""
        from ...proto.records import Sampling

        req = GenerateRequest(f"warmup-{uuid.uuid4().hex[:8]}", (0,), Sampling(max_tokens=1))
        outcome = Outcome()
        async for _ in self.requests.run(req, outcome):
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
        async for _ in self.requests.run(req, outcome):
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
    async def refresh(self) -> None:
        """Update every live member's memory, experts and all-reduce histogram."""
        await asyncio.gather(
            *(self._refresh(m) for m in self.members if self.node_state(m) == "ready"),
            return_exceptions=True,
        )

    # -- requests (requests.py) ---------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        """Requests running or waiting for a caller."""
        return self.requests.queue_depth

    def check_ready(self) -> None:
        """Raise the health machine's refusal unless the cluster can serve or a request may wait
        for it to recover (`Requests.check_ready`)."""
        self.requests.check_ready()

    def generate(self, req: GenerateRequest, outcome: Outcome) -> AsyncIterator[int]:
        """Run one request on every node; yields rank 0's tokens (`Requests.generate`)."""
        return self.requests.generate(req, outcome)

    async def cancel(self, request_id: str, abort: bool = False) -> None:
        """Stop a request on every node (`Requests.cancel`)."""
        await self.requests.cancel(request_id, abort)

    async def until_ready(self) -> None:
        """Return once the health machine says ready."""
        await self._ready.wait()

    # -- heartbeats and rejoin -----------------------------------------------------------------

    def start_monitor(self) -> None:
        if self._monitor is None:
            self._monitor = asyncio.create_task(self._watch(), name="heartbeat")

    async def _watch(self) -> None:
        while self.state != "stopping":
            await self.beat_all()
            if self._rejoin_task is None and H.can_rejoin(self.health, time.monotonic()):
                self._rejoin_task = self.spawn(self._rejoin(), "rejoin")
            await asyncio.sleep(self.heartbeat_s)

    async def beat_all(self) -> None:
        await asyncio.gather(*(self._beat(m) for m in self.members), return_exceptions=True)

    async def _beat(self, m: Member) -> None:
        try:
            h = await m.client.health(timeout=max(self.heartbeat_s, 1.0))
        except grpc.RpcError as exc:
            serving = self.node_state(m) in ("ready", "dead") and m.name not in self._loading
            self.event(H.HeartbeatFailed(m.name, f"not answering ({describe_rpc_error(exc)})"))
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
        self.event(H.HeartbeatOk(m.name, h.state, h.reason))
        if before != "failed" and self.node_state(m) == "failed":
            logger.warning("node %s: %s", m.name, self.health.node(m.name).reason)

    async def _rejoin(self) -> None:
        """Rebuild the cluster: every node loaded again (a failed envoy is restarted by its node's
        load), then a warm-up step. Every request that failed ends on the nodes first, and none
        starts until the rejoin is over (the cluster is not ready meanwhile)."""
        try:
            await asyncio.wait_for(self.requests.drained(), timeout=self.request_timeout_s)
            self.requests.renumber()  # the load starts every node's running batch afresh
            self.event(H.RejoinStarted())
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
            self.event(H.RejoinSucceeded())
        except asyncio.TimeoutError:
            self.event(H.RejoinFailed("failed requests did not end on the nodes", time.monotonic()))
        except (MoeClusterError, grpc.RpcError) as exc:
            logger.warning("rejoin failed: %s", exc)
            self.event(H.RejoinFailed(str(exc), time.monotonic()))
        finally:
            self._rejoin_task = None

    # -- status and shutdown -------------------------------------------------------------------

    def status(self) -> dict:
        r = self.requests
        load = r.owners.load()
        return {
            "state": self.state,
            "reason": self.reason,
            "rejoin_attempts": self.health.attempts,
            "model": self.model,
            "transport": self.transport,
            "uptime_s": round(time.monotonic() - self.started, 1),
            "queue_depth": r.queue_depth,
            "running": min(r.queue_depth, r.running_limit),
            "waiting": max(0, r.queue_depth - r.running_limit),
            "attention": r.owners.mode,
            "waiting_for_recovery": r.waiting,  # arrived while a lost node is rebuilt
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
        self.event(H.Stopping())
        pending = [t for t in [self._monitor, *self._tasks] if t is not None]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if shutdown_nodes:
            await asyncio.gather(
                *(m.client.shutdown() for m in self.members), return_exceptions=True
            )
        await asyncio.gather(*(m.client.close() for m in self.members), return_exceptions=True)
