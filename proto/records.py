"""Records the coordinator and the nodes exchange (their wire form is proto/node.proto).

They import no mlx: the HTTP server and the planner use them without loading a model.
proto/convert/ maps them to and from the generated messages; the placement is
proto.placement.Placement.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence, Union

from .errors import ErrorKind, UserError
from .placement import Placement

DEFAULT_PREFILL_STEP = 512  # tokens per prefill chunk
# What a node keeps free for its caches, the defaults of cluster.yaml's placement.kv_reserve and
# serving.prompt_cache (an expert cache sized `auto` leaves both).
DEFAULT_KV_RESERVE = 512 * 2**20  # bytes for the KV cache
DEFAULT_PROMPT_CACHE = 256 * 2**20  # bytes for the KV prefix (prompt) cache
# The all-reduce's time limits, the defaults of cluster.yaml's timeouts, the envoy and its spec.
COLLECTIVE_TIMEOUT_S = 5.0  # seconds a step waits for a peer before it fails naming the peer
MESH_CONNECT_TIMEOUT_S = 30.0  # seconds a request waits for the envoy mesh to be whole
# MLX builds a kernel the first time a graph needs it (NVRTC on CUDA: ~30 s for each CUTLASS
# quantized matmul; a pipeline state on Metal), so a node's first steps of each shape can take
# minutes where later ones take milliseconds, and a peer whose kernels are built already waits that
# long: such steps (a node's first COLD_WAITS waits, and the steps the batch engine marks cold, the
# first two of each shape) are bounded by COLD_STEP_S instead of the collective timeout.
COLD_STEP_S = 600.0
COLD_WAITS = 2


def fmt_bytes(n: float) -> str:
    """A byte count for people: decimal units, as disks and downloads are sized."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def wait_bound(timeout_s: float, cold: bool, cold_s: float = COLD_STEP_S) -> float:
    """Seconds a wait on the peers may take: the collective timeout, or where the wait may build
    kernels the cold bound (never below the timeout)."""
    return max(cold_s, timeout_s) if cold else timeout_s


# Below these a sampled request is greedy: a temperature under GREEDY_TEMPERATURE scales log-probabilities
# towards what float32 cannot hold (1/T is inf near 1e-39: every token equally likely), and a top_p
# under GREEDY_TOP_P keeps the most likely token alone for any vocabulary up to 1e6 tokens (under
# ~1e-45 it is 0.0 in float32, where a top-p filter reads past the vocabulary).
GREEDY_TEMPERATURE = 1e-6
GREEDY_TOP_P = 1e-6
PENALTY_CONTEXT = 20  # tokens a penalty looks back over unless told: mlx-lm's default
UINT32_MAX = 2**32 - 1  # the wire's token ids and counts


