"""Each node's decode route, chosen once at load by timing it on the node's own hardware.

A node computes a decode step's routed experts one of three ways (experts.py ROUTES): a skip kernel
that reads only its own experts (CUDA), redirected rows (one expert read per position: k per node
per layer, what one device reads alone), or a host read of the routing (only the selected experts,
for one host sync per layer). Which is fastest depends on the chip, the expert size, the weight
format and the sync's cost, none of which can be known ahead: so at load the node times one MoE
layer of its own shard on each route it has (a one-token decode input, k experts drawn from the
router's count, a few repetitions) and keeps the fastest for every layer.
cluster.yaml's `route: skip|device|host` forces one (benchmarks), and where it says `measure` (the
default) `MOE_CLUSTER_ROUTE=skip|device|host` in a node's environment does.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import mlx.core as mx
import numpy as np

from ...proto.errors import UserError
from .experts import ROUTES, ExpertShard

logger = logging.getLogger(__name__)

ENV = "MOE_CLUSTER_ROUTE"
# How a loader picks: a route by name (forced), "measure", or "preferred" (each layer's first route,
# nothing timed: in-process clusters in tests, where the route is a parameter of the test)
CHOICES = ROUTES + ("measure", "preferred")
REPEATS = (
    7  # timed calls per route, after one untimed (compilation, first touch); the median counts
)


@dataclass(frozen=True)
class RouteChoice:
    """What a node chose: the route most of its layers take, how, and the times measured (µs per
    call of one MoE layer, by route; empty where nothing was timed)."""

    route: str
    how: str  # measured | forced | preferred | only (one route to take)
    times_us: dict[str, float] = field(default_factory=dict)
    layer: int | None = None  # the MoE layer timed

    def describe(self) -> str:
        times = ", ".join(f"{r} {t:.1f} µs" for r, t in self.times_us.items())
        where = f" (one MoE layer {self.layer}: {times})" if self.times_us else ""
        return f"{self.route}, {self.how}{where}"


def requested(route: str | None) -> str:
    """The loader's `route` argument, or the node's environment (MOE_CLUSTER_ROUTE), else measure."""
    source = "route"
    if route is None:
        route, source = os.environ.get(ENV, "").strip() or "measure", ENV
    if route not in CHOICES:
        raise UserError(f"{source} must be one of {', '.join(CHOICES)} (got {route!r})")
    return route


TimeRoute = Callable[[ExpertShard, str, int], float]


def time_route(shard: ExpertShard, route: str, top_k: int) -> float:
    """Seconds one decode call (one token, `top_k` experts drawn at random from the router's count)
    of `shard` takes on `route`: the median of REPEATS calls after an untimed one, the same draws
    for every route. The shard is as it was afterwards (ExpertShard.trying)."""
    x, draws = shard.decode_sample(top_k, REPEATS + 1)
    times = []
    with shard.trying(route):
        for inds in draws:
            t0 = time.perf_counter()
            mx.eval(shard(x, inds))
            times.append(time.perf_counter() - t0)
    return float(np.median(times[1:]))


def choose(
    shards: Sequence[ExpertShard],
    top_k: Sequence[int],
    how: str = "measure",
    timer: TimeRoute | None = None,
) -> RouteChoice:
    """Set every shard's route (`how`: a route, forced where a layer can take it; measure; or
    preferred) and say what was chosen. A forced route no layer can take is an error. `timer`:
    seconds per call of a shard on a route (time_route). The timing calls count nothing: the
    node's counters are reset after them."""
    timer = timer or time_route
    if not shards:
        return RouteChoice("host", "only")
    if how in ROUTES:
        able = [s for s in shards if how in s.routes()]
        if not able:
            raise UserError(
                f"route {how} (cluster.yaml's route or {ENV}): no MoE layer of this node can take "
                f"it here (they can take: {', '.join(sorted({r for s in shards for r in s.routes()}))})"
            )
        for s in able:
            s.set_route(how)
        return RouteChoice(how, "forced")
    i = max(
        range(len(shards)), key=lambda j: (len(shards[j].routes()), -j)
    )  # the first with the most routes
    timed = shards[i]
    routes = timed.routes()
    times = {}
    if how == "measure" and len(routes) > 1:
        times = {r: timer(timed, r, top_k[i]) for r in routes}
        timed.telemetry.reset_counters()
    order = sorted(times, key=times.get) or list(routes)
    for s in shards:
        s.set_route(next((r for r in order if r in s.routes()), s.routes()[0]))
    kind = "measured" if times else ("only" if len(routes) == 1 else "preferred")
    return RouteChoice(
        order[0],
        kind,
        {r: round(t * 1e6, 1) for r, t in times.items()},
        timed.layer if times else None,
    )
