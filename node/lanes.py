"""Decoding sequences whose KV rows share one batched cache: a lane. The running batch has one,
or two where a step runs two micro-batches (node/overlap.py)."""

from __future__ import annotations

import mlx.core as mx


class Lane:
    """Sequences whose KV rows share one batched cache (mlx-lm's `merge`); a lone one keeps its
    own cache (the stock path's bytes)."""

    def __init__(self) -> None:
        self.rows: list = []  # the sequences, in the order of the cache's rows
        self.cache: list | None = None

    def join(self, s) -> None:
        """`s` (its own cache in `s.cache`) becomes the lane's last row."""
        if not self.rows:
            self.cache = s.cache
        elif len(self.rows) == 1 and self.rows[0].cache is self.cache:
            first = self.rows[0]
            self.cache = [type(a).merge([a, b]) for a, b in zip(first.cache, s.cache)]
        else:
            for mine, theirs in zip(self.cache, s.cache):
                mine.extend(type(theirs).merge([theirs]))
        self.rows.append(s)

    def leave(self, s) -> list:
        """`s` leaves; its own cache (its row, extracted) is the answer."""
        i = self.rows.index(s)
        cache = (
            self.cache
            if len(self.rows) == 1 and s.cache is self.cache
            else [_extract(c, i) for c in self.cache]
        )
        keep = [j for j in range(len(self.rows)) if j != i]
        self.rows.pop(i)
        if not keep:
            self.cache = None
        elif cache is not self.cache:
            for c in self.cache:
                c.filter(keep)
        return cache

    def forward(self, model, inputs: mx.array) -> mx.array:
        return model(inputs, cache=self.cache)


def _extract(c, i: int):
    """Row `i` of a batched cache as its own; an empty cache where the batch's never held keys (an
    MTP layer's cache before its first feed: mlx-lm's extract would index None)."""
    if getattr(c, "keys", True) is None:
        from mlx_lm.models.cache import KVCache

        return KVCache()
    return c.extract(i)


def shortest(lanes: list[Lane]) -> Lane:
    """The lane a sequence joins: the one with fewer rows, the first on a tie (every rank joins
    the same sequences in the same order, so the lanes match)."""
    return min(lanes, key=lambda lane: len(lane.rows))
