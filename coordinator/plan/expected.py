"""E[experts computed per node per MoE layer]: the `E` of Eq. 1, computed rather than typed in.

Eq. 1 is bound by the slowest node, so E is the expectation of the *maximum* over nodes of the
experts each computes in a layer, under the placement, the keepalive policy and the routing:

- `none`: each node computes its selected local experts; E = E[max over nodes].
- `lru`: each node pads its compute up to the cluster's max with least-recently-used local
  experts, so every node computes the max; E[max] is the same as for `none`.
- `busy`: each node computes all of its local experts every layer; E = max local expert count.

With a batch of B sequences a step routes B tokens, and a node computes each of its experts that
any of them selected once, for all of them: E_B = E[max over nodes of distinct local selected].

Routing is uniform top-k without replacement (every k-subset equally likely) unless a measured
profile gives the selected sets. Which replica computes a selected expert is decided by the one
rule every node applies, `node.routing.assign`. Methods, best first: exact over the
hypergeometric distribution of counts (placements without replicas, any size); exact
enumeration of all C(E, k) selections (small replicated placements); a seeded Monte-Carlo
estimate with its standard error (large replicated placements); the empirical mean over a
profile's recorded selections (exact for that profile).
"""

from __future__ import annotations

import itertools
import logging
import math
import random
from dataclasses import dataclass
from fractions import Fraction
from typing import Iterable, Mapping, Sequence

from ...node.moe.routing import rank_counts
from ...proto.placement import copy_everywhere, holders_of
from ...proto.records import KEEPALIVES
from .perfmodel import PlanError

logger = logging.getLogger(__name__)

ENUMERATION_LIMIT = 100_000  # selections; beyond this a replicated placement is sampled
MONTE_CARLO_SAMPLES = 20_000
MONTE_CARLO_SEED = 0
BATCH_SAMPLES = 4_000  # batches of tokens per Monte-Carlo E for --batch

Placement = Mapping[int, Sequence[int]]  # {rank: [expert ids]}


@dataclass(frozen=True)
class ExpectedExperts:
    """E for one MoE layer, and how it was obtained."""

    value: float
    method: str
    stderr: float = 0.0  # Monte-Carlo standard error; 0 when exact


# --- placements -----------------------------------------------------------------------------


def even_split(num_experts: int, nodes: int) -> dict[int, list[int]]:
    """Contiguous blocks of expert ids; the first `num_experts % nodes` ranks get one more (the
    node's own even placement, node.placement.Placement.even)."""
    from ...proto.placement import Placement

    if nodes < 1:
        raise PlanError(f"node count must be at least 1 (got {nodes})")
    if num_experts < nodes:
        raise PlanError(
            f"{num_experts} experts cannot be split over {nodes} nodes (each node needs one)"
        )
    return {r: list(es) for r, es in Placement.even({0: num_experts}, nodes).layers[0].items()}


def placement_for(
    num_experts: int,
    nodes: int,
    replicas_per_node: int = 0,
    profile_counts: Sequence[int] | None = None,
) -> dict[int, list[int]]:
    """Experts split evenly, then up to `replicas_per_node` extra experts per node, as the
    placement planner copies them (proto.placement.copy_everywhere): the hottest first (by
    `profile_counts`; under uniform routing the ranks' blocks interleaved so that every rank's
    experts get copies alike), each to every node that lacks it while each of those has room.
    """
    placement = even_split(num_experts, nodes)
    if replicas_per_node < 0:
        raise PlanError(f"replicas per node must be >= 0 (got {replicas_per_node})")
    if profile_counts is not None and len(profile_counts) != num_experts:
        raise PlanError(
            f"profile has counts for {len(profile_counts)} experts, the model has {num_experts}"
        )
    if replicas_per_node == 0 or nodes == 1:
        return placement
    if profile_counts is not None:
        order = sorted(range(num_experts), key=lambda e: (-profile_counts[e], e))
    else:
        blocks = [placement[r] for r in sorted(placement)]
        order = [b[i] for i in range(max(map(len, blocks))) for b in blocks if i < len(b)]
    free = [min(replicas_per_node, num_experts - len(placement[r])) for r in sorted(placement)]
    return copy_everywhere(placement, free, order)


