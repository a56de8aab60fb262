"""Placement planning: which experts each node holds, from memory budgets and a routing profile.

Pure functions. Each node's budget is its memory × fraction − the replicated weights − the KV
reserve; experts are split in proportion to the budgets. With a routing profile the hot experts
are spread so every node expects the same load, and the hottest are copied to every node while
spare memory allows (proto.placement.copy_everywhere); `node.routing.assign` then decides,
identically on every node, which copy computes a selection.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping, Sequence

from ...proto.expert_cache import ExpertCacheSpec
from ...proto.placement import Placement, PlacementError, copy_everywhere, even_counts
from ...proto.records import fmt_bytes

if TYPE_CHECKING:
    from ...node.describe import ModelDescription

__all__ = [
    "ModelFootprint",
    "footprint",
    "NodeBudget",
    "PlacementPlan",
    "PlacementError",
    "plan_placement",
    "proportional_counts",
]


@dataclass(frozen=True)
class NodeBudget:
    name: str
    memory_bytes: int  # what the node has for the model (unified memory)


@dataclass(frozen=True)
class ModelFootprint:
    """Bytes a node needs: replicated weights, and one expert of each MoE layer."""

    replicated_bytes: int
    expert_bytes: Mapping[int, int]  # MoE layer -> bytes of one routed expert
    num_experts: Mapping[int, int]  # MoE layer -> routed experts
    top_k: Mapping[int, int] = field(
        default_factory=dict
    )  # MoE layer -> experts each token selects

    @property
    def expert_set_bytes(self) -> int:
        """One expert in every MoE layer (what one more expert per layer costs a node)."""
        return sum(self.expert_bytes.values())


@dataclass(frozen=True)
class PlacementPlan:
    placement: Placement
    budgets: tuple[int, ...]  # bytes available for experts, per rank
    used: tuple[int, ...]  # bytes the plan puts on each rank (replicated + experts + KV reserve)
    available: tuple[int, ...]  # memory × fraction, per rank
    replicas: tuple[int, ...] = ()  # extra expert copies per rank (per layer)
    notes: tuple[str, ...] = field(default_factory=tuple)
    # per rank, what its node keeps resident (proto.expert_cache): "off" where everything fits
    expert_cache: tuple[str, ...] = ()


# The internal SSDs of the Macs in plan/presets.py read 4-6 GB/s (a node short of memory reads its
# misses from there): the range a disk-bound ceiling is stated for.
SSD_READ_BPS = (4e9, 6e9)


@dataclass(frozen=True)
class DiskReads:
    """What a node with an expert cache reads from disk per decoded token (batch 1)."""

    misses: float  # expert reads per token, over its MoE layers
    bytes: float
    hit_rate: float  # of its selections
    profiled: bool  # from the routing profile (its hottest experts pinned), else uniform routing


def disk_reads(
    model: ModelFootprint,
    held: Mapping[int, Sequence[int]],
    slots: Mapping[int, int],
    profile_counts: Mapping[int, Sequence[float]] | None = None,
) -> DiskReads:
    """Expected misses per token of a node holding `held` experts per MoE layer and keeping `slots`
    of them resident (`ExpertCacheSpec.capacities`, the node's own sizing). Each token selects top_k
    of E experts per layer; under uniform routing k·|held|/E of them land on the node and slots/|held|
    of those are resident; with a profile, the node pins its hottest experts and a selection lands
    on expert e in proportion to e's count."""
    misses = nbytes = selected = 0.0
    profiled = bool(profile_counts)
    for l, ids in held.items():
        k, E = model.top_k.get(l, 0), model.num_experts[l]
        if not k or not ids:
            continue
        keep = slots[l]
        load = list(profile_counts.get(l, ())) if profile_counts else []
        if load and sum(load):
            mine = sorted((load[e] for e in ids), reverse=True)
            sel = k * sum(mine) / sum(load)
            miss = sel * (1 - sum(mine[:keep]) / sum(mine)) if sum(mine) else 0.0
        else:
            sel = k * len(ids) / E
            miss = sel * (1 - keep / len(ids))
        selected += sel
        misses += miss
        nbytes += miss * model.expert_bytes[l]
    return DiskReads(misses, nbytes, 1 - misses / selected if selected else 1.0, profiled)


def proportional_counts(total: int, weights: Sequence[float], caps: Sequence[int]) -> list[int]:
    """Split `total` items in proportion to `weights` (largest remainder), never above `caps`."""
    n = len(weights)
    if sum(caps) < total:
        raise PlacementError(f"cannot place {total} experts in capacities {list(caps)}")
    wsum = sum(weights) or 1.0
    raw = [total * w / wsum for w in weights]
    counts = [min(int(x), c) for x, c in zip(raw, caps)]
    order = sorted(range(n), key=lambda i: (-(raw[i] - int(raw[i])), i))
    i = 0
    while sum(counts) < total:
        r = order[i % n]
        if counts[r] < caps[r]:
            counts[r] += 1
        i += 1
        if i > 10 * n * (total + 1):  # unreachable given sum(caps) >= total
            raise PlacementError("proportional split did not converge")
    return counts


def _assign_ids(
    num_experts: int, counts: Sequence[int], load: Sequence[float] | None
) -> dict[int, list[int]]:
    """Which expert ids each rank holds, `counts[r]` of them.

    Without a profile: contiguous blocks. With expected loads: hottest first, each to the rank
    with the least expected load among those with room (ties to the lower rank).
    """
    if load is None:
        out, start = {}, 0
        for r, c in enumerate(counts):
            out[r] = list(range(start, start + c))
            start += c
        return out
    out = {r: [] for r in range(len(counts))}
    total = [0.0] * len(counts)
    for e in sorted(range(num_experts), key=lambda e: (-load[e], e)):
        room = [r for r in out if len(out[r]) < counts[r]]
        r = min(room, key=lambda r: (total[r] / max(counts[r], 1), total[r], r))
        out[r].append(e)
        total[r] += load[e]
    return {r: sorted(es) for r, es in out.items()}


def plan_placement(
    model: ModelFootprint,
    nodes: Sequence[NodeBudget],
    *,
    strategy: str = "memory",
    memory_fraction: float = 0.75,
    kv_reserve: int = 0,
    profile_counts: Mapping[int, Sequence[float]] | None = None,
    replicate: bool = True,
    expert_cache: Sequence[ExpertCacheSpec] | None = None,
) -> PlacementPlan:
    """Plan which experts each node holds.

    Args:
        strategy: "even" (same count per node), "memory" (in proportion to budgets) or "profile"
            (proportional counts, experts spread by expected load, hottest copied to every node
            while spare room allows).
        profile_counts: MoE layer -> selection count per expert, from `moe-cluster profile`.
        expert_cache: per node: with a cache, a node may hold more experts than its memory fits
            (the rest are read from disk on a miss); without, such a plan is refused.
    """
    if strategy not in ("even", "memory", "profile"):
        raise PlacementError(f"unknown placement strategy {strategy!r} (even, memory, profile)")
    if strategy == "profile" and not profile_counts:
        raise PlacementError("placement strategy 'profile' needs a routing profile")
    n = len(nodes)
    if n < 1:
        raise PlacementError("no nodes to place experts on")
    available = [int(node.memory_bytes * memory_fraction) for node in nodes]
    budgets = [a - model.replicated_bytes - kv_reserve for a in available]
    per_set = model.expert_set_bytes
    layers = sorted(model.num_experts)
    E = {l: model.num_experts[l] for l in layers}
    emax = max(E.values())
    caching = [c.active for c in expert_cache] if expert_cache else [False] * n
    if len(caching) != n:
        raise PlacementError(f"expert_cache has {len(caching)} entries for {n} nodes")
    # a node with a cache holds any number of experts (room permitting for the replicated weights)
    caps = [
        emax if cache and b > 0 else (max(b, 0) // per_set if per_set else emax)
        for b, cache in zip(budgets, caching)
    ]
    if strategy == "even":
        weights = [1.0] * n
    else:
        weights = [max(b, 0) for b in budgets]

    def refuse(counts_hint: Sequence[int]) -> PlacementError:
        parts = []
        for i, node in enumerate(nodes):
            need = model.replicated_bytes + kv_reserve + counts_hint[i] * per_set
            parts.append(f"{node.name} needs {fmt_bytes(need)}, has {fmt_bytes(available[i])}")
        return PlacementError(
            "the model does not fit: "
            + "; ".join(parts)
            + f" (memory fraction {memory_fraction}, KV reserve {fmt_bytes(kv_reserve)})"
        )

    counts_by_layer: dict[int, list[int]] = {}
    for l in layers:
        share = [E[l] * w / (sum(weights) or 1) for w in weights]
        hint = [max(1, round(s)) if E[l] >= n else 1 for s in share]
        if strategy == "even":
            counts = even_counts(E[l], n)
            if any(c > cap for c, cap in zip(counts, caps)):
                raise refuse(counts)
        else:
            if sum(caps) < E[l] or any(b <= 0 for b in budgets):
                raise refuse(hint)
            counts = proportional_counts(E[l], weights, caps)
        counts_by_layer[l] = counts

    layers_out: dict[int, dict[int, tuple[int, ...]]] = {}
    replicas = [0] * n
    notes = []
    for l in layers:
        counts = counts_by_layer[l]
        load = list(profile_counts[l]) if profile_counts and l in profile_counts else None
        if load is not None and len(load) != E[l]:
            raise PlacementError(f"profile layer {l} has {len(load)} experts, the model has {E[l]}")
        held = _assign_ids(E[l], counts, load if strategy == "profile" else None)
        if strategy == "profile" and replicate and load is not None:
            free = [min(caps[r] - counts[r], E[l] - counts[r]) for r in range(n)]
            held = copy_everywhere(held, free, sorted(range(E[l]), key=lambda e: (-load[e], e)))
            for r in range(n):
                replicas[r] = max(replicas[r], len(held[r]) - counts[r])
        layers_out[l] = {r: tuple(held[r]) for r in range(n)}
    placement = Placement(n, layers_out)
    placement.check(dict(E))
    used = []
    for r in range(n):
        experts_bytes = sum(len(layers_out[l][r]) * model.expert_bytes[l] for l in layers)
        used.append(model.replicated_bytes + kv_reserve + experts_bytes)
    if any(replicas):
        notes.append(f"replicated hot experts: {replicas} extra per layer per node")
    caches = []
    for r in range(n):
        held = used[r] - model.replicated_bytes - kv_reserve
        spec = expert_cache[r] if expert_cache else ExpertCacheSpec()
        if not spec.active or (spec.mode == "auto" and held <= budgets[r]):
            caches.append("off")
            continue
        resident = {"auto": budgets[r], "bytes": spec.value, "fraction": held * spec.value}[
            spec.mode
        ]
        caches.append(str(ExpertCacheSpec("bytes", resident)) if spec.mode == "auto" else str(spec))
        if resident < held:
            used[r] -= int(held - resident)
            mine = {l: layers_out[l][r] for l in layers}
            slots = ExpertCacheSpec.parse(caches[-1]).capacities(
                {l: len(ids) for l, ids in mine.items()}, model.expert_bytes
            )
            disk = disk_reads(model, mine, slots, profile_counts)
            speed = (
                (
                    f"about {disk.misses:.1f} misses and {fmt_bytes(disk.bytes)} read per token "
                    f"({'the routing profile' if disk.profiled else 'uniform routing'}, hit rate "
                    f"{disk.hit_rate:.0%}), so at most {SSD_READ_BPS[0] / disk.bytes:.1f}–"
                    f"{SSD_READ_BPS[1] / disk.bytes:.1f} tok/s from a 4–6 GB/s SSD alone"
                    if disk.bytes
                    else "no reads per token expected"
                )
                if model.top_k
                else ("its speed follows its hit rate (the checkpoint's top-k is unknown here)")
            )
            notes.append(
                f"{nodes[r].name} holds {fmt_bytes(held)} of experts and keeps {fmt_bytes(resident)} "
                f"resident ({resident / held:.0%}); the rest are read from disk on a miss: {speed} "
                f"(`moe-cluster plan --model MODEL --hardware PRESET --nodes {n} --expert-cache "
                f"{resident / held:.0%}` predicts the whole step)"
            )
    return PlacementPlan(
        placement,
        tuple(budgets),
        tuple(used),
        tuple(available),
        tuple(replicas),
        tuple(notes),
        tuple(caches),
    )


def footprint(desc: ModelDescription, total_bytes: int | None = None) -> ModelFootprint:
    """What each node must hold, from the checkpoint's headers (no weights are read); described
    from a bare config, its figures scaled to `total_bytes` where known (a repo index's)."""
    b = desc.sizes(total_bytes)
    return ModelFootprint(
        replicated_bytes=b.replicated,
        expert_bytes=b.per_expert,
        num_experts=b.num_experts,
        top_k=b.top_k,
    )
