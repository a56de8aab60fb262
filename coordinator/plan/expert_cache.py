"""The expert cache in the performance model: hit rate against cache size and routing skew, what a
miss costs, and the fit of both to `bench decode --expert-cache` rows.

Per token on the busiest node, with a share s of its experts resident:

    t(s) = t(100%) + misses · c_miss + [s < 1] · moe_layers · c_layer
    misses = selected · (1 − h(s)),  h(s) = Σ_{i ≤ ⌈s·E_local⌉} i^−z / Σ_{i ≤ E_local} i^−z

h is the share of selections that land on the resident experts when the hottest are kept and
expert popularity follows Zipf(z) (z = 0: uniform routing, h = s). c_miss is the expert's bytes
over the disk's read bandwidth (a preset's SSD figure, or the calibrated per-miss cost); c_layer is
the fixed cost of a cached layer (the host reads the routing; the step leaves the device path).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from .calibration import CalibrationError


@dataclass(frozen=True)
class MissCost:
    per_miss_s: float  # seconds one miss costs: its read and the slot write
    per_layer_s: float = 0.0  # seconds a cached MoE layer costs per token beyond a resident one


def hit_rate(share: float, local: int, skew: float) -> float:
    """Share of a node's selections found resident, keeping its hottest ⌈share·local⌉ experts
    with Zipf(skew) popularity (0: uniform)."""
    if not 0 < share <= 1:
        raise ValueError(f"resident share must be in (0, 1] (got {share})")
    if local < 1:
        return 1.0
    c = max(1, min(local, math.ceil(share * local - 1e-9)))
    w = [(i + 1) ** -skew for i in range(local)]
    return sum(w[:c]) / sum(w)


def ssd_miss_cost(expert_bytes: float, ssd_read_Bps: float) -> MissCost:
    """What a miss costs from a disk's bandwidth alone (no calibration)."""
    if ssd_read_Bps <= 0:
        raise ValueError(f"SSD read bandwidth must be > 0 bytes/s (got {ssd_read_Bps})")
    return MissCost(per_miss_s=expert_bytes / ssd_read_Bps)


def predict(
    base_time_s: float,
    selected_per_token: float,
    share: float,
    local: int,
    skew: float,
    cost: MissCost,
    moe_layers: int,
) -> dict:
    """tok/s and its parts at `share` resident, from the time per token with every expert resident.

    Args:
        selected_per_token: experts the node computes per token, summed over its MoE layers.
        local: experts the node holds per MoE layer.
    """
    h = hit_rate(share, local, skew)
    misses = selected_per_token * (1.0 - h)
    disk = misses * cost.per_miss_s + (moe_layers * cost.per_layer_s if share < 1 else 0.0)
    t = base_time_s + disk
    return {
        "hit_rate": h,
        "misses_per_token": misses,
        "disk_s": disk,
        "time_s": t,
        "tokens_per_s": 1.0 / t,
    }


def break_even_hit_rate(
    selected_per_token: float, cost: MissCost, moe_layers: int, saved_s: float
) -> float | None:
    """The hit rate below which a node's misses cost more per token than `saved_s`, the time per
    token its share of the work saves the cluster (None: even a full hit rate costs more)."""
    fixed = moe_layers * cost.per_layer_s
    if saved_s <= fixed:
        return None
    if selected_per_token <= 0 or cost.per_miss_s <= 0:
        return 0.0
    return max(0.0, 1.0 - (saved_s - fixed) / (selected_per_token * cost.per_miss_s))


# --- calibration ------------------------------------------------------------------------------


@dataclass(frozen=True)
class CacheRow:
    """One `bench decode --expert-cache` row, per node: what the fit needs."""

    share: float  # resident slots / local experts
    local: int  # experts the node holds per MoE layer
    hit_rate: float
    selected_per_token: float
    misses_per_token: float
    time_per_token_s: float


