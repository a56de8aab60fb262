"""The performance model: Eq. 1 of Chen et al. (RACS '24) over model, hardware and network records.

    t_token = max((P_rep + P_shared + Σ_l P_expert,l · E_l + KV) / BW_mem,  FLOPs / F_gpu)   (1a)
              + layers · overhead                                                          (calibrated)
              + moe_layers · (wire latency + software stack) + comm data / BW_net           (1b)

E_l is the expected number of experts the busiest node computes in MoE layer l
(`expected_experts.py`). Everything here is pure arithmetic on frozen records.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace
from typing import Sequence

from ...proto.errors import UserError
from ...proto.placement import even_counts

logger = logging.getLogger(__name__)

# Table 1 (a): comm data per token = D_embed × 4 × layers × precision. The paper's factor 4 covers
# sending the partial sum and receiving the reduced one in both directions of the link.
COMM_FACTOR = 4
# the collectives a cluster can run over: the envoy, and mx.distributed
TRANSPORTS = ("envoy", "mlx")


class PlanError(UserError):
    """Bad input to the performance model or to `moe-cluster plan`, with the offending value."""


@dataclass(frozen=True)
class CacheSpec:
    """One layer's decode cache: bytes per cached token, fixed bytes (recurrent state) and an
    optional window (sliding-window attention keeps at most `max_tokens`)."""

    per_token_bytes: int
    fixed_bytes: int = 0
    max_tokens: int | None = None

    def bytes_at(self, context: int) -> int:
        tokens = context if self.max_tokens is None else min(context, self.max_tokens)
        return self.fixed_bytes + self.per_token_bytes * tokens


@dataclass(frozen=True)
class ModelSpec:
    """What Eq. 1 needs to know about a MoE model, in bytes and FLOPs per decoded token.

    Routed experts are sharded over the nodes; everything else is replicated. Shared experts are
    resident everywhere but each layer's shared expert is computed by one owner (decoder layer
    index mod N, as in DESIGN.md), so they are kept apart from the replicated reads.
    """

    name: str
    num_experts: int
    top_k: int
    layers: int  # decoder layers
    moe_layer_ids: tuple[int, ...]  # decoder-layer index of each MoE layer, ascending
    hidden: int
    act_bytes: int  # bytes per activation element (model dtype)
    replicated_bytes: int  # resident on every node, bytes
    replicated_read_bytes: (
        int  # of those, read by every node per decoded token (no shared experts), bytes
    )
    replicated_flops: float  # per decoded token, every node
    expert_layer_bytes: tuple[int, ...]  # one routed expert of each MoE layer, bytes
    expert_layer_flops: tuple[float, ...]  # one routed expert of each MoE layer, FLOPs per token
    shared_layer_bytes: tuple[
        int, ...
    ] = ()  # shared experts of each MoE layer (empty: none), bytes
    shared_layer_flops: tuple[float, ...] = ()
    comm_bytes_per_token: int | None = (
        None  # None: Table 1 (a), hidden × 4 × moe_layers × act_bytes
    )
    caches: tuple[CacheSpec, ...] = ()  # one per decoder layer (or fewer); empty: unknown
    weights: str = "bf16"  # "bf16", "4-bit affine g64", ...
    source: str = ""

    def __post_init__(self) -> None:
        if self.num_experts < 2:
            raise PlanError(
                f"{self.name}: a MoE model needs at least 2 routed experts (got {self.num_experts})"
            )
        if not 1 <= self.top_k <= self.num_experts:
            raise PlanError(
                f"{self.name}: top-k {self.top_k} must be between 1 and the expert count {self.num_experts}"
            )
        if not self.moe_layer_ids:
            raise PlanError(f"{self.name}: no MoE layers")
        n = len(self.moe_layer_ids)
        for label, values in (
            ("expert_layer_bytes", self.expert_layer_bytes),
            ("expert_layer_flops", self.expert_layer_flops),
        ):
            if len(values) != n:
                raise PlanError(
                    f"{self.name}: {label} has {len(values)} entries for {n} MoE layers"
                )
        for label, values in (
            ("shared_layer_bytes", self.shared_layer_bytes),
            ("shared_layer_flops", self.shared_layer_flops),
        ):
            if values and len(values) != n:
                raise PlanError(
                    f"{self.name}: {label} has {len(values)} entries for {n} MoE layers"
                )

    @property
    def moe_layers(self) -> int:
        return len(self.moe_layer_ids)

    @property
    def expert_bytes(self) -> int:
        """One routed expert summed over the MoE layers (Table 1's #Params_expert), bytes."""
        return sum(self.expert_layer_bytes)

    @property
    def shared_bytes(self) -> int:
        return sum(self.shared_layer_bytes)

    @property
    def total_bytes(self) -> int:
        return self.replicated_bytes + self.num_experts * self.expert_bytes

    @property
    def comm_bytes(self) -> int:
        if self.comm_bytes_per_token is not None:
            return self.comm_bytes_per_token
        return self.hidden * COMM_FACTOR * self.moe_layers * self.act_bytes

    def kv_cache_bytes(self, context: int) -> int:
        return sum(c.bytes_at(context) for c in self.caches)

    def shared_max(self, nodes: int) -> tuple[int, float]:
        """Bytes and FLOPs of shared experts the busiest node computes per token."""
        if not self.shared_layer_bytes:
            return 0, 0.0
        by_rank_b = [0] * nodes
        by_rank_f = [0.0] * nodes
        for lid, b, f in zip(self.moe_layer_ids, self.shared_layer_bytes, self.shared_layer_flops):
            by_rank_b[lid % nodes] += b
            by_rank_f[lid % nodes] += f
        r = max(range(nodes), key=lambda i: (by_rank_b[i], -i))
        return by_rank_b[r], by_rank_f[r]


@dataclass(frozen=True)
class HardwareSpec:
    """One node: memory, memory bandwidth, GPU throughput as Table 1 counts it, list price."""

    name: str
    memory_bytes: int
    bandwidth_Bps: float  # memory bandwidth, bytes/s
    flops: float  # bf16 FLOP/s
    price_usd: float
    note: str = ""
    ssd_read_Bps: float = (
        0.0  # the internal SSD's sequential read, bytes/s (expert cache misses); 0: unknown
    )


@dataclass(frozen=True)
class NetworkSpec:
    """The link between nodes: the wire (latency, bandwidth) apart from the software stack's
    per-layer cost (the paper's 1 ms per layer on 10 GbE is mostly its gRPC/TCP stack), which
    depends on the transport: the envoy's (`transport: envoy`) or mx.distributed's (`transport:
    mlx`, and mlx-lm's own pipeline and tensor parallelism)."""

    name: str
    wire_latency_s: float  # one all-reduce's time on the wire, seconds
    bandwidth_Bps: float  # bytes/s
    stack_s: float  # the envoy's software stack cost per MoE-layer all-reduce, seconds
    price_per_node_usd: float = 0.0  # NIC per node
    note: str = ""
    mlx_stack_s: float | None = None  # mx.distributed's stack cost; None: stack_s

    def stack(self, transport: str = "envoy") -> float:
        if transport not in TRANSPORTS:
            raise PlanError(f"unknown transport {transport!r}; choose from {', '.join(TRANSPORTS)}")
        return (
            self.stack_s if transport == "envoy" or self.mlx_stack_s is None else self.mlx_stack_s
        )

    def latency_s(self, transport: str = "envoy") -> float:
        """One collective's fixed cost over `transport`: the wire and that transport's stack."""
        return self.wire_latency_s + self.stack(transport)

    @property
    def latency_per_layer_s(self) -> float:
        return self.latency_s("envoy")

    def scaled(self, factor: float) -> "NetworkSpec":
        """The same link with every cost `factor` times higher: latencies times it, bandwidth over it."""
        return replace(
            self,
            wire_latency_s=self.wire_latency_s * factor,
            bandwidth_Bps=self.bandwidth_Bps / factor,
            stack_s=self.stack_s * factor,
            mlx_stack_s=None if self.mlx_stack_s is None else self.mlx_stack_s * factor,
        )

    def with_stack(self, seconds: float) -> "NetworkSpec":
        """The same wire with every transport's stack replaced (`--stack-latency`)."""
        return replace(self, stack_s=seconds, mlx_stack_s=None)


@dataclass(frozen=True)
class Overheads:
    """Calibrated corrections to Eq. 1 (`calibration.py`); the defaults are the paper's model."""

    bandwidth_Bps: float | None = None  # effective memory bandwidth, replaces the hardware's
    layer_overhead_s: float = 0.0  # fixed compute cost per decoder layer per token
    # Per MoE layer collective cost measured on one network: base at 2 nodes, growth per extra node.
    # None: use the network record.
    collective_base_s: float | None = None
    collective_per_node_s: float = 0.0
    # Per token per decoder layer (plan/race.py's race only; fitted by `plan --check-against`):
    # attention and the router (every node under expert parallelism, 1/N under tensor
    # parallelism), one token's pass through one expert, and ours' own work per token (batch
    # bookkeeping, waiting for the busiest node), which mlx-lm's strategies do not pay.
    token_attention_s: float = 0.0
    token_expert_s: float = 0.0
    token_ours_s: float = 0.0

    def collective_s(self, nodes: int) -> float | None:
        if self.collective_base_s is None:
            return None
        return max(0.0, self.collective_base_s + self.collective_per_node_s * (nodes - 2))


@dataclass(frozen=True)
class Estimate:
    """One row of the plan: Eq. 1's terms for one node count, memory and cost."""

    nodes: int
    network: str
    expected_experts: float  # mean over MoE layers of E[max over nodes]
    load_s: float
    compute_s: float
    overhead_s: float
    latency_s: float
    transfer_s: float
    time_s: float
    tokens_per_s: float
    replicated_bytes: int
    expert_shard_bytes: int  # the node holding the most expert bytes
    kv_cache_bytes: int
    memory_per_node_bytes: int
    usable_memory_bytes: int
    fits: bool
    price_per_node_usd: float
    tokens_per_s_per_usd: float
    extra: dict = field(default_factory=dict, compare=False)

    def to_json(self) -> dict:
        out = {
            "nodes": self.nodes,
            "network": self.network,
            "expected_experts": self.expected_experts,
            "load_s": self.load_s,
            "compute_s": self.compute_s,
            "overhead_s": self.overhead_s,
            "latency_s": self.latency_s,
            "transfer_s": self.transfer_s,
            "time_s": self.time_s,
            "tokens_per_s": self.tokens_per_s,
            "memory_per_node_bytes": self.memory_per_node_bytes,
            "replicated_bytes": self.replicated_bytes,
            "expert_shard_bytes": self.expert_shard_bytes,
            "kv_cache_bytes": self.kv_cache_bytes,
            "usable_memory_bytes": self.usable_memory_bytes,
            "fits": self.fits,
            "price_per_node_usd": self.price_per_node_usd,
            "tokens_per_s_per_usd": self.tokens_per_s_per_usd,
        }
        out.update(self.extra)
        return out


def estimate(
    model: ModelSpec,
    hardware: HardwareSpec,
    network: NetworkSpec,
    nodes: int,
    experts_per_layer: Sequence[float],
    *,
    expert_slots: Sequence[Sequence[int]] | None = None,
    context: int = 0,
    memory_fraction: float = 0.75,
    price_per_node_usd: float | None = None,
    overheads: Overheads = Overheads(),
    batch: int = 1,
    token_experts_per_layer: Sequence[float] | None = None,
    transport: str = "envoy",
) -> Estimate:
    """Eq. 1 for one node count; with `batch` sequences decoded together, for one step of them all.

    Args:
        experts_per_layer: E_l, expected experts the busiest node computes in each MoE layer
            (one value per MoE layer, or a single value for all).
        expert_slots: per MoE layer, the number of experts each rank holds (for memory);
            default an even split without replication.
        context: tokens in the KV cache: its bytes count in memory and are read per token.
        memory_fraction: share of each node's memory the GPU may wire (macOS default ~0.75).
        price_per_node_usd: all-in price of a node; default hardware list price + NIC (none for one node).
        overheads: calibrated corrections; default none (the paper's model).
        batch: sequences per step. The step reads the weights once for all of them (E is then the
            batch's E_B: distinct experts over its tokens) and each sequence's KV cache; FLOPs, the
            all-reduce's bytes and the KV memory grow with the batch, its latency does not.
            tokens_per_s is the aggregate, B / step time.
        token_experts_per_layer: E at batch 1 (FLOPs: each token multiplies through its own
            experts); default `experts_per_layer`.
        transport: the collective's (`envoy` or `mlx`): whose stack the network charges.
    """
    if nodes < 1:
        raise PlanError(f"node count must be at least 1 (got {nodes})")
    if context < 0:
        raise PlanError(f"context must be >= 0 tokens (got {context})")
    if not 0 < memory_fraction <= 1:
        raise PlanError(f"memory fraction must be in (0, 1] (got {memory_fraction})")
    E = list(experts_per_layer)
    if len(E) == 1:
        E = E * model.moe_layers
    if len(E) != model.moe_layers:
        raise PlanError(f"{len(E)} expected-expert values for {model.moe_layers} MoE layers")
    for e in E:
        if not 0 <= e <= model.num_experts:
            raise PlanError(f"expected experts per node {e} outside 0..{model.num_experts}")

    if batch < 1:
        raise PlanError(f"batch must be at least 1 sequence (got {batch})")
    E1 = list(token_experts_per_layer) if token_experts_per_layer is not None else E
    if len(E1) == 1:
        E1 = E1 * model.moe_layers
    kv = model.kv_cache_bytes(context) * batch
    shared_b, shared_f = model.shared_max(nodes)
    read = (
        model.replicated_read_bytes
        + shared_b
        + kv
        + sum(x * e for x, e in zip(model.expert_layer_bytes, E))
    )
    flops = batch * (
        model.replicated_flops + shared_f + sum(f * e for f, e in zip(model.expert_layer_flops, E1))
    )
    bandwidth = overheads.bandwidth_Bps or hardware.bandwidth_Bps
    load_s = read / bandwidth
    compute_s = flops / hardware.flops
    overhead_s = overheads.layer_overhead_s * model.layers
    if nodes == 1:
        latency_s = transfer_s = 0.0
    else:
        transfer_s = batch * model.comm_bytes / network.bandwidth_Bps
        collective = overheads.collective_s(nodes)
        if collective is None:
            latency_s = network.latency_s(transport) * model.moe_layers
        else:
            # The measured collective includes the data transfer; keep the columns adding up to it
            # (Table 1's comm bytes count four payloads a layer: more than a measured one moves).
            transfer_s = min(transfer_s, collective * model.moe_layers)
            latency_s = collective * model.moe_layers - transfer_s
    time_s = max(load_s, compute_s) + overhead_s + latency_s + transfer_s

    if expert_slots is None:
        expert_slots = [even_counts(model.num_experts, nodes)] * model.moe_layers
    if len(expert_slots) != model.moe_layers:
        raise PlanError(
            f"expert placement covers {len(expert_slots)} MoE layers, the model has {model.moe_layers}"
        )
    shard = max(
        sum(x * slots[r] for x, slots in zip(model.expert_layer_bytes, expert_slots))
        for r in range(nodes)
    )
    memory = model.replicated_bytes + shard + kv
    usable = int(hardware.memory_bytes * memory_fraction)
    if price_per_node_usd is not None:
        price = price_per_node_usd
    else:  # one node needs no NIC
        price = hardware.price_usd + (network.price_per_node_usd if nodes > 1 else 0.0)
    tps = batch / time_s
    return Estimate(
        nodes=nodes,
        network=network.name,
        expected_experts=sum(E) / len(E),
        load_s=load_s,
        compute_s=compute_s,
        overhead_s=overhead_s,
        latency_s=latency_s,
        transfer_s=transfer_s,
        time_s=time_s,
        tokens_per_s=tps,
        replicated_bytes=model.replicated_bytes,
        expert_shard_bytes=int(shard),
        kv_cache_bytes=kv,
        memory_per_node_bytes=int(memory),
        usable_memory_bytes=usable,
        fits=memory <= usable,
        price_per_node_usd=price,
        tokens_per_s_per_usd=tps / (nodes * price) if price > 0 else math.inf,
    )


def requantized(model: ModelSpec, bits: int, group_size: int = 64) -> ModelSpec:
    """A 16-bit model's byte counts after affine quantization of every weight (mlx-lm quantizes
    embeddings and linear layers alike): bits per weight plus a 16-bit scale and bias per group."""
    if bits not in (2, 3, 4, 5, 6, 8):
        raise PlanError(f"quantization bits must be one of 2, 3, 4, 5, 6, 8 (got {bits})")
    if group_size not in (32, 64, 128):
        raise PlanError(f"quantization group size must be 32, 64 or 128 (got {group_size})")
    if model.weights != "bf16":
        raise PlanError(
            f"{model.name} is already quantized ({model.weights}); cannot requantize it"
        )
    factor = (bits + 32 / group_size) / 16

    def scale(b: int) -> int:
        return int(round(b * factor))

    return replace(
        model,
        replicated_bytes=scale(model.replicated_bytes),
        replicated_read_bytes=scale(model.replicated_read_bytes),
        expert_layer_bytes=tuple(scale(b) for b in model.expert_layer_bytes),
        shared_layer_bytes=tuple(scale(b) for b in model.shared_layer_bytes),
        weights=f"{bits}-bit affine g{group_size}",
    )
