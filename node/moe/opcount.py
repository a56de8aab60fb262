"""What a MoE layer puts in a decode step's graph: its primitives by type, counted without running.

At batch 1 on a GPU a decode step is launch-bound: every primitive the step's lazy graph holds is a
kernel launch (~5-10 µs) plus the Python that built it, so the primitives one MoE layer adds over
stock mlx-lm's are a cost of their own, paid 94 times per token by a Qwen3-235B. Counted from the
graph itself (`mx.export_to_dot` walks every unevaluated input), they are exact and do not depend
on a busy machine, as a timing would.
"""

from __future__ import annotations

import io
import re
from collections import Counter
from typing import Callable

import mlx.core as mx

# Primitives that launch no kernel on a contiguous input: MLX shares the input's buffer (a view)
# or orders the graph. They still cost a node in the graph and the Python that built it.
VIEWS = frozenset(
    {
        "AsStrided",
        "Broadcast",
        "Depends",
        "ExpandDims",
        "Flatten",
        "Reshape",
        "Slice",
        "Split",
        "Squeeze",
        "StopGradient",
        "Transpose",
        "Unflatten",
        "View",
    }
)

_LABEL = re.compile(r'\[label ="([^"]+)", shape=rectangle\]')


def primitives(*outputs: mx.array) -> Counter:
    """The primitives of the graph that computes `outputs`, by type (every unevaluated array's
    primitive once: a primitive with several outputs, such as Split, counts once)."""
    dot = io.StringIO()
    mx.export_to_dot(dot, *outputs)
    return Counter(_LABEL.findall(dot.getvalue()))


def kernels(counts: Counter) -> int:
    """How many of `counts` launch a kernel (all but VIEWS)."""
    return sum(n for name, n in counts.items() if name not in VIEWS)


def layer_summary(counts: Counter) -> dict:
    """A MoE layer's count as a bench row reports it: total, kernels, and by type."""
    return {"primitives": sum(counts.values()), "kernels": kernels(counts), "by_type": dict(counts)}


def moe_layer(layer, x: mx.array, call: Callable | None = None) -> Counter:
    """The primitives one call of a MoE layer builds in a step after the first: a stock block, or a
    ClusterMoE with whatever it leaves for a later step to evaluate (keepalive lru's recency
    stamps). `call`: what to call instead of the layer itself (its partial, where the all-reduce is
    outside the graph). The layer must be one whose calls can be evaluated here."""
    recency = getattr(getattr(layer, "shard", None), "recency", None)
    call = call or layer
    # one call evaluated first: what a layer makes once and keeps (a constant, the stamps'
    # first zeros) is not the step's, as in every step after the first
    mx.eval(call(x), recency.stamp if recency is not None else [])
    before = recency.stamp if recency is not None else None
    out = [call(x)]
    if recency is not None and recency.stamp is not before:  # the call stamped what it computed
        out.append(recency.stamp)
    return primitives(*out)


def decode_input(block, bank_attr: str, width: int, rows: int = 1) -> mx.array:
    """A decode step's input to a MoE block, evaluated: `rows` tokens of one position, in the
    dtype the block computes in (an astype to the same dtype adds nothing, to another one adds a
    kernel: the count depends on it)."""
    from .reference import activation_dtype

    x = mx.random.normal((rows, 1, width), key=mx.random.key(0))
    x = x.astype(activation_dtype(block, bank_attr))
    mx.eval(x)
    return x


def stock_layer(blocks, rows: int = 1) -> Counter | None:
    """Primitives of stock mlx-lm's first MoE layer (`blocks`: the model's described MoE blocks)."""
    b = next((b for b in blocks if not b.routed_call), None)
    if b is None:
        return None
    return moe_layer(b.block, decode_input(b.block, b.bank_attr, b.width, rows))


def node_layer(sharded, rows: int = 1) -> Counter | None:
    """Primitives of one decode call of a node's first MoE layer on its own route: with its
    all-reduce where the transport builds it in the graph (`transport: mlx`, as GraphOnly of
    node/collective/mlx.py builds it), else up to the partial handed to the transport; None where
    the route reads the routing on the host (the graph stops there). The node is left as it was:
    its collective, keepalive's recency, and no call noted in its counters."""
    from ..collective.mlx import GraphOnly
    from .load import set_collective

    layer = next((m for m in sharded.layers if not m.description.routed_call), None)
    if layer is None or layer.shard.route == "host":
        return None
    b, state = layer.description, sharded.state
    x = decode_input(layer.block, b.bank_attr, b.width, rows)
    saved, noted = sharded.collective, len(state.pending)
    in_graph = saved.caps.in_graph
    if in_graph and state.world_size > 1:
        set_collective(sharded, GraphOnly(state.rank, state.world_size))
    try:
        with layer.shard.trying(layer.shard.route):
            return moe_layer(layer, x, None if in_graph else layer.partial)
    finally:
        set_collective(sharded, saved)
        del state.pending[noted:]


class SkipStandIn:
    """The skip route's kernels (kernels.skip_proj, CUDA only) for counting on any machine: each
    call one ErfInv of evaluated zeros shaped like the kernel's output, depending on its inputs;
    `relabel` names it the one custom kernel it stands for. `install` puts it in place of
    skip_proj and every MoE layer of `sharded` on the skip route (for a process that only
    counts: nothing is put back)."""

    def __call__(self, p, x: mx.array, slots: mx.array, per_x: int) -> mx.array:
        zeros = mx.zeros((slots.shape[0], p.weight.shape[1]), dtype=x.dtype)
        mx.eval(zeros)
        return mx.depends(mx.erfinv(zeros), [x, slots])

    def install(self, sharded) -> None:
        from . import kernels
        from .reference import activation_dtype

        kernels.skip_proj = self
        for m in sharded.layers:
            m.shard.use_skip(activation_dtype(m.block, m.description.bank_attr))
            m.shard.set_route("skip")

    @staticmethod
    def relabel(counts: Counter) -> Counter:
        """Each stand-in's ErfInv and Depends as the one CustomKernel primitive it stands for."""
        counts = Counter(counts)
        n = counts.pop("ErfInv", 0)
        counts["CustomKernel"] += n
        counts["Depends"] -= n
        return +counts  # drops the zero counts
