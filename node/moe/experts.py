"""ExpertShard: a node's local experts of one MoE layer, computed exactly, with keepalive.

It replaces an mlx-lm expert bank (`SwitchGLU`/`SwitchMLP`) and answers the same call,
`bank(x, inds) -> (..., k, D)`, with zeros where an expert is computed by another node, so the MoE
block's weighted sum becomes this node's partial sum. A call is `kernel(x, plan(inds))`: the slot
plan (plan.py) and the kernel (kernels.py) are chosen at load and when the route is set, never
per call; keepalive's recency and the expert cache belong to the plan, the counts to the node's
ShardState (telemetry.py).
"""

from __future__ import annotations

from contextlib import contextmanager
from types import MappingProxyType
from typing import Callable, Mapping, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ...proto.errors import UserError
from .expert_cache import LayerCache
from .kernels import (
    SORTED_FROM,
    CountedRows,
    ExpertMLP,
    Gather,
    HostRows,
    ShardLinear,
    Skip,
    act_dtype,
    groups,
    out_dim,
    skip_fits,
)
from .plan import CountedPlan, HostPlan, Recency, ShardConfig, device_plan
from .telemetry import ALLREDUCE_BUCKETS, LayerCounters, NodeConfig, ShardState, Timers

__all__ = [
    "ALLREDUCE_BUCKETS",
    "ROUTES",
    "ExpertShard",
    "LayerCounters",
    "NodeConfig",
    "ShardLinear",
    "ShardState",
    "Timers",
]

# How a decode step's routed experts are computed (ExpertShard.routes), in the order preferred where
# nothing is measured: on the device reading only this node's experts (a skip kernel), on the
# device with the other nodes' positions redirected to a local slot (one expert read per position),
# or with the routing read on the host (only the selected experts computed; one host sync a layer).
ROUTES = ("skip", "device", "host")


class _Step:
    """A route's call, composed when the route is set: `kernel(x, plan(inds))`. A device route
    at N > 1 hands calls of `host_from` positions or more (a prompt, a wide batch) to the host
    read, as a lone node does not; None: never."""

    def __init__(self, plan, kernel, host: tuple | None = None, host_from: int | None = None):
        self.plan, self.kernel = plan, kernel
        self._host_plan, self._host_kernel = host or (None, None)
        self.host_from = host_from if self._host_plan is not None else None

    def __call__(self, x: mx.array, inds: mx.array) -> mx.array:
        if self.host_from is not None and inds.size >= self.host_from:
            return self._host_kernel(x, self._host_plan(inds))
        return self.kernel(x, self.plan(inds))


