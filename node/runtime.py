"""A node at run time: its loaded shard, its prompt cache and the lock-step token loop."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Iterator

import mlx.core as mx

from ..proto.errors import UserError
from .collective.base import RIDE_MAX_TOKEN, TOKEN_LAYER, Cancelled, agree, waiting
from ..proto.records import GenerateRequest, check_token_ids
from .engine import Stats, generate_tokens
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
    collective_s: float = 0.0


class NodeRuntime:
    """Runs generation requests on a sharded model in lock-step with the other nodes.

    Every node runs the same loop on the same request. Each sampled token and the node's cancel
    flag ride on the next step's first MoE all-reduce (no round trip of their own); before a token
    is used every node checks that all sampled it (a mismatch is a TokenMismatch on every node,
    never drift) and a cancel seen by any node stops all of them at the same step, so no node is
    ever left waiting in an all-reduce. They agree on a cancel between prefill chunks too (one
    explicit round trip per chunk), so a long prompt stops within a chunk.

    The prompt cache (mlx-lm's LRUPromptCache: longest-common-prefix reuse, LRU within a byte
    budget, an entry dropped once its continuation is cached) is the same on every node because
    every node sees the same requests; before reusing a prefix the nodes still agree on its
    length, so a node that restarted with an empty cache cannot desynchronise the others.
    """

    def __init__(self, sharded: ShardedModel, prompt_cache_bytes: int = 0):
        from .vocab import embedding_rows

        self.sharded = sharded
        self.vocab = embedding_rows(sharded.model)  # token ids must be below this
        self.prompt_cache = None
        if prompt_cache_bytes > 0:
            from mlx_lm.models.cache import LRUPromptCache

            self.prompt_cache = LRUPromptCache(max_size=64, max_bytes=prompt_cache_bytes)

    def check(self, req: GenerateRequest) -> None:
        """Refuse (UserError) a request this model cannot run, before any MLX work: every node
        checks the same request against the same model, so all refuse it and none is left waiting
        in an all-reduce; an id past the embedding would read outside it and can end the process."""
        req.sampling.check()
        if not req.prompt:
            raise UserError(f"request {req.request_id} has an empty prompt")
        check_token_ids(req.prompt, self.vocab)

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

    def generate(self, req: GenerateRequest, should_cancel: Callable[[], bool] = lambda: False,
                 result: GenerateResult | None = None) -> Iterator[int]:
        result = result if result is not None else GenerateResult()
        collective = self.collective
        collective.begin(req.request_id)
        prompt = list(req.prompt)
        cache, covered = self._reuse(prompt)
        if cache is None and self.prompt_cache is not None:
            from mlx_lm.models.cache import make_prompt_cache

            cache = make_prompt_cache(self.sharded.model)
        result.cached_tokens = covered

        alone = collective.world_size == 1  # nobody to agree with: no agreement at all
        rides = not alone and self.vocab <= RIDE_MAX_TOKEN
        step = 0  # of the token being settled

        def hook(sampled: mx.array) -> mx.array:
            if alone:
                if should_cancel():
                    raise Cancelled()
            elif rides:
                collective.ride(sampled, should_cancel())
            else:
                agreement = agree(collective, int(sampled.item()), should_cancel())
                if agreement.check(step):
                    raise Cancelled()
            return sampled

        def settle(token: int) -> None:
            nonlocal step
            if rides:
                agreement = collective.settle()
                if agreement is None:  # no MoE all-reduce carried it: one explicit round trip
                    agreement = agree(collective, token, should_cancel())
                if agreement.check(step):
                    raise Cancelled()
            step += 1

        def between_chunks(done: int, total: int) -> None:
            # every node prefills the same chunks, so every node asks here the same number of times;
            # the watch restarts per chunk, so the timeout bounds one chunk, not the whole prompt
            collective.watch(f"prefill after {done}/{total} prompt tokens")
            if done < total and agree(collective, 0, should_cancel()).check(-1):
                raise Cancelled()

        fed: list[int] = []
        tokens = generate_tokens(
            self.sharded.model, prompt[covered:], req.sampling, eos_token_ids=req.eos_token_ids,
            prompt_cache=cache, prefill_step=req.prefill_step, token_hook=hook, stats=result.stats,
            logits_sink=result.logits if req.record_logits else None, fed_tokens=fed,
            prefill_hook=between_chunks, settle=settle if not alone else None,
        )
        try:
            while True:
                # mx.distributed cannot time out: the wait for each step is watched instead
                with waiting(collective, f"step {step}"):
                    token = next(tokens, None)
                if token is None:
                    break
                result.tokens.append(token)
                yield token
        except Cancelled:
            result.cancelled = True
            result.stats.finish_reason = "cancelled"
        finally:
            tokens.close()
        result.stats.prompt_tokens = len(prompt)
        if self.prompt_cache is not None and cache is not None:
            self._store(prompt + fed, cache)

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
