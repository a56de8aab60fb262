"""`cluster.yaml`: the cluster a user describes, validated strictly.

Every error names the file, the line and the key, in one line; unknown keys are errors (with a
suggestion when one is close). Sizes take units ("1GB", "512MiB") and durations take "ms", "s",
"m" ("5s"). The secret is never in the file: it comes from an environment variable or a file.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import yaml

from ...proto.errors import UserError
from ...proto.expert_cache import ExpertCacheSpec
from ...proto.records import (
    ATTENTION_MODES,
    COLLECTIVE_TIMEOUT_S,
    DECODE_ROUTES,
    DEFAULT_KV_RESERVE,
    DEFAULT_PROMPT_CACHE,
    DRAFT_LIMIT,
    KEEPALIVES,
    MTP_EXPERTS,
    SPECULATIVE_MODES,
    TlsFiles,
)
from .config_reader import ConfigError, Duration, Reader, Size, find_node
from .resume import MAX_RESUMES, RECOVERY_WAIT_S


@dataclass(frozen=True)
class NodeConfig:
    name: str
    # host or host:port of the node agent; omitted: found by mDNS (launch: remote) or 127.0.0.1 (local)
    address: str | None = None
    port: int | None = None  # agent port (local launch: chosen free if omitted)
    envoy_port: int | None = None  # envoy port (chosen free if omitted)
    # the envoy's data channel port, a firewall's second port per node (any free one if omitted)
    envoy_data_port: int | None = None
    memory: Size | None = None  # override the memory the node reports (bytes)
    expert_cache: str | None = None  # this node's placement.expert_cache
    # launch: local on a host with several CUDA GPUs: the one this node uses (its CUDA_VISIBLE_DEVICES)
    gpu: int | None = None


@dataclass(frozen=True)
class PlacementConfig:
    strategy: Literal["even", "memory", "profile"] = "memory"
    profile: str | None = None  # routing profile JSON from `moe-cluster profile`
    memory_fraction: float = 0.75  # of each node's memory usable for weights and caches
    kv_reserve: Size = Size(
        DEFAULT_KV_RESERVE
    )  # bytes kept free per node for the KV / prompt cache
    replicate: bool = (
        True  # with a profile: copy the hottest experts to every node, as spare memory allows
    )
    # experts each node keeps resident: off (all, or refuse what does not fit), auto (what its budget
    # holds), a size ("8GB") or a percent of its share ("50%"); the rest are read from disk on a miss
    expert_cache: str = "off"


@dataclass(frozen=True)
class ApiConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    api_key_env: str | None = None  # name of the environment variable holding the API key
    api_key_file: str | None = None
    max_body: Size = Size(16 * 2**20)  # bytes of a request body at most; larger ones get HTTP 413
    metrics_auth: bool = False  # /metrics needs the API key too (with a key configured)


@dataclass(frozen=True)
class SecretConfig:
    env: str | None = "MOE_CLUSTER_SECRET"  # environment variable holding the cluster secret
    file: str | None = None  # or a file holding it


@dataclass(frozen=True)
class DiscoveryConfig:
    # mDNS only on these interfaces (names or IPv4 addresses); empty: all of them
    interfaces: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Timeouts:
    discovery: Duration = Duration(30.0)  # finding remote nodes
    load: Duration = Duration(600.0)  # loading the shards
    collective: Duration = Duration(
        COLLECTIVE_TIMEOUT_S
    )  # a step fails after this long without a peer
    heartbeat: Duration = Duration(1.0)  # between health checks
    request: Duration = Duration(600.0)  # one generation, end to end
    # a node drops its running sequences after this long without a call of the coordinator (it
    # is hung or cut off; one that died closed their streams, which drops them at once); not
    # given: at least three heartbeats
    coordinator: Duration = Duration(10.0)


@dataclass(frozen=True)
class ServingConfig:
    prefill_chunk: int = 512  # tokens per prefill chunk (bounds attention and all-reduce size)
    prompt_cache: Size = Size(DEFAULT_PROMPT_CACHE)  # KV prefix cache budget per node, bytes
    queue: int = 16  # requests waiting at most (beyond max_batch running); more get 429
    max_batch: int = 8  # sequences each node decodes together (continuous batching)
    prefill_budget: int = 512  # prompt tokens prefilled per step while others decode
    max_tokens: int = 256  # default when a request does not say
    # seconds a request waits for a recovering cluster (arriving, or resuming after a lost node)
    # before it gets 503; a little above the slowest recovery the soak measured
    recovery_wait: Duration = Duration(RECOVERY_WAIT_S)
    max_resumes: int = MAX_RESUMES  # times one request may resume after a lost node; 0: never
    # one step verifies drafted tokens (node/speculate.py): fewer all-reduces per token where the
    # drafts hold. auto: prompt lookup and the request's prediction wherever the family's caches
    # can drop rejected drafts, each sequence guessing only while its guesses hold; quietly off
    # elsewhere, saying why in status (docs/speculative.md); mtp: the checkpoint's own
    # multi-token-prediction layers draft (node/mtp.py)
    speculative: Literal[SPECULATIVE_MODES] = "auto"
    draft_tokens: int = 4  # drafts a step verifies per sequence at most (1..16)
    draft_model: str = (
        ""  # speculative: draft: a small checkpoint with the model's tokenizer, on rank 0
    )
    # speculative: mtp at N > 1: the MTP layer's routed experts on every node (whole: its drafts
    # need no all-reduce) or split like any MoE layer's (sharded); auto: whole where they are
    # small beside this node's experts (node/mtp.py holding)
    mtp_experts: Literal[MTP_EXPERTS] = "auto"
    # two micro-batches per decode step: one half's all-reduce travels while the other half
    # computes its layer (node/overlap.py); off until measured on (docs/speculative.md)
    overlap: bool = False
    # who attends for a stream (serve/streams.py): every node (replicated), its owner alone
    # (by-stream), or auto: replicated for a stream that finds nothing else running
    attention: Literal[ATTENTION_MODES] = "replicated"


@dataclass(frozen=True)
class ShipConfig:
    """How the coordinator ships shards, with `checkpoint: coordinator` (node/cache.py keeps them)."""

    host: str = "0.0.0.0"  # where the coordinator's Ship service listens
    port: int = 7702  # 0: any free port (nodes are told which)
    chunk: Size = Size(2**20)  # bytes per streamed chunk
    max_rate: Size = Size(0)  # bytes per second per node; 0: as fast as the network goes


@dataclass(frozen=True)
class ClusterConfig:
    nodes: list[NodeConfig]
    # a checkpoint folder, "demo", or a Hugging Face repo id (org/name[@revision]) that `up`
    # downloads into this machine's Hugging Face cache
    model: str = "demo"
    # every-node: `model` is a folder on each node too; coordinator: only this machine has it, and
    # it ships each node its shard (`ship:` says how). Default: every-node for a folder,
    # coordinator for a repo id
    checkpoint: Literal["every-node", "coordinator"] = "every-node"
    ship: ShipConfig = field(default_factory=ShipConfig)
    name: str = "moe-cluster"
    launch: Literal["local", "remote"] = "local"
    transport: Literal["envoy", "mlx"] = "envoy"
    # transport mlx: auto (NCCL for local nodes that each have a GPU, where MLX has it; else the
    # ring) or ring (the host-mediated ring, to compare the envoy with)
    mlx_backend: Literal["auto", "ring"] = "auto"
    keepalive: Literal[KEEPALIVES] = "lru"  # Literal[("a", "b")] is Literal["a", "b"]
    route: Literal[DECODE_ROUTES] = "measure"  # the nodes' decode route (node/moe/route.py)
    verify: bool = True  # the load-time check (serve/verify.py)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    api: ApiConfig = field(default_factory=ApiConfig)
    secret: SecretConfig = field(default_factory=SecretConfig)
    tls: TlsFiles | None = None  # paths relative to this file
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    timeouts: Timeouts = field(default_factory=Timeouts)
    serving: ServingConfig = field(default_factory=ServingConfig)
    source: str = "cluster.yaml"  # where it was read from (not a key)


def load_config(path: str | os.PathLike, model: str | None = None) -> ClusterConfig:
    """Read and validate a cluster.yaml; raises ConfigError with FILE:LINE: KEY: problem.
    `model`: `up --model`, which takes the file's place (and sets checkpoint's default)."""
    path = Path(path)
    source = str(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{source}: no such file") from None
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read ({exc.strerror})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(
            f"{source}:{line}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
            "save the file as UTF-8"
        ) from None
    return parse_config(text, source, model)


def parse_config(
    text: str, source: str = "cluster.yaml", model: str | None = None
) -> ClusterConfig:
    try:
        root = yaml.compose(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f"{mark.line + 1}" if mark else "1"
        raise ConfigError(
            f"{source}:{line}: not valid YAML ({getattr(exc, 'problem', exc)})"
        ) from None
    if root is None:
        raise ConfigError(f"{source}:1: the file is empty; it needs at least `nodes:`")
    reader = Reader(source)
    config = reader.dataclass(root, ClusterConfig, "")
    if model is not None:
        config = replace(config, model=model)
    if find_node(root, "checkpoint") is root and names_repo(config.model):
        config = replace(config, checkpoint="coordinator")  # only this machine downloads it
    t = config.timeouts
    if find_node(root, "timeouts", "coordinator") is find_node(root, "timeouts"):  # not given
        # a slow heartbeat gets a bound of three: the nodes must not drop a live coordinator's work
        bound = Duration(max(t.coordinator, 3 * max(t.heartbeat, 1.0)))
        config = replace(config, timeouts=replace(t, coordinator=bound))
    _check(config, root, reader, "--model" if model is not None else "model")
    return _with_source(config, source)


def _with_source(config: ClusterConfig, source: str) -> ClusterConfig:
    return replace(config, source=source)


def names_repo(model: str) -> bool:
    """Whether `model` names a Hugging Face repo (org/name[@revision]) rather than a folder here:
    a folder that exists wins, as in mlx-lm."""
    from ...node.hub import parse_repo_id

    return (
        model != "demo"
        and not Path(model).expanduser().exists()
        and parse_repo_id(model) is not None
    )


_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


def _check(c: ClusterConfig, root: yaml.Node, r: Reader, model_key: str = "model") -> None:
    if not c.nodes:
        raise r.fail(find_node(root, "nodes"), "nodes", "needs at least one node")
    if c.mlx_backend != "auto" and c.transport != "mlx":
        raise r.fail(
            find_node(root, "mlx_backend"), "mlx_backend", "applies only with transport: mlx"
        )
    s = c.serving
    if s.attention != "replicated" and (s.overlap or s.speculative in ("draft", "mtp")):
        what = "overlap: true" if s.overlap else f"speculative: {s.speculative}"
        raise r.fail(
            find_node(root, "serving", "attention"),
            "serving.attention",
            f"{s.attention} cannot run with {what} (every node's rows go in one pass, and a draft "
            "is read from the first node for every stream); use attention: replicated",
        )
    if not c.timeouts.coordinator > 2 * max(c.timeouts.heartbeat, 1.0):
        # a heartbeat waits up to max(heartbeat, 1 s) for its answer, then the next one comes
        raise r.fail(
            find_node(root, "timeouts", "coordinator"),
            "timeouts.coordinator",
            f"must be more than twice the heartbeat's {max(c.timeouts.heartbeat, 1.0):g} s "
            f"(got {c.timeouts.coordinator:g} s): a node would drop requests between heartbeats",
        )
    names: dict[str, int] = {}
    for i, n in enumerate(c.nodes):
        where = f"nodes[{i}]"
        if not _NAME.match(n.name):
            raise r.fail(
                find_node(root, "nodes", i, "name"),
                f"{where}.name",
                f"{n.name!r} must be letters, digits, '.', '_' or '-' (up to 63)",
            )
        if n.name in names:
            raise r.fail(
                find_node(root, "nodes", i, "name"),
                f"{where}.name",
                f"{n.name!r} is used by nodes[{names[n.name]}] too",
            )
        names[n.name] = i
        for attr in ("port", "envoy_port", "envoy_data_port"):
            port = getattr(n, attr)
            if port is not None and not 1 <= port <= 65535:
                raise r.fail(
                    find_node(root, "nodes", i, attr),
                    f"{where}.{attr}",
                    f"{port} is not a port (1..65535)",
                )
        if n.envoy_data_port is not None:
            if c.transport != "envoy":
                raise r.fail(
                    find_node(root, "nodes", i, "envoy_data_port"),
                    f"{where}.envoy_data_port",
                    "applies only with transport: envoy",
                )
            if n.envoy_data_port in (n.port, n.envoy_port):
                raise r.fail(
                    find_node(root, "nodes", i, "envoy_data_port"),
                    f"{where}.envoy_data_port",
                    f"{n.envoy_data_port} is this node's {'port' if n.envoy_data_port == n.port else 'envoy_port'} too",
                )
        if n.address is not None and not re.fullmatch(r"[A-Za-z0-9_.:\[\]-]+", n.address):
            raise r.fail(
                find_node(root, "nodes", i, "address"),
                f"{where}.address",
                f"{n.address!r} is not a host or host:port",
            )
        if n.gpu is not None:
            if c.launch != "local":
                raise r.fail(
                    find_node(root, "nodes", i, "gpu"),
                    f"{where}.gpu",
                    "is for launch: local (a remote node uses the GPUs its own environment gives it)",
                )
            if n.gpu < 0:
                raise r.fail(
                    find_node(root, "nodes", i, "gpu"),
                    f"{where}.gpu",
                    f"must be a GPU index >= 0 (got {n.gpu})",
                )
        if n.expert_cache is not None:
            try:
                ExpertCacheSpec.parse(n.expert_cache)
            except UserError as exc:
                raise r.fail(
                    find_node(root, "nodes", i, "expert_cache"), f"{where}.expert_cache", str(exc)
                ) from None
    if not 0 < c.placement.memory_fraction <= 1:
        raise r.fail(
            find_node(root, "placement", "memory_fraction"),
            "placement.memory_fraction",
            f"must be in (0, 1] (got {c.placement.memory_fraction})",
        )
    try:
        ExpertCacheSpec.parse(c.placement.expert_cache)
    except UserError as exc:
        raise r.fail(
            find_node(root, "placement", "expert_cache"), "placement.expert_cache", str(exc)
        ) from None
    if c.placement.strategy == "profile" and not c.placement.profile:
        raise r.fail(
            find_node(root, "placement", "strategy"),
            "placement.profile",
            "strategy 'profile' needs a profile file",
        )
    if not 1 <= c.api.port <= 65535 and c.api.port != 0:
        raise r.fail(
            find_node(root, "api", "port"), "api.port", f"{c.api.port} is not a port (1..65535)"
        )
    if c.api.max_body < 1024:
        raise r.fail(
            find_node(root, "api", "max_body"),
            "api.max_body",
            f"must be at least 1KB (got {int(c.api.max_body)} bytes)",
        )
    if c.api.api_key_env and c.api.api_key_file:
        raise r.fail(find_node(root, "api"), "api", "give api_key_env or api_key_file, not both")
    secret = find_node(root, "secret")
    if isinstance(secret, yaml.MappingNode) and {"env", "file"} <= {
        k.value for k, _ in secret.value
    }:
        raise r.fail(secret, "secret", "give env or file, not both")
    if c.serving.prefill_chunk < 16:
        raise r.fail(
            find_node(root, "serving", "prefill_chunk"),
            "serving.prefill_chunk",
            f"must be at least 16 tokens (got {c.serving.prefill_chunk})",
        )
    for key in ("max_batch", "prefill_budget"):
        if getattr(c.serving, key) < 1:
            raise r.fail(
                find_node(root, "serving", key),
                f"serving.{key}",
                f"must be at least 1 (got {getattr(c.serving, key)})",
            )
    if c.serving.queue < 1:
        raise r.fail(
            find_node(root, "serving", "queue"),
            "serving.queue",
            f"must be at least 1 (got {c.serving.queue})",
        )
    if c.serving.max_tokens < 1:
        raise r.fail(
            find_node(root, "serving", "max_tokens"),
            "serving.max_tokens",
            f"must be at least 1 (got {c.serving.max_tokens})",
        )
    draft = c.serving.speculative == "draft"
    if draft != bool(c.serving.draft_model):
        key = "speculative" if draft else "draft_model"
        raise r.fail(
            find_node(root, "serving", key),
            f"serving.{key}",
            "speculative: draft needs serving.draft_model (a small checkpoint with the model's tokenizer)"
            if draft
            else "serving.draft_model needs speculative: draft",
        )
    if draft and c.checkpoint == "coordinator":
        raise r.fail(
            find_node(root, "serving", "draft_model"),
            "serving.draft_model",
            "the draft model is read on the first node's machine; checkpoint: coordinator ships only "
            "the model (copy the draft there and use checkpoint: every-node)",
        )
    if c.serving.mtp_experts != "auto" and c.serving.speculative != "mtp":
        raise r.fail(
            find_node(root, "serving", "mtp_experts"),
            "serving.mtp_experts",
            f"{c.serving.mtp_experts} needs speculative: mtp (got {c.serving.speculative})",
        )
    if c.serving.speculative == "mtp" and c.checkpoint == "coordinator":
        raise r.fail(
            find_node(root, "serving", "speculative"),
            "serving.speculative",
            "mtp reads the checkpoint's MTP layer on every node; checkpoint: coordinator ships only "
            "each node's shard of the model (use checkpoint: every-node)",
        )
    if (
        draft
        and c.launch == "local"
        and c.serving.draft_model != "demo"
        and not Path(c.serving.draft_model).expanduser().exists()
        and not names_repo(c.serving.draft_model)
    ):
        raise r.fail(
            find_node(root, "serving", "draft_model"),
            "serving.draft_model",
            f"{c.serving.draft_model} does not exist on this machine",
        )
    if draft and c.launch == "remote" and names_repo(c.serving.draft_model):
        raise r.fail(
            find_node(root, "serving", "draft_model"),
            "serving.draft_model",
            f"{c.serving.draft_model} names a Hugging Face repo, which only this machine "
            "downloads; with launch: remote the first node reads the draft: give its folder there",
        )
    if not 1 <= c.serving.draft_tokens <= DRAFT_LIMIT:
        raise r.fail(
            find_node(root, "serving", "draft_tokens"),
            "serving.draft_tokens",
            f"must be 1 to {DRAFT_LIMIT} (got {c.serving.draft_tokens})",
        )
    if c.serving.max_resumes < 0:
        raise r.fail(
            find_node(root, "serving", "max_resumes"),
            "serving.max_resumes",
            f"must be at least 0 (got {c.serving.max_resumes})",
        )
    if c.launch == "local":
        remote = [
            n.name
            for n in c.nodes
            if n.address not in (None, "127.0.0.1", "localhost", "::1")
            and not str(n.address).startswith(("127.", "localhost:"))
        ]
        if remote:
            i = names[remote[0]]
            raise r.fail(
                find_node(root, "nodes", i, "address"),
                f"nodes[{i}].address",
                "launch: local starts nodes on this machine; a remote address needs launch: remote",
            )
    if find_node(root, "ship") is not root and c.checkpoint != "coordinator":
        raise r.fail(
            find_node(root, "ship"),
            "ship",
            "applies only with checkpoint: coordinator (the nodes then "
            "receive their shards from this machine)",
        )
    if not 0 <= c.ship.port <= 65535:
        raise r.fail(
            find_node(root, "ship", "port"), "ship.port", f"{c.ship.port} is not a port (0..65535)"
        )
    if not 64 * 2**10 <= c.ship.chunk <= 4 * 2**20:
        raise r.fail(
            find_node(root, "ship", "chunk"),
            "ship.chunk",
            f"must be 64KiB to 4MiB (got {int(c.ship.chunk)} bytes)",
        )
    repo = names_repo(c.model)
    if (
        c.model != "demo"
        and c.launch == "local"
        and not repo
        and not Path(c.model).expanduser().exists()
    ):
        raise r.fail(
            find_node(root, "model"),
            model_key,
            f"{c.model} does not exist on this machine (nor is it a Hugging Face repo id, "
            "org/name)",
        )
    if repo and c.launch == "remote" and c.checkpoint == "every-node":
        raise r.fail(
            find_node(root, "checkpoint"),
            "checkpoint",
            f"every-node needs {c.model} on every node, but only this machine downloads a "
            "Hugging Face repo: use checkpoint: coordinator (the default for a repo id), or a "
            "folder at the same path on every node",
        )


def read_secret(c: ClusterConfig) -> str:
    """The cluster secret from its file or environment variable; empty means none is set."""
    if c.secret.file:
        p = Path(c.secret.file).expanduser()
        if not p.is_absolute():
            p = Path(c.source).parent / p
        try:
            return p.read_text().strip()
        except OSError as exc:
            raise ConfigError(
                f"{c.source}: secret.file: cannot read {p} ({exc.strerror})"
            ) from None
    if c.secret.env:
        return os.environ.get(c.secret.env, "")
    return ""


def read_api_key(c: ClusterConfig) -> str | None:
    if c.api.api_key_file:
        p = Path(c.api.api_key_file).expanduser()
        if not p.is_absolute():
            p = Path(c.source).parent / p
        try:
            return p.read_text().strip() or None
        except OSError as exc:
            raise ConfigError(
                f"{c.source}: api.api_key_file: cannot read {p} ({exc.strerror})"
            ) from None
    if c.api.api_key_env:
        key = os.environ.get(c.api.api_key_env)
        if not key:
            raise ConfigError(
                f"{c.source}: api.api_key_env: environment variable {c.api.api_key_env} is not set"
            )
        return key
    return None


def read_credentials(c: ClusterConfig) -> tuple[str, str | None]:
    """(cluster secret, API key) as `up` needs them; a ConfigError naming the key when one cannot be
    read. An empty secret is only allowed with launch: local (`up` then makes one for its nodes)."""
    secret = read_secret(c)
    if not secret and c.launch == "remote":
        raise ConfigError(
            f"{c.source}: secret: no cluster secret; set {c.secret.env or 'MOE_CLUSTER_SECRET'} "
            "(the same on every node) or secret.file"
        )
    return secret, read_api_key(c)


def tls_files(c: ClusterConfig) -> TlsFiles | None:
    """cluster.yaml's TLS files as absolute paths (relative ones are to the file's folder)."""
    if c.tls is None:
        return None
    base = Path(c.source).parent

    def absolute(p: str) -> str:
        q = Path(p).expanduser()
        return str(q if q.is_absolute() else (base / q).resolve())

    files = TlsFiles(absolute(c.tls.cert), absolute(c.tls.key), absolute(c.tls.ca))
    missing = [p for p in (files.cert, files.key, files.ca) if not Path(p).is_file()]
    if missing:
        raise ConfigError(f"{c.source}: tls: no such file {missing[0]}")
    return files


def validate_main(args) -> int:
    """`moe-cluster validate FILE`: check a cluster.yaml (and its secret and API key, as `up` reads
    them) and summarise it."""
    c = load_config(args.file)
    read_credentials(c)
    nodes = ", ".join(n.name + (f" ({n.address})" if n.address else "") for n in c.nodes)
    print(
        f"{c.source}: ok — {len(c.nodes)} nodes [{nodes}], model {c.model}, launch {c.launch}, "
        f"transport {c.transport}, keepalive {c.keepalive}, placement {c.placement.strategy}, "
        f"API http://{c.api.host}:{c.api.port}"
    )
    return 0
