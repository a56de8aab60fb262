"""A node at run time: its loaded shard and the lock-step token loop with the other nodes."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import mlx.core as mx

from .collective import Cancelled, agree
from .engine import DEFAULT_PREFILL_STEP, Sampling, Stats, generate_tokens
from .shard import ShardedModel

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt: Sequence[int]
    sampling: Sampling
    eos_token_ids: Sequence[int] = ()
    prefill_step: int = DEFAULT_PREFILL_STEP
    record_logits: bool = False


@dataclass
class GenerateResult:
    tokens: list[int] = field(default_factory=list)
    stats: Stats = field(default_factory=Stats)
    logits: list = field(default_factory=list)
    cancelled: bool = False


class NodeRuntime:
    """Runs generation requests on a sharded model in lock-step with the other nodes.

    Every node runs the same loop on the same request. After each sampled token the nodes agree
    (one tiny all-reduce): everyone takes rank 0's token, and a cancel seen by any node stops all
    of them at the same step, so no node is ever left waiting in an all-reduce.
    """

    def __init__(self, sharded: ShardedModel):
        self.sharded = sharded

    @property
    def collective(self):
        return self.sharded.collective

    def generate(self, req: GenerateRequest, should_cancel: Callable[[], bool] = lambda: False,
                 result: GenerateResult | None = None) -> Iterator[int]:
        result = result if result is not None else GenerateResult()
        collective = self.collective
        collective.begin(req.request_id)

        def hook(sampled: mx.array) -> mx.array:
            token, cancelled = agree(collective, int(sampled.item()), should_cancel())
            if cancelled:
                raise Cancelled()
            return mx.array([token], dtype=sampled.dtype)

        try:
            for token in generate_tokens(
                self.sharded.model, req.prompt, req.sampling, eos_token_ids=req.eos_token_ids,
                prefill_step=req.prefill_step, token_hook=hook, stats=result.stats,
                logits_sink=result.logits if req.record_logits else None,
            ):
                result.tokens.append(token)
                yield token
        except Cancelled:
            result.cancelled = True
            result.stats.finish_reason = "cancelled"