@dataclass(frozen=True)
class Sampling:
    """How to pick tokens; temperature 0 (or an edge value, see `greedy`) is greedy.

    The filters and the logits processors are mlx-lm's (`mlx_lm.sample_utils`, node/sampling.py),
    with its meanings: top_k 0, min_p 0 and a penalty of 0 are off; a penalty looks at the last
    `*_context_size` tokens of the prompt and the output (0: all of them, as mlx-lm's slice reads
    it); `logit_bias` adds to a token's logit before everything else.
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    # draws the seed's sampler made before this request: a request resumed after a lost node goes on
    # with the draw its step k would have made (node/batch.py advances the key as many times)
    step: int = 0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 0.0  # multiplies a seen token's negative logit, divides a positive
    repetition_context_size: int = PENALTY_CONTEXT
    presence_penalty: float = 0.0  # subtracted once from each seen token's logit
    presence_context_size: int = PENALTY_CONTEXT
    frequency_penalty: float = 0.0  # subtracted from a token's logit for each time it was seen
    frequency_context_size: int = PENALTY_CONTEXT
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), by token id

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_p < GREEDY_TOP_P

    @property
    def processed(self) -> bool:
        """Whether logits processors change the logits before the token is picked."""
        return bool(
            self.logit_bias
            or self.repetition_penalty
            or self.presence_penalty
            or self.frequency_penalty
        )

    def check(self) -> None:
        if self.max_tokens < 1:
            raise UserError(f"max_tokens must be at least 1 (got {self.max_tokens})")
        if not 0 <= self.temperature < float("inf"):  # NaN fails this too
            raise UserError(f"temperature must be a finite number >= 0 (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top_p must be in (0, 1] (got {self.top_p})")
        if self.seed is not None and (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not 0 <= self.seed <= SEED_MAX
        ):
            raise UserError(f"seed must be an integer in [0, 2**64-1] (got {self.seed!r})")
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise UserError(f"the sampler's step must be an integer >= 0 (got {self.step!r})")
        for name in (
            "top_k",
            "repetition_context_size",
            "presence_context_size",
            "frequency_context_size",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= UINT32_MAX:
                raise UserError(f"{name} must be an integer in [0, 2**32-1] (got {v!r})")
        if not 0 <= self.min_p <= 1:
            raise UserError(f"min_p must be in [0, 1] (got {self.min_p})")
        if not 0 <= self.repetition_penalty < float("inf"):
            raise UserError(
                f"repetition_penalty must be a finite number >= 0 (got {self.repetition_penalty})"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -float("inf") < v < float("inf"):
                raise UserError(f"{name} must be a finite number (got {v})")
        for token, bias in self.logit_bias:
            if (
                isinstance(token, bool)
                or not isinstance(token, int)
                or not 0 <= token <= UINT32_MAX
            ):
                raise UserError(f"logit_bias: a token id must be an integer >= 0 (got {token!r})")
            if not -float("inf") < bias < float("inf"):
                raise UserError(f"logit_bias[{token}] must be a finite number (got {bias})")


SEED_MAX = 2**64 - 1  # mx.random.seed takes 0 .. 2**64-1 (measured: 2**64 and -1 raise TypeError)


def check_token_ids(ids: Sequence, vocab: int, what: str = "prompt") -> None:
    """Refuse ids that are not ints in [0, vocab) (vocab: the embedding's rows), naming the first
    offending position and value; an id past the table reads outside it and can end a node."""
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int):
            raise UserError(f"{what}[{i}] must be an integer token id (got {t!r})")
        if not 0 <= t < vocab:
            raise UserError(f"{what}[{i}] is out of range ({t}): token ids must be in [0, {vocab})")


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt: Sequence[int]
    sampling: Sampling
    eos_token_ids: Sequence[int] = ()
    prefill_step: int = DEFAULT_PREFILL_STEP
    record_logits: bool = False
    draft_tokens: int | None = (
        None  # drafts per step at most (speculation); None: the node's setting
    )
    prediction: Sequence[int] = ()  # the output the client expects (OpenAI's `prediction`): drafts
    quiet: bool = False  # the node sends no tokens, only the end (ranks but 0: the coordinator reads rank 0's)
    stop_sequences: Sequence[
        Sequence[int]
    ] = ()  # the output ends after any of these (finish reason stop)
    seq: int = 0  # the coordinator's admission order (a running batch admits in it); 0: the node numbers it
    owner: int = -1  # attention by stream: the rank that alone attends for it; -1: every rank


@dataclass(frozen=True)
class TlsFiles:
    """The PEM files of the cluster's TLS: cluster.yaml's `tls:` (paths relative to the file), and
    what each node's agent and envoy are given (absolute paths on that node)."""

    cert: str  # certificate chain
    key: str  # its private key
    ca: str = ""  # root certificates the peers' certificates are signed by; "": `cert` itself

    def __post_init__(self) -> None:
        if not self.ca:
            object.__setattr__(self, "ca", self.cert)  # one self-signed certificate for the cluster


KEEPALIVES = ("none", "lru", "busy")
# How a node picks its decode route (node/moe/route.py): timed at load, or forced (benchmarks)
DECODE_ROUTES = ("measure", "skip", "device", "host")
SPECULATIVE_MODES = ("off", "auto", "prompt-lookup", "draft", "mtp")  # node/speculate.py
ATTENTION_MODES = ("replicated", "by-stream", "auto")  # who attends for a stream (node/batch.py)
DRAFT_LIMIT = 16  # the most drafts one step verifies per sequence
# where the MTP layer's routed experts live at N > 1 (node/mtp.py holding)
MTP_EXPERTS = ("auto", "whole", "sharded")
NODE_STATES = ("idle", "loading", "ready", "busy", "failed", "stopping")
FINISH_REASONS = ("stop", "length", "cancelled", "error")


def _check(value: str, allowed: tuple[str, ...], what: str) -> None:
    if value not in allowed:
        raise UserError(f"{what} must be one of {', '.join(allowed)} (got {value!r})")


@dataclass(frozen=True)
class ShipSource:
    """Where a node without the checkpoint fetches its shard (the coordinator's Ship service)."""

    fingerprint: str  # of the checkpoint: names the node's cached shard
    address: str  # host:port; ":port" means the host the Load came from


@dataclass(frozen=True)
class FetchSpec:
    """A node's request for blobs of a shard (proto/ship.proto's FetchRequest)."""

    fingerprint: str
    blobs: tuple[str, ...]
    node: str = ""  # the asking node's name, for the coordinator's progress lines
    first_offset: int = 0  # start blobs[0] here (a resumed stream)
    chunk_bytes: int = 0  # 0: the coordinator's default


@dataclass(frozen=True)
class ShipChunk:
    """Bytes of one blob (proto/ship.proto's Chunk)."""

    blob: str
    offset: int
    data: bytes
    crc32: int
    last: bool
    sha256: str = ""  # on the last chunk: the blob's sha256 at the source


@dataclass(frozen=True)
class LoadSpec:
    """What a node loads and how it reaches the other nodes."""

    model: str  # checkpoint folder on the node
    rank: int
    world_size: int
    transport: Any  # a node.transports spec (EnvoySpec or MlxSpec)
    placement: Placement | None = None  # None: an even split
    keepalive: str = "lru"
    prefill_step: int = DEFAULT_PREFILL_STEP  # tokens per prefill chunk
    prompt_cache_bytes: int = 0  # KV prefix cache budget; 0: none
    ship: ShipSource | None = None  # set: the node has no checkpoint; it fills its cache from here
    expert_cache: str = "off"  # experts kept resident (proto.expert_cache); the rest read on a miss
    max_batch: int = 8  # sequences the running batch holds at once
    prefill_budget: int = 512  # prompt tokens per step while other sequences decode
    kv_budget_bytes: int = 0  # KV of running sequences plus the prompt cache; 0: no limit
    # a routing profile, ((MoE layer, selections per expert, tokens), ...): the expert cache pins
    # the hottest experts and prefetches the next layer's from it
    heat: tuple = ()
    route: str = "measure"  # DECODE_ROUTES; measure: timed at load
    speculative: str = "off"  # node/speculate.py MODES
    draft_tokens: int = 4  # drafts a step verifies per sequence at most, where speculation is on
    draft_model: str = (
        ""  # speculative: draft: the draft checkpoint, on rank 0's machine (rank 0 only)
    )
    mtp_experts: str = "auto"  # MTP_EXPERTS: speculative "mtp"'s routed experts at N > 1
    overlap: bool = False  # two micro-batches per decode step (node/overlap.py)
    attention: str = "replicated"  # ATTENTION_MODES (node/batch.py BatchLimits.attention)
    # seconds without a call of the coordinator after which the node drops its running sequences
    # (the coordinator is gone: nobody reads them); 0: never
    orphan_after_s: float = 0.0
    # keep the loaded model where this spec matches it (node/adopt.py), else refuse, changing nothing
    adopt: bool = False

    def __post_init__(self) -> None:
        _check(self.keepalive, KEEPALIVES, "keepalive")
        if not 0 <= self.orphan_after_s < float("inf"):
            raise UserError(
                f"orphan_after_s must be a finite number >= 0 (got {self.orphan_after_s})"
            )
        _check(self.route, DECODE_ROUTES, "route")
        _check(self.mtp_experts, MTP_EXPERTS, "mtp_experts")
        if self.max_batch < 1 or self.prefill_budget < 1:
            raise UserError(
                f"max_batch ({self.max_batch}) and prefill_budget ({self.prefill_budget}) must be at least 1"
            )
        from .expert_cache import ExpertCacheSpec

        ExpertCacheSpec.parse(self.expert_cache)
        if not 0 <= self.rank < self.world_size:
            raise UserError(f"rank {self.rank} must be in [0, world_size {self.world_size})")


@dataclass(frozen=True)
class NodeError:
    """An error a node reports (in LoadProgress or as a GenerateEvent)."""

    kind: ErrorKind  # how the coordinator reacts (proto.errors.KINDS maps it to HTTP and gRPC)
    message: str
    rank: int = 0


@dataclass(frozen=True)
class LoadProgress:
    bytes_loaded: int
    bytes_total: int
    phase: str
    done: bool = False
    error: NodeError | None = None


@dataclass(frozen=True)
class GeneratedTokens:
    ids: tuple[int, ...]


@dataclass(frozen=True)
class Timings:
    prompt_s: float = 0.0
    generation_s: float = 0.0
    collective_s: float = 0.0  # of which waiting in all-reduces
    queue_s: float = 0.0  # before the request started


@dataclass(frozen=True)
class GenerateDone:
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    timings: Timings = field(default_factory=Timings)
    counters: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check(self.finish_reason, FINISH_REASONS, "finish_reason")


GenerateEvent = Union[GeneratedTokens, GenerateDone, NodeError]


@dataclass(frozen=True)
class Health:
    ok: bool
    state: str
    reason: str = ""  # why the node is failed (its envoy exited, ...); empty otherwise

    def __post_init__(self) -> None:
        _check(self.state, NODE_STATES, "state")


@dataclass(frozen=True)
class Memory:
    device_bytes: int = 0
    budget_bytes: int = 0
    used_bytes: int = 0
    peak_bytes: int = 0


@dataclass(frozen=True)
class AllreduceHistogram:
    """A node's all-reduce latencies since it loaded: counts[i] calls took longer than bounds[i - 1]
    and at most bounds[i] seconds; the last count, longer than every bound."""

    bounds: tuple[float, ...]  # seconds, ascending
    counts: tuple[int, ...]  # len(bounds) + 1
    sum_s: float = 0.0

    def __post_init__(self) -> None:
        if len(self.counts) != len(self.bounds) + 1:
            raise ValueError(
                f"an all-reduce histogram with {len(self.bounds)} bounds needs {len(self.bounds) + 1} "
                f"counts (got {len(self.counts)})"
            )


@dataclass(frozen=True)
class LayerRouting:
    """One MoE layer on a node: the experts it holds, and the router's selections of each expert
    since the load (indexed by expert id; the same on every node, the router being replicated)."""

    layer: int
    held: tuple[int, ...]
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class ExpertCacheLayer:
    """One MoE layer's expert cache on a node (node/moe/expert_cache.py), sums since the load."""

    layer: int
    capacity: int  # resident slots
    local: int  # experts the node holds for the layer
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0
    prefetched: int = 0  # reads started ahead of the layer's routing (from the routing profile)
    prefetch_hits: int = 0  # misses whose bytes a prefetch had already read
    prefetch_bytes: int = 0  # bytes read by prefetches, used or not

    @classmethod
    def of(cls, layer: int, counts) -> "ExpertCacheLayer":
        """Layer `layer`'s record from anything with these fields (a cache's counters, a message)."""
        names = [f.name for f in dataclasses.fields(cls) if f.name != "layer"]
        return cls(layer, **{n: getattr(counts, n) for n in names})


@dataclass(frozen=True)
class NodeStatus:
    state: str
    model: str = ""
    rank: int = 0
    world_size: int = 1
    memory: Memory = field(default_factory=Memory)
    device: str = ""
    backend: str = ""  # the transport: envoy, mlx or local
    experts_per_layer: Mapping[int, int] = field(default_factory=dict)
    counters: Mapping[str, float] = field(default_factory=dict)
    uptime_s: float = 0.0
    pid: int = 0
    queue_depth: int = 0
    allreduce: AllreduceHistogram | None = None  # None before a model is loaded
    routing: tuple[LayerRouting, ...] = ()  # by layer
    expert_cache: tuple[
        ExpertCacheLayer, ...
    ] = ()  # by layer, where fewer experts are resident than held
    route: str = ""  # the decode route chosen at load (node/moe/route.py): skip, device or host
    route_us: Mapping[str, float] = field(
        default_factory=dict
    )  # µs per MoE layer call, per route timed
    speculative: str = ""  # "prompt-lookup, 4 drafts", "off", or "off: <why the model cannot>"
    micro_batches: str = ""  # "2 per step", "off", or "off: <why the node cannot>"
    # positions from which a device route's call takes the host read (node/moe/route.py); 0: never
    route_host_from: int = 0
    streams: int = 0  # running streams this node attends for (node/batch.py RunningBatch.streams)
    kv_bytes: int = 0  # KV bytes reserved for them
    attention: str = ""  # the load's serving.attention ("" before a load)

    def __post_init__(self) -> None:
        _check(self.state, NODE_STATES, "state")
