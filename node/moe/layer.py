"""The MoE layer on a cluster: one explicit module wrapping a model's MoE block.

`ClusterMoE` takes the block's place in its parent. It runs the block (whose bank is now this
node's `ExpertShard`, answering zeros for experts other nodes compute), makes every term that is not
a routed expert's count once in the cluster, and hands the result to its `Combine` (combine.py),
which all-reduces it once:

- on the layer's owner (rank = layer index mod N, so the extra work rotates) the block runs whole;
- elsewhere its dense children (shared experts and their gates, found by `structure`) are `Zero`
  modules, and an inline non-routed term (a `residual`) is subtracted by running the block a second
  time with the bank silenced.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..collective.base import rank_order_sum
from .combine import Combine
from .experts import ExpertShard
from .structure import MoEBlock, Zero, get_bank, set_bank


def owns_dense_terms(layer: int, rank: int, world_size: int) -> bool:
    """Whether `rank` runs layer `layer`'s dense terms (shared experts): one node per layer."""
    return layer % world_size == rank


class _SilentBank(nn.Module):
    """The bank with every expert silenced: zeros shaped like its output."""

    def __init__(self, out_dims: int):
        super().__init__()
        self._out_dims = out_dims

    def __call__(self, x, inds, *args, **kwargs):
        return mx.zeros(inds.shape + (self._out_dims,), dtype=x.dtype)


class ClusterMoE(nn.Module):
    """A MoE block whose output is this node's share, all-reduced once per call."""

    def __init__(self, moe: MoEBlock, shard: ExpertShard, combine: Combine, owner: bool):
        super().__init__()
        self.block = moe.block
        self._moe = moe
        self.combine = combine  # the hand-over of its partial (combine.py), chosen at load
        self._owner = owner  # runs the dense terms this layer (owns_dense_terms)
        self._silent = _SilentBank(moe.bank.out_dims)
        set_bank(self.block, moe.bank.attr, shard)
        if not self._owner:
            for name in moe.dense:
                setattr(self.block, name, Zero())

    @property
    def shard(self) -> ExpertShard:
        return get_bank(self.block, self._moe.bank.attr)

    @property
    def layer(self) -> int:
        return self._moe.layer

    @property
    def description(self) -> MoEBlock:
        return self._moe

    def _residual(self, x, *args, **kwargs) -> mx.array:
        """The block's output with the bank silenced: its inline non-routed term."""
        bank = self.shard
        set_bank(self.block, self._moe.bank.attr, self._silent)
        try:
            return self._moe.forward(self.block, x, *args, **kwargs)
        finally:
            set_bank(self.block, self._moe.bank.attr, bank)

    def partial(self, x, *args, **kwargs) -> mx.array:
        """This node's share of the block's output: what it hands the all-reduce."""
        y = self._moe.forward(self.block, x, *args, **kwargs)
        if self._moe.residual and not self._owner:
            y = y - self._residual(x, *args, **kwargs)
        return y

    def __call__(self, x, *args, **kwargs):
        return self.combine(self, x, *args, **kwargs)


def install(model: nn.Module, path: str, module: nn.Module) -> None:
    """Put `module` at `path` in `model` (an attribute or a list entry of its parent), e.g. a
    `ClusterMoE` where its block was."""
    parent_path, _, name = path.rpartition(".")
    parent = model
    for part in parent_path.split(".") if parent_path else ():
        parent = parent[int(part)] if isinstance(parent, list) else getattr(parent, part)
    if isinstance(parent, list):
        parent[int(name)] = module
    else:
        setattr(parent, name, module)


class InProcessCluster(nn.Module):
    """Every rank's `ClusterMoE` of one layer in one process, summed in rank order in float32.

    Attention and the router are replicated and computed identically on every node, so one copy of
    them feeds all ranks' blocks here: the arithmetic is the cluster's, without processes or a
    transport (the family sweep runs every mlx-lm family through it).
    """

    def __init__(self, ranks: list[ClusterMoE]):
        super().__init__()
        self.ranks = ranks

    def __call__(self, x, *args, **kwargs):
        return rank_order_sum([r.partial(x, *args, **kwargs) for r in self.ranks])