class ExpertShard(nn.Module):
    """The local experts of one MoE layer, stacked (E_local, ...) per projection."""

    def __init__(
        self,
        layer: int,
        global_ids: Sequence[int],
        holders: Mapping[int, Sequence[int]],
        projections: Mapping[str, ShardLinear],
        kind: str,
        activation: Callable,
        state: ShardState,
    ):
        super().__init__()
        if kind not in ("glu", "mlp"):
            raise ValueError(f"unknown expert kind {kind!r}")
        for name, proj in projections.items():
            setattr(self, name, proj)
        node = state.config
        frozen = MappingProxyType({e: tuple(rs) for e, rs in holders.items()})
        self.config = ShardConfig(
            layer, tuple(global_ids), frozen, kind, node.rank, node.world_size, node.keepalive
        )
        self._state = state
        state.add_layer(layer, self.config.global_ids, len(holders))
        names = ("gate_proj", "up_proj", "down_proj") if kind == "glu" else ("fc1", "fc2")
        self.mlp = ExpertMLP([projections[n] for n in names], kind, activation)
        self.recency = Recency(len(self.config.global_ids))
        self.device_plan = device_plan(self.config, state, self.recency)
        # kernels as plain attributes: a dict on an nn.Module would be walked as a parameter tree
        self.gather = Gather(self.mlp)
        self._host_read()
        self.skip: Skip | None = None  # use_skip
        self._next: LayerCache | None = None  # prefetch_into
        self._next_candidates: tuple[int, ...] = ()
        self._depth = 0
        self.set_route(self.routes()[0])

    # The route: which plan and kernel a call takes

    def routes(self) -> tuple[str, ...]:
        """The routes this layer's decode step can take (ROUTES), preferred first. Alone, only one:
        every expert is here, so the device route (stock mlx-lm's op for op) reads nothing it does
        not use, and the host read would only add a sync; without device routing (an expert
        cache, keepalive busy, per-expert matmuls), only the host read."""
        device = self.device_plan is not None and self.mlp.gathered
        if self.config.world_size == 1:
            return ("device",) if device else ("host",)
        skip = self.skip is not None and device
        return (("skip",) if skip else ()) + (("device",) if device else ()) + ("host",)

    def set_route(self, route: str, host_from: int | None = SORTED_FROM) -> None:
        """Compute decode steps by `route` from now on (one of routes()); a device route hands
        calls of `host_from` positions or more to the host read (None: none)."""
        if route not in self.routes():
            raise UserError(
                f"MoE layer {self.layer} cannot take the {route!r} route here "
                f"(it can take: {', '.join(self.routes())})"
            )
        self._route = route
        host = (self.host_plan, self.host_rows)
        if route == "host":
            self._step = _Step(*host)
        else:
            kernel = self.skip if route == "skip" else self.gather
            alone = self.config.world_size == 1
            self._step = _Step(self.device_plan, kernel, None if alone else host, host_from)

    @property
    def route(self) -> str:
        return self._route

    @property
    def host_from(self) -> int | None:
        """Positions from which a call takes the host read instead (None: never; the host route
        takes every call)."""
        return self._step.host_from

    @property
    def plan(self):
        """The slot plan a decode call of this route takes (plan.py)."""
        return self._step.plan

    @property
    def kernel(self):
        """The kernel a decode call of this route takes (kernels.py)."""
        return self._step.kernel

    def _host_read(self, cache: LayerCache | None = None, ahead: int = 1) -> None:
        """The host read's plan and kernel: where the device plans a call (no expert cache, keepalive
        none or lru), the device sorts the rows and the host reads only their count (CountedPlan);
        otherwise the host reads the routing and plans in numpy (HostPlan)."""
        dp = self.device_plan
        if cache is None and dp is not None and self.config.world_size > 1 and self.mlp.gathered:
            self.host_plan = CountedPlan(dp, self._state, len(self.config.global_ids))
            self.host_rows = CountedRows(self.mlp)
        else:
            self.host_plan = HostPlan(self.config, self._state, self.recency, cache, ahead)
            self.host_rows = HostRows(self.mlp)

    def host_only(self, cache: LayerCache | None = None, ahead: int = 1) -> None:
        """Read every call's routing on the host and plan it there (what an expert cache needs;
        tests compare the device routes against it)."""
        self.device_plan = None
        self.skip = None
        self._host_read(cache, ahead)
        self.set_route("host")

    def attach_cache(self, cache: LayerCache, ahead: int = 1) -> None:
        """Keep only `cache.capacity` experts resident (the projections hold that many slots): the
        host reads the routing to learn the misses, so the device-routed path is off. `ahead`: how
        many of a later round's misses are read while an earlier round computes."""
        self._state.cache[self.layer] = cache.stats
        self.host_only(cache, ahead)

    def prefetch_into(
        self, cache: LayerCache | None, candidates: Sequence[int], depth: int
    ) -> None:
        """When this layer begins, start reading the first `depth` non-resident `candidates` (local
        indices, likeliest first) of `cache`, the next layer's: its routing is not known before this
        layer's output."""
        self._next = cache if depth > 0 and candidates else None
        self._next_candidates = tuple(candidates)
        self._depth = depth

    def enable_skip_gemv(self) -> str | None:
        """Compute the device-routed decode step at N > 1 with a skip kernel (CUDA): skip_gemv for
        bfloat16/float16 weights, qskip for 4/8-bit affine and mxfp4 ones; neither reads anything
        for the positions another node computes. Returns why not (None: on, and the route)."""
        if self.device_plan is None or self.config.world_size == 1 or not self.mlp.gathered:
            return "this layer's decode is not routed on the device at N > 1"
        why, dtype = skip_fits(self.mlp)
        if why:
            return why
        self.use_skip(dtype)
        self.set_route("skip")
        return None

    def use_skip(self, dtype: mx.Dtype) -> None:
        """Offer the skip route for inputs of `dtype` (enable_skip_gemv, where its check passed)."""
        self.skip = Skip(self.mlp, dtype, self.gather)

    def slice_inputs(self, slices: int) -> bool:
        """Store the last projection (down, fc2) in `slices` slices of its input dimension
        (ShardLinear.slice_inputs; 1: whole again). False where it cannot be: alone (a lone node
        stays stock's op for op), an expert cache (it writes whole experts into their slots), a skip
        kernel (it reads the weight as stored), or a weight gather_mm does not multiply."""
        last = self.mlp.last
        if slices != 1 and (
            self.config.world_size == 1
            or self.cache is not None
            or self.skip is not None
            or not last.can_slice(slices)
        ):
            return False
        last.slice_inputs(slices)
        return True

    @contextmanager
    def trying(self, route: str):
        """Calls on `route` that leave the layer as it was: its route, keepalive's recency, and no
        prefetch of the next layer's cache (the node's counters are the caller's to reset)."""
        saved = self._route, self.recency.saved(), self._next, self.host_from
        self.set_route(route, None)  # the route's own kernel at every size
        self._next = None
        try:
            yield self
        finally:
            self.set_route(saved[0], saved[3])
            self.recency.restore(saved[1])
            self._next = saved[2]

    # What it holds

    @property
    def layer(self) -> int:
        return self.config.layer

    @property
    def global_ids(self) -> tuple[int, ...]:
        return self.config.global_ids

    @property
    def telemetry(self) -> ShardState:
        """The node's counters, which this shard's calls add to (not `state`: nn.Module's own)."""
        return self._state

    @property
    def device_routed(self) -> bool:
        return self.device_plan is not None

    @property
    def cache(self) -> LayerCache | None:
        return self.host_plan.cache

    @property
    def lru(self) -> list[int]:
        """Local slots, least recently computed first (reads the stamps on the host)."""
        return self.recency.order()

    # Calls

    def __call__(self, x: mx.array, inds: mx.array) -> mx.array:
        if self._next is not None:  # the next layer's likely misses read while this one runs
            self._next.prefetch(self._next_candidates, self._depth)
        return self._step(x, inds)

    def decode_sample(
        self, top_k: int, count: int, seed: int = 0, tokens: int = 1
    ) -> tuple[mx.array, list[mx.array]]:
        """A decode call's input for timing: `tokens` rows of a batch (tokens, 1, hidden) in the
        experts' dtype, and `count` routings of it, each row `top_k` distinct experts drawn from the
        router's count."""
        last = self.mlp.last
        n = self.config.num_experts
        rng = np.random.default_rng(seed)
        x = mx.random.normal((tokens, 1, out_dim(last)), key=mx.random.key(seed)) * 0.1
        x = x.astype(act_dtype(last))
        k = min(top_k, n)
        draws = [
            np.stack([rng.choice(n, size=k, replace=False) for _ in range(tokens)])
            for _ in range(count)
        ]
        inds = [mx.array(d[:, None].astype(np.int32)) for d in draws]
        mx.eval(x, *inds)
        return x, inds

    def warm_up(self) -> None:
        """Touch every local expert once (the paper's warm-up before the first request)."""
        if not self.global_ids:
            return
        last = self.mlp.last
        cache = self.cache
        slots = np.arange(cache.capacity if cache is not None else len(self.global_ids))
        x = mx.zeros((len(slots), 1, out_dim(last)), dtype=act_dtype(last))
        mx.eval(self.mlp(x, mx.array(slots.astype(np.uint32)), groups(slots)))

    def resident_bytes(self) -> int:
        return sum(v.nbytes for _, v in _leaves(self.parameters()))

    def matrix_bytes(self) -> int:
        """Bytes of one local expert (every projection: weights, scales, biases), what a kernel
        reads for one expert it computes."""
        slots = self.mlp.projections[0].weight.shape[0]
        return self.resident_bytes() // slots if slots else 0


def _leaves(tree):
    from mlx.utils import tree_flatten

    return tree_flatten(tree)
