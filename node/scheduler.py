"""The running batch's decisions, as pure functions of what the ranks agreed: how much of each
joining prompt a step prefills, which tokens a sequence hands out and why it ends, and which queued
requests join. Every rank computes them from the same agreed values, so every node runs the same
sequences in the same order; node/batch.py carries them out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


def prefill_chunks(
    joining: Sequence[tuple[int, int]], budget: int, others_decode: bool
) -> list[tuple[int, int]]:
    """The prompt chunks one step prefills, in order: (index into `joining`, tokens).

    `joining[i]` = (prompt tokens sequence i has left to prefill, its chunk size). Chunks are
    whole, joining prompts go in order, and at most `budget` tokens are prefilled while other
    sequences decode (a 10,000-token prompt never stalls the running streams); with nobody
    decoding, one chunk per step (the step's shape, and so its kernels, stay those of one chunk).
    The first chunk always goes, whatever its size."""
    budget = budget if others_decode else 0
    used, out = 0, []
    for i, (todo, chunk) in enumerate(joining):
        while todo:
            n = min(chunk, todo)
            if used and (not budget or used + n > budget):
                return out
            out.append((i, n))
            todo -= n
            used += n
    return out


@dataclass(frozen=True)
class Emitted:
    """What a sequence does with the tokens the ranks agreed on for it at one step."""

    fed: int  # of the agreed tokens, how many it feeds (the first ones)
    out: tuple[int, ...]  # those handed to its caller (an end-of-sequence token is not)
    finish: str | None  # why it ends here ("stop", "length"), or None


def emit(
    tokens: Sequence[int],
    *,
    eos: frozenset[int] | set[int],
    stops: Sequence[Sequence[int]],
    handed: Sequence[int],
    max_tokens: int,
) -> Emitted:
    """A sequence's agreed tokens, in order, until one ends it: an end-of-sequence token (fed,
    not handed out), a stop sequence completed by the tokens handed out (`handed` before these),
    or `max_tokens` handed out in all."""
    out: list[int] = []
    longest = max((len(stop) for stop in stops), default=0)
    tail = list(handed[len(handed) - longest :]) if longest else []  # what a stop can end with
    count = len(handed)
    for n, token in enumerate(tokens, start=1):
        if token in eos:
            return Emitted(n, tuple(out), "stop")
        out.append(token)
        tail.append(token)
        count += 1
        if any(_ends_with(tail, stop) for stop in stops):
            return Emitted(n, tuple(out), "stop")
        if count >= max_tokens:
            return Emitted(n, tuple(out), "length")
    return Emitted(len(tokens), tuple(out), None)


def admissions(
    held: Sequence[int],
    reserve: dict[int, int],
    running: Sequence[tuple[int, int]],
    max_batch: int,
    kv_budget: int,
    *,
    owner: dict[int, int] | None = None,
    world: int = 1,
) -> list[int]:
    """Which of the requests every rank holds (`held`, admission numbers in order) join now.

    First come, first served, on each node: a request joins while its nodes (its owner's, or
    every node where it is replicated, `owner[n]` -1) run fewer than `max_batch` sequences and its
    KV reserve (`reserve[n]`, bytes) fits `kv_budget` beside theirs (`running`: (owner, reserve)
    of each running sequence). A request waiting for a node blocks every later one that needs
    that node (the head of a node's queue is never overtaken, so no request starves); another
    node's requests go on. A sequence alone on its nodes always runs (`kv_budget` 0: no limit)."""
    owner = owner or {}
    count, load = [0] * world, [0] * world
    for o, r in running:
        for node in _nodes(o, world):
            count[node] += 1
            load[node] += r
    blocked: set[int] = set()
    out = []
    for n in held:
        nodes = _nodes(owner.get(n, -1), world)
        if blocked.intersection(nodes) or any(
            count[i] >= max_batch or (kv_budget and count[i] and load[i] + reserve[n] > kv_budget)
            for i in nodes
        ):
            blocked.update(nodes)
            continue
        out.append(n)
        for i in nodes:
            count[i] += 1
            load[i] += reserve[n]
    return out


def prefill_passes(
    joining: Sequence[tuple[int, int, int]], budget: int, others_decode: bool
) -> list[tuple[tuple[int, int], ...]]:
    """The forward passes one step prefills, in order, each a tuple of (index into `joining`,
    tokens): `joining[i]` = (its owner, -1 where every node attends for it; prompt tokens left;
    its chunk size). Each node's (and the replicated streams') chunks are `prefill_chunks`' own;
    a replicated chunk is a pass of its own (every node runs it), and owned chunks share passes,
    at most one per node, in order (every node's rows gathered into one call per MoE layer)."""
    groups: dict[int, list[int]] = {}
    for i, (owner, _, _) in enumerate(joining):
        groups.setdefault(owner, []).append(i)
    passes: list[tuple[tuple[int, int], ...]] = []
    for i, n in prefill_chunks([joining[i][1:] for i in groups.get(-1, [])], budget, others_decode):
        passes.append(((groups[-1][i], n),))
    owned: list[list[tuple[int, int]]] = []
    for owner, members in sorted(groups.items()):
        if owner < 0:
            continue
        chunks = prefill_chunks([joining[i][1:] for i in members], budget, others_decode)
        for k, (i, n) in enumerate(chunks):
            if k == len(owned):
                owned.append([])
            owned[k].append((members[i], n))
    return passes + [tuple(p) for p in owned]


def _nodes(owner: int, world: int) -> range | tuple[int]:
    return range(world) if owner < 0 else (owner,)


def _ends_with(tokens: Sequence[int], stop: Sequence[int]) -> bool:
    n = len(stop)
    return 0 < n <= len(tokens) and tuple(tokens[-n:]) == tuple(stop)
