"""`moe-cluster node`: the agent a user starts on each Mac.

It advertises itself by mDNS, serves the Node gRPC service (Load, Generate, Cancel, Status,
Health, Shutdown, Probe, and `bench link`'s Link* in node/link_bench.py) behind the cluster
secret, and runs all MLX work on one owned worker thread: loading a shard starts its envoy (or
joins `mx.distributed`), and each Generate runs in lock-step with the other nodes. Results travel back to the event loop through a queue, errors as values.
"""

from __future__ import annotations

import asyncio
import logging
import time
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import grpc

from ..common.auth import SecretInterceptor, server_credentials
from ..common.ports import default_ip
from ..proto import CHANNEL_OPTIONS, convert
from ..proto import node_pb2_grpc as npb_grpc
from ..proto.errors import (
    BusyError,
    ErrorKind,
    MoeClusterError,
    NotReadyError,
    UnavailableError,
    UserError,
    grpc_code,
    kind_of,
)
from . import adopt, lifecycle
from .device import DeviceInfo, device_info, release_memory
from .lifecycle import NodeState
from .generate_events import QueueSink, done_figures, node_error
from .link_bench import LinkBench
from .status_reply import node_status
from ..common.worker import Worker
from ..proto.records import (
    DEFAULT_KV_RESERVE,
    GenerateDone,
    GeneratedTokens,
    Health,
    LoadProgress,
    Memory,
    NodeError,
    Timings,
)

logger = logging.getLogger(__name__)

# seconds an adopting Load waits for the sequences it dropped to leave the batch (each leaves at the
# next step every rank agrees on: a step, or a prefill chunk)
ADOPT_DRAIN_S = 10.0


@dataclass(frozen=True)
class AgentConfig:
    name: str
    host: str = "0.0.0.0"  # where the gRPC service listens
    port: int = 0  # 0: any free port
    advertise: str = ""  # address put in the mDNS record ("" = the first interface's, or host)
    cluster: str = "moe-cluster"
    secret: str = field(default="", repr=False)
    mdns: bool = True
    interfaces: tuple[str, ...] = ()  # mDNS only on these (names or IPv4 addresses)
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    memory_bytes: int | None = None  # override what the node reports
    cache_dir: str = (
        ""  # shards shipped by the coordinator (node/cache.py); "": the user's cache folder
    )


