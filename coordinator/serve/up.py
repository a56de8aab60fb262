"""`moe-cluster up FILE`: start (or find) the nodes, plan placement, load, serve the API.

Ctrl-C, SIGTERM or `moe-cluster down` stop everything it started.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

from ...node.checkpoint import (
    Checkpoint,
    check_runnable,
    config_folder,
    index_bytes,
    read_config,
)
from ...node.describe import describe
from ...proto.expert_cache import ExpertCacheSpec
from ...proto.profile import parse_profile
from ...proto.records import LoadSpec
from ...node.collective.specs import EnvoySpec, MlxSpec
from ...common.ports import free_ports
from .client import ClusterError, NodeClient
from .cluster import Cluster, Member
from .config import (
    ClusterConfig,
    ConfigError,
    load_config,
    names_repo,
    read_credentials,
    tls_files,
)
from .discover import DEFAULT_ENVOY_PORT, remote_members
from .placement import ModelFootprint, NodeBudget, PlacementError, footprint, plan_placement
from .progress import Progress
from .shipping import ShipService, say_shipped, start_ship

logger = logging.getLogger(__name__)


def _draft_model(c: ClusterConfig) -> str:
    """The draft checkpoint as rank 0 reads it: resolved here where the nodes run on this machine."""
    d = c.serving.draft_model
    return str(Checkpoint.open(d).path) if d and c.launch == "local" else d


def state_file() -> Path:
    """Where `up` records its URL and pid, so `down` and `status` find it without --url."""
    base = Path(os.environ.get("XDG_RUNTIME_DIR") or Path.home() / ".cache")
    return base / "moe-cluster" / "up.json"


def _read_profile(path: str, base: Path):
    """cluster.yaml's placement.profile, checked (a path relative to the file)."""
    p = Path(path).expanduser()
    if not p.is_absolute():
        p = base / p
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"placement.profile: cannot read {p}: {exc}") from None
    return parse_profile(data, str(p))


def _transport(c: ClusterConfig, hosts: list[str], envoy_ports: list[int], rank_listen_any: bool):
    if c.transport == "envoy":
        addresses = tuple(f"{h}:{p}" for h, p in zip(hosts, envoy_ports))
        tls = tls_files(c)
        return lambda rank: EnvoySpec(
            addresses,
            listen=f"0.0.0.0:{envoy_ports[rank]}" if rank_listen_any else "",
            timeout_s=c.timeouts.collective,
            tls=tls,
            data_port=c.nodes[rank].envoy_data_port or 0,
        )
    hosts_spec = tuple((f"{h}:{p}",) for h, p in zip(hosts, envoy_ports))
    # nodes on this machine, each on its own GPU (`gpu:`): NCCL where MLX's CUDA build has it
    from ...node.collective.mlx import mlx_backend

    backend = mlx_backend(
        c.launch == "local" and all(n.gpu is not None for n in c.nodes), c.mlx_backend
    )
    return lambda rank: MlxSpec(
        hosts_spec, backend=backend, timeout_s=max(c.timeouts.collective, 30.0)
    )