def rows_of(bench_out: dict, nodes: int, moe_layers: int) -> list[CacheRow]:
    """The bench's expert-cache rows of `nodes` nodes."""
    out = []
    for i, r in enumerate(bench_out.get("expert_cache") or ()):
        if r.get("nodes") != nodes:
            continue
        try:
            local = r["local"] // (nodes * moe_layers)
            out.append(
                CacheRow(
                    r["capacity"] / r["local"],
                    local,
                    r["hit_rate"],
                    r["selected_per_token"],
                    r["misses_per_token"],
                    r["time_per_token_s"],
                )
            )
        except (KeyError, TypeError, ZeroDivisionError) as exc:
            raise CalibrationError(
                f"bench decode: expert_cache[{i}] is malformed ({exc})"
            ) from None
    return out


def fit_skew(rows: Sequence[CacheRow]) -> float:
    """The Zipf exponent whose hit rates best match the measured ones (least squares, 0..3)."""
    cached = [r for r in rows if r.share < 1]
    if not cached:
        return 0.0
    grid = [i / 50 for i in range(151)]
    return min(
        grid, key=lambda z: sum((hit_rate(r.share, r.local, z) - r.hit_rate) ** 2 for r in cached)
    )


def fit_cost(rows: Sequence[CacheRow], base_time_s: float, moe_layers: int) -> MissCost:
    """Per-miss and per-cached-layer costs by least squares on t − t(100%) = a · misses + b · layers,
    both kept ≥ 0."""
    cached = [r for r in rows if r.share < 1]
    if not cached:
        raise CalibrationError(
            "bench decode: no expert-cache row below 100%; nothing to fit the miss cost to"
        )
    xs = [(r.misses_per_token, float(moe_layers)) for r in cached]
    ys = [r.time_per_token_s - base_time_s for r in cached]
    sxx = sum(a * a for a, _ in xs)
    sxl = sum(a * l for a, l in xs)
    sll = sum(l * l for _, l in xs)
    sxy = sum(a * y for (a, _), y in zip(xs, ys))
    sly = sum(l * y for (_, l), y in zip(xs, ys))
    det = sxx * sll - sxl * sxl
    if det > 1e-12 * max(sxx * sll, 1e-30):
        a = (sxy * sll - sly * sxl) / det
        b = (sxx * sly - sxl * sxy) / det
        if a >= 0 and b >= 0:
            return MissCost(a, b)
    # one of the two does not separate (or came out negative): fit each alone, keep the better
    only_miss = MissCost(max(sxy / sxx, 0.0) if sxx else 0.0)
    only_layer = MissCost(0.0, max(sly / sll, 0.0))

    def sse(c: MissCost) -> float:
        return sum((a * c.per_miss_s + l * c.per_layer_s - y) ** 2 for (a, l), y in zip(xs, ys))

    return min((only_miss, only_layer), key=sse)


def calibrate(bench_out: dict, nodes: int, moe_layers: int) -> dict | None:
    """Fit skew and miss cost to the bench's rows of `nodes` nodes and predict each row back:
    {per_miss_s, per_layer_s, skew, points: [{expert_cache, profile, measured_tps, predicted_tps,
    error}], max_abs_error}; None without rows below 100%."""
    raw = [r for r in bench_out.get("expert_cache") or () if r.get("nodes") == nodes]
    rows = rows_of(bench_out, nodes, moe_layers)
    full = [r for r in rows if r.share >= 1]
    if not full or not any(r.share < 1 for r in rows):
        return None
    base = sum(r.time_per_token_s for r in full) / len(full)
    cost = fit_cost(rows, base, moe_layers)
    skew = fit_skew(rows)
    selected = sum(r.selected_per_token for r in rows) / len(rows)
    points = []
    for meta, r in zip(raw, rows):
        p = predict(base, selected, r.share, r.local, skew, cost, moe_layers)
        points.append(
            {
                "expert_cache": meta["expert_cache"],
                "profile": meta["profile"],
                "measured_tps": 1.0 / r.time_per_token_s,
                "predicted_tps": p["tokens_per_s"],
                "measured_hit_rate": r.hit_rate,
                "predicted_hit_rate": p["hit_rate"],
                "error": p["tokens_per_s"] * r.time_per_token_s - 1.0,
            }
        )
    return {
        "nodes": nodes,
        "per_miss_s": cost.per_miss_s,
        "per_layer_s": cost.per_layer_s,
        "skew": skew,
        "full_time_per_token_s": base,
        "selected_per_token": selected,
        "points": points,
        "max_abs_error": max(abs(p["error"]) for p in points),
    }