class NodeAgent(npb_grpc.NodeServicer):
    """State of one node: what is loaded, what runs, and the service around it."""

    def __init__(self, config: AgentConfig, device: DeviceInfo | None = None):
        self.config = config
        self.device = device or device_info()
        self.life = NodeState()  # node/lifecycle.py: changed only by _on(event)
        self.started = time.monotonic()
        self.sharded = None
        self.runtime = None
        self.load_spec = None
        self._loaded_from: tuple = ()  # (folder, node.adopt.identity) of the model loaded
        self._last_call = time.monotonic()  # of the coordinator's last call (the orphan watch)
        self._worker = Worker("mlx-worker")  # the one thread that touches MLX
        self._driving: asyncio.Future | None = None  # the worker stepping the running batch
        self._stop: asyncio.Event | None = None
        self.link = LinkBench(config.host)  # `bench link`'s measurements from this node
        self._preimporting: threading.Thread | None = None

    def start_preimport(self) -> None:
        """Import mlx-lm's heavy dependencies on a thread while the agent waits for its first load
        (`_preimport`)."""
        self._preimporting = threading.Thread(target=_preimport, name="preimport", daemon=True)
        self._preimporting.start()

    def join_preimport(self) -> None:
        """Wait for the preimport thread: transformers' lazy module, imported by a second thread
        while the first is still inside it, raises ImportError ("cannot import name
        'AutoTokenizer'")."""
        if self._preimporting is not None:
            self._preimporting.join()

    # -- helpers -------------------------------------------------------------------------------

    @property
    def state(self) -> str:
        return self.life.phase

    @property
    def failure(self) -> str:
        return self.life.failure

    def _on(self, event) -> None:
        self.life = lifecycle.apply(self.life, event)

    def _memory(self) -> Memory:
        import mlx.core as mx

        budget = self.config.memory_bytes or self.device.memory_bytes
        return Memory(
            device_bytes=self.device.total_memory_bytes,
            budget_bytes=budget,
            used_bytes=int(mx.get_active_memory()),
            peak_bytes=int(mx.get_peak_memory()),
        )

    def _close_model(self) -> None:
        """Drop the loaded model and stop its transport (runs on the worker)."""
        if self.sharded is not None:
            try:
                self.sharded.collective.close()
            finally:
                self.sharded = None
                self.runtime = None
                release_memory()

    def _watch_collective(self) -> None:
        """A loaded node whose envoy exited cannot all-reduce: it is failed, and says why, instead of
        letting every request wait out its peers' timeouts. Cheap (a waitpid): checked on
        every Health, Status and Generate."""
        if self.sharded is None or not self.life.serving:
            return
        reason = self.sharded.collective.failure()
        if reason:
            self._on(lifecycle.Failed(reason))
            logger.error("node failed: %s; the coordinator reloads it", reason)

    # -- RPCs ----------------------------------------------------------------------------------

    async def Health(self, request, context):
        self._heard()
        self._watch_collective()
        return convert.health_to_proto(
            Health(
                ok=self.state not in ("failed", "stopping"),
                state=self.state,
                reason=self.failure if self.state == "failed" else "",
            )
        )

    async def Status(self, request, context):
        # not a sign of the coordinator: anyone holding the secret may watch a node
        self._watch_collective()
        return convert.status_to_proto(
            node_status(
                self.state,
                self.load_spec,
                self._memory(),
                self.device.device,
                self.sharded,
                self.runtime,
                time.monotonic() - self.started,
            )
        )

    def _idle(self) -> None:
        if self.runtime is not None and self.runtime.batch.busy():
            raise BusyError(f"{sum(self.runtime.batch.running())} requests are running")

    def _ready(self) -> None:
        if self.state == "failed":
            raise UnavailableError(f"node {self.config.name} has failed: {self.failure}")
        if self.runtime is None or not self.life.serving:
            raise NotReadyError(f"node is {self.state}, not ready")

    async def Load(self, request, context):
        self._heard()
        try:
            spec = convert.load_request_from_proto(
                request, secret=self.config.secret, tls=self._tls_files()
            )
            if spec.adopt:  # a coordinator that adopts runs nothing yet: what runs is orphaned
                await self._drop_orphans(ADOPT_DRAIN_S)
            self._idle()
        except MoeClusterError as exc:
            await context.abort(grpc_code(exc.kind), str(exc))
        if spec.adopt:
            yield convert.load_progress_to_proto(self._adopt(spec))
            return
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        last = [0.0]

        def progress(done: int, total: int, phase: str) -> None:
            now = time.monotonic()
            if now - last[0] > 0.1 or done >= total:
                last[0] = now
                loop.call_soon_threadsafe(events.put_nowait, LoadProgress(done, total, phase))

        ship_address = _ship_address(spec, context.peer())

        def load():
            self.join_preimport()  # transformers imported on two threads at once fails on one of them
            from .runtime import NodeRuntime
            from .moe.load import load_shard, load_unsharded
            from .collective.specs import make_collective

            self._close_model()
            self._loaded_from = ()
            model = spec.model
            if spec.ship is not None:  # no checkpoint here: the coordinator fills the cache
                model = self._fill_cache(spec, ship_address, progress)
            # as it stands before a byte is read: a file changed during the load fails an adopt
            folder = getattr(model, "path", model)  # a shipped shard: its cache folder
            loaded_from = (str(folder), adopt.identity(folder))
            if (
                spec.world_size == 1 and spec.ship is None and spec.expert_cache == "off"
            ):  # alone: stock mlx-lm
                progress(0, 1, "replicated")
                self.sharded = load_unsharded(spec.model)
                self.runtime = NodeRuntime(
                    self.sharded, prompt_cache_bytes=spec.prompt_cache_bytes, limits=_limits(spec)
                )
                self._loaded_from = loaded_from
                return self.sharded.info
            if spec.world_size == 1:  # a shipped shard alone: nothing to exchange
                from .collective.base import LocalCollective

                collective = LocalCollective()
            else:
                collective = make_collective(spec.transport, spec.rank)
            try:
                sharded = load_shard(
                    model,
                    spec.placement,
                    spec.rank,
                    keepalive=spec.keepalive,
                    collective=collective,
                    progress=progress,
                    expert_cache=spec.expert_cache,
                    cache_reserve_bytes=DEFAULT_KV_RESERVE + spec.prompt_cache_bytes,
                    route=None if spec.route == "measure" else spec.route,
                    profile={layer: (list(counts), tokens) for layer, counts, tokens in spec.heat}
                    or None,
                )
            except BaseException:
                collective.close()
                raise
            self.sharded = sharded
            self.runtime = NodeRuntime(
                sharded, prompt_cache_bytes=spec.prompt_cache_bytes, limits=_limits(spec)
            )
            self._loaded_from = loaded_from
            return sharded.info

        self._on(lifecycle.Load())
        self.load_spec = spec
        fut = asyncio.ensure_future(self._worker.call(load))
        logger.info("loading %s as rank %d of %d", spec.model, spec.rank, spec.world_size)
        while True:
            getter = asyncio.ensure_future(events.get())
            finished, _ = await asyncio.wait({getter, fut}, return_when=asyncio.FIRST_COMPLETED)
            if getter in finished:
                yield convert.load_progress_to_proto(getter.result())
                continue
            getter.cancel()
            break
        try:
            info = fut.result()
        except BaseException as exc:  # noqa: BLE001 - reported to the coordinator
            self._on(lifecycle.Failed(f"load failed: {exc}"))
            logger.error(
                "load failed: %s: %s",
                type(exc).__name__,
                exc,
                exc_info=kind_of(exc) is ErrorKind.INTERNAL,
            )
            yield convert.load_progress_to_proto(
                LoadProgress(0, 0, "failed", done=True, error=node_error(exc, spec.rank))
            )
            return
        self._on(lifecycle.Loaded())
        self._heard()  # a long load is not the coordinator's silence
        total = info.resident_weight_bytes
        yield convert.load_progress_to_proto(LoadProgress(total, total, "ready", done=True))

    def _adopt(self, spec) -> LoadProgress:
        """Keep the loaded model for a coordinator whose Load describes it (node/adopt.py), and
        re-join: the envoy's channels to its peers, or the mx.distributed group, never closed, so
        there is nothing to rebuild where the transport has not failed (the coordinator's warm-up
        step then runs through the whole mesh). Anything else is refused, changing nothing: the
        coordinator then loads every node afresh."""
        why, kind = "", ErrorKind.NOT_READY
        if self.sharded is None or not self.life.serving:
            why, kind = f"nothing loaded to adopt (node is {self.state})", ErrorKind.NOT_FOUND
        elif self.sharded.collective.failure():
            why = f"its transport failed: {self.sharded.collective.failure()}"
        else:
            why = adopt.mismatch(self.load_spec, spec)
        if not why and adopt.identity(self._loaded_from[0]) != self._loaded_from[1]:
            why = f"the model's files changed since it loaded them ({self._loaded_from[0]})"
        if why:
            logger.info("not adopted: %s", why)
            error = NodeError(kind, f"cannot adopt: {why}", spec.rank)
            return LoadProgress(0, 0, "refused", done=True, error=error)
        self.load_spec = spec  # the new coordinator's Ship address and orphan bound
        logger.info("adopted as rank %d of %d: %s kept", spec.rank, spec.world_size, spec.model)
        total = self.sharded.info.resident_weight_bytes
        return LoadProgress(0, total, "adopted", done=True)

    async def _drop_orphans(self, wait_s: float) -> None:
        """End every sequence of the running batch (a cancel on any rank ends a sequence on every
        rank at the same step) and wait up to `wait_s` for the batch to go idle: their KV is freed
        as they leave (a prefix may stay in the prompt cache, for the client's retry)."""
        if self.runtime is None or not self.runtime.batch.busy():
            return
        self.runtime.batch.cancel_all()
        deadline = time.monotonic() + wait_s
        while self.runtime is not None and self.runtime.batch.busy():
            if time.monotonic() > deadline:
                return  # _idle says what still runs
            await asyncio.sleep(0.02)

    def _heard(self) -> None:
        self._last_call = time.monotonic()

    async def _watch_coordinator(self) -> None:
        """Drop the running sequences when the coordinator has not called (a heartbeat, a
        request) for the Load's `orphan_after_s`: it is hung or cut off, and nobody reads them.
        (A coordinator that died closed their Generate streams: they left at once, `withdraw`.)"""
        while True:
            bound = self.load_spec.orphan_after_s if self.load_spec is not None else 0.0
            await asyncio.sleep(min(max(bound / 4, 0.05), 0.5) if bound else 0.5)
            silent = time.monotonic() - self._last_call
            if not bound or silent <= bound or self.runtime is None:
                continue
            if self.runtime.batch.busy():
                running, queued = self.runtime.batch.running()
                logger.warning(
                    "no call of the coordinator for %.1f s (timeouts.coordinator %.1f s): "
                    "dropping its %d running and %d queued sequences",
                    silent,
                    bound,
                    running,
                    queued,
                )
                self.runtime.batch.cancel_all()
                self._heard()  # once per silence of `bound`

    def _fill_cache(self, spec, address: str, progress):
        """This node's shard from its cache, fetching what is missing (runs on the worker)."""
        from pathlib import Path

        from .cache import default_cache_dir
        from .ship import fill_cache

        cache_dir = (
            Path(self.config.cache_dir).expanduser()
            if self.config.cache_dir
            else default_cache_dir()
        )
        return fill_cache(
            spec.ship,
            address,
            cache_dir=cache_dir,
            secret=self.config.secret,
            tls=self._tls_files(),
            node=self.config.name,
            placement=spec.placement,
            rank=spec.rank,
            world_size=spec.world_size,
            progress=progress,
        )

    async def Generate(self, request, context):
        """One request joins the running batch (node/batch.py); its tokens stream back as the batch
        hands them out. Many Generate calls run at once: the worker thread steps them together."""
        self._heard()
        self._watch_collective()
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        try:
            # ready first: a node that loaded once has joined _preimport's thread (see load)
            self._ready()
            from .runtime import GenerateResult

            result = GenerateResult()
            req = convert.generate_request_from_proto(
                request, prefill_step=self.load_spec.prefill_step
            )
            # refused before MLX sees it (a bad id can crash the process)
            seq = self.runtime.batch.submit(req, None, QueueSink(loop, events), result)
        except MoeClusterError as exc:
            await context.abort(grpc_code(exc.kind), str(exc))
        rid = req.request_id
        self._drive()
        ended = False
        backlog: deque = (
            deque()
        )  # events taken off the queue while coalescing tokens, not yet handled
        try:
            while True:
                kind, value = backlog.popleft() if backlog else await events.get()
                if kind == "tokens" and req.quiet:  # the coordinator reads rank 0's tokens only
                    continue
                if kind == "tokens":  # every token already waiting goes in one message
                    ids = list(value)
                    while not events.empty():
                        backlog.append(events.get_nowait())
                    while backlog and backlog[0][0] == "tokens":
                        ids.extend(backlog.popleft()[1])
                    yield convert.generate_event_to_proto(GeneratedTokens(tuple(ids)))
                    continue
                ended = True
                if kind == "failed":
                    logger.error(
                        "request %s failed: %s: %s",
                        rid,
                        type(value).__name__,
                        value,
                        exc_info=kind_of(value) is ErrorKind.INTERNAL,
                    )
                    yield convert.generate_event_to_proto(node_error(value, self.load_spec.rank))
                    return
                s = result.stats
                yield convert.generate_event_to_proto(
                    GenerateDone(
                        finish_reason=s.finish_reason or "length",
                        prompt_tokens=s.prompt_tokens,
                        cached_tokens=result.cached_tokens,
                        generated_tokens=len(result.tokens),
                        timings=Timings(
                            prompt_s=s.prompt_seconds,
                            generation_s=s.generation_seconds,
                            collective_s=result.figures.collective_s,
                        ),
                        # the request's own figures: the node's running means (experts selected and
                        # computed per layer) are the node's, in its status, not this request's
                        counters={
                            "peak_memory_bytes": float(_peak_memory()),
                            **done_figures(result.figures, len(self.sharded.moe_layers())),
                        },
                    )
                )
                return
        finally:
            if not ended:  # the caller went away: the sequence leaves the batch at its next step
                self.runtime.batch.withdraw(seq)

    def _drive(self) -> None:
        """Step the running batch on the worker thread while it has work (one driver at a time)."""
        if self._driving is not None or self.runtime is None:
            return
        batch = self.runtime.batch

        def drive():
            while batch.busy():
                batch.step()

        def finished(fut) -> None:
            self._driving = None
            if fut.exception() is not None:
                logger.error("the running batch stopped: %s", fut.exception())
            self._on(lifecycle.Idle())
            if self.runtime is not None and self.runtime.batch.busy():
                self._drive()

        self._on(lifecycle.Busy())
        self._driving = asyncio.ensure_future(self._worker.call(drive))
        self._driving.add_done_callback(finished)

    async def Probe(self, request, context):
        self._heard()
        try:
            self._ready()
            self._idle()
            layer, x = convert.probe_request_from_proto(request)
            y = await self._worker.call(lambda: self.sharded.probe(layer, x))
        except MoeClusterError as exc:
            await context.abort(grpc_code(exc.kind), str(exc))
        return convert.probe_reply_to_proto(y)

    async def Cancel(self, request, context):
        self._heard()
        rid = convert.cancel_request_from_proto(request)
        if self.runtime is None:
            return convert.cancel_reply_to_proto(False)
        found = self.runtime.batch.cancel(rid)
        if found and convert.cancel_is_abort(request):
            # it failed elsewhere: the worker is likely blocked in a step of the batch; fail it now
            self.sharded.collective.abort(self.runtime.batch.epoch_id)
        return convert.cancel_reply_to_proto(found)

    async def Shutdown(self, request, context):
        grace = convert.shutdown_request_from_proto(request)
        logger.info("shutdown requested (grace %.1fs)", grace)
        self._on(lifecycle.Stop())
        if self.runtime is not None:
            self.runtime.batch.cancel_all()
        if self._stop is not None:
            asyncio.get_running_loop().call_later(0.05, self._stop.set)
        return convert.shutdown_reply_to_proto()

    # -- bench link: the path to the other nodes, measured from here (node/link_bench.py) ---------

    async def LinkListen(self, request, context):
        return convert.link_listen_to_proto(self.link.listen())

    async def LinkProbe(self, request, context):
        try:
            spec = convert.link_probe_request_from_proto(request)
            result = await self.link.probe(spec)
        except MoeClusterError as exc:
            await context.abort(grpc_code(exc.kind), str(exc))
        return convert.link_probe_reply_to_proto(result)

    async def LinkAllReduce(self, request, context):
        try:
            self._idle()  # a running batch would time its own steps, and slow these
            spec = convert.link_allreduce_request_from_proto(
                request, secret=self.config.secret, tls=self._tls_files()
            )
            result = await self.link.allreduce(spec)
        except MoeClusterError as exc:
            await context.abort(grpc_code(exc.kind), str(exc))
        return convert.link_allreduce_reply_to_proto(result)

    # -- lifecycle -----------------------------------------------------------------------------

    def _tls_files(self):
        from ..proto.records import TlsFiles

        c = self.config
        if c.tls_cert and c.tls_key and c.tls_ca:
            return TlsFiles(c.tls_cert, c.tls_key, c.tls_ca)
        return None

    async def serve(self, ready: Callable[[int], None] | None = None) -> None:
        """Serve until Shutdown or a signal; closes everything it opened."""
        import signal

        c = self.config
        if not c.secret:
            raise UserError("no cluster secret: set MOE_CLUSTER_SECRET (the same on every node)")
        self._stop = asyncio.Event()
        from ..common.ports import check_port_free

        try:
            check_port_free(c.host, c.port, "is another node agent running? --port P picks another")
        except OSError as exc:  # the port is the user's choice: a one-line error, not a bug
            raise UserError(str(exc)) from None
        server = grpc.aio.server(
            interceptors=[SecretInterceptor(c.secret)], options=CHANNEL_OPTIONS
        )
        npb_grpc.add_NodeServicer_to_server(self, server)
        address = f"{c.host}:{c.port}"
        if c.tls_cert and c.tls_key:
            port = server.add_secure_port(
                address, server_credentials(c.tls_cert, c.tls_key, c.tls_ca)
            )
        else:
            port = server.add_insecure_port(address)
        if port == 0:
            raise UserError(f"cannot listen on {address}")
        await server.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        advertiser = None
        orphans = asyncio.create_task(self._watch_coordinator(), name="orphan-watch")
        try:
            if c.mdns:
                from ..common.mdns import Advert, Advertiser, interface_addresses

                addr = c.advertise or (
                    interface_addresses(list(c.interfaces))[0]
                    if c.interfaces
                    else (c.host if c.host not in ("0.0.0.0", "") else default_ip())
                )
                from importlib.metadata import version

                advertiser = Advertiser(
                    Advert(
                        c.name,
                        addr,
                        port,
                        version("moe-cluster"),
                        c.memory_bytes or self.device.memory_bytes,
                        self.device.backend,
                        self.device.device,
                        c.cluster,
                    ),
                    list(c.interfaces) or None,
                )
                await advertiser.start()
            logger.info("node %s serving on port %d", c.name, port)
            if ready:
                ready(port)
            await self._stop.wait()
        finally:
            self._on(lifecycle.Stop())
            orphans.cancel()
            await asyncio.gather(orphans, return_exceptions=True)
            if advertiser is not None:
                await advertiser.close()
            await server.stop(1.0)
            self.link.close()
            await self._worker.call(self._close_model)
            self._worker.close()


