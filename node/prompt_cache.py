"""The node's prompt cache: KV caches of earlier requests, reused by a request that starts with the
same tokens, identically on every node.

mlx-lm's LRUPromptCache keeps the entries (longest-common-prefix reuse, LRU within a byte budget,
an entry dropped once its continuation is cached). Every node sees the same requests, so every
node's cache holds the same entries; before reusing a prefix the nodes still agree on its length,
so a node that restarted with an empty cache cannot desynchronise the others.
"""

from __future__ import annotations

import mlx.core as mx

from .collective.base import TOKEN_LAYER, Collective, waiting

_KEY = "model"  # one model per node: the cache's model key is constant


class PromptCache:
    """What the running batch asks of the prompt cache: a prefix to continue from, an entry to keep,
    and room made for running sequences."""

    def __init__(self, max_bytes: int, collective: Collective):
        from mlx_lm.models.cache import LRUPromptCache

        self.entries = LRUPromptCache(max_size=64, max_bytes=max_bytes)
        self.collective = collective

    @property
    def nbytes(self) -> int:
        return self.entries.nbytes

    def reuse(self, prompt: list[int], agreed: bool = True) -> tuple[list | None, int]:
        """(cache to continue from, number of prompt tokens it covers), agreed by all nodes (not
        `agreed`: this node's alone, for a stream only it attends for); at least the prompt's last
        token is left to prefill."""
        from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

        cache, rest = self.entries.fetch_nearest_cache(_KEY, prompt)
        covered = len(prompt) - len(rest) if cache is not None else 0
        if cache is not None and covered == len(prompt):
            if can_trim_prompt_cache(cache):
                trim_prompt_cache(cache, 1)
                covered -= 1
            else:
                cache, covered = None, 0
        if not agreed:
            return (cache, covered) if cache is not None and covered > 0 else (None, 0)
        agreed = int(min(self._every_rank(covered)))
        ok = True
        if cache is not None and agreed < covered:
            if can_trim_prompt_cache(cache):
                trim_prompt_cache(cache, covered - agreed)
                covered = agreed
            else:
                ok = False
        if agreed == 0 or not all(v > 0 for v in self._every_rank(1.0 if ok else 0.0)):
            return None, 0
        return cache, agreed

    def store(self, tokens: list[int], cache: list) -> None:
        """Keep `cache` as the entry for `tokens` (the prompt and every token fed after it).

        A cache may hold positions past `tokens`: a cancel lands while the next token is being
        sampled, after the token before it was fed but never handed out, and a speculating step
        holds accepted guesses beyond the tokens handed out. They are trimmed here so that an
        entry's tokens always match its positions."""
        from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

        offset = max((getattr(c, "offset", 0) for c in cache), default=0)
        if offset > len(tokens):
            if not can_trim_prompt_cache(cache):
                return
            trim_prompt_cache(cache, offset - len(tokens))
            offset = len(tokens)
        if offset <= 0:
            return
        self.entries.insert_cache(_KEY, tokens[:offset], cache)

    def make_room(self, n_bytes: int) -> None:
        """Drop least recently used entries until the cache holds at most `n_bytes`."""
        self.entries.trim_to(n_bytes=max(0, n_bytes))

    def _every_rank(self, value: float) -> list[float]:
        """Every rank's value, in rank order (one all-reduce of a one-hot vector)."""
        c = self.collective
        mine = mx.zeros((c.world_size,), dtype=mx.float32)
        mine[c.rank] = float(value)
        with waiting(c, "the prompt cache agreement"):
            return c.all_reduce(mine, TOKEN_LAYER).tolist()
