"""ExpertShard: a node's local experts of one MoE layer, computed exactly, with keepalive.

It replaces an mlx-lm expert bank (`SwitchGLU`/`SwitchMLP`) and answers the same call,
`bank(x, inds) -> (..., k, D)`, with zeros where an expert is computed by another node, so the MoE
block's weighted sum becomes this node's partial sum.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ...proto.errors import UserError
from ...proto.records import KEEPALIVES
from . import qskip, skip_gemv
from .expert_cache import CacheStats, LayerCache, Staging
from .routing import ArrayRule, assign, everywhere_or_once, per_rank, selected_experts

# Upper bounds (seconds) of the all-reduce latency histogram every node keeps (the coordinator's
# /metrics shows it per node).
ALLREDUCE_BUCKETS = (25e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 50e-3, 0.25, 1.0)


@dataclass
class LayerCounters:
    """Sums over calls, per MoE layer: distinct experts selected for this node, computed, filler."""

    calls: int = 0
    selected: int = 0
    computed: int = 0
    filler: int = 0
    cluster_max: int = 0  # the largest per-node selected count, summed over calls
    positions: int = 0  # routed (token, j) positions of every node, summed over calls


@dataclass
class Timers:
    """Seconds per phase, summed over the forward passes of a request (the paper's Table 3)."""

    attention_router: float = 0.0  # up to the router's decision (host sync on the indices)
    experts: float = 0.0  # the MoE block's own compute (routed + shared experts)
    collective: float = 0.0  # waiting on the all-reduce

    def reset(self) -> None:
        self.attention_router = self.experts = self.collective = 0.0


@dataclass
class ShardState:
    """What all the shards of one node share: its rank, the keepalive policy and the counters."""

    rank: int
    world_size: int
    keepalive: str = "lru"
    counters: dict[int, LayerCounters] = field(default_factory=dict)
    timers: Timers = field(default_factory=Timers)
    allreduce_counts: list[int] = field(default_factory=lambda: [0] * (len(ALLREDUCE_BUCKETS) + 1))
    allreduce_seconds: float = 0.0  # lifetime sum
    # (layer, selected, cluster max) of calls routed on the device, as lazy scalars: folded into
    # `counters` when read, so no call waits on the host for its counts
    pending: list = field(default_factory=list)
    # per MoE layer: the experts this node holds, and (token, slot) selections of each expert since
    # the load, (num_experts,). The router is replicated, so every node counts the same selections.
    held: dict[int, tuple[int, ...]] = field(default_factory=dict)
    routed: dict[int, np.ndarray] = field(default_factory=dict)
    # per MoE layer, where an expert cache keeps fewer experts resident than the node holds
    cache: dict[int, CacheStats] = field(default_factory=dict)
    cache_spec: str = "off"  # placement.expert_cache as the node was loaded with it
    staging: Staging = field(default_factory=Staging)  # expert reads held outside the slots
    route: object = None  # route.RouteChoice: how decode steps compute the routed experts, set at load
    # len(pending) when each of the last two steps began (step_begins): what came before the older
    # one belongs to steps already evaluated, so folding it never waits on the device
    _marks: list = field(default_factory=lambda: [0, 0])
    _lock: threading.Lock = field(default_factory=threading.Lock)  # folding vs. readers on other threads

    def __post_init__(self):
        if self.keepalive not in KEEPALIVES:
            raise UserError(f"keepalive must be one of {', '.join(KEEPALIVES)} (got {self.keepalive!r})")

    def record_allreduce(self, seconds: float) -> None:
        import bisect

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
        summed = ("capacity", "local", "hits", "misses", "bytes_read", "read_seconds", "prefetched",
                  "prefetch_hits", "prefetch_bytes")
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
        flat = flat[(flat >= 0) & (flat < len(r))]  # a family's own sentinel ids (none known) are not experts
        r += np.bincount(flat, minlength=len(r))

    def routing(self, fold: bool = True) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
        """{layer: (experts held here, selections per expert)}; `fold`: device-routed calls folded in
        first (only on the thread that drives MLX)."""
        if fold:
            self.settle()
        with self._lock:
            return {layer: (self.held.get(layer, ()), tuple(int(n) for n in r)) for layer, r in sorted(self.routed.items())}

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
        reading the indices of a step still running cost ~20% of decode (Qwen3-30B-A3B shape, H100)."""
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
        done, self.pending = self.pending[: len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        self._marks = [max(0, m - len(done)) for m in self._marks]  # they index `pending`
        if not done:
            return
        flat = [np.asarray(memoryview(inds)).reshape(-1) for _, inds, _ in done]  # no copy, no graph op
        ids = np.concatenate(flat).astype(np.int64)  # every call's expert ids, end to end
        call = np.repeat(np.arange(len(done)), [f.size for f in flat])
        layers = sorted({layer for layer, _, _ in done})
        index = {layer: i for i, layer in enumerate(layers)}
        layer_of_call = np.fromiter((index[layer] for layer, _, _ in done), dtype=np.int64, count=len(done))
        layer_of = layer_of_call[call]  # per id: its layer's index in `layers`
        # per call, the rank computing each expert: its layer's table, or the call's own where
        # replicas were assigned on the device (ArrayRule's ranks, evaluated with the step)
        rows: dict[int, int] = {}  # id(table) -> its row in `tables`: a layer's table is shared by its calls
        tables, table_of_call = [], np.empty(len(done), dtype=np.int64)
        for i, (_, _, t) in enumerate(done):
            if id(t) not in rows:
                rows[id(t)] = len(tables)
                tables.append(np.asarray(memoryview(t) if isinstance(t, mx.array) else t))
            table_of_call[i] = rows[id(t)]
        width = max(len(t) for t in tables)
        known = (ids >= 0) & (ids < np.array([len(t) for t in tables])[table_of_call[call]])
        call, ids, layer_of = call[known], ids[known], layer_of[known]  # a family's sentinel ids are no expert
        for i, layer in enumerate(layers):  # per-expert selections (the routing heat map)
            self.count_routed(layer, ids[layer_of == i])
        # each call's distinct experts, then how many of them each rank computes
        key = np.unique(call * width + ids)
        call_of, expert_of = key // width, key % width
        rank_table = np.stack([np.pad(t.astype(np.int64), (0, width - len(t))) for t in tables])
        counts = np.zeros((len(done), self.world_size), dtype=np.int64)
        np.add.at(counts, (call_of, rank_table[table_of_call[call_of], expert_of]), 1)
        calls = np.bincount(layer_of_call, minlength=len(layers))
        positions = np.bincount(layer_of_call, weights=[f.size for f in flat], minlength=len(layers))
        mine = np.bincount(layer_of_call, weights=counts[:, self.rank], minlength=len(layers))
        biggest = np.bincount(layer_of_call, weights=counts.max(axis=1), minlength=len(layers))
        fill = np.zeros(len(done))
        if self.keepalive == "lru" and self.world_size > 1:  # ExpertShard._fill's count: up to the busiest node
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
        """Mean per MoE layer per call of selected/computed/filler on this node; `fold`: device-routed
        calls folded in first (only on the thread that drives MLX)."""
        if fold:
            self.settle()
        with self._lock:
            counters = list(self.counters.values())
        calls = sum(c.calls for c in counters)
        if not calls:
            return {"selected": 0.0, "computed": 0.0, "filler": 0.0}
        return {k: sum(getattr(c, k) for c in counters) / calls for k in ("selected", "computed", "filler")}


class ShardLinear(nn.Module):
    """One projection of the local experts: weight (E_local, out, in), maybe quantized, maybe biased."""

    def __init__(self, weight: mx.array, *, scales=None, biases=None, bias=None, quant: Mapping | None = None):
        super().__init__()
        self.weight = weight
        if scales is not None:
            self.scales = scales
        if biases is not None:
            self.biases = biases
        if bias is not None:
            self.bias = bias
        self.quant = dict(quant) if quant else None  # {"group_size", "bits", "mode"}
        # decided once: this runs three times per MoE layer per token, on the step's critical path
        self._per_expert = _per_expert(weight.dtype, quant is not None)
        self._biased = bias is not None

    def __call__(self, x: mx.array, slots: mx.array, groups: Sequence[tuple[int, int, int]]) -> mx.array:
        """x (M, 1, in) rows sorted by slot; slots (M,); groups [(slot, start, end)] -> (M, 1, out)."""
        if self._per_expert:
            y = mx.concatenate([self._one(x[a:b], s) for s, a, b in groups], axis=0)
        elif self.quant is not None:
            y = mx.gather_qmm(
                x, self["weight"], self["scales"], self.get("biases"), rhs_indices=slots, transpose=True,
                group_size=self.quant["group_size"], bits=self.quant["bits"], mode=self.quant["mode"],
                sorted_indices=x.shape[0] >= SORTED_FROM,
            )
        else:
            y = mx.gather_mm(x, self["weight"].swapaxes(-1, -2), rhs_indices=slots,
                             sorted_indices=x.shape[0] >= SORTED_FROM)
        if self._biased:
            y = y + mx.expand_dims(self["bias"][slots], -2)
        return y

    def _one(self, x: mx.array, slot: int) -> mx.array:
        """Rows of one expert through its (maybe quantized) matrix."""
        if self.quant is None:
            return x @ self["weight"][slot].T
        biases = self.get("biases")
        return mx.quantized_matmul(x, self["weight"][slot], self["scales"][slot],
                                   biases[slot] if biases is not None else None, transpose=True,
                                   group_size=self.quant["group_size"], bits=self.quant["bits"],
                                   mode=self.quant["mode"])


# Device-routed calls fold their counts into the counters every so many calls, leaving the newest
# (a step still being built) for later.
_FOLD_AT = 1024  # device-routed calls folded at once, from steps already evaluated
_FOLD_HARD, _FOLD_KEEP = 8192, 512  # without step marks: the bound, and the newest calls left alone

# How the local experts are multiplied: one gather_mm for all rows (the default, "auto"), or one
# matmul per expert (MLX's CPU backend has no bfloat16/float16 gather_mm, so "auto" does that there).
# MOE_CLUSTER_EXPERT_MATMUL=per-expert forces the latter everywhere.
EXPERT_MATMUL = os.environ.get("MOE_CLUSTER_EXPERT_MATMUL", "auto")
# Rows are always grouped by expert, but gather_mm is told so only from this many rows on, as
# mlx-lm's SwitchGLU does: on MLX's CUDA backend the sorted kernel is ~6x slower for decode-sized
# batches (DBRX experts on an H200: 1.07 ms vs 0.17 ms per call; scripts/gpu/expert_matmul_probe.py).
SORTED_FROM = 64
_STAMP_SPAN = 1 << 16  # keepalive's recency counts restart this often (ExpertShard._touch)
# How a decode step's routed experts are computed (ExpertShard.routes), in the order preferred where
# nothing is measured: on the device reading only this node's experts (a skip kernel), on the
# device with the other nodes' positions redirected to a local slot (one expert read per position),
# or with the routing read on the host (only the selected experts computed; one host sync a layer).
ROUTES = ("skip", "device", "host")


def _gather_mm_ok(dtype: mx.Dtype) -> bool:
    return dtype == mx.float32 or mx.default_device().type != mx.DeviceType.cpu


def _per_expert(dtype: mx.Dtype, quantized: bool) -> bool:
    if EXPERT_MATMUL == "per-expert":
        return True
    return not quantized and not _gather_mm_ok(dtype)


class ExpertShard(nn.Module):
    """The local experts of one MoE layer, stacked (E_local, ...) per projection."""

    def __init__(
        self,
        layer: int,
        global_ids: Sequence[int],
        holders: Mapping[int, Sequence[int]],
        projections: Mapping[str, ShardLinear],
        kind: str,
        activation: Callable,
        state: ShardState,
    ):
        super().__init__()
        if kind not in ("glu", "mlp"):
            raise ValueError(f"unknown expert kind {kind!r}")
        for name, proj in projections.items():
            setattr(self, name, proj)
        self._layer = layer
        self._ids = tuple(global_ids)
        self._slot = np.full(max(len(holders), 1), -1, dtype=np.int64)
        for slot, e in enumerate(self._ids):
            self._slot[e] = slot
        self._holders = {e: tuple(rs) for e, rs in holders.items()}
        self._kind = kind
        self._activation = activation
        self._state = state
        # Keepalive's recency, on the device so that the decode step can choose its fillers without
        # a host read: the call count at which each local slot was last computed (0: never), and
        # the count itself. Least recently used = smallest (stamp, slot).
        self._stamp = mx.zeros((len(self._ids),), dtype=mx.int32)
        self._calls = 0
        state.counters.setdefault(layer, LayerCounters())
        state.held[layer] = self._ids
        state.routed.setdefault(layer, np.zeros(len(holders), dtype=np.int64))
        # Routing on the device, without reading the indices on the host, where the work is a
        # fixed function of them and of device state: every expert has one holder, or one holder or
        # all of them (replicas choose their rank through ArrayRule, routing.py's rule as array
        # operations), and keepalive is none, or lru (its fillers are chosen on the device from the
        # recency stamps), or the node is alone (the cluster maximum is ours: no filler).
        self._lut = self._rank_of = self._ranks = self._local = self._rule = None
        self._identity = False
        if self._ids and everywhere_or_once(self._holders, state.world_size) and (
                state.keepalive in ("none", "lru") or state.world_size == 1):
            n = len(self._slot)
            if all(len(rs) == 1 for rs in self._holders.values()):
                self._rank_of = np.array([self._holders[e][0] for e in range(n)], dtype=np.int64)
                lut = np.where(self._rank_of == state.rank, self._slot, -1)  # global -> slot
                # alone with every expert in id order, the table is the identity: the indices are the slots
                self._identity = bool(np.array_equal(lut, np.arange(n)))
                self._lut = mx.array(lut.astype(np.int32))
            else:  # replicas: the table is made per call from the rule's ranks
                self._rule = ArrayRule(self._holders, state.world_size)
                self._held_slot = mx.array(self._slot.astype(np.int32))  # global -> slot here, -1: not held
            if state.keepalive == "lru" and state.world_size > 1:
                self._local = mx.array(np.asarray(self._ids, dtype=np.int32))  # slot -> global id
                if self._rank_of is not None:
                    # expert -> its rank, one-hot (num_experts, world): distinct experts per rank in one sum
                    self._ranks = mx.array(self._rank_of[:, None] == np.arange(state.world_size))
                else:  # each call's ranks, one-hot against the ranks
                    self._world = mx.arange(state.world_size)
        last = self.down_proj if kind == "glu" else self.fc2
        self._gathered = not last._per_expert  # one gather_mm per call
        self._skip: mx.Dtype | None = None  # decode at N > 1 through skip_gemv, for inputs of this dtype (enable_skip_gemv)
        self._route = self.routes()[0]  # chosen once, at load (set_route)
        self._cache: LayerCache | None = None
        self._ahead = 1
        self._next: LayerCache | None = None  # prefetch_into
        self._next_candidates: tuple[int, ...] = ()
        self._depth = 0

    def attach_cache(self, cache: LayerCache, ahead: int = 1) -> None:
        """Keep only `cache.capacity` experts resident (the projections hold that many slots): the
        host reads the routing to learn the misses, so the device-routed path is off. `ahead`: how
        many of a later round's misses are read while an earlier round computes."""
        self._cache = cache
        self._ahead = max(int(ahead), 1)
        self._lut = self._rule = None
        self._route = "host"
        self._state.cache[self._layer] = cache.stats

    def prefetch_into(self, cache: LayerCache | None, candidates: Sequence[int], depth: int) -> None:
        """When this layer begins, start reading the first `depth` non-resident `candidates` (local
        indices, likeliest first) of `cache`, the next layer's: its routing is not known before this
        layer's output."""
        self._next = cache if depth > 0 and candidates else None
        self._next_candidates = tuple(candidates)
        self._depth = depth

    def enable_skip_gemv(self) -> str | None:
        """Compute the device-routed decode step at N > 1 with a skip kernel (CUDA): skip_gemv for
        bfloat16/float16 weights, qskip for 4/8-bit affine and mxfp4 ones; neither reads anything
        for the positions another node computes. Returns why not (None: on, and the route)."""
        if not self._device_routed or self._state.world_size == 1 or not self._gathered:
            return "this layer's decode is not routed on the device at N > 1"
        projs = self._projections()
        for p in projs:
            fits = (qskip.fits(p.weight, p.scales, p.get("biases"), p.quant) if p.quant is not None
                    else skip_gemv.fits(p.weight))
            if p._biased or not fits:
                return "biased, float32, odd-sized or unsupported quantized expert weights"
        dtypes = {_act_dtype(p) for p in projs}
        # float32 keeps gather_mm/gather_qmm: summed in the kernel's order, longcat_flash's float32
        # model was 3.2e-4 from stock at N = 2 (bound 1e-4), within it with gather_mm (skip_gemv.py)
        if len(dtypes) != 1 or not dtypes <= {mx.bfloat16, mx.float16}:
            return "expert projections of different dtypes"
        for p in projs:
            why = (qskip.check(p.weight, p.scales, p.get("biases"), p.quant) if p.quant is not None
                   else skip_gemv.check(p.weight))
            if why:
                return why
        self._skip = dtypes.pop()
        self._route = "skip"
        return None

    def routes(self) -> tuple[str, ...]:
        """The routes this layer's decode step can take (ROUTES), preferred first. Alone, only one:
        every expert is here, so the device route (stock mlx-lm's op for op) reads nothing it does
        not use, and the host read would only add a sync; without device routing (an expert
        cache, keepalive busy, per-expert matmuls), only the host read."""
        device = self._device_routed and self._gathered
        if self._state.world_size == 1:
            return ("device",) if device else ("host",)
        return (("skip",) if self._skip is not None and device else ()) + (("device",) if device else ()) + ("host",)

    @property
    def route(self) -> str:
        return self._route

    @property
    def layer(self) -> int:
        return self._layer

    def decode_sample(self, top_k: int, count: int, seed: int = 0) -> tuple[mx.array, list[mx.array]]:
        """A decode call's input for timing: one token (1, 1, hidden) in the experts' dtype, and
        `count` routings of it, each `top_k` distinct experts drawn from the router's count."""
        last = self.down_proj if self._kind == "glu" else self.fc2
        n = len(self._slot)
        rng = np.random.default_rng(seed)
        x = (mx.random.normal((1, 1, _out_dim(last)), key=mx.random.key(seed)) * 0.1).astype(_act_dtype(last))
        inds = [mx.array(rng.choice(n, size=min(top_k, n), replace=False)[None, None].astype(np.int32))
                for _ in range(count)]
        mx.eval(x, *inds)
        return x, inds

    @contextmanager
    def trying(self, route: str):
        """Calls on `route` that leave the layer as it was: its route, keepalive's recency, and no
        prefetch of the next layer's cache (the node's counters are the caller's to reset)."""
        saved = self._route, self._stamp, self._calls, self._next
        self._route, self._next = route, None
        try:
            yield self
        finally:
            self._route, self._stamp, self._calls, self._next = saved

    def set_route(self, route: str) -> None:
        """Compute decode steps by `route` from now on (one of routes())."""
        if route not in self.routes():
            raise UserError(f"MoE layer {self._layer} cannot take the {route!r} route here "
                            f"(it can take: {', '.join(self.routes())})")
        self._route = route

    def _projections(self) -> list[ShardLinear]:
        return [self.gate_proj, self.up_proj, self.down_proj] if self._kind == "glu" else [self.fc1, self.fc2]

    def _skipped(self, x: mx.array, inds: mx.array, slots: mx.array) -> mx.array:
        """_routed_on_device's MLP through the skip kernels: `slots` (..., k) local slot per
        position, -1 where none is read; (..., k, out)."""
        k, x2, s = inds.shape[-1], x.reshape(-1, x.shape[-1]), slots.reshape(-1).astype(mx.int32)
        if self._kind == "glu":
            h = self._activation(_skip_proj(self.up_proj, x2, s, k), _skip_proj(self.gate_proj, x2, s, k))
            y = _skip_proj(self.down_proj, h, s, 1)
        else:
            y = _skip_proj(self.fc2, self._activation(_skip_proj(self.fc1, x2, s, k)), s, 1)
        return y.reshape(*inds.shape, y.shape[-1])

    @property
    def _device_routed(self) -> bool:
        return self._lut is not None or self._rule is not None

    @property
    def global_ids(self) -> tuple[int, ...]:
        return self._ids

    @property
    def cache(self) -> LayerCache | None:
        return self._cache

    def _mlp(self, x: mx.array, slots: mx.array, groups) -> mx.array:
        if self._kind == "glu":
            up = self.up_proj(x, slots, groups)
            gate = self.gate_proj(x, slots, groups)
            return self.down_proj(self._activation(up, gate), slots, groups)
        return self.fc2(self._activation(self.fc1(x, slots, groups)), slots, groups)

    @property
    def _lru(self) -> list[int]:
        """Local slots, least recently computed first (reads the stamps on the host)."""
        stamp = np.array(self._stamp)
        return np.lexsort((np.arange(len(stamp)), stamp)).tolist()

    def _touch(self, computed: mx.array) -> None:
        """Stamp the slots `computed` (bool, per slot) with this call's count. The counts restart
        every _STAMP_SPAN calls, older stamps shifted down (those older than half the span tie at 0),
        so that _fill's int32 key, stamp × local slots + slot, never overflows."""
        if self._calls >= _STAMP_SPAN:
            self._calls -= _STAMP_SPAN // 2
            self._stamp = mx.maximum(self._stamp - _STAMP_SPAN // 2, 0)
        self._calls += 1
        self._stamp = mx.where(computed, self._calls, self._stamp)

    def _fillers(self, mine: list[int], cluster_max: int) -> list[int]:
        policy = self._state.keepalive
        if policy == "none":
            return []
        taken = set(mine)
        free = [s for s in self._lru if s not in taken]
        if self._cache is not None:  # keep busy with what is resident: a filler is never read from disk
            free = [s for s in free if self._cache.slot_of[s] >= 0]
        if policy == "busy":
            return free
        want = min(cluster_max, len(self._ids)) - len(mine)
        return free[: max(want, 0)]  # least recently used first

    def _routed_on_device(self, x: mx.array, inds: mx.array) -> mx.array:
        """Every (token, j) position through its expert's slot, no host sync: positions another
        node computes (for a replica, the one this call's ArrayRule picks) repeat a slot this node
        computes anyway (keepalive lru: go to its fillers, `_fill`) and are zeroed, so without
        keepalive a node reads at most one expert more than it selected, and only where it selected
        none (measured against the host path in tests/unit/test_experts.py)."""
        rows = mx.expand_dims(x, (-2, -3))  # (..., 1, 1, D): every slot of a token reads its row, as SwitchGLU
        if self._state.world_size == 1:  # alone: every expert is here, in stock's order where it is the identity
            self._state.note(self._layer, inds, self._rank_of)
            slots = inds if self._identity else self._lut[inds].astype(mx.uint32)
            if inds.size >= SORTED_FROM:
                return self._sorted(rows, slots)
            return self._mlp(rows, slots, None).squeeze(-2)
        lut, rank_of, ranks, present = self._lut, self._rank_of, self._ranks, None
        if self._rule is not None or ranks is not None:
            present = selected_experts(inds, len(self._slot))
        if self._rule is not None:  # this call's ranks for the replicas, then its table
            rank_of = self._rule(inds, present)
            lut = mx.where(rank_of == self._state.rank, self._held_slot, -1)
            if self._local is not None:  # keepalive lru
                ranks = rank_of[:, None] == self._world
        self._state.note(self._layer, inds, rank_of)
        slots = lut[inds]  # (..., k): local slot, or -1 where another node computes it
        mine = slots >= 0
        if self._route == "skip" and x.dtype == self._skip:
            if ranks is None:  # nothing read for the positions another node computes
                return self._skipped(x, inds, slots)
            y = self._skipped(x, inds, mx.where(mine, slots, self._fill(mine, ranks, present)))  # fillers read, then zeroed
            return mx.where(mine[..., None], y, mx.zeros_like(y))
        # keepalive none: another node's positions repeat a slot read anyway (the highest selected
        # here; slot 0 where none is): a repeated expert's weights come from cache, not memory
        # (scripts/filler_probe.py), though a CPU still computes the row
        other = self._fill(mine, ranks, present) if ranks is not None else mx.maximum(slots.max(), 0)
        y = self._mlp(rows, mx.where(mine, slots, other).astype(mx.uint32), None).squeeze(-2)  # (..., k, out)
        return mx.where(mine[..., None], y, mx.zeros_like(y))

    def _fill(self, mine: mx.array, ranks: mx.array, present: mx.array) -> mx.array:
        """Keepalive lru on the device (`ranks`: expert x rank, who computes it; `present`: the
        experts this call selects): the slot each position another node computes takes here, so
        that this node computes as many distinct experts as the busiest node (min(cluster max, its
        experts)), the extra ones its least recently used; the rest repeat an expert already read.
        Another node's positions always suffice: the busiest node's experts all sit at positions
        that are not ours. Its outputs are zeroed by the caller; only the weights' reads matter."""
        local = len(self._ids)
        per_rank = (present[:, None] & ranks).astype(mx.int32).sum(axis=0)  # distinct experts per rank
        selected = (present & ranks[:, self._state.rank])[self._local]  # (local,): computed here
        n_mine = per_rank[self._state.rank]
        want = mx.minimum(per_rank.max(), local) - n_mine  # fillers this call
        order = mx.argsort(mx.where(selected, 2**31 - 1, self._stamp * local + mx.arange(local)))  # free, LRU first
        nth = mx.cumsum((~mine).reshape(-1).astype(mx.int32)) - 1  # each position's index among the others'
        repeat = mx.where(n_mine > 0, mx.argmax(selected), order[0])  # a slot read anyway
        fill = mx.where(nth < want, order[mx.clip(nth, 0, local - 1)], repeat).reshape(mine.shape)
        self._touch(selected | (mx.argsort(order) < want))
        return fill

    def _sorted(self, rows: mx.array, slots: mx.array) -> mx.array:
        """Many rows (a prompt, a wide batch) alone: mlx-lm's SwitchGLU sorted path op for op (rows
        grouped by expert, gather_mm told so, then put back), so a lone node's prefill is stock's to
        the bit in every dtype (a GPU's sorted kernel rounds differently from its unsorted one)."""
        flat = slots.flatten()
        order = mx.argsort(flat)
        back = mx.argsort(order)
        y = self._mlp(rows.flatten(0, -3)[order // slots.shape[-1]], flat[order], None)
        return mx.unflatten(y[back], 0, slots.shape).squeeze(-2)

    def __call__(self, x: mx.array, inds: mx.array) -> mx.array:
        state = self._state
        if self._next is not None:  # the next layer's likely misses read while this one runs
            self._next.prefetch(self._next_candidates, self._depth)
        if self._route != "host" and (inds.size < SORTED_FROM or state.world_size == 1):
            return self._routed_on_device(x, inds)
        t0 = time.perf_counter()
        flat = np.array(inds).reshape(-1, inds.shape[-1])  # host sync: tiny
        state.timers.attention_router += time.perf_counter() - t0
        state.count_routed(self._layer, flat)
        T, k = flat.shape
        chosen = assign(np.unique(flat).tolist(), self._holders)
        mine = sorted(int(self._slot[e]) for e, r in chosen.items() if r == state.rank)
        cache = self._cache
        if cache is not None:  # the misses are read from here on, while the rest of the call is set up
            cache.fetch(mine[: cache.capacity])
        counts = per_rank(chosen, state.world_size)
        fillers = self._fillers(mine, max(counts))
        if self._ids:
            computed = np.zeros(len(self._ids), dtype=bool)
            computed[mine + fillers] = True
            self._touch(mx.array(computed))
        c = state.counters[self._layer]
        c.calls += 1
        c.selected += len(mine)
        c.computed += len(mine) + len(fillers)
        c.filler += len(fillers)
        c.cluster_max += max(counts)
        c.positions += flat.size

        out_shape = tuple(inds.shape) + (x.shape[-1],)
        if not mine and not fillers:
            if cache is not None:
                cache.drop_staged()
            return mx.zeros(out_shape, dtype=x.dtype)
        # The (token, j) positions whose expert this node computes, then one row per filler
        # expert; rows sorted by slot so each expert's tokens are contiguous (gather_mm's
        # sorted path, or one matmul per expert).
        flat1 = flat.reshape(-1)
        here = np.array([e for e, r in chosen.items() if r == state.rank], dtype=flat1.dtype)
        positions = np.flatnonzero(np.isin(flat1, here))
        local = self._slot[flat1[positions]]  # each position's local expert
        xf = x.reshape(-1, x.shape[-1])
        # With a cache, the experts go through the slots C at a time (one round, unless this call
        # selects more than C); without, the local index is the slot.
        size = cache.capacity if cache is not None else max(len(mine), 1)
        rounds = [mine[i: i + size] for i in range(0, len(mine), size)] or [[]]
        if cache is not None and len(rounds) > 1:
            cache.stats.rounds += 1
        ys, src, base = [], np.full(T * k, -1, dtype=np.int64), 0
        for r, chunk in enumerate(rounds):
            slot_of = cache.ensure(chunk) if cache is not None else None
            if cache is not None and r + 1 < len(rounds):  # the next round's first misses, while this one computes
                cache.fetch(rounds[r + 1][: self._ahead])
            extra = fillers if r == len(rounds) - 1 else []
            if slot_of is not None:  # fillers were picked resident; loading `chunk` may have evicted some
                extra = [s for s in extra if slot_of[s] >= 0]
            sel = np.flatnonzero(np.isin(local, chunk))
            row_local = np.concatenate([local[sel], np.asarray(extra, dtype=np.int64)])
            row_slots = slot_of[row_local] if slot_of is not None else row_local
            row_tokens = np.concatenate([positions[sel] // k, np.zeros(len(extra), dtype=np.int64)])
            perm = np.argsort(row_slots, kind="stable")
            row_slots, row_tokens = row_slots[perm], row_tokens[perm]
            sorted_row = np.empty(len(perm), dtype=np.int64)
            sorted_row[perm] = np.arange(len(perm))
            rows = xf[mx.array(row_tokens.astype(np.int32))][:, None, :]
            y = self._mlp(rows, mx.array(row_slots.astype(np.uint32)), _groups(row_slots))[:, 0, :]
            if cache is not None:
                cache.reading(y)  # evaluated before the next miss overwrites a slot it reads
            src[positions[sel]] = base + sorted_row[: len(sel)]
            base += len(row_slots)
            ys.append(y)
        if cache is not None:
            cache.drop_staged()  # prefetched experts the routing did not select
        # Every position takes its row, or the appended zero row if another node computes it.
        # Filler rows are computed with the rest (one primitive) and then left out.
        src[src < 0] = base
        y = mx.concatenate(ys + [mx.zeros((1, ys[0].shape[-1]), dtype=ys[0].dtype)], axis=0)
        return y[mx.array(src.astype(np.int32))].reshape(out_shape)

    def warm_up(self) -> None:
        """Touch every local expert once (the paper's warm-up before the first request)."""
        if not self._ids:
            return
        d_in = self.down_proj if self._kind == "glu" else self.fc2
        hidden = _out_dim(d_in)
        slots = np.arange(self._cache.capacity if self._cache is not None else len(self._ids))
        x = mx.zeros((len(slots), 1, hidden), dtype=_act_dtype(d_in))
        groups = _groups(slots)
        mx.eval(self._mlp(x, mx.array(slots.astype(np.uint32)), groups))

    def resident_bytes(self) -> int:
        return sum(v.nbytes for _, v in _leaves(self.parameters()))

    def matrix_bytes(self) -> int:
        """Bytes of one local expert (every projection: weights, scales, biases), what a kernel
        reads for one expert it computes."""
        slots = self._projections()[0].weight.shape[0]
        return self.resident_bytes() // slots if slots else 0


def _skip_proj(p: ShardLinear, x: mx.array, slots: mx.array, per_x: int) -> mx.array:
    """One projection of the skipping decode step, by the kernel for its weight format."""
    if p.quant is None:
        return skip_gemv.skip_gemv(x, p.weight, slots, per_x)
    return qskip.qskip(x, p.weight, p.scales, p.get("biases"), slots, per_x, p.quant)


def _groups(slots: np.ndarray) -> list[tuple[int, int, int]]:
    """Runs of equal slot in sorted rows: [(slot, start, end)]."""
    if len(slots) == 0:
        return []
    edges = np.flatnonzero(np.diff(slots)) + 1
    starts = np.concatenate([[0], edges])
    ends = np.concatenate([edges, [len(slots)]])
    return [(int(slots[a]), int(a), int(b)) for a, b in zip(starts, ends)]


def _out_dim(lin: ShardLinear) -> int:
    return lin.weight.shape[1]


def _act_dtype(lin: ShardLinear) -> mx.Dtype:
    if lin.quant is not None:
        return lin.scales.dtype if lin.scales.dtype in (mx.float32, mx.float16, mx.bfloat16) else mx.float32
    return lin.weight.dtype


def _leaves(tree):
    from mlx.utils import tree_flatten

    return tree_flatten(tree)