def _limits(spec):
    from .batch import BatchLimits

    return BatchLimits(
        spec.max_batch,
        spec.prefill_budget,
        spec.kv_budget_bytes,
        spec.speculative,
        spec.draft_tokens,
        spec.draft_model,
        spec.overlap,
        spec.attention,
        spec.mtp_experts,
    )


def _ship_address(spec, peer: str) -> str:
    """host:port of the coordinator's Ship service: ":port" means the host this Load came from."""
    if spec.ship is None:
        return ""
    if not spec.ship.address.startswith(":"):
        return spec.ship.address
    from .ship import peer_host

    return peer_host(peer) + spec.ship.address


def _peak_memory() -> int:
    import mlx.core as mx

    return int(mx.get_peak_memory())


def _preimport() -> None:
    """Import mlx-lm's heavy non-MLX dependencies (node/preimport.py: transformers, ~1.5 s of CPU
    on 2 vCPUs) while the agent waits for its first load, not after the load came: the load's own
    import then finds them there, or waits for this one to finish (Python's import locks). Not MLX:
    MLX started on a thread other than the one that runs the model aborts the process at exit."""
    try:
        from . import preimport  # noqa: F401
    except Exception:  # noqa: BLE001 - the load imports them again and names the error
        logger.debug("importing mlx-lm's dependencies ahead of a load failed", exc_info=True)
