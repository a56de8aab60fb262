"""Per-hop timestamps of the envoy's all-reduces (`moe-cluster bench allreduce --trace`).

Every stamp is `time.perf_counter_ns()`, which reads one system-wide clock on Linux
(CLOCK_MONOTONIC) and macOS (mach_absolute_time), so stamps of the node, its envoy and the peers'
envoys on one machine compare directly. Tracing is chosen once, when the node starts its envoy
(`EnvoySpec.trace`, the envoy's `--trace`): untraced, the envoy and the node skip every stamp on a
single `is None` test.

The envoy writes its stamps of a step into the link's control block (`TRACE` on, see
envoy/link.py) before it publishes the answer, so the node, which reads them after the answer
and before its next reduce, gets them without a message of their own:

- LINK: the node's REDUCE read off the link (the hand-off's end);
- SENT: this rank's frame made, just before it goes to every peer's connection;
- COMPLETE: the last partial in (own or a peer's);
- SUMMED: the sum in the result area, just before the answer;
- ARRIVED + r: peer r's frame of this step decoded (0 for this rank and for ranks past
  MAX_RANKS).
"""

from __future__ import annotations

import time

import numpy as np

TRACE = 8  # first trace word of the control block (after the control words' cache line)
LINK, SENT, COMPLETE, SUMMED, ARRIVED = range(TRACE, TRACE + 5)
MAX_RANKS = 20  # ranks whose arrival is stamped: the words end with the control block's 32nd
WORDS = ARRIVED + MAX_RANKS - TRACE  # trace words after TRACE


class EnvoyStamps:
    """The envoy's side: stamps of the pending step, written into the control block's trace words."""

    def __init__(self, words: np.ndarray, world_size: int):
        self._words = words  # uint64 view of the trace words (WORDS of them)
        self._n = min(world_size, MAX_RANKS)
        self._arrived: dict[tuple[str, int], list[int]] = {}  # (request, step) -> per-rank stamps
        self.link = self.sent = 0

    def arrived(self, request_id: str, step: int, rank: int) -> None:
        if rank < self._n:
            key = (request_id, step)
            got = self._arrived.get(key)
            if got is None:
                if (
                    len(self._arrived) > 64
                ):  # frames of steps that never finish here (a failed request)
                    self._arrived.clear()
                got = self._arrived[key] = [0] * self._n
            got[rank] = time.perf_counter_ns()

    def publish(self, request_id: str, step: int, complete: int, summed: int) -> None:
        """Write the finished step's stamps where the node reads them (before the answer)."""
        w = self._words
        w[LINK - TRACE] = self.link
        w[SENT - TRACE] = self.sent
        w[COMPLETE - TRACE] = complete
        w[SUMMED - TRACE] = summed
        got = self._arrived.pop((request_id, step), None)
        w[ARRIVED - TRACE : ARRIVED - TRACE + self._n] = got if got is not None else 0


# ---------------------------------------------------------------------------------------------
# The node's record of one traced all-reduce, and the per-hop table over many


NODE_FIELDS = ("entered", "on_host", "handed", "answered", "on_device")  # node stamps, in order
ENVOY_FIELDS = ("link", "sent", "complete", "summed")


def record(step: int, node: tuple[int, ...], envoy: np.ndarray) -> tuple[int, ...]:
    """One all-reduce as the node keeps it: (step, *node stamps, *envoy words)."""
    return (step, *node, *(int(v) for v in envoy))


