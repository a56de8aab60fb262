"""Attention by stream in the running batch: each pass's layout of rows for the MoE layers'
hand-over (moe/combine.py StreamCombine), and the idle pass of a node that brings no rows.

Every rank follows every stream, so every rank computes the same layout: how many rows each rank
brings to a pass (its own streams' positions), and where this rank's replicated and own rows sit
in its input. docs/architecture.md#attention-by-stream has the step."""

from __future__ import annotations

import mlx.core as mx

from ..proto.errors import UserError
from .moe.combine import StreamCombine
from .moe.load import activation_dtype, set_combine


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

    def prefill(self, owners: list[int], counts: list[int], mine: int | None) -> None:
        """A prefill pass: chunk i of `counts[i]` tokens of a stream owned by `owners[i]` (-1:
        replicated, alone in its pass); `mine`: the index of this rank's chunk, or None."""
        rows = [0] * self.world
        for owner, n in zip(owners, counts):
            if owner >= 0:
                rows[owner] = n
        own = mine is not None and owners[mine] >= 0
        self.combine.arrange(rows, [], list(range(counts[mine])) if own else [])

    def decode(self, decoding: list, rows: list, width: int) -> bool:
        """A decode pass of `decoding` (every rank's sequences, in order) at `width` positions
        each, this rank's input rows being `rows`' (its lanes' order); whether it brings any."""
        at = {id(s): i for i, s in enumerate(rows)}
        counts = [0] * self.world
        shared, own = [], []
        for s in decoding:
            if s.owner >= 0:
                counts[s.owner] += width
            if s.local:
                (shared if s.owner < 0 else own).extend(at[id(s)] * width + j for j in range(width))
        self.combine.arrange(counts, shared, own)
        return bool(rows)

    def idle(self) -> None:
        """A forward pass this rank brings no rows to: its experts serve the others' rows, layer
        by layer in the model's order, as their forward passes call them."""
        mx.eval([self.combine.idle(m, dtype, width) for m, dtype, width in self._layers])