async def run_up(c: ClusterConfig, *, log_dir: Path) -> int:
    """Start the cluster `c` describes and serve it until Ctrl-C, SIGTERM or `down`."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    up = Up(c, log_dir, stop)
    try:
        await up.start()
        await stop.wait()
        print("stopping...", file=sys.stderr, flush=True)
        return 0
    finally:
        await up.close()


FIRST_TRIES = 3  # a node's first status, asked again where it could not be reached (`first_status`)


async def first_status(client: NodeClient, tries: int = FIRST_TRIES, pause_s: float = 0.5):
    """A node's status asked right after it said it serves: where its port refuses the call
    (gRPC UNAVAILABLE, a loaded host that has not accepted yet) it is asked again, `tries` times
    in all, `pause_s` apart and longer each time; any other failure, or the last, is the answer."""
    import grpc

    for attempt in range(tries):
        try:
            return await client.status()
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            if code != grpc.StatusCode.UNAVAILABLE or attempt == tries - 1:
                raise
            await asyncio.sleep(pause_s * (attempt + 1))


class Up:
    """One `up`, phase by phase: each phase a method, what it made kept for the next and for
    `close` (which undoes whatever ran, in reverse)."""

    def __init__(self, c: ClusterConfig, log_dir: Path, stop: asyncio.Event):
        self.c = c
        self.log_dir = log_dir
        self.stop = stop
        self.launcher = None  # local nodes, where `launch: local`
        self.local: list = []  # their LocalNode records
        self.ports: list[int] = []  # free ports for the local nodes (agent, envoy)
        self.ship: ShipService | None = None
        self.cluster: Cluster | None = None
        self.sock = None  # the API's listening socket (a supervisor's, or bound here)
        self.page = None  # holding.py's page on it until the API takes over
        self.runner = None  # the API's aiohttp runner
        self.url = ""
        self.adopted = False  # the nodes kept what they had loaded (a restarted coordinator)
        self.t_start = time.monotonic()

    async def start(self) -> None:
        """Every phase up to a cluster serving its API."""
        c = self.c
        self.open_model()
        await self.hold_api()
        await self.start_local_nodes()
        self.describe_model()
        found, envoy_ports = await self.find_nodes()
        members = await self.meet(found)
        self.page.members = members
        if self.ckpt is None:  # a repo id: checked against the cluster before its weights come
            self.check_fit(members)
        if self.launcher is not None:  # said once the model is good: a bad one is the only line
            print(
                f"started {len(self.local)} nodes on this machine (logs in {self.log_dir})",
                file=sys.stderr,
                flush=True,
            )
        if self.ckpt is None:
            await self.download(members)
            self.describe_model()
        if c.checkpoint == "coordinator":
            self.ship = await start_ship(c, self.desc, self.secret)
        self.place(members, found, envoy_ports)
        self.cluster = self.make_cluster(members)
        if not await self.adopt(members):
            await self.load(members)
        if self.ship is not None:
            say_shipped(self.ship, members)
        if c.verify and len(members) > 1:
            await self.verify(members)
        await self.say_allreduce(members)
        self.cluster.start_monitor()
        await self.serve_api(members)

    def open_model(self) -> None:
        """The checkpoint (of a Hugging Face repo, its config and index alone: the weights come
        once the cluster is known to hold them), the credentials and the routing profile, checked
        before anything starts."""
        c = self.c
        if names_repo(c.model):
            self.ckpt = None
            self.config_dir = config_folder(c.model)
        else:
            self.ckpt = Checkpoint.open(c.model)  # a bad model is refused here
        self.secret, self.api_key = read_credentials(c)  # the same checks as `validate`
        if not self.secret:
            self.secret = secrets.token_urlsafe(24)  # local nodes get it from us
        routing = (
            _read_profile(c.placement.profile, Path(c.source).parent)
            if c.placement.profile
            else None
        )
        self.profile = (
            {int(l): list(v.counts) for l, v in routing.layers.items()} if routing else None
        )
        # the nodes get it too: an expert cache pins the hottest experts and prefetches from it
        self.heat = (
            tuple(
                (int(l), tuple(float(n) for n in v.counts), v.tokens)
                for l, v in routing.layers.items()
            )
            if routing
            else ()
        )

    async def hold_api(self) -> None:
        """The API's socket, bound (or a supervisor's, held across restarts: listen.py) before
        anything starts, and a page on it that answers 503 with Retry-After and the phase until
        the API takes the socket over (holding.py)."""
        from .holding import HoldingPage
        from .listen import api_socket

        c = self.c
        try:
            self.sock, passed = api_socket(c.api.host, c.api.port)
        except OSError as exc:
            raise ConfigError(
                f"{c.source}: api: cannot listen on {c.api.host}:{c.api.port} ({exc.strerror or exc}); "
                "is another cluster running? --api-port P picks another"
            ) from None
        if passed:
            logger.info("serving the API on the socket passed by the supervisor")
        self.page = HoldingPage(c, self.api_key, self.stop, self.sock)
        await self.page.start()

    def describe_model(self) -> None:
        """The tokenizer, and the checkpoint's config and headers, read once: placement, shipping,
        the API's vocabulary and the load check take this description (a repo's, before its
        weights are here, from its config alone). A model of no MoE family this machine runs is
        refused here. Both import mlx-lm (and transformers: seconds), which is why local nodes
        were started first."""
        from ...node.checkpoint import load_tokenizer

        if self.ckpt is None:  # messages name the repo, not a folder of the cache
            config, where = read_config(self.config_dir), f"{self.c.model}/config.json"
            check_runnable(config, where)
            self.desc = describe(config, where)
            self.desc.require_moe()
            return
        check_runnable(self.ckpt.config, self.ckpt.path / "config.json")
        self.tokenizer = load_tokenizer(self.ckpt.path)
        self.desc = describe(self.ckpt)

    def check_fit(self, members: list[Member]) -> None:
        """A repo's placement on the nodes from its config (its index's size where it has one),
        before a byte of its weights: a cluster that cannot hold it is refused here."""
        try:
            self.plan(members, footprint(self.desc, index_bytes(self.config_dir)))
        except PlacementError as exc:
            raise PlacementError(f"{self.c.model}, not downloaded: {exc}") from None

    async def download(self, members: list[Member]) -> None:
        """A repo's weights into this machine's Hugging Face cache (only what is missing there),
        with progress in the log and on the dashboard at the API's address."""
        from .download import fetch_weights

        path = await fetch_weights(self.c, self.page, self.stop)
        self.ckpt = Checkpoint.open(path)

    async def start_local_nodes(self) -> None:
        """`launch: local`: spawn the listed nodes on this machine (they boot while `up` reads the
        checkpoint, on this thread: MLX started on another aborts the process at exit)."""
        from .launcher import Launcher, LocalNode

        c = self.c
        if c.launch != "local":
            return
        self.ports = free_ports(2 * len(c.nodes))
        self.launcher = Launcher(
            self.secret,
            self.log_dir,
            c.name,
            tls=tls_files(c),
            cache_root=(
                state_file().parent / "cache" / c.name if c.checkpoint == "coordinator" else None
            ),
        )
        self.local = [
            LocalNode(
                n.name,
                n.port or self.ports[2 * i],
                self.log_dir / f"{n.name}.log",
                n.memory,
                n.gpu,
            )
            for i, n in enumerate(c.nodes)
        ]
        for n in self.local:
            await self.launcher.spawn(n)

    async def find_nodes(self) -> tuple[list[tuple[str, str, str]], list[int]]:
        """(name, agent address, host) of every node in rank order, and their envoy ports."""
        c = self.c
        self.page.say("starting", f"finding the {len(c.nodes)} nodes")
        if self.launcher is not None:
            await asyncio.gather(*(self.launcher.ready(n) for n in self.local))
            found = [(n.name, f"127.0.0.1:{n.port}", "127.0.0.1") for n in self.local]
            return found, [n.envoy_port or self.ports[2 * i + 1] for i, n in enumerate(c.nodes)]
        print(
            f"looking for {len(c.nodes)} nodes of cluster {c.name!r}...",
            file=sys.stderr,
            flush=True,
        )
        found = await remote_members(c)
        return found, [n.envoy_port or DEFAULT_ENVOY_PORT for n in c.nodes]

    async def meet(self, found: list[tuple[str, str, str]]) -> list[Member]:
        """A client per node, and each node's memory and device from its status."""
        tls = tls_files(self.c)
        members = [
            Member(
                name,
                NodeClient(
                    name,
                    addr,
                    self.secret,
                    tls_ca=tls.ca if tls else None,
                    tls_cert=tls.cert if tls else None,
                    tls_key=tls.key if tls else None,
                ),
                rank,
            )
            for rank, (name, addr, _) in enumerate(found)
        ]
        for m in members:
            try:
                s = await first_status(m.client)
            except Exception as exc:  # noqa: BLE001 - any failure to reach a node is the same answer
                from .client import describe_rpc_error

                why = describe_rpc_error(exc) if hasattr(exc, "code") else str(exc)
                raise ClusterError(f"node {m.name} at {m.address}: {why}") from None
            override = next(n.memory for n in self.c.nodes if n.name == m.name)
            m.memory_bytes = int(override or s.memory.budget_bytes or s.memory.device_bytes)
            m.device = s.device
        return members

    def plan(self, members: list[Member], model: ModelFootprint):
        """The experts' placement on `members` (a model that does not fit is refused here)."""
        c = self.c
        node_config = {n.name: n for n in c.nodes}
        caches = [
            ExpertCacheSpec.parse(node_config[m.name].expert_cache or c.placement.expert_cache)
            for m in members
        ]
        return plan_placement(
            model,
            [NodeBudget(m.name, m.memory_bytes) for m in members],
            strategy=c.placement.strategy,
            memory_fraction=c.placement.memory_fraction,
            kv_reserve=c.placement.kv_reserve + c.serving.prompt_cache,
            profile_counts=self.profile,
            replicate=c.placement.replicate,
            expert_cache=caches,
        )

    def place(
        self, members: list[Member], found: list[tuple[str, str, str]], envoy_ports: list[int]
    ) -> None:
        """Placement of the experts, and each node's LoadSpec and weight budget."""
        c = self.c
        kv_reserve = c.placement.kv_reserve + c.serving.prompt_cache  # bytes per node
        plan = self.plan(members, footprint(self.desc))
        make_transport = _transport(c, [h for _, _, h in found], envoy_ports, c.launch == "remote")
        ship = self.ship
        for m in members:
            m.spec = LoadSpec(
                model=str(self.ckpt.path),
                rank=m.rank,
                world_size=len(members),
                transport=make_transport(m.rank),
                placement=plan.placement,
                keepalive=c.keepalive,
                prefill_step=c.serving.prefill_chunk,
                prompt_cache_bytes=c.serving.prompt_cache,
                ship=ship.source if ship else None,
                expert_cache=plan.expert_cache[m.rank],
                max_batch=c.serving.max_batch,
                prefill_budget=c.serving.prefill_budget,
                kv_budget_bytes=kv_reserve,
                heat=self.heat,
                route=c.route,
                speculative=c.serving.speculative,
                draft_tokens=c.serving.draft_tokens,
                draft_model=_draft_model(c) if m.rank == 0 else "",
                mtp_experts=c.serving.mtp_experts,
                overlap=c.serving.overlap,
                attention=c.serving.attention,
                orphan_after_s=c.timeouts.coordinator,
            )
            # what weights may use: memory × memory_fraction less the KV reserve and prompt cache
            m.budget_bytes = plan.available[m.rank] - kv_reserve
        for note in plan.notes:
            print(f"placement: {note}", file=sys.stderr)

    def make_cluster(self, members: list[Member]) -> Cluster:
        """The running cluster: its members, health machine and requests (serve/cluster.py)."""
        c = self.c
        launcher = self.launcher

        def respawn(m: Member):
            launcher.respawn(m.name)

        return Cluster(
            members,
            model=c.model,
            transport=c.transport,
            heartbeat_s=c.timeouts.heartbeat,
            load_timeout_s=c.timeouts.load,
            request_timeout_s=c.timeouts.request,
            queue_limit=c.serving.queue,
            max_batch=c.serving.max_batch,
            recovery_wait_s=c.serving.recovery_wait,
            max_resumes=c.serving.max_resumes,
            respawn=respawn if launcher else None,
            pid_of=launcher.pid if launcher else None,
            attention=c.serving.attention,
        )

    async def adopt(self, members: list[Member]) -> bool:
        """Remote nodes that still hold what this `up` would load (its coordinator died, or was
        stopped, and this one restarts it) keep it: no shard byte is read or shipped, and the
        warm-up step runs through the mesh their envoys kept (cluster.py `adopt`). False: they
        are loaded afresh. Local nodes were started by this `up`: nothing to adopt."""
        if self.launcher is not None:
            return False
        from ...proto.errors import ErrorKind

        self.page.say("loading", "adopting the loaded nodes")
        self.t_load = time.monotonic()
        refused = await self.cluster.adopt()
        self.adopted = not refused
        if self.adopted:
            print(
                f"adopted {len(members)} loaded nodes in {time.monotonic() - self.t_load:.2f}s: "
                "nothing read or shipped",
                file=sys.stderr,
                flush=True,
            )
        elif any(e.kind is not ErrorKind.NOT_FOUND for e in refused.values()):  # not fresh nodes
            why = "; ".join(str(e) for e in refused.values())
            print(f"not adopting the loaded nodes ({why}): loading them", file=sys.stderr)
        return self.adopted

    async def load(self, members: list[Member]) -> None:
        """Every node loads (and receives) its shard; what was shipped and each decode route said."""
        self.page.say("loading", "loading the nodes' shards")
        progress = Progress([m.name for m in members])
        self.t_load = time.monotonic()
        await self.cluster.load(progress.update)
        routes = [
            f"{m.name} {m.route}"
            + (
                f" ({', '.join(f'{r} {us:.1f} µs' for r, us in m.route_us.items())})"
                if m.route_us
                else ""
            )
            + (f", the host read from {m.route_host_from} positions" if m.route_host_from else "")
            for m in members
            if m.route
        ]
        if (
            routes
        ):  # each node's decode route, timed at load on its own hardware (node/moe/route.py)
            print("decode route: " + "; ".join(routes), file=sys.stderr, flush=True)

    async def verify(self, members: list[Member]) -> None:
        """The load check: each MoE layer of the cluster against the checkpoint's own."""
        from .verify import check_load

        self.page.say("loading", "checking the load against the checkpoint")
        checks = await check_load(members, self.desc, timeout_s=self.c.timeouts.load)
        if checks:
            worst = max(checks, key=lambda k: k.max_abs_diff / k.tolerance)
            print(
                f"load check: MoE layers {', '.join(str(k.layer) for k in checks)} match the "
                f"checkpoint (largest |Δ| {worst.max_abs_diff:.2g} at layer {worst.layer}, "
                f"tolerance {worst.tolerance:.2g})",
                file=sys.stderr,
                flush=True,
            )

    async def say_allreduce(self, members: list[Member]) -> None:
        """Once loaded: the all-reduce per MoE layer a short decode paid over this cluster's own
        link, and the tok/s it leaves room for (`moe-cluster bench link` measures the link alone)."""
        if len(members) < 2:
            return
        got = await self.cluster.time_allreduce()
        if got is None:
            return
        per_layer, tps, layers = got
        if per_layer <= 0:  # mx.distributed's all-gather runs inside the step's graph, untimed
            print(
                f"all-reduce per MoE layer: not timed apart over transport {self.c.transport} "
                f"(decode {tps:.1f} tok/s)",
                file=sys.stderr,
                flush=True,
            )
            return
        per_token = per_layer * layers
        print(
            f"all-reduce per MoE layer: {per_layer * 1e6:.0f} µs over transport "
            f"{self.c.transport} ({layers} MoE layers: {per_token * 1e3:.2f} ms a token, "
            f"{min(per_token * tps, 1.0):.0%} of a {tps:.1f} tok/s decode; the all-reduces alone "
            f"allow {1 / per_token:.0f} tok/s at batch 1)",
            file=sys.stderr,
            flush=True,
        )

    async def serve_api(self, members: list[Member]) -> None:
        """The HTTP API on cluster.yaml's `api`, its URL recorded for `down` and `status`."""
        from aiohttp import web

        from .api import Api, ApiRunner, ServingOptions

        c = self.c
        cfg = self.desc.config
        context = int(getattr(self.tokenizer, "model_max_length", 0) or 0)
        context = int(
            cfg.get("max_position_embeddings") or cfg.get("max_seq_len") or context or 4096
        )
        api = Api(
            self.cluster,
            self.tokenizer,
            ServingOptions(
                model_id=c.model,
                context_length=context,
                default_max_tokens=c.serving.max_tokens,
                api_key=self.api_key,
                on_shutdown=self.stop.set,
                vocab_size=self.desc.vocab,  # prompt ids at or past it are refused
                max_body=c.api.max_body,
                metrics_auth=c.api.metrics_auth,
                speculative=c.serving.speculative,
                draft_tokens=c.serving.draft_tokens,
            ),
        )
        self.runner = ApiRunner(api.app(), handler_cancellation=True, access_log=None)
        await self.runner.setup()
        await web.SockSite(self.runner, self.sock).start()
        await self.page.close()  # the API answers on the socket from now on
        self.url = self.page.url
        sf = state_file()
        sf.parent.mkdir(parents=True, exist_ok=True)
        sf.write_text(json.dumps({"url": self.url, "pid": os.getpid(), "config": c.source}))
        how = (
            f"{len(members)} nodes, transport {c.transport}"
            if len(members) > 1
            else "1 node (stock mlx-lm, nothing to exchange)"
        )
        print(
            f"moe-cluster ready: {self.url} — model {c.model}, {how}, "
            f"{'adopted' if self.adopted else 'loaded'} in {time.monotonic() - self.t_load:.1f}s, "
            f"ready {time.monotonic() - self.t_start:.1f}s after start "
            "(Ctrl-C or `moe-cluster down` to stop)",
            flush=True,
        )

    async def close(self) -> None:
        """Undo what the phases did, the last first; shuts local nodes down, leaves remote ones."""
        if self.runner is not None:
            await self.runner.cleanup()
        if self.page is not None:
            await self.page.close()
        if self.sock is not None:
            self.sock.close()
        if self.ship is not None:
            await self.ship.close()
        if self.cluster is not None:
            await self.cluster.close(shutdown_nodes=self.launcher is not None)
        if self.launcher is not None:
            await self.launcher.close()
        try:
            sf = state_file()
            if sf.exists() and json.loads(sf.read_text()).get("pid") == os.getpid():
                sf.unlink()
        except (OSError, json.JSONDecodeError):
            pass


def main(args) -> int:
    c = load_config(args.file, model=args.model)  # --model takes the file's place
    if args.api_port is not None:
        c = replace(c, api=replace(c.api, port=args.api_port))
    log_dir = (
        Path(args.log_dir).expanduser() if args.log_dir else state_file().parent / "logs" / c.name
    )
    try:
        from ...common.process import run_grpc_loop

        return run_grpc_loop(lambda: run_up(c, log_dir=log_dir))
    except KeyboardInterrupt:
        return 130
