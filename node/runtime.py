"""A node at run time: its loaded shard, its prompt cache and the lock-step token loop."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Iterator

import mlx.core as mx

from ..proto.errors import UserError
from .batch import BatchLimits, RunningBatch, SequenceFigures
from .collective.base import TOKEN_LAYER, waiting
from ..proto.records import GenerateRequest, check_token_ids
from .engine import Stats
from .speculate import DRAFT_LIMIT
from .moe.load import ShardedModel

logger = logging.getLogger(__name__)

_CACHE_KEY = "model"  # one model per node: the prompt cache's model key is constant


@dataclass
class GenerateResult:
    tokens: list[int] = field(default_factory=list)
    stats: Stats = field(default_factory=Stats)
    logits: list = field(default_factory=list)
    cancelled: bool = False
    cached_tokens: int = 0  # prompt tokens served from the prompt cache
    figures: SequenceFigures = field(default_factory=SequenceFigures)


class NodeRuntime:
    """Runs generation requests on a sharded model in lock-step with the other nodes: the running
    batch (node/batch.py) steps every request together; what each step agrees on (who joins, who
    is cancelled, the tokens) rides on its first MoE all-reduce.

    The prompt cache (mlx-lm's LRUPromptCache: longest-common-prefix reuse, LRU within a byte
    budget, an entry dropped once its continuation is cached) is the same on every node because
    every node sees the same requests; before reusing a prefix the nodes still agree on its
    length, so a node that restarted with an empty cache cannot desynchronise the others.
    """

    def __init__(self, sharded: ShardedModel, prompt_cache_bytes: int = 0, limits: BatchLimits | None = None):
        from .vocab import embedding_rows

        self.sharded = sharded
        self.vocab = embedding_rows(sharded.model)  # token ids must be below this
        self.prompt_cache = None
        if prompt_cache_bytes > 0:
            from mlx_lm.models.cache import LRUPromptCache

            self.prompt_cache = LRUPromptCache(max_size=64, max_bytes=prompt_cache_bytes)
        self._auto_seq = 0
        self.batch = RunningBatch(self, limits or BatchLimits())

    def check(self, req: GenerateRequest) -> None:
        """Refuse (UserError) a request this model cannot run, before any MLX work: every node
        checks the same request against the same model, so all refuse it and none is left waiting
        in an all-reduce; an id past the embedding would read outside it and can end the process."""
        req.sampling.check()
        if not req.prompt:
            raise UserError(f"request {req.request_id} has an empty prompt")
        check_token_ids(req.prompt, self.vocab)
        if req.prediction:
            check_token_ids(req.prediction, self.vocab, "prediction")
        if req.draft_tokens is not None and not 0 <= req.draft_tokens <= DRAFT_LIMIT:
            raise UserError(f"request {req.request_id} asks for {req.draft_tokens} drafts per step "
                            f"(at most {DRAFT_LIMIT})")

    @property
    def collective(self):
        return self.sharded.collective

    def _agree_all(self, value: float) -> list[float]:
        """Every rank's value, in rank order (one all-reduce of a one-hot vector)."""
        c = self.collective
        mine = mx.zeros((c.world_size,), dtype=mx.float32)
        mine[c.rank] = float(value)
        with waiting(c, "the prompt cache agreement"):
            return c.all_reduce(mine, TOKEN_LAYER).tolist()

    def _reuse(self, prompt: list[int]) -> tuple[list | None, int]:
        """(cache to continue from, number of prompt tokens it covers), agreed by all nodes."""
        from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

        if self.prompt_cache is None:
            return None, 0
        cache, rest = self.prompt_cache.fetch_nearest_cache(_CACHE_KEY, prompt)
        covered = len(prompt) - len(rest) if cache is not None else 0
        if cache is not None and covered == len(prompt):  # at least one token must be prefilled
            if can_trim_prompt_cache(cache):
                trim_prompt_cache(cache, 1)
                covered -= 1
            else:
                cache, covered = None, 0
        agreed = int(min(self._agree_all(covered)))
        ok = True
        if cache is not None and agreed < covered:
            if can_trim_prompt_cache(cache):
                trim_prompt_cache(cache, covered - agreed)
                covered = agreed
            else:
                ok = False
        if agreed == 0 or not all(v > 0 for v in self._agree_all(1.0 if ok else 0.0)):
            return None, 0
        return cache, agreed

    def next_seq(self) -> int:
        """The admission order of a request that came without one (run from this process alone, as
        simulate does: every node numbers the same requests the same way)."""
        self._auto_seq += 1
        return self._auto_seq

    def generate(self, req: GenerateRequest, should_cancel: Callable[[], bool] = lambda: False,
                 result: GenerateResult | None = None) -> Iterator[int]:
        """One request driven from the caller's thread through the running batch (simulate, tests);
        the agent drives the batch from its worker for every request at once."""
        result = result if result is not None else GenerateResult()
        out = _Collect()
        s = self.batch.submit(req, req.seq or self.next_seq(), out, result)
        try:
            while not out.ended:
                if should_cancel():
                    self.batch.cancel(req.request_id)
                self.batch.step()
                yield from out.drain()
            yield from out.drain()
            if out.error is not None:
                raise out.error
        finally:
            if not out.ended:  # the caller stopped early: the sequence leaves at the next step
                self.batch.withdraw(s)
                for _ in range(4):
                    if out.ended:
                        break
                    self.batch.step()

    def _store(self, tokens: list[int], cache: list) -> None:
        """Keep `cache` as the entry for `tokens` (the prompt and every token fed after it).

        A cancel lands while the next token is being sampled, after the token before it was fed
        but never handed out: the cache then holds one position more than `tokens`, trimmed here so
        that an entry's tokens always match its positions.
        """
        from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

        offset = max((getattr(c, "offset", 0) for c in cache), default=0)
        if offset > len(tokens):
            if not can_trim_prompt_cache(cache):
                return
            trim_prompt_cache(cache, offset - len(tokens))
            offset = len(tokens)
        if offset <= 0:
            return
        self.prompt_cache.insert_cache(_CACHE_KEY, tokens[:offset], cache)


class _Collect:
    """A Sink that keeps a sequence's tokens for a caller on the driving thread."""

    def __init__(self) -> None:
        self.pending: list[int] = []
        self.ended = False
        self.error: BaseException | None = None

    def tokens(self, ids: list[int]) -> None:
        self.pending.extend(ids)

    def done(self, result) -> None:
        self.ended = True

    def failed(self, exc: BaseException) -> None:
        self.ended, self.error = True, exc

    def drain(self) -> Iterator[int]:
        ids, self.pending = self.pending, []
        return iter(ids)
