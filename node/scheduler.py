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
    running: Sequence[int],
    max_batch: int,
    kv_budget: int,
) -> list[int]:
    """Which of the requests every rank holds (`held`, admission numbers in order) join now.

    First come, first served: they join in order while fewer than `max_batch` run and their KV
    reserve (`reserve[n]`, bytes) fits the budget beside the running sequences' (`running`: their
    reserves); the head of the queue is never overtaken, so no request starves. A request alone
    always runs (`kv_budget` 0: no KV limit)."""
    running = list(running)
    out = []
    for n in held:
        if len(running) >= max_batch or (
            kv_budget and running and sum(running) + reserve[n] > kv_budget
        ):
            break
        out.append(n)
        running.append(reserve[n])
    return out


def _ends_with(tokens: Sequence[int], stop: Sequence[int]) -> bool:
    n = len(stop)
    return 0 < n <= len(tokens) and tuple(tokens[-n:]) == tuple(stop)
