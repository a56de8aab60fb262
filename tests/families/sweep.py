"""One family through the cluster's arithmetic against stock mlx-lm: the core of the family sweep.

`check(family, tmp, nodes, quantize)` builds the family's tiny checkpoint (tiny.py), decodes it
greedily with stock mlx-lm, then with every rank's shard in this process (node.moe.load's
`load_in_process`: each MoE block is every rank's `ClusterMoE` share summed in rank order), and
returns tokens and the largest |Δlogit|. Used by test_sweep.py and by table.py
(the table of docs/families.md).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

import tiny

PROMPT = [1, 17, 42, 99, 7, 200, 3, 55]
STEPS = 6
TOLERANCE = 1e-4  # float32 |Δlogit|, the project's bar for "exact"
QUANT_TOLERANCE = 1e-3  # identical quantized weights: only float32 addition order differs
# One quantization mode per family, in turn, so every mode and every bank kind is covered.
QUANT_ROTATION = ("4bit", "8bit", "mxfp4", "mxfp8", "4bit+8bit-layer")


def quant_mode(family: str) -> str:
    return QUANT_ROTATION[tiny.families().index(family) % len(QUANT_ROTATION)]


def checkpoint(family: str, tmp: Path, quantize: str | None = None) -> Path:
    return tiny.make_checkpoint(
        family, Path(tmp) / f"{family}-{quantize or 'f32'}", quantize=quantize
    )


def check(
    path: Path, nodes: int, reference=None, keepalive: str = "lru", route: str = "preferred"
) -> dict:
    """{"tokens", "reference_tokens", "max_abs_logit_diff", "tokens_match"} for one node count.
    keepalive "none" and "lru" route decode steps on the device ("busy" reads the indices on the host);
    `route`: load_shard's (node/moe/route.py), each layer's preferred one unless told."""
    from moe_cluster.node.moe.load import load_in_process

    ref_tokens, ref_logits = reference or tiny.stock_tokens(path, PROMPT, STEPS)
    sm = load_in_process(str(path), nodes, keepalive=keepalive, route=route)
    tokens, logits = tiny.decode(sm.model, PROMPT, STEPS)
    assert len(tokens) == len(ref_tokens) == STEPS and logits.shape == ref_logits.shape, (
        len(tokens),
        len(ref_tokens),
        logits.shape,
        ref_logits.shape,
    )
    diff = float(np.max(np.abs(logits - ref_logits)))
    return {
        "tokens": tokens,
        "reference_tokens": ref_tokens,
        "max_abs_logit_diff": diff,
        "tokens_match": tokens == ref_tokens,
    }
