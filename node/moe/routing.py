"""Which node computes each selected expert: the one deterministic rule every node applies.

The router is replicated, so every node sees the same selection and, applying the same rule to
the same placement, reaches the same assignment without talking to the others. The performance
model uses the same rule to compute the expected per-node load.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import mlx.core as mx
import numpy as np

# holders[e] = the ranks that hold expert e of this layer, ascending.
Holders = Mapping[int, Sequence[int]]


def assign(selected: Iterable[int], holders: Holders) -> dict[int, int]:
    """Map each selected expert to the rank that computes it.

    An expert held once goes to its holder. Replicated experts are then taken in order of
    (number of holders, expert id) and each goes to its least-loaded holder, the lowest rank on a
    tie, so the largest per-node count stays small and every node agrees.
    """
    chosen: dict[int, int] = {}
    load: dict[int, int] = {}
    replicated = []
    for e in sorted(set(selected)):
        hs = holders.get(e)
        if not hs:
            raise KeyError(f"expert {e} is held by no node")
        if len(hs) == 1:
            chosen[e] = hs[0]
            load[hs[0]] = load.get(hs[0], 0) + 1
        else:
            replicated.append(e)
    for e in sorted(replicated, key=lambda e: (len(holders[e]), e)):
        r = min(holders[e], key=lambda r: (load.get(r, 0), r))
        chosen[e] = r
        load[r] = load.get(r, 0) + 1
    return chosen


def per_rank(chosen: Mapping[int, int], world_size: int) -> list[int]:
    """How many experts each rank computes under an assignment {expert: rank}."""
    counts = [0] * world_size
    for r in chosen.values():
        counts[r] += 1
    return counts


def rank_counts(selected: Iterable[int], holders: Holders, world_size: int) -> list[int]:
    """How many distinct selected experts each rank computes under `assign`."""
    return per_rank(assign(selected, holders), world_size)


def selected_experts(inds: mx.array, experts: mx.array) -> mx.array:
    """(num_experts,) bool: the experts a call's indices select, on the device (`experts`: the
    ids, arange(num_experts), made once by the caller). A comparison and a reduction: two kernels
    where a scatter into zeros is three."""
    return (inds.reshape(-1, 1) == experts).any(axis=0)


def everywhere_or_once(holders: Holders, world_size: int) -> bool:
    """Every expert is held by one node or by all of them: every placement at N = 2, and any
    placement whose replicas are full copies. `ArrayRule` computes `assign` for these."""
    full = tuple(range(world_size))
    return all(len(rs) == 1 or tuple(rs) == full for rs in holders.values())


class ArrayRule:
    """`assign` as a few array operations on the device, for holders where `everywhere_or_once`:
    the decode step learns which node computes each replicated expert without reading the routing
    on the host.

    With every replica on every node, `assign`'s greedy pass is water-filling: the single-held
    experts set each rank's load L_r, then each replicated expert, by id, takes the free place
    (level, rank) that is smallest in that order, with level >= L_r. So the n-th replicated expert
    selected goes to the rank of the n-th smallest such place; only levels min(L) .. min(L) + P - 1
    can hold one of the first P. The unit tests hold it to `assign` on random selections.
    """

    def __init__(self, holders: Holders, world_size: int):
        if not everywhere_or_once(holders, world_size):
            raise ValueError("ArrayRule needs every expert held by one node or by every node")
        n = len(holders)
        single = np.array([len(holders[e]) == 1 for e in range(n)])
        owner = np.array([holders[e][0] for e in range(n)])
        self._n, self._world, self._replicated = n, world_size, int((~single).sum())
        self._single = mx.array(single)
        self._owner = mx.array(owner.astype(np.int32))
        self._load = mx.array(
            ((owner[:, None] == np.arange(world_size)) & single[:, None]).astype(np.int32)
        )
        self._grids: dict[
            int, tuple[mx.array, mx.array]
        ] = {}  # P -> levels above min(L) (P, 1), places (P, world)

    def __call__(self, inds: mx.array, present: mx.array) -> mx.array:
        """(num_experts,) int32: the rank computing each expert that `inds` select (`present`: the
        experts they select, `selected_experts`); any rank for the others."""
        P = max(min(inds.size, self._replicated), 1)  # replicated experts one call can select
        if P not in self._grids:
            self._grids[P] = (
                mx.arange(P, dtype=mx.int32)[:, None],
                mx.arange(P * self._world, dtype=mx.int32).reshape(P, self._world),
            )
        levels, places = self._grids[P]
        load = (self._load * present[:, None]).sum(axis=0)  # (world,): single-held experts per rank
        nth = (
            mx.cumsum((present & ~self._single).astype(mx.int32)) - 1
        )  # each replica's turn, by id
        free = levels + load.min() >= load  # (P, world): place (level, rank) is above rank's load
        turn = mx.sort(mx.where(free, places, P * self._world).reshape(-1))[:P] % self._world
        return mx.where(self._single, self._owner, turn[mx.clip(nth, 0, P - 1)])
