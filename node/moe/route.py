"""Each node's decode route, chosen once at load by timing it on the node's own hardware.

A node computes a decode step's routed experts one of three ways (experts.py ROUTES): a skip kernel
that reads only its own experts (CUDA), redirected rows (one expert read per position: k per node
per layer, what one device reads alone), or a host read of the routing (only the selected experts,
for one host sync per layer). Which is fastest depends on the chip, the expert size, the weight
format and the sync's cost, none of which can be known ahead: so at load the node times one MoE
layer of its own shard on each route it has (a one-token decode input, k experts drawn from the
router's count, a few repetitions) and keeps the fastest for every layer. Wide calls (a prompt, a
batch of many streams) may go another way: where the fastest is a device route, the node times it
against the host read on batches of HANDOFF_TOKENS rows and hands calls from the first size where
the host read wins to it (`host_from` positions; past twice the widest size where it never wins).
A GPU pays a host sync per layer dearly and a CPU the rows another node computes, so the
crossover is measured too.
cluster.yaml's `route: skip|device|host` forces one (benchmarks); `measure` (the default) times.

At N > 1, where the route is measured, the node then times the same layer's decode call of a small
batch with the down projection (fc2) stored whole and in SLICES slices of its input dimension
(choose_slices), and keeps the slices where they take at most SLICE_GAIN of the whole weight's
time; a forced route keeps the weights whole, as a benchmark or a test that pins the path needs.
On a 2-vCPU EPYC through OpenBLAS, a float32 down projection of 192 inputs multiplied in two slices
of 96 took a MoE layer of 16 streams from 4.7 to 4.1 ms (the same bytes read; a tensor-parallel
rank's half-width experts have that shape for free); elsewhere the timing may find nothing and the
weights stay as they are.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import mlx.core as mx
import numpy as np

from ...proto.errors import UserError
from .experts import ROUTES, ExpertShard
from .kernels import SORTED_FROM

logger = logging.getLogger(__name__)

# How a loader picks: a route by name (forced), "measure", or "preferred" (each layer's first route,
# nothing timed: in-process clusters in tests, where the route is a parameter of the test)
CHOICES = ROUTES + ("measure", "preferred")
# timed calls per route, after an untimed pass over the same draws (compilation, and the first
# touch of every expert they read: a route timed first must not pay for the ones timed after it);
# the median counts
REPEATS = 7
HANDOFF_TOKENS = (8, 32, 128, 512)  # batch rows at which a device route is timed against the host
HANDOFF_REPEATS = 3
# The down projection's slices (ExpertShard.slice_inputs): two, as four measured no faster in decode
# and 7% slower on a prompt; timed at SLICE_TOKENS tokens (a batch of streams), whole and sliced in
# turn SLICE_ROUNDS times (medians), kept when they take at most SLICE_GAIN of the whole's time
SLICES = 2
SLICE_TOKENS = 16
SLICE_ROUNDS = 5
SLICE_GAIN = 0.95
# Layers whose down projection holds fewer bytes an expert than this are not timed and stay whole:
# such a matrix sits in a core's L2 either way, so the slices have no memory traffic to save; on the
# EPYC they took 1.12-4.2x the whole matrix's time at 40-192 KiB an expert (0.78x at 384 KiB), and
# the timing took most of a small model's load (the demo model's at N = 2: 0.22 s, 0.06 without)
SLICE_FROM_BYTES = 256 * 1024


@dataclass(frozen=True)
class RouteChoice:
    """What a node chose: the route most of its layers take, how, and the times measured (µs per
    call of one MoE layer, by route; empty where nothing was timed)."""

    route: str
    how: str  # measured | forced | preferred | only (one route to take)
    times_us: dict[str, float] = field(default_factory=dict)
    layer: int | None = None  # the MoE layer timed
    # positions from which a device route's call takes the host read (None: no host read to hand
    # to), and the times that set it: {batch rows: {route: µs}}
    host_from: int | None = None
    handoff_us: dict[int, dict[str, float]] = field(default_factory=dict)
    # the down projection's slices (choose_slices), and the times that chose them: {slices: µs}
    slices: int = 1
    slices_us: dict[int, float] = field(default_factory=dict)

    def describe(self) -> str:
        times = ", ".join(f"{r} {t:.1f} µs" for r, t in self.times_us.items())
        where = f" (one MoE layer {self.layer}: {times})" if self.times_us else ""
        return f"{self.route}, {self.how}{where}{self.handoff()}{self.sliced()}"

    def sliced(self) -> str:
        """The down projection's slices, as a clause of describe() ("" where none was timed)."""
        if not self.slices_us:
            return ""
        at = " / ".join(f"{n}: {us:.0f}" for n, us in self.slices_us.items())
        kept = f"in {self.slices} slices" if self.slices > 1 else "whole"
        return f"; the down projection {kept} (µs at {SLICE_TOKENS} tokens by slices, {at})"

    def handoff(self) -> str:
        """Where wide calls go, as a clause of describe() ("" where none goes to the host read)."""
        if self.host_from is None:
            return ""
        at = ", ".join(
            f"{t} rows: " + " / ".join(f"{r} {us:.0f}" for r, us in by.items())
            for t, by in self.handoff_us.items()
        )
        timed = f" (µs at {at})" if at else ""
        return f"; the host read from {self.host_from} positions{timed}"


