"""Which node computes each selected expert: the one deterministic rule every node applies.

The router is replicated, so every node sees the same selection and, applying the same rule to
the same placement, reaches the same assignment without talking to the others. The performance
model uses the same rule to compute the expected per-node load.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

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