def is_disjoint(placement: Placement) -> bool:
    seen: set[int] = set()
    for es in placement.values():
        if seen & set(es):
            return False
        seen |= set(es)
    return True


# --- E[max] under uniform routing -----------------------------------------------------------


def expected_max_hypergeometric(sizes: Sequence[int], k: int) -> Fraction:
    """Exact E[max_r c_r] when k of sum(sizes) experts are drawn uniformly without replacement
    and rank r holds `sizes[r]` of them (no replicas): the counts are multivariate
    hypergeometric, P(all c_r <= t) = [x^k] Π_r Σ_{c<=t} C(s_r, c) x^c / C(E, k), and
    E[max] = Σ_{t=0}^{k-1} (1 - P(max <= t))."""
    total = sum(sizes)
    if not 0 <= k <= total:
        raise PlanError(f"top-k {k} must be between 0 and the expert count {total}")
    denom = math.comb(total, k)
    expect = Fraction(0)
    for t in range(k):
        poly = [1] + [0] * k  # coefficients of x^0..x^k
        for s in sizes:
            term = [math.comb(s, c) for c in range(min(t, s) + 1)]
            nxt = [0] * (k + 1)
            for i, a in enumerate(poly):
                if a:
                    for c, b in enumerate(term):
                        if i + c > k:
                            break
                        nxt[i + c] += a * b
            poly = nxt
        expect += 1 - Fraction(poly[k], denom)
    return expect


def _max_count(selected: Iterable[int], holders: Mapping[int, Sequence[int]], nodes: int) -> int:
    return max(rank_counts(selected, holders, nodes))


def expected_max_enumerated(placement: Placement, num_experts: int, k: int) -> Fraction:
    """Exact E[max] by applying `assign` to every one of the C(E, k) selections."""
    holders = holders_of(placement, num_experts)
    nodes = len(placement)
    total = sum(
        _max_count(s, holders, nodes) for s in itertools.combinations(range(num_experts), k)
    )
    return Fraction(total, math.comb(num_experts, k))


def expected_max_sampled(
    placement: Placement,
    num_experts: int,
    k: int,
    samples: int = MONTE_CARLO_SAMPLES,
    seed: int = MONTE_CARLO_SEED,
) -> tuple[float, float]:
    """Monte-Carlo E[max] over uniform k-subsets: (mean, standard error)."""
    holders = holders_of(placement, num_experts)
    nodes = len(placement)
    rng = random.Random(seed)
    xs = [_max_count(rng.sample(range(num_experts), k), holders, nodes) for _ in range(samples)]
    mean = sum(xs) / samples
    var = sum((x - mean) ** 2 for x in xs) / max(1, samples - 1)
    return mean, math.sqrt(var / samples)


def expected_max_from_sets(
    placement: Placement, num_experts: int, sets: Sequence[Sequence[int]]
) -> float:
    """Empirical E[max] over recorded selections (one set of expert ids per token)."""
    if not sets:
        raise PlanError("the routing profile has no recorded selections ('sets') for a layer")
    holders = holders_of(placement, num_experts)
    nodes = len(placement)
    for s in sets:
        bad = [e for e in s if not 0 <= e < num_experts]
        if bad:
            raise PlanError(
                f"profile selection {list(s)} names experts {bad} outside 0..{num_experts - 1}"
            )
    return sum(_max_count(s, holders, nodes) for s in sets) / len(sets)


