"""How a MoE layer's partial becomes its sum: the hand-over to the collective, chosen once.

`ClusterMoE` (layer.py) computes this node's share of a block's output and calls its `Combine`,
which the loader picks from the collective's declared capabilities (base.Capabilities) and the
runtime replaces once where the node runs two micro-batches (node/overlap.py):

- `GraphCombine`: the collective is a graph operation (one node, `mx.distributed`): the lazy
  partial goes in and the step stays one lazy graph.
- `HostCombine`: the partial is evaluated, handed over and its sum waited for, each timed.
- `SyncedCombine`: a benchmark's diagnostic pass over a graph collective, evaluated in three timed
  parts per layer (its input, its partial, its sum); slower than the graph, but it splits it.

Every combine adds its timings to the step's timers (telemetry.Timers), which the running batch
takes at the end of each step for the step's report.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

import mlx.core as mx

from ..collective.base import Collective

if TYPE_CHECKING:
    from .layer import ClusterMoE
    from .telemetry import Timers


class Combine(Protocol):
    collective: Collective

    def __call__(self, layer: "ClusterMoE", x: mx.array, *args, **kwargs) -> mx.array:
        """The block's output at `x` summed over the cluster (the layer's partial, combined)."""


class GraphCombine:
    """The partial handed to a graph collective unevaluated: no host sync in the step."""

    def __init__(self, collective: Collective, timers: "Timers"):
        self.collective = collective

    def __call__(self, layer, x, *args, **kwargs):
        return self.collective.all_reduce(layer.partial(x, *args, **kwargs), layer.layer)


class HostCombine:
    """The partial evaluated (the experts' time), then all-reduced (the collective's wait)."""

    def __init__(self, collective: Collective, timers: "Timers"):
        self.collective = collective
        self._timers = timers

    def __call__(self, layer, x, *args, **kwargs):
        y = layer.partial(x, *args, **kwargs)
        t0 = time.perf_counter()
        mx.eval(y)
        t1 = time.perf_counter()
        y = self.collective.all_reduce(y, layer.layer)
        self._timers.experts += t1 - t0
        self._timers.wait(time.perf_counter() - t1)
        return y


class SyncedCombine:
    """A graph collective's layer evaluated in three parts, each timed: what came before it
    (attention and the rest since the last MoE layer: `attention_router`), the router and the
    experts (`experts`), the all-reduce with its wait for the slowest node (`collective`)."""

    def __init__(self, collective: Collective, timers: "Timers"):
        self.collective = collective
        self._timers = timers

    def __call__(self, layer, x, *args, **kwargs):
        timers = self._timers
        t0 = time.perf_counter()
        mx.eval(x)
        t1 = time.perf_counter()
        routed = timers.attention_router  # a host read times its own routing wait (HostPlan)
        y = layer.partial(x, *args, **kwargs)
        mx.eval(y)
        t2 = time.perf_counter()
        out = self.collective.all_reduce(y, layer.layer)
        mx.eval(out)
        t3 = time.perf_counter()
        inner = timers.attention_router - routed  # counted there already, inside t1..t2
        timers.attention_router += t1 - t0
        timers.experts += (t2 - t1) - inner
        timers.wait(t3 - t2)
        return out


def combine_for(collective: Collective, timers: "Timers") -> Combine:
    """The hand-over a collective's capabilities call for."""
    kind = GraphCombine if collective.caps.in_graph else HostCombine
    return kind(collective, timers)


class StreamCombine:
    """Attention by stream (`serving.attention`): each stream is owned by one node, which alone
    attends for it. In a pass of owned streams, a node's input is its own streams' rows; every
    node's are gathered, the block runs on all of them (the router is replicated, the experts this
    node's) and each row's sum goes back to its owner (a reduce-scatter). A pass of replicated
    streams (every node runs the same rows: a stream started by `auto` with nothing else running)
    is an all-reduce, as with replicated attention.

    The running batch sets each pass's layout before it runs (`arrange`): how many rows each rank
    brings, all zeros for a replicated pass."""

    def __init__(self, collective: Collective, timers: "Timers"):
        self.collective = collective
        self._timers = timers
        self._graph = combine_for(collective, timers)
        self._plain = self._graph
        self._host = self._syncs = not collective.caps.in_graph
        self.counts: tuple[int, ...] = ()  # own rows (tokens) each rank brings to the pass

    def sync(self, on: bool) -> None:
        """A benchmark's diagnostic pass (SyncedCombine): a graph collective's layers evaluated
        and timed in parts, here too."""
        self._syncs = on or self._host
        self._plain = SyncedCombine(self.collective, self._timers) if on else self._graph

    def arrange(self, counts) -> None:
        """The next passes' rows per rank (every rank computes the same); all zeros: replicated."""
        self.counts = tuple(counts)

    def __call__(self, layer, x, *args, **kwargs):
        if not any(self.counts):  # a replicated pass: one all-reduce
            return self._plain(layer, x, *args, **kwargs)
        if args or kwargs:
            from ...proto.errors import UserError

            raise UserError(
                f"attention by stream: MoE layer {layer.layer} takes more than its input "
                f"({type(layer.block).__name__}); serve this model with attention: replicated"
            )
        width = x.shape[-1]
        return self._combined(layer, x.reshape(-1, width)).reshape(x.shape)

    def idle(self, layer, dtype: mx.Dtype, width: int) -> mx.array:
        """A pass this node brings no rows to: its experts on the others' rows."""
        return self._combined(layer, mx.zeros((0, width), dtype))

    def _combined(self, layer, rows: mx.array) -> mx.array:
        """This node's rows (n, D) -> their sums, through every node's experts."""
        c, timers, syncs = self.collective, self._timers, self._syncs
        t0 = time.perf_counter()
        if syncs:
            mx.eval(rows)  # attention and the rest since the last MoE layer
        t1 = time.perf_counter()
        every = c.all_gather(rows, self.counts, layer.layer)  # (S, D), rank order
        if syncs:
            mx.eval(every)
        t2 = time.perf_counter()
        partial = layer.partial(every[None])[0]  # (S, D)
        if syncs:
            mx.eval(partial)
        t3 = time.perf_counter()
        out = c.reduce_scatter(partial, self.counts, layer.layer)  # (n, D)
        if syncs:
            mx.eval(out)
            timers.attention_router += t1 - t0
            timers.experts += t3 - t2
            timers.wait(t2 - t1)
            timers.wait(time.perf_counter() - t3)
        return out