def requested(route: str | None) -> str:
    """The loader's `route` argument (None: measure), checked."""
    route = route or "measure"
    if route not in CHOICES:
        raise UserError(f"route must be one of {', '.join(CHOICES)} (got {route!r})")
    return route


TimeRoute = Callable[[ExpertShard, str, int, int], float]


def time_route(shard: ExpertShard, route: str, top_k: int, tokens: int = 1) -> float:
    """Seconds one decode call (`tokens` rows, each `top_k` experts drawn at random from the
    router's count) of `shard` takes on `route`: the median of the timed calls (REPEATS for one
    row, HANDOFF_REPEATS for a batch) after an untimed pass over the same draws, the same draws
    for every route. The shard is as it was afterwards (ExpertShard.trying)."""
    repeats = REPEATS if tokens == 1 else HANDOFF_REPEATS
    x, draws = shard.decode_sample(top_k, repeats, tokens=tokens)
    times = []
    with shard.trying(route):
        for inds in draws:
            mx.eval(shard(x, inds))
        for inds in draws:
            t0 = time.perf_counter()
            mx.eval(shard(x, inds))
            times.append(time.perf_counter() - t0)
    return float(np.median(times))


def choose(
    shards: Sequence[ExpertShard],
    top_k: Sequence[int],
    how: str = "measure",
    timer: TimeRoute | None = None,
    source: str = "cluster.yaml's route",
    handoff: tuple[int, dict[int, dict[str, float]]] | None = None,
) -> RouteChoice:
    """Set every shard's route (`how`: a route, forced where a layer can take it; measure; or
    preferred) and say what was chosen. A forced route no layer can take is an error (`source`
    says where it was asked for). `timer`:
    seconds per call of a shard on a route (time_route). The timing calls count nothing: the
    node's counters are reset after them. `handoff`: a forced route's (host_from, times) kept from
    an earlier choice instead of timed again (routes compared in turn under one hand-off)."""
    timer = timer or time_route
    if not shards:
        return RouteChoice("host", "only")
    if how in ROUTES:
        able = [j for j, s in enumerate(shards) if how in s.routes()]
        if not able:
            raise UserError(
                f"route {how} ({source}): no MoE layer of this node can take "
                f"it here (they can take: {', '.join(sorted({r for s in shards for r in s.routes()}))})"
            )
        # forcing names the route of decode steps; where wide calls (a prompt, a wide batch) go
        # is still measured, as for a chosen route: a fixed SORTED_FROM sends 8 streams of a top-8
        # model (64 positions) to one host sync per MoE layer, however fast the forced route is
        i = able[_most_routes([shards[j] for j in able])]
        host_from, handoff_us = handoff or (SORTED_FROM, {})
        if handoff is None and how != "host" and "host" in shards[i].routes():
            host_from, handoff_us = _crossover(shards[i], how, top_k[i], timer)
            shards[i].telemetry.reset_counters()
        for j in able:
            shards[j].set_route(how, host_from)
        return RouteChoice(how, "forced", host_from=shards[i].host_from, handoff_us=handoff_us)
    i = _most_routes(shards)
    timed = shards[i]
    routes = timed.routes()
    times, handoff, host_from = {}, {}, SORTED_FROM
    if how == "measure" and len(routes) > 1:
        times = {r: timer(timed, r, top_k[i], 1) for r in routes}
        first = min(times, key=times.get)
        if first != "host" and "host" in routes:
            host_from, handoff = _crossover(timed, first, top_k[i], timer)
        timed.telemetry.reset_counters()
    order = sorted(times, key=times.get) or list(routes)
    for s in shards:
        s.set_route(next((r for r in order if r in s.routes()), s.routes()[0]), host_from)
    kind = "measured" if times else ("only" if len(routes) == 1 else "preferred")
    return RouteChoice(
        order[0],
        kind,
        {r: round(t * 1e6, 1) for r, t in times.items()},
        timed.layer if times else None,
        timed.host_from,
        handoff,
    )


