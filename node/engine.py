"""One request on mlx-lm's `generate_step`: the references, benchmarks and tools that run a model
(sharded or stock) in one process. Nodes serve through the running batch (node/batch.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn

from ..proto.errors import UserError
from ..proto.records import DEFAULT_PREFILL_STEP, Sampling


@dataclass
class Stats:
    """Figures of one generation, filled in as it runs."""

    prompt_tokens: int = 0
    generated: int = 0
    prompt_seconds: float = 0.0
    generation_seconds: float = 0.0
    finish_reason: str | None = None
    tokens: list[int] = field(default_factory=list)

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds else 0.0

    @property
    def generation_tps(self) -> float:
        # The first token comes with the prompt; the rest are timed as generation (as mlx-lm does).
        return self.generated / self.generation_seconds if self.generation_seconds else 0.0


def make_sampler(sampling: Sampling):
    from mlx_lm.sample_utils import make_sampler as mlx_make_sampler

    if (
        sampling.greedy
    ):  # the edge values too: mlx-lm's top-p filter reads past the vocabulary at 0.0
        return mlx_make_sampler(temp=0.0)
    top_p = sampling.top_p if sampling.top_p < 1.0 else 0.0
    return mlx_make_sampler(temp=sampling.temperature, top_p=top_p)


def generate_tokens(
    model: nn.Module,
    prompt: Sequence[int],
    sampling: Sampling,
    *,
    eos_token_ids: Sequence[int] = (),
    prompt_cache: list | None = None,
    prefill_step: int = DEFAULT_PREFILL_STEP,
    stats: Stats | None = None,
    logits_sink: list | None = None,
) -> Iterator[int]:
    """Yield generated token ids until an EOS token (not yielded) or `max_tokens`.

    Args:
        prompt: token ids to process; with a `prompt_cache`, only the part not cached yet.
        stats: filled in with timings and the finish reason.
        logits_sink: if given, each step's raw logits (float32 numpy) are appended to it.
    """
    from mlx_lm.generate import generate_step

    sampling.check()
    if not prompt:
        raise UserError("the prompt has no tokens")
    stats = stats if stats is not None else Stats()
    stats.prompt_tokens = len(prompt)
    if sampling.seed is not None:
        mx.random.seed(sampling.seed)
    eos = set(eos_token_ids)
    steps = generate_step(
        mx.array(list(prompt), dtype=mx.uint32),
        model,
        max_tokens=sampling.max_tokens,
        sampler=make_sampler(sampling),
        prompt_cache=prompt_cache,
        prefill_step_size=prefill_step,
        logits_processors=[_recorder(logits_sink)] if logits_sink is not None else None,
    )
    tic = time.perf_counter()
    stats.finish_reason = "length"
    for n, (token, _) in enumerate(steps):
        now = time.perf_counter()
        if n == 0:
            stats.prompt_seconds = now - tic
            tic = now
        else:
            stats.generation_seconds = now - tic
        if token in eos:
            stats.finish_reason = "stop"
            break
        stats.generated += 1
        stats.tokens.append(token)
        yield token
        if stats.generated == sampling.max_tokens:
            break


def _recorder(sink: list):
    import numpy as np

    def record(tokens, logits):
        sink.append(np.array(logits.astype(mx.float32)).reshape(-1))
        return logits

    return record
