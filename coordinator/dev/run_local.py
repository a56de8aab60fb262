"""`moe-cluster run`: single-node generation with stock mlx-lm, the development fallback."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import mlx.core as mx

from ...node.checkpoint import Checkpoint, check_runnable, model_args
from ...node.engine import Stats, generate_tokens
from ...proto.errors import UserError
from ...proto.records import Sampling


@dataclass(frozen=True)
class RunResult:
    text: str
    tokens: list[int]
    prompt_tokens: int
    prompt_tps: float
    generation_tps: float
    peak_memory_bytes: int
    finish_reason: str

    def to_json(self) -> dict:
        return {
            "text": self.text,
            "tokens": self.tokens,
            "prompt_tokens": self.prompt_tokens,
            "prompt_tps": round(self.prompt_tps, 3),
            "generation_tps": round(self.generation_tps, 3),
            "peak_memory_bytes": self.peak_memory_bytes,
            "finish_reason": self.finish_reason,
        }


def load_stock(model_spec: str):
    """Load a checkpoint with stock mlx-lm after checking it, so bad input is a clear error."""
    from mlx_lm import load

    ckpt = Checkpoint.open(model_spec)
    model_args(ckpt.config, ckpt.path / "config.json")
    check_runnable(ckpt.config, ckpt.path / "config.json")
    model, tokenizer = load(str(ckpt.path))
    return ckpt, model, tokenizer


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """Encode a raw prompt exactly as mlx-lm's `generate` does."""
    add_special = tokenizer.bos_token is None or not prompt.startswith(tokenizer.bos_token)
    ids = tokenizer.encode(prompt, add_special_tokens=add_special)
    if not ids:
        raise UserError("the prompt is empty after tokenization")
    return ids


def run(model_spec: str, prompt: str, sampling: Sampling, *, stream_to=None) -> RunResult:
    _, model, tokenizer = load_stock(model_spec)
    ids = encode_prompt(tokenizer, prompt)
    mx.reset_peak_memory()
    detok = tokenizer.detokenizer
    detok.reset()
    stats = Stats()
    for token in generate_tokens(
        model, ids, sampling, eos_token_ids=tokenizer.eos_token_ids, stats=stats
    ):
        detok.add_token(token)
        if stream_to is not None:
            stream_to.write(detok.last_segment)
            stream_to.flush()
    detok.finalize()
    if stream_to is not None:
        stream_to.write(detok.last_segment + "\n")
    return RunResult(
        text=detok.text,
        tokens=stats.tokens,
        prompt_tokens=stats.prompt_tokens,
        prompt_tps=stats.prompt_tps,
        generation_tps=stats.generation_tps,
        peak_memory_bytes=int(mx.get_peak_memory()),
        finish_reason=stats.finish_reason or "length",
    )


def main(args) -> int:
    sampling = Sampling(args.max_tokens, args.temperature, args.top_p, args.seed)
    sampling.check()
    if args.json:
        result = run(args.model, args.prompt, sampling)
        print(json.dumps(result.to_json()))
        return 0
    result = run(args.model, args.prompt, sampling, stream_to=sys.stdout)
    print("=" * 10, file=sys.stderr)
    print(
        f"Prompt: {result.prompt_tokens} tokens, {result.prompt_tps:.1f} tokens/s", file=sys.stderr
    )
    print(
        f"Generation: {len(result.tokens)} tokens, {result.generation_tps:.1f} tokens/s",
        file=sys.stderr,
    )
    print(f"Peak memory: {result.peak_memory_bytes / 1e9:.3f} GB", file=sys.stderr)
    return 0