def expected_distinct_alone(num_experts: int, top_k: int, batch: int) -> float:
    """Exact E[distinct experts selected by `batch` tokens], uniform routing: each expert is missed
    by one token with probability 1 - k/E, by all of them independently."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def expected_max_batch_sampled(
    placement: Placement,
    num_experts: int,
    k: int,
    batch: int,
    sets: Sequence[Sequence[int]] | None = None,
    samples: int = BATCH_SAMPLES,
    seed: int = MONTE_CARLO_SEED,
) -> tuple[float, float]:
    """Monte-Carlo E[max over nodes of the distinct local experts `batch` tokens select]: each node
    computes each of its selected experts once for the whole batch. Tokens route uniformly, or as
    recorded selections drawn with replacement from a profile's `sets`. (mean, standard error)."""
    holders = holders_of(placement, num_experts)
    nodes = len(placement)
    rng = random.Random(seed)
    xs = []
    for _ in range(samples):
        chosen: set[int] = set()
        for _ in range(batch):
            chosen.update(rng.choice(sets) if sets else rng.sample(range(num_experts), k))
        xs.append(_max_count(sorted(chosen), holders, nodes))
    mean = sum(xs) / samples
    var = sum((x - mean) ** 2 for x in xs) / max(1, samples - 1)
    return mean, math.sqrt(var / samples)


def expected_experts(
    placement: Placement,
    num_experts: int,
    top_k: int,
    keepalive: str = "lru",
    sets: Sequence[Sequence[int]] | None = None,
    batch: int = 1,
) -> ExpectedExperts:
    """E for one MoE layer under a placement and keepalive policy (see the module docstring); with
    `batch` > 1, for one step of that many sequences (the union of their selections)."""
    if keepalive not in KEEPALIVES:
        raise PlanError(
            f"unknown keepalive policy {keepalive!r}; choose from {', '.join(KEEPALIVES)}"
        )
    if batch < 1:
        raise PlanError(f"batch must be at least 1 sequence (got {batch})")
    nodes = len(placement)
    if batch > 1 and keepalive != "busy":
        if sets is not None and not sets:
            raise PlanError("the routing profile has no recorded selections ('sets') for a layer")
        if nodes == 1 and sets is None:
            return ExpectedExperts(
                expected_distinct_alone(num_experts, top_k, batch),
                f"exact: distinct experts of {batch} tokens, uniform routing",
            )
        mean, se = expected_max_batch_sampled(placement, num_experts, top_k, batch, sets)
        source = f"{len(sets)} recorded tokens drawn" if sets else "uniform selections"
        return ExpectedExperts(
            mean,
            f"Monte Carlo: {BATCH_SAMPLES} batches of {batch} tokens ({source}), seed "
            f"{MONTE_CARLO_SEED}, standard error {se:.4f}",
            stderr=se,
        )
    if nodes == 1:
        # One node runs stock mlx-lm: exactly the selected experts.
        return ExpectedExperts(float(top_k), "one node: the k selected experts")
    if keepalive == "busy":
        most = max(len(es) for es in placement.values())
        return ExpectedExperts(float(most), "busy: every local expert, every layer")
    if sets is not None:
        return ExpectedExperts(
            expected_max_from_sets(placement, num_experts, sets),
            f"profile: mean over {len(sets)} recorded tokens",
        )
    if is_disjoint(placement):
        sizes = [len(placement[r]) for r in sorted(placement)]
        value = expected_max_hypergeometric(sizes, top_k)
        return ExpectedExperts(float(value), "exact: hypergeometric counts, uniform routing")
    n = math.comb(num_experts, top_k)
    if n <= ENUMERATION_LIMIT:
        return ExpectedExperts(
            float(expected_max_enumerated(placement, num_experts, top_k)),
            f"exact: all C({num_experts},{top_k}) = {n} selections, uniform routing",
        )
    mean, se = expected_max_sampled(placement, num_experts, top_k)
    return ExpectedExperts(
        mean,
        f"Monte Carlo: {MONTE_CARLO_SAMPLES} uniform selections, seed {MONTE_CARLO_SEED}, "
        f"standard error {se:.4f}",
        stderr=se,
    )
