"""What a sequence's KV cache takes: bytes per position, and what the running batch reserves for it
while it runs (its prompt, its tokens and a verifying step's drafts, in mlx-lm's growth steps)."""

from __future__ import annotations

import math

import mlx.core as mx

from ..proto.records import GenerateRequest

KV_STEP = 256  # mlx-lm's KVCache grows in steps of this many positions


def kv_reserve(req: GenerateRequest, per_token: int, drafts: int) -> int:
    """KV bytes held for `req` while it runs (0 where the config does not say)."""
    if not per_token:
        return 0
    # a verifying step holds its drafts before the rejected ones roll back
    positions = math.ceil((len(req.prompt) + req.sampling.max_tokens + drafts) / KV_STEP) * KV_STEP
    return positions * per_token


def kv_bytes_per_token(model) -> int:
    """KV bytes one position takes over every layer (0 where the config does not say)."""
    args = getattr(model, "args", None)
    layers = getattr(model, "layers", None)
    if args is None or layers is None:
        return 0
    heads = getattr(args, "num_attention_heads", None)
    kv_heads = getattr(args, "num_key_value_heads", None) or heads
    head_dim = getattr(args, "head_dim", None) or (args.hidden_size // heads if heads else None)
    if not kv_heads or not head_dim:
        return 0
    from mlx.utils import tree_flatten

    floats = (mx.float32, mx.float16, mx.bfloat16)  # activations' dtypes, not quantized weights'
    dtype = next(
        (p.dtype for _, p in tree_flatten(model.parameters()) if p.dtype in floats), mx.float32
    )
    return len(layers) * 2 * kv_heads * head_dim * dtype.size
