"""What one MoE layer of a node at N = 2 puts in a decode step's graph, against stock mlx-lm's
layer: at batch 1 on a GPU every primitive is a kernel launch, so the extras are pinned here and a
change that adds some fails. Counted exactly from the graph (node/moe/opcount.py), no timing."""

from __future__ import annotations

import mlx.core as mx
import pytest

from moe_cluster.node.collective.mlx import GraphOnly
from moe_cluster.node.demo import MODEL_DIR
from moe_cluster.node.moe.load import load_shard, load_unsharded
from moe_cluster.node.moe import kernels as kernels_module
from moe_cluster.node.moe.opcount import SkipStandIn, decode_input, kernels, moe_layer

# (primitives, kernels) one MoE layer of rank 0 adds over stock's on its route at N = 2,
# with `transport: mlx`'s all-reduce as NCCL builds it (at two ranks the all_sum of the float32
# partials, one primitive). What is left: the slot and mask gathers, the filler's max, the two selects
# (slots, zeroed rows), the all_sum and its casts where the model is not float32; keepalive lru
# adds the filler choice on the device (plan.Recency).
EXTRA = {
    ("float32", "device", "none"): (16, 6),
    ("float32", "device", "lru"): (45, 22),
    ("bfloat16-4bit", "device", "none"): (18, 8),
    ("bfloat16-4bit", "device", "lru"): (47, 24),
    # the route CUDA takes for these weights, its kernels stood in for (opcount.SkipStandIn):
    # stock's three gather_qmm and their index ranges are three custom kernels here
    ("bfloat16-4bit", "skip", "none"): (1, 1),
    ("bfloat16-4bit", "skip", "lru"): (43, 24),
}


def _checkpoint(kind: str, make_ckpt):
    if kind == "float32":
        return MODEL_DIR
    return make_ckpt("qwen3_moe", "mlx", "bfloat16", 4)


def _counts(path, route: str, keepalive: str, rows: int, monkeypatch):
    stock = load_unsharded(str(path))
    ours = load_shard(
        str(path),
        None,
        0,
        keepalive=keepalive,
        collective=GraphOnly(0, 2),
        warm_up=False,
        route="device",
    )
    if route == "skip":
        monkeypatch.setattr(kernels_module, "skip_proj", kernels_module.skip_proj)  # put back after
        SkipStandIn().install(ours)
    b = stock.blocks[0]
    x = decode_input(b.block, b.bank_attr, b.width, rows)
    assert ours.layers[0].shard.route == route
    return moe_layer(b.block, x), SkipStandIn.relabel(moe_layer(ours.layers[0], x))


@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("kind, route, keepalive", sorted(EXTRA))
def test_a_moe_layer_adds_at_most_its_pinned_primitives_over_stocks(
    kind, route, keepalive, rows, make_ckpt, monkeypatch
):
    stock, ours = _counts(_checkpoint(kind, make_ckpt), route, keepalive, rows, monkeypatch)
    prims, kerns = EXTRA[(kind, route, keepalive)]
    extra = sum(ours.values()) - sum(stock.values()), kernels(ours) - kernels(stock)
    assert extra[0] <= prims and extra[1] <= kerns, (extra, dict(ours - stock))


def test_the_count_sees_every_primitive_of_the_graph():
    """Evaluated inputs are leaves; each primitive counts once, a view as a primitive but no kernel."""
    from moe_cluster.node.moe.opcount import primitives

    a, b = mx.array([1.0, 2.0]), mx.array([3.0, 4.0])
    mx.eval(a, b)
    y = (a * b + a).astype(mx.float16).reshape(2, 1)
    counts = primitives(y)
    assert counts == {"Multiply": 1, "Add": 1, "AsType": 1, "Reshape": 1}, counts
    assert kernels(counts) == 3
    mx.eval(y)
    assert primitives(y) == {}
