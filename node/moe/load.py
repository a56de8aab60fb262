"""Build a node's shard of a MoE checkpoint: the model for expert parallelism.

The model is built by mlx-lm (its config, `sanitize` and quantization) with every non-expert weight;
each expert bank is replaced by an `ExpertShard` holding only this node's experts, read by byte
range from the safetensors files, and each MoE block by a `ClusterMoE` (layer.py) that makes its
non-routed terms count once and all-reduces its output once. What the model is made of (its
blocks, found by `structure.py`, their expert tensors and the quantization) comes from the
model's description, `node/describe.py`, read once.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ...proto.errors import UserError
from ...proto.placement import Placement
from ..checkpoint import (
    Checkpoint,
    check_runnable,
    read_tensor,
)
from ..describe import ModelDescription, describe
from ..collective.base import Capabilities, Collective, LocalCollective
from . import skip_gemv
from . import route as decode_route
from ...proto.expert_cache import ExpertCacheSpec, auto_budget
from ...proto.records import DEFAULT_KV_RESERVE, DEFAULT_PROMPT_CACHE
from .reference import activation_dtype
from ..device import ieee_float32, metal_info, on_cuda, on_metal
from .experts import ExpertShard, NodeConfig, ShardState
from .combine import Combine, combine_for
from .layer import ClusterMoE, InProcessCluster, install, owns_dense_terms
from .structure import MoEBlock, rebind
from .shard_experts import ShardError, make_shard, quantize_replicated

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardInfo:
    """What a node holds after loading, measured."""

    rank: int
    experts_per_layer: dict[int, int]
    resident_weight_bytes: int  # sum of the arrays the model now holds
    active_memory_bytes: int  # MLX allocator's live bytes after the load (measured)
    replicated_bytes: int
    expert_bytes: int
    load_seconds: float
    peak_memory_bytes: int  # MLX allocator peak during the load


@dataclass
class ShardedModel:
    model: nn.Module
    config: dict
    blocks: list[MoEBlock]
    placement: Placement
    state: ShardState
    info: ShardInfo
    collective: Collective = field(default_factory=LocalCollective)
    layers: list[ClusterMoE] = field(default_factory=list)  # empty when nothing is sharded
    path: str = ""  # the checkpoint's folder (node/mtp.py reads its MTP layers from it)

    def moe_layers(self) -> dict[int, int]:
        return {b.layer: b.num_experts for b in self.blocks}

    def probe(self, layer: int, x: np.ndarray) -> np.ndarray:
        """This node's share of MoE layer `layer`'s output for x (tokens, hidden) float32, in float32:
        what it would hand the all-reduce (the load-time check sums the shares)."""
        moe = next((m for m in self.layers if m.layer == layer), None)
        if moe is None:
            raise UserError(
                f"layer {layer} is not a MoE layer this node shards "
                f"(MoE layers: {sorted(m.layer for m in self.layers)})"
            )
        if moe.description.routed_call:
            raise UserError(
                f"layer {layer}'s MoE block is called with its routing from outside; it cannot be probed"
            )
        dtype = activation_dtype(moe.block, moe.description.bank_attr)
        with ieee_float32(dtype):  # as the reference is computed: the check holds float32 to 1e-4
            y = moe.partial(mx.array(x)[None].astype(dtype))
            return np.array(y[0].astype(mx.float32))


# ---------------------------------------------------------------------------------------------
# Loading


def load_shard(
    model_spec: str | Checkpoint | ModelDescription,
    placement: Placement | None,
    rank: int,
    *,
    keepalive: str = "lru",
    collective: Collective | None = None,
    warm_up: bool = True,
    progress: Callable[[int, int, str], None] | None = None,
    expert_cache: ExpertCacheSpec | str | None = None,
    cache_budget_bytes: int | None = None,
    cache_reserve_bytes: int = DEFAULT_KV_RESERVE + DEFAULT_PROMPT_CACHE,
    profile: dict[int, tuple[Sequence[float], int]] | None = None,
    prefetch: int | None = None,
    route: str | None = None,
) -> ShardedModel:
    """Load this rank's shard. `placement=None` means an even split over `collective.world_size`.
    `model_spec` is a checkpoint folder, an open Checkpoint (a node's cached shard, node/cache.py)
    or its description (node/describe.py).

    Args:
        progress: called as progress(bytes_loaded, bytes_total, phase) while reading.
        expert_cache: off, auto, a size or a percent of this node's experts to keep resident; the
            rest are read from `model_spec`'s files on a miss (node/moe/expert_cache.py).
        cache_budget_bytes: what `auto` may spend on resident experts (the coordinator's budget).
            On Metal `auto` also stays within the GPU's recommended working set less the replicated
            weights and `cache_reserve_bytes` (the KV and prompt caches): proto.expert_cache.auto_budget.
        profile: {MoE layer: (selections per expert, tokens)} from a routing profile: the hottest
            start resident, and those selected by most tokens are pinned.
        prefetch: with a cache and a profile, the next MoE layer's hottest non-resident experts
            are read when a layer begins; None (auto): those selected by at least half of the
            profile's tokens (at most top-k); N: the N hottest; 0: off.
        route: how decode steps compute the routed experts (route.py): skip, device or host
            (forced where a layer can take it), measure (time each on one layer, keep the fastest),
            preferred (each layer's first); None: measure.
    """
    how = decode_route.requested(route)  # a bad value fails before anything is read
    collective = collective or LocalCollective()
    t_start = time.perf_counter()
    mx.reset_peak_memory()
    if isinstance(model_spec, ModelDescription):
        desc = model_spec
        check_runnable(desc.config, desc.where)
    else:
        # a node reads a folder: only the coordinator downloads a repo
        ckpt = (
            model_spec
            if isinstance(model_spec, Checkpoint)
            else Checkpoint.open(model_spec, download=False)
        )
        check_runnable(ckpt.config, ckpt.path / "config.json")  # before a block is probed
        desc = describe(ckpt)
    ckpt, config = desc.checkpoint, desc.config
    desc.require_moe()
    if desc.quant is not None:
        desc.quant.require_applied()
    model, blocks = desc.new_model()  # parameters are lazy: nothing is allocated yet
    moe_layers = {b.layer: b.num_experts for b in blocks}
    world = collective.world_size
    placement = placement or Placement.even(moe_layers, world)
    if placement.world_size != world:
        raise ShardError(
            f"placement is for {placement.world_size} nodes but the cluster has {world}"
        )
    placement.check(moe_layers)
    if not 0 <= rank < world:
        raise ShardError(f"rank {rank} is out of range 0..{world - 1}")
    NodeConfig(rank, world, keepalive)  # a bad keepalive is named before a bad expert_cache
    spec = (
        expert_cache
        if isinstance(expert_cache, ExpertCacheSpec)
        else ExpertCacheSpec.parse(expert_cache)
    )
    state = ShardState(rank, world, keepalive, str(spec) if spec.active else "off")
    combine = combine_for(collective, state.timers)  # every MoE layer's hand-over, one for all
    capacity: dict[int, int] = {}
    if spec.active:
        sizes = desc.sizes()
        budget = cache_budget_bytes
        if spec.mode == "auto":
            budget = auto_budget(
                sizes.replicated,
                cache_reserve_bytes,
                metal=metal_info(),
                given_bytes=cache_budget_bytes,
            )
        capacity = spec.capacities(
            {b.layer: len(placement.layers[b.layer][rank]) for b in blocks},
            sizes.per_expert,
            budget,
        )

    # 1. Replicated weights, through the family's own sanitize. Expert tensors (and shared experts
    #    another node owns) enter it as lazy placeholders, never evaluated, never read from disk,
    #    so sanitize sees the checkpoint it expects.
    bank_prefixes = tuple(b.bank_path + "." for b in blocks)
    owner = {b.layer: owns_dense_terms(b.layer, rank, world) for b in blocks}
    skipped = bank_prefixes + tuple(
        p + "." for b in blocks if not owner[b.layer] for p in b.dense_paths()
    )
    expert_keys = desc.expert_keys()
    to_read = {k for k in ckpt.tensors if k not in expert_keys and not k.startswith(skipped)}
    total = sum(ckpt.tensors[k].nbytes for k in to_read) + sum(
        m.local_bytes(placement.layers[m.layer][rank], ckpt.tensors) for m in desc.moe
    )
    report = progress or (lambda done, total, phase: None)
    done = 0
    weights = {}
    for key, info in ckpt.tensors.items():
        if key in to_read:
            weights[key] = read_tensor(info)
            done += info.nbytes
            report(done, total, "replicated")
        else:
            weights[key] = mx.zeros(info.shape, info.mx_dtype)
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    weights = {k: v for k, v in weights.items() if not k.startswith(skipped)}
    replicated_bytes = sum(v.nbytes for v in weights.values())

    # 2. Expert shards, by byte range; each block goes into its ClusterMoE (the block keeps its
    #    place in the model until the weights are loaded, so parameter paths stay the checkpoint's).
    resident_experts = 0
    layers: list[ClusterMoE] = []
    for b in blocks:
        shard = make_shard(
            desc,
            b,
            placement.layers[b.layer][rank],
            placement.holders(b.layer, b.num_experts),
            state,
            capacity.get(b.layer),
            (profile or {}).get(b.layer),
        )
        resident_experts += shard.resident_bytes()
        report(min(done + resident_experts, total), total, "experts")
        layers.append(ClusterMoE(b, shard, combine, owner[b.layer]))
    _wire_prefetch(blocks, [layer.shard for layer in layers], profile, prefetch)

    # 3. Quantize and load the replicated part, then check that nothing is missing or left over.
    quantize_replicated(model, desc.quant, weights, bank_prefixes)
    model.eval()
    params = dict(tree_flatten(model.parameters()))
    shard_params = {k: v for k, v in params.items() if k.startswith(bank_prefixes)}
    missing = sorted(set(params) - set(shard_params) - set(weights))
    extra = sorted(set(weights) - set(params))
    if missing or extra:
        raise ShardError(
            f"{ckpt.path}: weights do not match the model: missing {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}, unexpected {extra[:5]}{' ...' if len(extra) > 5 else ''}"
        )
    model.load_weights(list(weights.items()) + list(shard_params.items()), strict=True)
    # a shard may re-lay its weights below (choose_slices): no reference to the old ones stays here
    del weights, params, shard_params
    mx.eval(model.parameters())
    for b, layer in zip(blocks, layers):
        install(model, b.path, layer)

    resident = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    if warm_up and (on_metal() or on_cuda()):
        # Metal's driver pages out buffers that sit idle; touch every local expert once, then wire
        # the resident set (paper §3.2, Algorithm 2's warm-up). On CUDA MLX's buffers are managed
        # memory that the loader wrote from the host: the device's first read of each page
        # migrates it, and a route timed on unread experts measures that migration (8 ms a MoE
        # layer of the DeepSeek-V3 shape where the warm read takes 0.6 ms), and so would the
        # first requests.
        report(total, total, "warmup")
        for layer in layers:
            layer.shard.warm_up()
    elif warm_up:
        logger.info("expert warm-up: on the CPU, nothing to do")
    if skip_gemv.available():
        why = {layer.shard.enable_skip_gemv() for layer in layers}
        logger.info(
            "decode at N > 1: %s",
            "a skip kernel in every MoE layer (reads only this node's experts)"
            if why == {None}
            else f"no skip kernel where it does not apply: {sorted(w for w in why if w)}",
        )
    shards, top_k = [layer.shard for layer in layers], [b.top_k or 1 for b in blocks]
    state.route = decode_route.choose(shards, top_k, how)
    if how == "measure":  # a forced route (a benchmark, a test) pins the weights' layout too
        state.route = decode_route.choose_slices(shards, top_k, state.route)
    logger.info("rank %d decode route: %s", rank, state.route.describe())
    if world > 1:
        # each rank chooses alone, so a cluster that stalls must show what each chose: on stderr,
        # which a bench keeps where a node's log file goes with its temporary folder
        print(
            f"moe-cluster node: rank {rank} decode route: {state.route.describe()}", file=sys.stderr
        )
    _wire(resident)
    # The loader's temporaries (byte-range reads, stacks) would stay in MLX's buffer cache: on CUDA
    # that is managed memory, and weights plus cache past the card's size page during decode.
    mx.clear_cache()
    _check_memory_limit()
    info = ShardInfo(
        rank=rank,
        experts_per_layer=placement.experts_per_layer(rank),
        resident_weight_bytes=resident,
        active_memory_bytes=int(mx.get_active_memory()),
        replicated_bytes=replicated_bytes,
        expert_bytes=resident_experts,
        load_seconds=time.perf_counter() - t_start,
        peak_memory_bytes=int(mx.get_peak_memory()),
    )
    logger.info(
        "rank %d loaded %d MoE layers, %.1f MB resident (%.1f MB experts) in %.1fs",
        rank,
        len(blocks),
        resident / 1e6,
        resident_experts / 1e6,
        info.load_seconds,
    )
    return ShardedModel(
        model, config, blocks, placement, state, info, collective, layers, str(ckpt.path)
    )


def _wire_prefetch(
    blocks: Sequence[MoEBlock],
    shards: Sequence[ExpertShard],
    profile: dict[int, tuple[Sequence[float], int]] | None,
    depth: int | None,
) -> None:
    """Each MoE layer prefetches for the next one (the last for the first: the next token's), from
    the profile's selections of the next layer's local experts, hottest first. `depth` None (auto):
    only those the profile saw selected by at least half of the tokens, at most top-k of them, so a
    read is more likely used than dropped; N: the N hottest selected at all; 0: none."""
    if depth is not None and depth < 0:
        raise ShardError(f"prefetch depth must be >= 0 (got {depth})")
    for i, shard in enumerate(shards):
        nxt, target = blocks[(i + 1) % len(blocks)], shards[(i + 1) % len(shards)]
        if target.cache is None or not profile or nxt.layer not in profile:
            continue
        counts, tokens = profile[nxt.layer]
        share = {
            j: counts[e] / tokens if tokens else 0.0 for j, e in enumerate(target.global_ids)
        }  # local j
        floor = 0.5 if depth is None else 0.0
        candidates = [
            j
            for j in sorted(share, key=lambda j: (-share[j], j))
            if share[j] > 0 and share[j] >= floor
        ]
        shard.prefetch_into(target.cache, candidates, nxt.top_k if depth is None else depth)


def set_combine(sm: ShardedModel, combine: Combine) -> None:
    """Every MoE layer hands its partial to `combine` from now on (chosen once: at load, where
    the runtime runs two micro-batches, or by a benchmark's diagnostic pass)."""
    for layer in sm.layers:
        layer.combine = combine


def set_collective(sm: ShardedModel, collective: Collective) -> None:
    """`collective` in place of the node's, with the hand-over its capabilities call for (tests
    and the op counter, which count what one transport puts in the graph)."""
    sm.collective = collective
    set_combine(sm, combine_for(collective, sm.state.timers))


@dataclass(frozen=True)
class _Seat:
    """A rank's place in an in-process cluster: its blocks are summed by `InProcessCluster`."""

    rank: int
    world_size: int
    caps = Capabilities(in_graph=True)

    def all_reduce(self, partial: mx.array, layer: int) -> mx.array:
        raise AssertionError(
            "an in-process rank's blocks are summed by InProcessCluster, not all-reduced"
        )


def load_in_process(
    model_spec: str,
    world_size: int,
    placement: Placement | None = None,
    *,
    keepalive: str = "lru",
    expert_cache: ExpertCacheSpec | str | None = None,
    profile: dict[int, tuple[Sequence[float], int]] | None = None,
    prefetch: int | None = None,
    route: str = "preferred",
) -> ShardedModel:
    """All `world_size` ranks' shards in this process, behind one model: rank 0's, with each MoE
    block replaced by every rank's share summed in rank order (`InProcessCluster`). `route`: as
    load_shard's, each layer's preferred one unless told (tests choose it, not a measurement)."""
    ranks = [
        load_shard(
            model_spec,
            placement,
            r,
            keepalive=keepalive,
            collective=_Seat(r, world_size),
            warm_up=False,
            expert_cache=expert_cache,
            profile=profile,
            prefetch=prefetch,
            route=route,
        )
        for r in range(world_size)
    ]
    first = ranks[0]
    for i, b in enumerate(first.blocks):
        install(first.model, b.path, InProcessCluster([sm.layers[i] for sm in ranks]))
    return first


def load_unsharded(model_spec: str) -> ShardedModel:
    """One node alone: stock mlx-lm's model, nothing patched (the single-node fallback runs at
    mlx-lm's own speed, with the same serving stack)."""
    from mlx_lm.utils import load_model

    t0 = time.perf_counter()
    mx.reset_peak_memory()
    ckpt = Checkpoint.open(model_spec, download=False)  # only the coordinator downloads
    check_runnable(ckpt.config, ckpt.path / "config.json")
    desc = describe(ckpt)
    model, config = load_model(ckpt.path)
    blocks = rebind(desc.blocks, model)  # described on a model of its own: these weights stay
    moe_layers = {b.layer: b.num_experts for b in blocks}
    resident = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    _wire(resident)
    experts = sum(v.nbytes for b in blocks for _, v in tree_flatten(_params(b.bank.module)))
    info = ShardInfo(
        rank=0,
        experts_per_layer=dict(moe_layers),
        resident_weight_bytes=resident,
        active_memory_bytes=int(mx.get_active_memory()),
        replicated_bytes=resident - experts,
        expert_bytes=experts,
        load_seconds=time.perf_counter() - t0,
        peak_memory_bytes=int(mx.get_peak_memory()),
    )
    return ShardedModel(
        model,
        config,
        blocks,
        Placement.even(moe_layers, 1),
        ShardState(0, 1, "none"),
        info,
        LocalCollective(),
        path=str(ckpt.path),
    )


def _params(bank) -> dict | list:
    """A bank's parameters: one module's, or a list of per-expert modules' (DBRX)."""
    return [m.parameters() for m in bank] if isinstance(bank, list) else bank.parameters()


def _check_memory_limit() -> None:
    """While its active memory is above its memory limit, MLX waits for the device after every array
    it evaluates (mlx/transforms.cpp), so a step that crosses the limit loses its pipelining. The
    CUDA allocator sets the limit at 0.8 x the card (about 68 GB of an 80 GB H100), Metal at 1.5 x
    the working set: a node loaded close to it is told so, with the numbers."""
    get = getattr(mx, "get_memory_limit", None)
    limit = int(get()) if get is not None else 0
    active = int(mx.get_active_memory())
    if limit and active > 0.9 * limit:
        logger.warning(
            "loaded, MLX holds %.1f GB, within 10%% of its memory limit (%.1f GB): past the limit MLX "
            "waits for the device after every operation and decoding slows down; give this node a "
            "smaller share (placement.memory_fraction, or its memory in cluster.yaml)",
            active / 1e9,
            limit / 1e9,
        )


def _wire(resident_bytes: int) -> None:
    """On Metal, wire the resident set so the driver does not page idle experts out (paper §3.2)."""
    if not on_metal() or not hasattr(mx, "set_wired_limit"):
        logger.info(
            "wired memory limit: not on Metal, nothing to do (%d bytes resident)", resident_bytes
        )
        return
    limit = int(metal_info().get("max_recommended_working_set_size") or 0)
    if limit and resident_bytes > limit:
        logger.warning(
            "resident weights (%.1f GB) exceed the recommended working set (%.1f GB); "
            "the GPU may page experts out",
            resident_bytes / 1e9,
            limit / 1e9,
        )
    mx.set_wired_limit(min(resident_bytes, limit) if limit else resident_bytes)