# (name, what it covers); the order of the table
HOPS = (
    ("node: partial to the host", "the partial evaluated and exported to numpy (to_wire)"),
    ("node: hand-off", "the partial into shared memory"),
    ("envoy: wake-up on REDUCE", "REDUCE about to go on the link -> the envoy reads it"),
    ("envoy: frame out", "REDUCE read -> this rank's frame made"),
    (
        "wire: peer's frame in",
        "a peer's frame made -> decoded here (encode, send, wake-up, decode)",
    ),
    ("envoy: wait for the last partial", "own frame made -> the last partial in"),
    ("envoy: sum", "the last partial in -> the sum in the result area"),
    ("node: wake-up on the answer", "the sum published -> the node has the answer"),
    ("node: result to the device", "the answer -> an mx.array holding it"),
    ("late peer", "this node's REDUCE -> the last node's REDUCE (how long every envoy must wait)"),
    ("after the last REDUCE", "the last node's REDUCE -> this node has the answer"),
    ("total", "all_reduce called -> it returns"),
)


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
                by_step.setdefault(row[0], {})[rank] = row
    out: dict[str, list[float]] = {name: [] for name, _ in HOPS}
    e0 = 1 + len(NODE_FIELDS)  # index of the envoy's first word in a record
    for ranks in by_step.values():
        if len(ranks) != n:
            continue
        last_handed = max(r[3] for r in ranks.values())
        for rank, r in ranks.items():
            entered, on_host, handed, answered, on_device = r[1:e0]
            link, sent, complete, summed = r[e0 : e0 + 4]
            arrived = r[e0 + 4 :]
            if not (link and sent and complete and summed):
                continue  # a step the envoy did not stamp (it failed)
            us = lambda a, b: (b - a) / 1e3  # noqa: E731
            peer_in = [
                us(ranks[p][e0 + 1], arrived[p])
                for p in ranks
                if p != rank and p < len(arrived) and arrived[p] and ranks[p][e0 + 1]
            ]
            _append(
                out,
                HOPS,
                (
                    us(entered, on_host),
                    us(on_host, handed),
                    us(handed, link),
                    us(link, sent),
                    None,
                    us(sent, complete),
                    us(complete, summed),
                    us(summed, answered),
                    us(answered, on_device),
                    us(handed, last_handed),
                    us(last_handed, answered),
                    us(entered, on_device),
                ),
            )
            out["wire: peer's frame in"].extend(peer_in)
    return out


def _append(out: dict[str, list[float]], hops, values) -> None:
    """Each hop's duration (None: one gathered apart) onto its list."""
    for (name, _), value in zip(hops, values):
        if value is not None:
            out[name].append(value)


# Where the node reads its frames itself (envoy/exchange.py): its record is DIRECT, its stamps
# DIRECT_FIELDS, then when each rank's frame was read here
DIRECT = -1
DIRECT_FIELDS = ("entered", "on_host", "sent", "complete", "on_device")
DIRECT_HOPS = (
    ("node: partial to the host", "the partial evaluated and exported to numpy (to_wire)"),
    ("node: frame out", "this rank's frame made and written to every peer's socket"),
    ("wire: peer's frame in", "a peer's frame written -> read here (send, wake-up, read, checks)"),
    ("node: wait for the last partial", "own frame out -> every peer's partial in"),
    ("node: sum to the device", "every partial in -> their sum an evaluated mx.array"),
    ("late peer", "this node's frame out -> the last node's (how long every node must wait)"),
    ("after the last frame out", "the last node's frame out -> this node has the sum"),
    ("total", "all_reduce called -> it returns"),
)


def direct_record(step: int, node: tuple[int, ...], on_device: int, arrived: list[int]):
    """One all-reduce of a node that reads its frames itself: (DIRECT, step, stamps, arrivals)."""
    return (DIRECT, step, *node, on_device, *arrived)


def direct_hops(records: dict[int, list[tuple[int, ...]]], skip: int = 0) -> dict[str, list[float]]:
    """`hops` for `direct_record`s."""
    n = len(records)
    by_step: dict[int, dict[int, tuple[int, ...]]] = {}
    for rank, rows in records.items():
        for row in rows:
            if row[1] >= skip:
                by_step.setdefault(row[1], {})[rank] = row[2:]
    out: dict[str, list[float]] = {name: [] for name, _ in DIRECT_HOPS}
    k = len(DIRECT_FIELDS)
    for ranks in by_step.values():
        if len(ranks) != n:
            continue
        last_sent = max(r[2] for r in ranks.values())
        for rank, r in ranks.items():
            entered, on_host, sent, complete, on_device = r[:k]
            arrived = r[k:]
            us = lambda a, b: (b - a) / 1e3  # noqa: E731
            _append(
                out,
                DIRECT_HOPS,
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
                us(ranks[p][2], arrived[p]) for p in ranks if p != rank and arrived[p]
            )
    return out


def table(durations: dict[str, list[float]], hops=HOPS) -> list[dict]:
    """Rows of the per-hop table: hop, what it covers, p50 and p90 (microseconds), samples."""
    rows = []
    for name, what in hops:
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
