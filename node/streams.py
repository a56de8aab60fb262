"""Attention by stream in the running batch: each pass's layout of rows for the MoE layers'
hand-over (moe/combine.py StreamCombine), and the idle pass of a node that brings no rows.

Every rank follows every stream, so every rank computes the same layout: how many rows each rank
brings to a pass (its own streams' positions). Replicated streams (every rank attends for them:
`auto`'s first) run in passes of their own, in a lane of their own, which is the same on every
rank. docs/architecture.md#attention-by-stream has the step."""

from __future__ import annotations

import mlx.core as mx

from ..proto.errors import UserError
from .moe.combine import StreamCombine
from .moe.load import set_combine
from .moe.reference import activation_dtype


class StreamPasses:
    """The stream layout of a node's passes, and its idle passes."""

    def __init__(self, sharded, attention: str):
        routed = [m.layer for m in sharded.layers if m.description.routed_call]
        if routed:
            raise UserError(
                f"attention: {attention}: MoE layers {routed} take their routing from outside "
                "the block, which cannot be gathered across nodes; use attention: replicated"
            )
        c = sharded.collective
        self.rank, self.world = c.rank, c.world_size
        self.combine = StreamCombine(c, sharded.state.timers)
        set_combine(sharded, self.combine)  # every MoE layer's hand-over, once
        self._layers = [
            (m, activation_dtype(m.block, m.description.bank_attr), m.description.width)
            for m in sharded.layers
        ]

    def replicated(self) -> None:
        """A pass every rank runs alike (replicated streams): an all-reduce per MoE layer."""
        self.combine.arrange([0] * self.world)

    def prefill(self, owners: list[int], counts: list[int]) -> None:
        """A prefill pass of owned chunks: `counts[i]` tokens of a stream owned by `owners[i]`."""
        rows = [0] * self.world
        for owner, n in zip(owners, counts):
            rows[owner] = n
        self.combine.arrange(rows)

    def decode(self, decoding: list, width: int) -> bool:
        """The decode pass of the owned streams among `decoding` (every rank's), `width` positions
        each; whether this rank brings rows to it (else it runs an idle pass)."""
        counts = [0] * self.world
        for s in decoding:
            if s.owner >= 0:
                counts[s.owner] += width
        self.combine.arrange(counts)
        return counts[self.rank] > 0

    def idle(self) -> None:
        """A forward pass this rank brings no rows to: its experts serve the others' rows, layer
        by layer in the model's order, as their forward passes call them."""
        mx.eval([self.combine.idle(m, dtype, width) for m, dtype, width in self._layers])
