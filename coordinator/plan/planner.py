"""The plan's computation: a model (a preset or a described checkpoint) on a hardware preset, every
(network, node count) row of Eq. 1 with E computed from the placement, and the same rows with an
expert cache (placement.expert_cache) or where the experts do not fit."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path

from ...proto.profile import RoutingProfile, parse_profile
from . import expert_cache as cache_model
from . import presets
from .calibration import Calibration
from .expected import ExpectedExperts, even_split, expected_experts, placement_for
from .link import MEASURED
from .perfmodel import (
    Estimate,
    HardwareSpec,
    ModelSpec,
    NetworkSpec,
    PlanError,
    estimate,
    requantized,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Settings:
    keepalive: str = "lru"
    replication: str = "none"
    context: int = 0
    memory_fraction: float = 0.75
    batch: int = 1
    price_per_node_usd: float | None = None
    transport: str = "envoy"


@dataclass(frozen=True)
class Plan:
    """A plan as the command reports it (render.py): its rows and what they were computed from."""

    model: ModelSpec
    hardware: HardwareSpec
    networks: tuple[NetworkSpec, ...]
    rows: tuple[Estimate, ...]
    settings: Settings
    calibration: Calibration | None
    checkpoint_bytes: int | None  # the checkpoint's size, where one was described


def load_model(
    spec: str, bits: int | None = None, group_size: int = 64
) -> tuple[ModelSpec, int | None]:
    """A preset by name, or a checkpoint folder / config.json described with mlx-lm."""
    if bits is not None and bits not in (2, 3, 4, 5, 6, 8):
        raise PlanError(f"--bits {bits}: choose 2, 3, 4, 5, 6 or 8")
    if group_size not in (32, 64, 128):
        raise PlanError(f"--group-size {group_size}: choose 32, 64 or 128")
    if spec in presets.MODELS:
        model = presets.model_preset(spec)
        return (requantized(model, bits, group_size) if bits else model), None
    from ...node.checkpoint import config_folder
    from ...node.hub import parse_repo_id

    path, name = Path(spec).expanduser(), None
    if spec == "demo" or (not path.exists() and parse_repo_id(spec) is not None):
        # a Hugging Face repo: its config and index alone, never its weights
        spec, name = str(config_folder(spec)), spec
    elif not path.exists():
        raise PlanError(
            f"--model {spec!r} is neither a preset ({', '.join(presets.MODELS)}), an existing "
            "path nor a Hugging Face repo id (org/name)"
        )
    from .describe import describe_path  # mlx and mlx-lm: only when a checkpoint is described

    return describe_path(spec, bits=bits, group_size=group_size, name=name)


def read_profile(path: str, model: ModelSpec) -> RoutingProfile:
    try:
        obj = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise PlanError(f"--profile {path}: no such file") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PlanError(f"--profile {path} is not readable JSON: {exc}") from exc
    profile = parse_profile(obj, path)
    if profile.num_experts != model.num_experts or profile.top_k != model.top_k:
        raise PlanError(
            f"--profile {path}: {profile.num_experts} experts top-{profile.top_k}, but {model.name} has "
            f"{model.num_experts} experts top-{model.top_k}"
        )
    stray = sorted(set(profile.layers) - set(model.moe_layer_ids))
    if stray:
        raise PlanError(f"--profile {path}: layers {stray} are not MoE layers of {model.name}")
    missing = len(model.moe_layer_ids) - len(profile.layers)
    if missing:
        logger.warning(
            "--profile %s covers %d of %d MoE layers; the others assume uniform routing",
            path,
            len(profile.layers),
            model.moe_layers,
        )
    return profile


def replicas_per_node(model: ModelSpec, hardware: HardwareSpec, nodes: int, s: Settings) -> int:
    """Replica slots per node for `--replication auto`: spare memory after the replicated weights,
    the KV cache and the largest even share of experts, in whole experts (every MoE layer)."""
    if s.replication != "auto" or nodes == 1:
        return 0
    own = max(len(es) for es in even_split(model.num_experts, nodes).values())
    spare = (
        hardware.memory_bytes * s.memory_fraction
        - model.replicated_bytes
        - model.kv_cache_bytes(s.context)
        - own * model.expert_bytes
    )
    if spare <= 0:
        return 0
    return min(int(spare // model.expert_bytes), model.num_experts - own)


def expected_for(
    model: ModelSpec,
    nodes: int,
    replicas: int,
    keepalive: str,
    profile: RoutingProfile | None,
    batch: int = 1,
) -> tuple[list[float], list[list[int]], str]:
    """E per MoE layer (for a step of `batch` tokens), experts held per rank per MoE layer, and how
    E was obtained."""
    uniform = placement_for(model.num_experts, nodes, replicas)
    cache: dict[tuple, ExpectedExperts] = {}
    values, slots, methods = [], [], []
    for lid in model.moe_layer_ids:
        layer = profile.layers.get(lid) if profile else None
        placement = (
            placement_for(model.num_experts, nodes, replicas, layer.counts) if layer else uniform
        )
        if layer is not None:
            ee = expected_experts(
                placement, model.num_experts, model.top_k, keepalive, layer.sets, batch
            )
        else:
            key = tuple(tuple(placement[r]) for r in sorted(placement))
            if key not in cache:
                cache[key] = expected_experts(
                    placement, model.num_experts, model.top_k, keepalive, batch=batch
                )
            ee = cache[key]
        values.append(ee.value)
        slots.append([len(placement[r]) for r in range(nodes)])
        methods.append(ee.method)
    distinct = list(dict.fromkeys(methods))
    method = distinct[0] if len(distinct) == 1 else "; ".join(distinct)
    return values, slots, method


def make_plan(
    model: ModelSpec,
    hardware: HardwareSpec,
    networks: list[NetworkSpec],
    nodes: list[int],
    settings: Settings,
    *,
    expected_override: list[float] | None = None,
    profile: RoutingProfile | None = None,
    calibration: Calibration | None = None,
) -> list[Estimate]:
    """Every (network, node count) row of the plan."""
    if expected_override is not None and len(expected_override) not in (1, len(nodes)):
        raise PlanError(
            f"--expected-experts has {len(expected_override)} values for {len(nodes)} node counts "
            f"({','.join(map(str, nodes))}); give one value or one per node count"
        )
    rows = []
    for i, n in enumerate(nodes):
        if n > model.num_experts:
            raise PlanError(
                f"--nodes {n}: more nodes than {model.name}'s {model.num_experts} experts"
            )
        replicas = replicas_per_node(model, hardware, n, settings)
        values, slots, method = expected_for(
            model, n, replicas, settings.keepalive, profile, settings.batch
        )
        per_token = (
            values
            if settings.batch == 1
            else expected_for(model, n, replicas, settings.keepalive, profile)[0]
        )
        if expected_override is not None:
            e = expected_override[0 if len(expected_override) == 1 else i]
            if e > model.num_experts:
                raise PlanError(
                    f"--expected-experts {e} exceeds {model.name}'s {model.num_experts} experts"
                )
            computed = sum(values) / len(values)
            values, method = [e], f"given by --expected-experts (computed: {computed:.3f})"
            per_token = values if settings.batch == 1 else per_token
        for net in networks:
            overheads = None
            if calibration is not None:
                apply = calibration.network in (None, net.name)
                overheads = calibration.overheads(apply_collective=apply)
                if net.name == MEASURED and calibration.link is not None:
                    # the all-reduce measured for a step of this batch, its bytes included, and
                    # the wait beyond it a bench fitted (Calibration.with_link)
                    measured = calibration.link.collective_s(settings.transport, settings.batch)
                    if measured is None:
                        raise PlanError(
                            f"the calibration's link has no {settings.transport} all-reduce "
                            "measured (bench link --transports)"
                        )
                    wait = calibration.collective_base_s or 0.0  # the nodes waiting for each other
                    overheads = replace(
                        overheads, collective_base_s=measured + wait, collective_per_node_s=0.0
                    )
            row = estimate(
                model,
                hardware,
                net,
                n,
                values,
                expert_slots=slots,
                context=settings.context,
                memory_fraction=settings.memory_fraction,
                price_per_node_usd=settings.price_per_node_usd,
                batch=settings.batch,
                token_experts_per_layer=per_token,
                transport=settings.transport,
                **({"overheads": overheads} if overheads is not None else {}),
            )
            rows.append(
                replace(
                    row,
                    extra={
                        "batch": settings.batch,
                        "tokens_per_s_per_sequence": row.tokens_per_s / settings.batch,
                        "expected_experts_method": method,
                        "replicas_per_node": replicas,
                        "experts_per_node_max": max(max(s) for s in slots),
                    },
                )
            )
    return rows


def miss_cost(
    model: ModelSpec, ssd_Bps: float, calibration: Calibration | None
) -> tuple[cache_model.MissCost, str]:
    """What one expert-cache miss costs, and where that figure comes from."""
    if calibration is not None and calibration.cache_per_miss_s is not None:
        return cache_model.MissCost(
            calibration.cache_per_miss_s, calibration.cache_per_layer_s
        ), "calibrated"
    if ssd_Bps > 0:
        return cache_model.ssd_miss_cost(_per_expert(model), ssd_Bps), f"SSD {ssd_Bps / 1e9:g} GB/s"
    raise PlanError(
        "--expert-cache needs the SSD's read bandwidth: this hardware preset has none; "
        "pass --ssd-bandwidth or a --calibration with an expert cache fit"
    )


def _per_expert(model: ModelSpec) -> float:
    return sum(model.expert_layer_bytes) / model.moe_layers  # bytes, one expert of one layer


def _cached_row(
    model: ModelSpec, r: Estimate, share: float, z: float, cost: cache_model.MissCost, source: str
) -> dict:
    """Plan row `r` with each node keeping `share` of its experts resident (plan/expert_cache.py)."""
    local = math.ceil(model.num_experts / r.nodes)  # the busiest node's experts per layer
    p = cache_model.predict(
        r.time_s, r.expected_experts * model.moe_layers, share, local, z, cost, model.moe_layers
    )
    memory = r.memory_per_node_bytes - int((1 - share) * r.expert_shard_bytes)
    return {
        "nodes": r.nodes,
        "network": r.network,
        "expert_cache": f"{share:.0%}",
        "skew": z,
        "hit_rate": p["hit_rate"],
        "misses_per_token": p["misses_per_token"],
        "disk_bytes_per_token": p["misses_per_token"] * _per_expert(model),
        "disk_s": p["disk_s"],
        "tokens_per_s": p["tokens_per_s"],
        "memory_per_node_bytes": memory,
        "fits": memory <= r.usable_memory_bytes,
        "miss_cost": source,
    }


def cache_plan(
    model: ModelSpec,
    rows: list[Estimate],
    shares: list[float],
    skews: list[float],
    ssd_Bps: float,
    calibration: Calibration | None,
    settings: Settings,
) -> list[dict]:
    """Each plan row again with each node keeping `share` of its experts resident, per routing skew:
    hit rate, bytes read from disk per token, tok/s and memory (plan/expert_cache.py)."""
    cost, source = miss_cost(model, ssd_Bps, calibration)
    return [
        _cached_row(model, r, share, z, cost, source)
        for r in rows
        for share in shares
        for z in skews
    ]


def misfit_speeds(
    model: ModelSpec,
    rows: list[Estimate],
    skews: list[float],
    ssd_Bps: float,
    calibration: Calibration | None,
) -> list[dict]:
    """Rows whose nodes cannot hold their share of the experts, as `placement.expert_cache: auto`
    serves them: each node keeps what its usable memory holds after the replicated weights and the
    KV cache (at least one expert per layer) and reads the rest from disk. The expected tok/s per
    skew (plan/expert_cache.py), or why no cache helps (the rest alone does not fit)."""
    out = []
    for r in (r for r in rows if not r.fits):
        room = r.usable_memory_bytes - (r.memory_per_node_bytes - r.expert_shard_bytes)
        local = math.ceil(model.num_experts / r.nodes)
        if room <= 0 or not r.expert_shard_bytes:
            out.append(
                {
                    "nodes": r.nodes,
                    "network": r.network,
                    "servable": False,
                    "memory_without_experts_bytes": r.memory_per_node_bytes - r.expert_shard_bytes,
                    "usable_memory_bytes": r.usable_memory_bytes,
                }
            )
            continue
        slots = max(
            1, min(local, math.floor(room / r.expert_shard_bytes * local))
        )  # as ExpertCacheSpec sizes them
        share = slots / local
        try:
            cost, source = miss_cost(model, ssd_Bps, calibration)
        except PlanError:
            cost, source = (
                None,
                "unknown: this hardware preset has no SSD bandwidth (--ssd-bandwidth)",
            )
        for z in skews:
            row = {
                "nodes": r.nodes,
                "network": r.network,
                "servable": True,
                "resident_share": share,
                "resident_experts": slots,
                "local_experts": local,
                "skew": z,
                "full_tokens_per_s": r.tokens_per_s,
                "miss_cost": source,
                "memory_per_node_bytes": r.memory_per_node_bytes,
                "usable_memory_bytes": r.usable_memory_bytes,
            }
            if cost is not None:
                cached = _cached_row(model, r, share, z, cost, source)
                row.update(
                    {k: cached[k] for k in ("hit_rate", "disk_bytes_per_token", "tokens_per_s")}
                )
            out.append(row)
    return out
