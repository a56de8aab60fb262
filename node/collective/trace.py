"""Per-hop timestamps of the envoy transport's all-reduces (`moe-cluster bench allreduce --trace`).

Every stamp is `time.perf_counter_ns()`, which reads one system-wide clock on Linux
(CLOCK_MONOTONIC) and macOS (mach_absolute_time), so stamps of the nodes of one machine compare
directly. Tracing is chosen once, when the node starts its transport (`EnvoySpec.trace`):
untraced, each stamp point is a single test of a flag.

Each node keeps one `record` per all-reduce: when it entered the all-reduce, had its partial on
the host, began writing its frame, had written it to every peer, had every peer's partial in and
had the sum on the device, then when each rank's frame was read here (0 for its own). A peer's
frame can be read before its writer stamps the write's end (the writer may be descheduled as its
write returns), never before the write began: the wire hop starts there. `hops` joins the ranks'
records by step.
"""

from __future__ import annotations

import numpy as np

FIELDS = ("entered", "on_host", "writing", "sent", "complete", "on_device")  # the node's stamps

# (name, what it covers); the order of the table
HOPS = (
    ("node: partial to the host", "the partial evaluated and exported to numpy (to_wire)"),
    ("node: frame out", "this rank's frame made and written to every peer's socket"),
    ("wire: peer's frame in", "a peer begins writing its frame -> read here (send, wake-up, read)"),
    ("node: wait for the last partial", "own frame out -> every peer's partial in"),
    ("node: sum to the device", "every partial in -> their sum an evaluated mx.array"),
    ("late peer", "this node's frame out -> the last node's (how long every node must wait)"),
    ("after the last frame out", "the last node's frame out -> this node has the sum"),
    ("total", "all_reduce called -> it returns"),
)


def record(step: int, stamps: tuple[int, ...], arrived: list[int]) -> tuple[int, ...]:
    """One all-reduce as the node keeps it: (step, *FIELDS stamps, *arrival per rank)."""
    return (step, *stamps, *arrived)


def hops(records: dict[int, list[tuple[int, ...]]], skip: int = 0) -> dict[str, list[float]]:
    """Per hop, its durations in microseconds, pooled over ranks and steps.

    Args:
        records: rank -> that rank's `record`s, steps in order (every rank ran the same steps).
        skip: steps to leave out at the start (the warm-up).
    """
    n = len(records)
    by_step: dict[int, dict[int, tuple[int, ...]]] = {}
    for rank, rows in records.items():
        for row in rows:
            if row[0] >= skip:
                by_step.setdefault(row[0], {})[rank] = row[1:]
    out: dict[str, list[float]] = {name: [] for name, _ in HOPS}
    k = len(FIELDS)
    for ranks in by_step.values():
        if len(ranks) != n:
            continue  # a step some rank did not finish (it failed there)
        last_sent = max(r[3] for r in ranks.values())
        for rank, r in ranks.items():
            entered, on_host, _, sent, complete, on_device = r[:k]
            arrived = r[k:]

            def us(a: int, b: int) -> float:
                return (b - a) / 1e3

            _append(
                out,
                (
                    us(entered, on_host),
                    us(on_host, sent),
                    None,
                    us(sent, complete),
                    us(complete, on_device),
                    us(sent, last_sent),
                    us(last_sent, on_device),
                    us(entered, on_device),
                ),
            )
            out["wire: peer's frame in"].extend(
                us(ranks[p][2], arrived[p])  # from when p began writing
                for p in ranks
                if p != rank and p < len(arrived) and arrived[p]
            )
    return out


def _append(out: dict[str, list[float]], values) -> None:
    """Each hop's duration (None: one gathered apart) onto its list."""
    for (name, _), value in zip(HOPS, values):
        if value is not None:
            out[name].append(value)


def table(durations: dict[str, list[float]]) -> list[dict]:
    """Rows of the per-hop table: hop, what it covers, p50 and p90 (microseconds), samples."""
    rows = []
    for name, what in HOPS:
        values = durations.get(name) or []
        p50, p90 = np.percentile(values, [50, 90]) if values else (float("nan"), float("nan"))
        rows.append(
            {
                "hop": name,
                "covers": what,
                "p50_us": round(float(p50), 1),
                "p90_us": round(float(p90), 1),
                "samples": len(values),
            }
        )
    return rows
