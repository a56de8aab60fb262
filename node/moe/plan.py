"""Slot plans: how a MoE layer's routing indices become this node's local slots, and which
positions are its own, chosen once at load.

On the device, without reading the indices on the host: a table from expert to local slot
(`Table`: every expert has one holder; `Alone`: one node holds every expert), or the replica rule
as array operations (`Replicas`: every expert has one holder or all of them). Keepalive lru wraps
either (`Recency.fill`): the positions another node computes take this node's least recently used
experts, on the device. Otherwise the host reads the indices (`HostPlan`), assigns the experts,
picks keepalive's fillers, and an expert cache (expert_cache.py) fills its slots round by round.
Where the device can plan a call the host must still shape (`CountedPlan`: a prompt, a wide batch),
the device sorts its rows (its positions and keepalive lru's fillers) and the host reads only how
many there are.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import cached_property, partial
from typing import TYPE_CHECKING, Callable, Iterator, Mapping

import mlx.core as mx
import numpy as np

from .expert_cache import LayerCache
from .routing import ArrayRule, assign, everywhere_or_once, per_rank, selected_experts

if TYPE_CHECKING:
    from .telemetry import ShardState

_STAMP_SPAN = 1 << 16  # keepalive's recency counts restart this often (Recency.touch)
_UNHELD = -2  # HostPlan's owner of an expert no node holds


@dataclass(frozen=True)
class ShardConfig:
    """What one shard is, fixed at load: its MoE layer, the experts it holds (local slot i holds
    global expert global_ids[i]), who holds every expert, its MLP's kind, and the node's place."""

    layer: int
    global_ids: tuple[int, ...]
    holders: Mapping[int, tuple[int, ...]]  # global expert -> the ranks holding it
    kind: str  # "glu" (gate/up/down) or "mlp" (fc1/fc2)
    rank: int
    world_size: int
    keepalive: str  # proto.records.KEEPALIVES

    @property
    def num_experts(self) -> int:
        return max(len(self.holders), 1)

    def slot_table(self) -> np.ndarray:
        """global expert -> local slot, -1 where not held here; (num_experts,)."""
        slot = np.full(self.num_experts, -1, dtype=np.int64)
        for i, e in enumerate(self.global_ids):
            slot[e] = i
        return slot


@dataclass(frozen=True)
class SlotTables:
    """Expert -> this node's slot, on the device, (num_experts,) each: made once at load (Table) or
    per call (Replicas, from the replica rule's ranks). A kernel takes the form it reads, so that
    one gather gives it what an index, a mask and a cast gave before."""

    slot: mx.array  # int32: the local slot, -1 where another node computes the expert
    safe: mx.array  # uint32: the local slot, 0 where another node computes it (any kernel reads)
    here: mx.array  # bool: this node computes it
    away: mx.array  # int32: 1 where another node computes it (keepalive lru counts them)

    @classmethod
    def fixed(cls, slot: np.ndarray) -> SlotTables:
        """From a table fixed at load (numpy, -1 where another node computes the expert)."""
        here = slot >= 0
        return cls(
            mx.array(slot.astype(np.int32)),
            mx.array(np.where(here, slot, 0).astype(np.uint32)),
            mx.array(here),
            mx.array((~here).astype(np.int32)),
        )


class Routed:
    """A device plan's answer for one call: the routing indices `inds` (..., k) and, each made on
    first use so that a kernel's graph holds only what it reads, `slots` the local slot of each
    position (-1 where another node computes it), `safe` the same with 0 there (uint32), and
    `mine` whether this node computes it (None when alone: every position is ours, `slots` given);
    `fill` (..., k) the slot such a position reads instead (keepalive lru), None where none was
    chosen, and `filling` (..., k) where that slot is one of the call's fillers (the others repeat
    an expert read anyway)."""

    def __init__(
        self,
        inds: mx.array,
        tables: SlotTables | None = None,
        slots: mx.array | None = None,
        fill: mx.array | None = None,
    ):
        self.inds, self.fill, self._tables = inds, fill, tables
        self.filling: mx.array | None = None
        if slots is not None:
            self.slots = slots

    @property
    def alone(self) -> bool:
        return self._tables is None

    @cached_property
    def slots(self) -> mx.array:
        return self._tables.slot[self.inds]

    @cached_property
    def safe(self) -> mx.array:
        return self._tables.safe[self.inds]

    @cached_property
    def away(self) -> mx.array:
        return self._tables.away[self.inds]

    @cached_property
    def mine(self) -> mx.array | None:
        return None if self._tables is None else self._tables.here[self.inds]


class Recency:
    """Keepalive's recency, on the device so that the decode step can choose its fillers without
    a host read: the call count at which each local slot was last computed (0: never), and the
    count itself. Least recently used = smallest (stamp, slot)."""

    def __init__(self, local: int):
        self.stamp = mx.zeros((local,), dtype=mx.int32)
        self.calls = 0
        self._slots = mx.array(np.arange(local, dtype=np.int32))  # fill's tie-break, made once

    def order(self) -> list[int]:
        """Local slots, least recently computed first (reads the stamps on the host)."""
        stamp = np.array(self.stamp)
        return np.lexsort((np.arange(len(stamp)), stamp)).tolist()

    def saved(self) -> tuple:
        return self.stamp, self.calls

    def restore(self, saved: tuple) -> None:
        self.stamp, self.calls = saved

    def touch(self, computed: mx.array) -> None:
        """Stamp the slots `computed` (bool, per slot) with this call's count. The counts restart
        every _STAMP_SPAN calls, older stamps shifted down (those older than half the span tie at
        0), so that fill's int32 key, stamp × local slots + slot, never overflows."""
        if self.calls >= _STAMP_SPAN:
            self.calls -= _STAMP_SPAN // 2
            self.stamp = mx.maximum(self.stamp - _STAMP_SPAN // 2, 0)
        self.calls += 1
        self.stamp = mx.where(computed, self.calls, self.stamp)

    def fill(
        self,
        away: mx.array,
        present: mx.array,
        ranks: mx.array,
        selected: mx.array,
        rank: int,
        rows: bool = False,
    ) -> tuple[mx.array, mx.array | None]:
        """Keepalive lru on the device (`away` (..., k) int32: 1 at the positions another node
        computes; `present`: the experts this call selects; `ranks`: expert x rank, who computes it;
        `selected` (local,): the local slots computed here): the slot each position another node
        computes takes here, so that this node computes as many distinct experts as the busiest
        node (min(cluster max, its experts)), the extra ones its least recently used; the rest
        repeat an expert already read. Another node's positions always suffice: the busiest node's
        experts all sit at positions that are not ours. Its outputs are zeroed by the kernel; only
        the weights' reads matter, and what it holds at this node's own positions is never read.
        `rows`: also where fill is a filler (CountedPlan computes a row for each), else None."""
        if self.calls >= _STAMP_SPAN:  # as touch: the counts restart, older stamps shifted down
            self.calls -= _STAMP_SPAN // 2
            self.stamp = mx.maximum(self.stamp - _STAMP_SPAN // 2, 0)
        self.calls += 1
        if (rank, rows) not in _LRU_FILL:
            _LRU_FILL[rank, rows] = mx.compile(partial(_lru_fill, rank=rank, rows=rows))
        fill, self.stamp, *filling = _LRU_FILL[rank, rows](
            away, present, ranks, selected, self.stamp, mx.array(self.calls), self._slots
        )
        return fill, filling[0] if rows else None


# (rank, rows) -> _lru_fill compiled, shared by every layer
_LRU_FILL: dict[tuple[int, bool], Callable] = {}


def _lru_fill(away, present, ranks, selected, stamp, calls, slots, rank: int, rows: bool):
    """Recency.fill's arithmetic, a pure function compiled once per shape (its elementwise runs
    fused): (the filler of each position, the stamps after this call[, the fillers' positions])."""
    local = slots.shape[0]
    per_rank = (present[:, None] & ranks).sum(axis=0)  # distinct experts per rank (int32)
    n_mine = per_rank[rank : rank + 1]  # a slice: a view, where an index would gather
    want = mx.minimum(per_rank.max(), local) - n_mine  # fillers this call
    # the free slots, least recently used first
    order = mx.argsort(mx.where(selected, 2**31 - 1, stamp * local + slots))
    # each of the other nodes' positions: its index among them (>= 0: clipped above only)
    nth = mx.cumsum(away.reshape(-1), inclusive=False)
    repeat = mx.where(n_mine > 0, mx.argmax(selected), order[:1])  # a slot read anyway
    fill = mx.where(nth < want, order[mx.minimum(nth, local - 1)], repeat)
    computed = selected | (mx.argsort(order) < want)
    out = (fill.reshape(away.shape), mx.where(computed, calls, stamp))
    if not rows:  # the device route's graph: nothing it does not read
        return out
    return (*out, ((away.reshape(-1) > 0) & (nth < want)).reshape(away.shape))


class Alone:
    """One node holds every expert: each index is its expert's slot (the identity in id order)."""

    def __init__(self, cfg: ShardConfig, state: ShardState):
        self._layer, self._state = cfg.layer, state
        slot = cfg.slot_table()
        self.rank_of = np.array([cfg.holders[e][0] for e in range(len(slot))], dtype=np.int64)
        lut = np.where(self.rank_of == cfg.rank, slot, -1)  # global -> slot
        self.identity = bool(np.array_equal(lut, np.arange(len(slot))))  # the indices are the slots
        # every expert is here (world size 1): uint32 already, as gather_mm takes it
        self.lut = mx.array(lut.astype(np.uint32))

    def __call__(self, inds: mx.array) -> Routed:
        self._state.note(self._layer, inds, self.rank_of)
        return Routed(inds, slots=inds if self.identity else self.lut[inds])


class Table:
    """Every expert has one holder: a table from global expert to local slot, -1 elsewhere;
    keepalive lru (`recency`) points the others' positions at fillers."""

    def __init__(self, cfg: ShardConfig, state: ShardState, recency: Recency | None):
        self._layer, self._state, self._rank, self.recency = cfg.layer, state, cfg.rank, recency
        slot = cfg.slot_table()
        self.rank_of = np.array([cfg.holders[e][0] for e in range(len(slot))], dtype=np.int64)
        self.tables = SlotTables.fixed(np.where(self.rank_of == cfg.rank, slot, -1))
        if recency is not None:
            self._local = mx.array(np.asarray(cfg.global_ids, dtype=np.int32))  # slot -> global id
            self._experts = _expert_ids(len(slot))
            # expert -> its rank, one-hot (num_experts, world): distinct experts per rank in one sum
            self._ranks = mx.array(self.rank_of[:, None] == np.arange(cfg.world_size))

    def __call__(self, inds: mx.array, rows: bool = False) -> Routed:
        """`rows`: the fillers' positions too (Routed.filling), for CountedPlan."""
        self._state.note(self._layer, inds, self.rank_of)
        r = Routed(inds, self.tables)
        if self.recency is not None:
            present = selected_experts(inds, self._experts)
            # every local expert has this node as its one holder: selected here if present
            r.fill, r.filling = self.recency.fill(
                r.away, present, self._ranks, present[self._local], self._rank, rows
            )
        return r


class Replicas:
    """Every expert has one holder or all of them: each call's ranks for the replicas come from the
    replica rule as array operations (routing.ArrayRule), then its table; keepalive lru as Table."""

    def __init__(self, cfg: ShardConfig, state: ShardState, recency: Recency | None):
        self._layer, self._state, self._rank, self.recency = cfg.layer, state, cfg.rank, recency
        slot = cfg.slot_table()
        self._n = len(slot)
        self.rule = ArrayRule(cfg.holders, cfg.world_size)
        self._held_slot = mx.array(slot.astype(np.int32))  # global -> slot here, -1: not held
        self._held_safe = mx.array(np.maximum(slot, 0).astype(np.uint32))  # 0: not held
        self._experts = _expert_ids(self._n)
        if recency is not None:
            self._local = mx.array(np.asarray(cfg.global_ids, dtype=np.int32))
            # each call's ranks, one-hot against the ranks
            self._world = mx.array(np.arange(cfg.world_size, dtype=np.int32))

    def __call__(self, inds: mx.array, rows: bool = False) -> Routed:
        """`rows`: as Table's."""
        present = selected_experts(inds, self._experts)
        rank_of = self.rule(inds, present)
        here = rank_of == self._rank
        self._state.note(self._layer, inds, rank_of)
        tables = SlotTables(
            mx.where(here, self._held_slot, -1),
            mx.where(here, self._held_safe, 0),
            here,
            mx.where(here, 0, 1),
        )
        r = Routed(inds, tables)
        if self.recency is not None:
            ranks = rank_of[:, None] == self._world
            selected = (present & here)[self._local]
            r.fill, r.filling = self.recency.fill(
                r.away, present, ranks, selected, self._rank, rows
            )
        return r


def _expert_ids(n: int) -> mx.array:
    """selected_experts' ids, made once, in the routing indices' dtype (argpartition's uint32): a
    comparison of other dtypes would cast both sides every call."""
    return mx.array(np.arange(n, dtype=np.uint32))


def device_plan(
    cfg: ShardConfig, state: ShardState, recency: Recency
) -> Alone | Table | Replicas | None:
    """The plan that routes this shard's calls on the device, or None where the host must decide:
    the work must be a fixed function of the indices and of device state (every expert has one
    holder, or one holder or all of them; keepalive none, or lru with its fillers chosen on the
    device from the recency stamps, or the node alone, where the cluster maximum is its own)."""
    if (
        not cfg.global_ids
        or not everywhere_or_once(cfg.holders, cfg.world_size)
        or not (cfg.keepalive in ("none", "lru") or cfg.world_size == 1)
    ):
        return None
    if cfg.world_size == 1:
        return Alone(cfg, state)
    lru = recency if cfg.keepalive == "lru" else None
    if all(len(rs) == 1 for rs in cfg.holders.values()):
        return Table(cfg, state, lru)
    return Replicas(cfg, state, lru)


@dataclass
class Rows:
    """One round of a host-read call: the rows it computes, sorted by slot."""

    positions: np.ndarray  # the (token, j) positions these rows answer
    order: np.ndarray  # each of those positions' row among the sorted ones
    tokens: np.ndarray  # per row, the token whose input it reads
    slots: np.ndarray  # per row, the slot computing it (sorted)


class Hosted:
    """A host plan's answer for one call: the positions this node computes and its fillers, in
    rounds of at most the cache's slots (one round without a cache); `rounds()` fills the slots
    as it goes, and `reading(y)` holds each round's output until then."""

    def __init__(
        self,
        inds: mx.array,
        positions: np.ndarray = None,
        local: np.ndarray = None,
        mine: list[int] = (),
        fillers: list[int] = (),
        cache: LayerCache | None = None,
        ahead: int = 1,
        k: int = 1,
    ):
        self.inds = inds
        self.positions_total = int(np.prod(inds.shape))
        self.empty = not mine and not fillers
        self._positions, self._local = positions, local
        self._mine, self._fillers = list(mine), list(fillers)
        self._cache, self._ahead, self._k = cache, ahead, k

    def reading(self, y: mx.array) -> None:
        if self._cache is not None:
            self._cache.reading(y)

    def rounds(self) -> Iterator[Rows]:
        cache, mine, local, positions = self._cache, self._mine, self._local, self._positions
        k = self._k
        # With a cache, the experts go through the slots C at a time (one round, unless this call
        # selects more than C); without, the local index is the slot.
        size = cache.capacity if cache is not None else max(len(mine), 1)
        rounds = [mine[i : i + size] for i in range(0, len(mine), size)] or [[]]
        if cache is not None and len(rounds) > 1:
            cache.stats.rounds += 1
        for r, chunk in enumerate(rounds):
            slot_of = cache.ensure(chunk) if cache is not None else None
            # the next round's first misses are read while this one computes
            if cache is not None and r + 1 < len(rounds):
                cache.fetch(rounds[r + 1][: self._ahead])
            extra = self._fillers if r == len(rounds) - 1 else []
            # fillers were picked resident; loading `chunk` may have evicted some
            if slot_of is not None:
                extra = [s for s in extra if slot_of[s] >= 0]
            # one round without a cache: every position is in it
            sel = (
                np.flatnonzero(np.isin(local, chunk))
                if cache is not None
                else np.arange(len(local))
            )
            row_local = np.concatenate([local[sel], np.asarray(extra, dtype=np.int64)])
            row_slots = slot_of[row_local] if slot_of is not None else row_local
            row_tokens = np.concatenate([positions[sel] // k, np.zeros(len(extra), dtype=np.int64)])
            perm = np.argsort(row_slots, kind="stable")
            sorted_row = np.empty(len(perm), dtype=np.int64)
            sorted_row[perm] = np.arange(len(perm))
            yield Rows(positions[sel], sorted_row[: len(sel)], row_tokens[perm], row_slots[perm])
        if cache is not None:
            cache.drop_staged()  # prefetched experts the routing did not select


class HostPlan:
    """The host reads the routing (one sync), assigns every selected expert to one holder
    (routing.assign), counts the call, and picks keepalive's fillers from the recency stamps; with
    an expert cache, the misses start reading as soon as they are known."""

    def __init__(
        self,
        cfg: ShardConfig,
        state: ShardState,
        recency: Recency,
        cache: LayerCache | None = None,
        ahead: int = 1,
    ):
        self.cfg, self._state, self.recency = cfg, state, recency
        self._slot = cfg.slot_table()
        # each expert's one holder, -1 where several hold it (routing.assign picks per call): with
        # no replicas a call's assignment is a lookup, not a loop over its experts
        self._owner = np.full(cfg.num_experts, _UNHELD, dtype=np.int64)
        for e, rs in cfg.holders.items():
            self._owner[e] = rs[0] if len(rs) == 1 else -1
        self._replicas = any(len(rs) > 1 for rs in cfg.holders.values())
        self.cache = cache
        self._ahead = max(int(ahead), 1)

    def __call__(self, inds: mx.array) -> Hosted:
        cfg, state, cache = self.cfg, self._state, self.cache
        t0 = time.perf_counter()
        flat = np.array(inds).reshape(-1, inds.shape[-1])  # host sync: tiny
        state.timers.attention_router += time.perf_counter() - t0
        state.count_routed(cfg.layer, flat)
        selected = np.unique(flat)
        rank_of = self._ranks(selected)  # (num_experts,): the rank computing each selected expert
        counts = np.bincount(rank_of[selected], minlength=cfg.world_size)
        mine = np.sort(self._slot[selected[rank_of[selected] == cfg.rank]]).tolist()
        # the misses are read from here on, while the rest of the call is set up
        if cache is not None:
            cache.fetch(mine[: cache.capacity])
        fillers = self._fillers(mine, int(counts.max()))
        if cfg.global_ids and cfg.keepalive != "none":  # the stamps are read for fillers only
            computed = np.zeros(len(cfg.global_ids), dtype=bool)
            computed[mine + fillers] = True
            self.recency.touch(mx.array(computed))
        state.count_call(cfg.layer, len(mine), len(fillers), int(counts.max()), flat.size)
        if not mine and not fillers:
            if cache is not None:
                cache.drop_staged()
            return Hosted(inds)
        # The (token, j) positions whose expert this node computes, then one row per filler
        # expert; rows sorted by slot so each expert's tokens are contiguous (gather_mm's
        # sorted path, or one matmul per expert).
        flat1 = flat.reshape(-1)
        positions = np.flatnonzero(rank_of[flat1] == cfg.rank)
        return Hosted(
            inds,
            positions,
            self._slot[flat1[positions]],
            mine,
            fillers,
            cache,
            self._ahead,
            flat.shape[1],
        )

    def _ranks(self, selected: np.ndarray) -> np.ndarray:
        """The rank computing each expert (num_experts,) under routing.assign for a call that
        selects `selected` (sorted, distinct); -1 for replicated experts it does not select."""
        owner = self._owner
        outside = (selected < 0) | (selected >= len(owner))
        if outside.any() or (owner[selected[~outside]] == _UNHELD).any():
            bad = selected[outside][0] if outside.any() else selected[owner[selected] == _UNHELD][0]
            raise KeyError(f"expert {int(bad)} is held by no node")
        if not self._replicas:
            return owner
        chosen = assign(selected.tolist(), self.cfg.holders)
        rank_of = owner.copy()
        rank_of[list(chosen)] = list(chosen.values())
        return rank_of

    def _fillers(self, mine: list[int], cluster_max: int) -> list[int]:
        policy = self.cfg.keepalive
        if policy == "none":
            return []
        taken = set(mine)
        free = [s for s in self.recency.order() if s not in taken]
        # keep busy with what is resident: a filler is never read from disk
        if self.cache is not None:
            free = [s for s in free if self.cache.slot_of[s] >= 0]
        if policy == "busy":
            return free
        want = min(cluster_max, len(self.cfg.global_ids)) - len(mine)
        return free[: max(want, 0)]  # least recently used first


class Counted:
    """A counted plan's answer for one call: the routing indices `inds`; per position (flat), the
    slot its row reads (`slots`: its own expert's, or keepalive's filler) and whether its output is
    this node's (`mine`); the positions sorted by (slot, position) with the rows first (`order`, on
    the device), and how many rows there are (`n`, read)."""

    def __init__(self, inds: mx.array, slots: mx.array, mine: mx.array, order: mx.array, n: int):
        self.inds, self.slots, self.mine, self.order, self.n = inds, slots, mine, order, n


class CountedPlan:
    """The host read where the device can plan (every expert has one holder or all of them,
    keepalive none or lru, no expert cache): the device plan (Table, Replicas) assigns every
    position and picks keepalive lru's fillers, the device sorts this node's rows by slot (its
    positions, then one per filler), as HostPlan's numpy does, and the host reads only how many
    rows there are, the one number that fixes their shape. Python's part of the read is a few
    graph operations, so the node's MLX worker, idle from the read until the experts are handed to
    it, waits less (one rank by stream, 16 streams of 1,024 positions on the CPU: 0.39 ms a layer
    from the read to the experts' start with HostPlan, 0.17 with this; docs/race.md). The counts
    and the stamps are the device plan's (ShardState.note, Recency.fill)."""

    cache = None  # in the host plan's place: never an expert cache here

    def __init__(self, device: Table | Replicas, state: ShardState, local: int):
        self.device, self._state, self._local = device, state, local
        self._positions: dict[int, mx.array] = {}  # positions of a call -> arange, made once

    def __call__(self, inds: mx.array) -> Counted:
        r = self.device(inds, rows=True)
        slots = r.slots.reshape(-1)
        mine = slots >= 0
        if r.fill is None:
            rows = mine
        else:  # a filler's row reads its slot, its output is not this node's
            rows = mine | r.filling.reshape(-1)
            slots = mx.where(mine, slots, r.fill.reshape(-1))
        p = slots.size
        if p not in self._positions:
            self._positions[p] = mx.arange(p, dtype=mx.int32 if self._fits(p) else mx.int64)
        # slot-major, then position: HostPlan's rows in HostPlan's order; the rest last
        key = slots.astype(self._positions[p].dtype) * p + self._positions[p]
        order = mx.argsort(mx.where(rows, key, self._local * p))
        count = rows.sum()
        t0 = time.perf_counter()
        n = count.item()  # host sync: one number
        self._state.timers.attention_router += time.perf_counter() - t0
        return Counted(r.inds, slots, mine, order, n)

    def _fits(self, p: int) -> bool:
        return (self._local + 1) * p < 2**31


# a shard's slot plan: routing indices -> its slots
Plan = Callable[[mx.array], "Routed | Hosted | Counted"]