def choose_slices(
    shards: Sequence[ExpertShard],
    top_k: Sequence[int],
    choice: RouteChoice,
    timer: TimeRoute | None = None,
) -> RouteChoice:
    """Store every shard's down projection in SLICES slices of its input dimension where that
    measured faster on one layer's decode call (SLICE_TOKENS tokens, whole and sliced in turn), and
    say so in the choice returned; shards that cannot be sliced (ExpertShard.slice_inputs) stay
    whole, and nothing is timed where none can or where the experts are too small to gain
    (SLICE_FROM_BYTES)."""
    timer = timer or time_route
    big = (j for j, s in enumerate(shards) if _expert_bytes(s) >= SLICE_FROM_BYTES)
    i = next((j for j in big if shards[j].slice_inputs(SLICES)), None)
    if i is None:
        return choice
    timed = shards[i]
    times: dict[int, list[float]] = {1: [], SLICES: []}
    for _ in range(SLICE_ROUNDS):
        for n in (1, SLICES):
            timed.slice_inputs(n)
            times[n].append(timer(timed, timed.route, top_k[i], SLICE_TOKENS))
    timed.telemetry.reset_counters()
    median = {n: float(np.median(t)) for n, t in times.items()}
    keep = SLICES if median[SLICES] <= SLICE_GAIN * median[1] else 1
    for s in shards:
        s.slice_inputs(keep)
    return replace(choice, slices=keep, slices_us={n: round(t * 1e6, 1) for n, t in median.items()})


def _most_routes(shards: Sequence[ExpertShard]) -> int:
    """The index of the first shard with the most routes: the one timed."""
    return max(range(len(shards)), key=lambda j: (len(shards[j].routes()), -j))


def _crossover(
    shard: ExpertShard, route: str, top_k: int, timer: TimeRoute
) -> tuple[int, dict[int, dict[str, float]]]:
    """(positions from which the host read beats `route`; the times, µs by batch rows): the first
    of HANDOFF_TOKENS where it does, the sizes above it not timed. Where it never does, calls past
    twice the widest size timed still go to it: nothing measured says the device route wins
    there, and a skip kernel's launch has a bound on its positions (65,535 on CUDA)."""
    times: dict[int, dict[str, float]] = {}
    for tokens in HANDOFF_TOKENS:
        t = {r: timer(shard, r, top_k, tokens) for r in (route, "host")}
        times[tokens] = {r: round(s * 1e6, 1) for r, s in t.items()}
        if t["host"] < t[route]:
            return tokens * top_k, times
    return 2 * HANDOFF_TOKENS[-1] * top_k, times


def _expert_bytes(shard: ExpertShard) -> int:
    """Bytes of one expert's down projection (0 where the shard holds none)."""
    w = shard.mlp.last.weight
    experts = w.shape[0] // shard.mlp.last.slices if w.ndim == 3 else 0
    return w.nbytes // experts if experts else 0
