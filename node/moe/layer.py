"""The MoE layer on a cluster: one explicit module wrapping a model's MoE block.

`ClusterMoE` takes the block's place in its parent. It runs the block (whose bank is now this
node's `ExpertShard`, answering zeros for experts other nodes compute), makes every term that is not
a routed expert's count once in the cluster, and all-reduces the result once:

- on the layer's owner (rank = layer index mod N, so the extra work rotates) the block runs whole;
- elsewhere its dense children (shared experts and their gates, found by `structure`) are `Zero`
  modules, and an inline non-routed term (a `residual`) is subtracted by running the block a second
  time with the bank silenced.
"""

from __future__ import annotations

import time

import mlx.core as mx
import mlx.nn as nn

from ..collective.base import Collective, rank_order_sum
from .experts import ExpertShard, ShardState
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

    def __init__(
        self,
        moe: MoEBlock,
        shard: ExpertShard,
        collective: Collective,
        state: ShardState,
        owner: bool,
    ):
        super().__init__()
        self.block = moe.block
        self._moe = moe
        self._collective = collective
        self._state = state
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

    def set_collective(self, collective: Collective) -> None:
        self._collective = collective

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
        if getattr(self._collective, "in_graph", False):
            if self._state.synced:
                return self._synced(x, *args, **kwargs)
            # the step stays one lazy graph
            return self._collective.all_reduce(self.partial(x, *args, **kwargs), self._moe.layer)
        y = self.partial(x, *args, **kwargs)
        state = self._state
        collective = self._collective
        t0 = time.perf_counter()
        if not getattr(collective, "evaluates", False):
            mx.eval(y)
        t1 = time.perf_counter()
        y = collective.all_reduce(y, self._moe.layer)
        # two micro-batches (node/overlap.py): the other lane's layer ran meanwhile, timed there,
        # and this one's partial was evaluated inside (its wait counts as the experts')
        evaluated = getattr(collective, "evaluated_s", 0.0)
        waited = time.perf_counter() - t1 - getattr(collective, "away_s", 0.0) - evaluated
        state.timers.experts += t1 - t0 + evaluated
        state.timers.collective += waited
        state.record_allreduce(waited)
        return y

    def _synced(self, x, *args, **kwargs) -> mx.array:
        """An in-graph layer evaluated in three parts, each timed: what came before it (attention
        and the rest since the last MoE layer: `attention_router`), the router and the experts
        (`experts`), the all-reduce with its wait for the slowest node (`collective`)."""
        timers = self._state.timers
        t0 = time.perf_counter()
        mx.eval(x)
        t1 = time.perf_counter()
        routed = timers.attention_router  # a host read times its own routing wait (HostPlan)
        y = self.partial(x, *args, **kwargs)
        mx.eval(y)
        t2 = time.perf_counter()
        out = self._collective.all_reduce(y, self._moe.layer)
        mx.eval(out)
        t3 = time.perf_counter()
        inner = timers.attention_router - routed  # counted there already, inside t1..t2
        timers.attention_router += t1 - t0
        timers.experts += (t2 - t1) - inner
        timers.collective += t3 - t2
        return out


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
