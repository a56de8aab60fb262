"""The load-time check: the cluster's output of a few MoE blocks against the checkpoint's.

After `Load`, every node is sent the same probe input of a MoE layer and answers its share of
that layer's output; the shares are summed in rank order in float32, as the all-reduce sums them,
and compared with the stock block's output, which the coordinator computes from the checkpoint
reading only the experts the probe selects (node.moe.reference.Reference). A mismatch beyond the
dtype's tolerance stops `up` naming the layer: it catches a node whose shard differs from the
checkpoint, an mlx-lm upgrade, or a family the structure rule misread, that no test saw.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ...proto.errors import UserError

logger = logging.getLogger(__name__)

PROBE_TOKENS = 4
MAX_LAYERS = 4  # first, last and evenly between: enough to catch a family misread, cheap to read
# |Δ| allowed, relative to max(1, max |reference|): float32 differs only by addition order; a
# half-precision sum of the same terms in another order moves by a few ulps of 2^-8.
TOLERANCE = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 5e-2}


class LoadCheckError(UserError):
    """The cluster's output of a MoE layer is not the checkpoint's."""


@dataclass(frozen=True)
class LayerCheck:
    layer: int
    max_abs_diff: float
    tolerance: float  # absolute, after scaling by the reference's magnitude


def pick_layers(layers: Sequence[int], most: int = MAX_LAYERS) -> list[int]:
    """Up to `most` layers, first and last included, evenly spaced."""
    if len(layers) <= most:
        return list(layers)
    step = (len(layers) - 1) / (most - 1)
    return sorted({layers[round(i * step)] for i in range(most)})


async def check_load(members, desc, timeout_s: float = 60.0) -> list[LayerCheck]:
    """Probe every member (in rank order) on a few MoE layers of the described checkpoint
    (node.describe.ModelDescription); raises LoadCheckError on a mismatch."""
    from ...node.moe.reference import Reference

    ref = Reference(desc)
    model_path = desc.checkpoint.path
    layers = pick_layers(ref.layers())
    if not layers:
        logger.warning(
            "load check: no MoE layer of this family can be probed (its blocks get their routing "
            "from outside); skipped"
        )
        return []
    x = np.random.default_rng(0).standard_normal((PROBE_TOKENS, ref.hidden())).astype(np.float32)
    expected = ref.outputs(layers, x)
    ordered = sorted(members, key=lambda m: m.rank)
    checks = []
    for layer in layers:
        shares = await asyncio.gather(
            *(m.client.probe(layer, x, timeout=timeout_s) for m in ordered)
        )
        total = shares[0].astype(np.float32)
        for s in shares[1:]:
            total = total + s
        want = expected[layer]
        diff = float(np.max(np.abs(total - want)))
        tol = TOLERANCE.get(ref.dtype(layer), TOLERANCE["bfloat16"]) * max(
            1.0, float(np.max(np.abs(want)))
        )
        checks.append(LayerCheck(layer, diff, tol))
        if not diff <= tol:  # NaN fails too
            raise LoadCheckError(
                f"load check failed at layer {layer} ({ref.blocks[layer].path}): the cluster's output differs "
                f"from the checkpoint's by {diff:.3g} (tolerance {tol:.3g}); a node's weights do not match "
                f"{model_path}, or this family's MoE block is not what the structure rule saw"
            )
    return checks
