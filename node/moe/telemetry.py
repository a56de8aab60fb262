"""What a node's shards count: per-layer selections, the phases' timers, the all-reduce latency
histogram, the routing heat map and the expert cache's figures, apart from what the shards are
(plan.ShardConfig) and how they compute (plan.py, kernels.py).

Device-routed calls are noted as lazy indices and folded into the counters later, off the step's
critical path; the host path counts as it goes.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from ...proto.errors import UserError
from ...proto.records import KEEPALIVES
from .expert_cache import CacheStats, Staging

# Upper bounds (seconds) of the all-reduce latency histogram every node keeps (the coordinator's
# /metrics shows it per node).
ALLREDUCE_BUCKETS = (
    25e-6,
    50e-6,
    100e-6,
    200e-6,
    500e-6,
    1e-3,
    2e-3,
    5e-3,
    10e-3,
    50e-3,
    0.25,
    1.0,
)


@dataclass
class LayerCounters:
    """Sums over calls, per MoE layer: distinct experts selected for this node, computed, filler."""

    calls: int = 0
    selected: int = 0
    computed: int = 0
    filler: int = 0
    cluster_max: int = 0  # the largest per-node selected count, summed over calls
    positions: int = 0  # routed (token, j) positions of every node, summed over calls


@dataclass(frozen=True)
class StepTimes:
    """Seconds one step of the running batch spent per phase of its MoE layers (the paper's Table 3),
    and each all-reduce's wait: what the step's report carries (node/figures.py StepReport)."""

    attention_router: float = 0.0  # up to the router's decision (host sync on the indices)
    experts: float = 0.0  # the MoE block's own compute (routed + shared experts)
    collective: float = 0.0  # waiting on the all-reduces
    waits: tuple[float, ...] = ()  # each all-reduce's wait, in order


@dataclass
class Timers:
    """Seconds per phase, summed: the step being run (ShardState.timers, which the MoE layers and
    the host routing add to and the running batch takes at the end of each step), or a node's
    totals over the steps since a reset (ShardState.totals)."""

    attention_router: float = 0.0
    experts: float = 0.0
    collective: float = 0.0
    waits: list = field(default_factory=list)

    def reset(self) -> None:
        self.attention_router = self.experts = self.collective = 0.0
        self.waits = []

    def wait(self, seconds: float) -> None:
        """One all-reduce waited `seconds` (for its sum, beyond this node's own work)."""
        self.collective += seconds
        self.waits.append(seconds)

    def take(self) -> StepTimes:
        """What was summed so far, as a record; the sums start over."""
        out = StepTimes(self.attention_router, self.experts, self.collective, tuple(self.waits))
        self.reset()
        return out

    def add(self, t: StepTimes) -> None:
        self.attention_router += t.attention_router
        self.experts += t.experts
        self.collective += t.collective

    def figures(self) -> dict[str, float]:
        """The three sums (what benchmarks report)."""
        return {
            "attention_router": self.attention_router,
            "experts": self.experts,
            "collective": self.collective,
        }


@dataclass(frozen=True)
class NodeConfig:
    """A node's place among the shards, fixed at load: its rank, the cluster's size, the
    keepalive policy and the expert cache it was loaded with (placement.expert_cache)."""

    rank: int
    world_size: int
    keepalive: str = "lru"
    cache_spec: str = "off"

    def __post_init__(self):
        if self.keepalive not in KEEPALIVES:
            raise UserError(
                f"keepalive must be one of {', '.join(KEEPALIVES)} (got {self.keepalive!r})"
            )


class ShardState:
    """What all the shards of one node share: its frozen config, the route chosen at load, and
    what they count (counters, timers, the all-reduce histogram, the routing heat map, the expert
    cache's figures and the device-routed calls not folded yet, behind a lock)."""

    def __init__(self, rank: int, world_size: int, keepalive: str = "lru", cache_spec: str = "off"):
        self.config = NodeConfig(rank, world_size, keepalive, cache_spec)
        self.counters: dict[int, LayerCounters] = {}
        self.timers = Timers()  # the step being run: taken by the running batch at its end
        self.totals = Timers()  # the steps' since the last reset (benchmarks reset it)
        self.allreduce_counts = [0] * (len(ALLREDUCE_BUCKETS) + 1)
        self.allreduce_seconds = 0.0  # lifetime sum
        # (layer, indices, rank of each expert) of calls routed on the device, lazy: folded into
        # `counters` when read, so no call waits on the host for its counts
        self.pending: list = []
        # per MoE layer: the experts this node holds, and (token, slot) selections of each expert
        # since the load, (num_experts,). The router is replicated: every node counts the same.
        self.held: dict[int, tuple[int, ...]] = {}
        self.routed: dict[int, np.ndarray] = {}
        # per MoE layer, where an expert cache keeps fewer experts resident than the node holds
        self.cache: dict[int, CacheStats] = {}
        self.staging = Staging()  # expert reads held outside the slots
        # route.RouteChoice: how decode steps compute the routed experts, set at load; where a
        # benchmark forces others in turn, `forced_handoff` is the hand-off they share (sim.py)
        self.route = None
        self.forced_handoff: tuple | None = None
        # len(pending) when each of the last two steps began (step_begins): what came before the
        # older one belongs to steps already evaluated, so folding it never waits on the device
        self._marks = [0, 0]
        self._lock = threading.Lock()  # folding vs. readers on other threads

    @property
    def rank(self) -> int:
        return self.config.rank

    @property
    def world_size(self) -> int:
        return self.config.world_size

    @property
    def keepalive(self) -> str:
        return self.config.keepalive

    @property
    def cache_spec(self) -> str:
        return self.config.cache_spec

    def add_layer(self, layer: int, held: tuple[int, ...], num_experts: int) -> None:
        """A shard of MoE `layer` holding the experts `held` of `num_experts` counts here."""
        self.counters.setdefault(layer, LayerCounters())
        self.held[layer] = held
        self.routed.setdefault(layer, np.zeros(num_experts, dtype=np.int64))

    def count_call(
        self, layer: int, selected: int, fillers: int, cluster_max: int, positions: int
    ) -> None:
        """A call counted on the host: experts selected here, fillers, the busiest node's count, and
        the routed positions of the call."""
        c = self.counters[layer]
        c.calls += 1
        c.selected += selected
        c.computed += selected + fillers
        c.filler += fillers
        c.cluster_max += cluster_max
        c.positions += positions

    def record_step(self, times: StepTimes) -> None:
        """A step's timings into the totals and its all-reduces into the latency histogram."""
        self.totals.add(times)
        for seconds in times.waits:
            self.allreduce_counts[bisect.bisect_left(ALLREDUCE_BUCKETS, seconds)] += 1
            self.allreduce_seconds += seconds

    def report(self) -> dict[str, float]:
        """Counters for the node's Status: keepalive means (the all-reduce histogram travels as its
        own record, proto.records.AllreduceHistogram). Read from any thread: it folds nothing."""
        return dict(self.means(fold=False))

    def reset_counters(self) -> None:
        self.counters = {layer: LayerCounters() for layer in self.counters}
        self.routed = {layer: np.zeros_like(r) for layer, r in self.routed.items()}
        self.pending = []
        self._marks = [0, 0]
        for c in self.cache.values():
            c.reset()
        self.staging.reset()

    def cache_totals(self) -> dict[str, int] | None:
        """The expert cache summed over layers: capacity (resident slots), hits, misses, bytes read
        (None without a cache). Selections of a fully resident layer are hits."""
        if self.cache_spec == "off":
            return None
        self.settle()
        summed = (
            "capacity",
            "local",
            "hits",
            "misses",
            "bytes_read",
            "read_seconds",
            "prefetched",
            "prefetch_hits",
            "prefetch_bytes",
        )
        out = dict.fromkeys(summed, 0) | {"read_seconds": 0.0, "staged_peak_bytes": 0}
        for layer, c in self.counters.items():
            stats = self.cache.get(layer)
            if stats is None:  # every local expert resident: a selection here is a hit
                out["capacity"] += len(self.held.get(layer, ()))
                out["local"] += len(self.held.get(layer, ()))
                out["hits"] += c.selected
                continue
            for k in summed:
                out[k] += getattr(stats, k)
        out["staged_peak_bytes"] = self.staging.peak
        return out

    def count_routed(self, layer: int, inds: np.ndarray) -> None:
        r = self.routed[layer]
        flat = inds.reshape(-1)
        # a family's own sentinel ids (none known) are not experts
        flat = flat[(flat >= 0) & (flat < len(r))]
        r += np.bincount(flat, minlength=len(r))

    def routing(self, fold: bool = True) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
        """{layer: (experts held here, selections per expert)}; `fold`: device-routed calls folded
        in first (only on the thread that drives MLX)."""
        if fold:
            self.settle()
        with self._lock:
            return {
                layer: (self.held.get(layer, ()), tuple(int(n) for n in r))
                for layer, r in sorted(self.routed.items())
            }

    def note(self, layer: int, inds: mx.array, rank_of: np.ndarray | mx.array) -> None:
        """A call routed on the device: its indices (evaluated with the step anyway) are counted
        on the host later, adding nothing to the step's graph. rank_of[e] = the rank computing e:
        the layer's table, or this call's (replicas; evaluated with the step too)."""
        self.pending.append((layer, inds, rank_of))
        if len(self.pending) > _FOLD_HARD:  # nobody marks steps (a loop of its own): bound the list
            self.settle(keep=_FOLD_KEEP)

    def step_begins(self) -> None:
        """A step starts; the one two steps back has been evaluated (its token was read). Folds what
        steps before it noted once there is enough of it, never waiting on the device: on a GPU,
        reading the indices of a step still running cost ~20% of decode (Qwen3-30B-A3B shape,
        H100)."""
        self._marks = [self._marks[1], len(self.pending)]
        safe = self._marks[0]
        if safe > _FOLD_AT:
            self.settle(keep=len(self.pending) - safe)

    def settle(self, keep: int = 0) -> None:
        """Fold the device-routed calls into `counters` (all but the `keep` newest, which may belong
        to a step still being built). One host copy and a few numpy passes for all of them: folding
        call by call cost ~30 us per MoE layer call, as much as the layer's own graph building."""
        with self._lock:
            self._settle(keep)

    def _settle(self, keep: int) -> None:
        cut = len(self.pending) - keep
        done, self.pending = self.pending[:cut], self.pending[cut:]
        self._marks = [max(0, m - len(done)) for m in self._marks]  # they index `pending`
        if not done:
            return
        # no copy, no graph op
        flat = [np.asarray(memoryview(inds)).reshape(-1) for _, inds, _ in done]
        ids = np.concatenate(flat).astype(np.int64)  # every call's expert ids, end to end
        call = np.repeat(np.arange(len(done)), [f.size for f in flat])
        layers = sorted({layer for layer, _, _ in done})
        index = {layer: i for i, layer in enumerate(layers)}
        layer_of_call = np.fromiter(
            (index[layer] for layer, _, _ in done), dtype=np.int64, count=len(done)
        )
        layer_of = layer_of_call[call]  # per id: its layer's index in `layers`
        # per call, the rank computing each expert: its layer's table, or the call's own where
        # replicas were assigned on the device (ArrayRule's ranks, evaluated with the step)
        # id(table) -> its row in `tables`: a layer's table is shared by its calls
        rows: dict[int, int] = {}
        tables, table_of_call = [], np.empty(len(done), dtype=np.int64)
        for i, (_, _, t) in enumerate(done):
            if id(t) not in rows:
                rows[id(t)] = len(tables)
                tables.append(np.asarray(memoryview(t) if isinstance(t, mx.array) else t))
            table_of_call[i] = rows[id(t)]
        width = max(len(t) for t in tables)
        known = (ids >= 0) & (ids < np.array([len(t) for t in tables])[table_of_call[call]])
        # a family's sentinel ids are no expert
        call, ids, layer_of = call[known], ids[known], layer_of[known]
        # per-expert selections (the routing heat map), every layer in one count
        heat = np.bincount(layer_of * width + ids, minlength=len(layers) * width)
        for i, layer in enumerate(layers):
            r = self.routed[layer]
            n = min(len(r), width)
            r[:n] += heat[i * width : i * width + n]
        # each call's distinct experts, then how many of them each rank computes
        present = np.zeros((len(done), width), dtype=bool)
        present[call, ids] = True
        rank_table = np.stack([np.pad(t.astype(np.int64), (0, width - len(t))) for t in tables])
        ranks = rank_table[table_of_call]  # (calls, width): the rank computing each expert
        counts = np.stack([(present & (ranks == r)).sum(axis=1) for r in range(self.world_size)], 1)
        calls = np.bincount(layer_of_call, minlength=len(layers))
        mine = np.bincount(layer_of_call, weights=counts[:, self.rank], minlength=len(layers))
        biggest = np.bincount(layer_of_call, weights=counts.max(axis=1), minlength=len(layers))
        positions = np.bincount(
            layer_of_call, weights=[f.size for f in flat], minlength=len(layers)
        )
        fill = np.zeros(len(done))
        # Recency.fill's count: up to the busiest node
        if self.keepalive == "lru" and self.world_size > 1:
            held = np.array([len(self.held.get(layer, ())) for layer in layers])[layer_of_call]
            fill = np.maximum(np.minimum(counts.max(axis=1), held) - counts[:, self.rank], 0)
        filler = np.bincount(layer_of_call, weights=fill, minlength=len(layers))
        for i, layer in enumerate(layers):
            c = self.counters.setdefault(layer, LayerCounters())
            c.calls += int(calls[i])
            c.selected += int(mine[i])
            c.computed += int(mine[i] + filler[i])
            c.filler += int(filler[i])
            c.cluster_max += int(biggest[i])
            c.positions += int(positions[i])

    def means(self, fold: bool = True) -> dict[str, float]:
        """Mean per MoE layer per call of selected/computed/filler on this node; `fold`:
        device-routed calls folded in first (only on the thread that drives MLX)."""
        if fold:
            self.settle()
        with self._lock:
            counters = list(self.counters.values())
        calls = sum(c.calls for c in counters)
        if not calls:
            return {"selected": 0.0, "computed": 0.0, "filler": 0.0}
        return {
            k: sum(getattr(c, k) for c in counters) / calls
            for k in ("selected", "computed", "filler")
        }


# Device-routed calls fold their counts into the counters every so many calls, leaving the newest
# (a step still being built) for later.
_FOLD_AT = 1024  # device-routed calls folded at once, from steps already evaluated
_FOLD_HARD, _FOLD_KEEP = 8192, 512  # without step marks: the bound, and the newest calls left alone
