"""The load-time check's reference: a checkpoint's MoE blocks computed as stock mlx-lm computes
them, without loading the model (only each probed block's own weights and the experts its input
selects are read), and the dtype a block computes in."""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..checkpoint import read_tensor
from ..describe import ModelDescription
from ..device import ieee_float32
from .shard_experts import make_shard, quantize_replicated
from .experts import ShardState
from .structure import set_bank


def activation_dtype(block: nn.Module, bank_attr: str) -> mx.Dtype:
    """The dtype a block computes in: that of its own floating-point parameters (a quantized
    module's scales), the bank's aside; float32 when it has none."""
    floating = (mx.float32, mx.float16, mx.bfloat16)
    head = bank_attr.split(".")[0]
    for key, v in tree_flatten(block.parameters()):
        if key.split(".")[0] != head and v.dtype in floating:
            return v.dtype
    return mx.float32


class _Selection(nn.Module):
    """Stands in for a bank to learn which experts a block selects: records them, answers zeros."""

    def __init__(self, out_dims: int):
        super().__init__()
        self._out_dims = out_dims
        self.selected: set[int] = set()

    def __call__(self, x, inds, *args, **kwargs):
        self.selected.update(int(e) for e in np.unique(np.array(inds)))
        return mx.zeros(inds.shape + (self._out_dims,), dtype=x.dtype)


class Reference:
    """Stock output of a checkpoint's MoE blocks, computed without loading the model: the reference
    of the load-time check.

    Per block it reads its own weights (router, shared experts, norms) through the family's sanitize
    and quantization, and only the experts the input selects, by byte range.
    """

    def __init__(self, desc: ModelDescription):
        self.desc = desc
        self.ckpt = desc.checkpoint
        self.model, blocks = desc.new_model()
        self.blocks = {b.layer: b for b in blocks}

    def layers(self) -> list[int]:
        """MoE layers a probe can run (a block called with its routing from outside cannot)."""
        return [l for l, b in sorted(self.blocks.items()) if not b.routed_call]

    def hidden(self) -> int:
        """Width of the MoE blocks' input."""
        return next(iter(self.blocks.values())).width if self.blocks else 0

    def dtype(self, layer: int) -> str:
        b = self.blocks[layer]
        return str(activation_dtype(b.block, b.bank_attr)).removeprefix("mlx.core.")

    def outputs(self, layers: Sequence[int], x: np.ndarray) -> dict[int, np.ndarray]:
        """{layer: stock block output} for x (tokens, hidden) float32, as float32."""
        ckpt, desc = self.ckpt, self.desc
        expert_keys = desc.expert_keys()
        bank_prefixes = tuple(b.bank_path + "." for b in self.blocks.values())
        wanted = tuple(self.blocks[l].path + "." for l in layers)
        weights = {}
        for key, info in ckpt.tensors.items():
            own = (
                key.startswith(wanted)
                and key not in expert_keys
                and not key.startswith(bank_prefixes)
            )
            weights[key] = (
                read_tensor(info) if own else mx.zeros(info.shape, info.mx_dtype)
            )  # lazy, never evaluated
        if hasattr(self.model, "sanitize"):
            weights = self.model.sanitize(weights)
        quantize_replicated(self.model, desc.quant, weights, bank_prefixes)
        self.model.load_weights(
            [
                (k, v)
                for k, v in weights.items()
                if k.startswith(wanted) and not k.startswith(bank_prefixes)
            ],
            strict=False,
        )
        out = {}
        for layer in layers:
            b = self.blocks[layer]
            dtype = activation_dtype(b.block, b.bank_attr)
            with ieee_float32(dtype):  # as the nodes compute their shares of the check
                xa = mx.array(x)[None].astype(dtype)
                selection = _Selection(b.bank.out_dims)
                set_bank(b.block, b.bank_attr, selection)
                b.forward(b.block, xa)
                holders = {
                    e: (0,) if e in selection.selected else (1,) for e in range(b.num_experts)
                }
                shard = make_shard(
                    desc, b, sorted(selection.selected), holders, ShardState(0, 2, "none")
                )
                set_bank(b.block, b.bank_attr, shard)
                out[layer] = np.array(b.forward(b.block, xa)[0].astype(mx.float32))
        return out
