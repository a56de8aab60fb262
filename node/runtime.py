"""A node at run time: its loaded shard, its prompt cache and the lock-step token loop."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Iterator

import mlx.core as mx

from ..proto.errors import UserError
from .batch import BatchLimits, RunningBatch
from .figures import SequenceFigures
from .prompt_cache import PromptCache
from ..proto.records import GenerateRequest, check_token_ids
from .engine import Stats
from .speculate import DRAFT_LIMIT
from .moe.load import ShardedModel

logger = logging.getLogger(__name__)


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

    The prompt cache (node/prompt_cache.py) is the same on every node.
    """

    def __init__(
        self, sharded: ShardedModel, prompt_cache_bytes: int = 0, limits: BatchLimits | None = None
    ):
        from .vocab import embedding_rows

        self.sharded = sharded
        self.vocab = embedding_rows(sharded.model)  # token ids must be below this
        self.prompt_cache = (
            PromptCache(prompt_cache_bytes, sharded.collective) if prompt_cache_bytes > 0 else None
        )
        self.batch = RunningBatch(
            sharded,
            limits or BatchLimits(),
            check=self.check,
            prompt_cache=self.prompt_cache,
            vocab=self.vocab,
        )

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
            raise UserError(
                f"request {req.request_id} asks for {req.draft_tokens} drafts per step "
                f"(at most {DRAFT_LIMIT})"
            )

    @property
    def collective(self):
        return self.sharded.collective

    def next_seq(self) -> int:
        """The admission order of a request that came without one (RunningBatch.next_seq)."""
        return self.batch.next_seq()

    def generate(
        self,
        req: GenerateRequest,
        should_cancel: Callable[[], bool] = lambda: False,
        result: GenerateResult | None = None,
    ) -> Iterator[int]:
        """One request driven from the caller's thread through the running batch (simulate, tests);
        the agent drives the batch from its worker for every request at once."""
        result = result if result is not None else GenerateResult()
        out = _Collect()
        s = self.batch.submit(req, None, out, result)
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
