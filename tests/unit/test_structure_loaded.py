"""A model whose checkpoint is loaded gets its MoE blocks from the description, rebound, and keeps
its weights (the probe draws a block's own weights afresh, so it runs on the description's own
model): the single-node fallback and `profile` run such a model, and a router left with the
probe's weights routes wrongly."""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_flatten

from moe_cluster.node.checkpoint import Checkpoint
from moe_cluster.node.demo import MODEL_DIR
from moe_cluster.node.describe import describe
from moe_cluster.node.moe.structure import find_moe_blocks, rebind


def _weights(model) -> dict:
    return dict(tree_flatten(model.parameters()))


def test_a_loaded_models_weights_survive_its_description():
    from mlx_lm.utils import load_model

    model, _ = load_model(MODEL_DIR)
    before = _weights(model)
    blocks = rebind(describe(Checkpoint.open(MODEL_DIR)).blocks, model)
    assert [b.layer for b in blocks] == [0, 1, 2, 3]
    modules = dict(model.named_modules())
    assert all(b.block is modules[b.path] for b in blocks)  # this model's modules, not another's
    after = _weights(model)
    assert after.keys() == before.keys()
    assert all(mx.array_equal(before[k], after[k]).item() for k in before)
    # the probe itself (on a model built empty, whose weights a load replaces) draws over them
    find_moe_blocks(model)
    changed = [k for k, v in _weights(model).items() if not mx.array_equal(before[k], v).item()]
    assert changed, "the probe no longer draws a block's weights: rebinding may be unneeded"


def test_a_node_loaded_near_mlxs_memory_limit_is_told(monkeypatch, caplog):
    """Past its memory limit MLX waits for the device after every operation: a node whose weights
    come within 10% of the limit says so at load, with the numbers; one well below says nothing."""
    import logging

    from moe_cluster.node.moe.load import load_shard

    with caplog.at_level(logging.WARNING, logger="moe_cluster.node.moe.load"):
        sharded = load_shard(MODEL_DIR, None, 0, keepalive="none", warm_up=False)
    assert "memory limit" not in caplog.text
    # the loader's temporaries are given back, not kept cached (79 KB of a 9 MB model before; what is
    # left is the locals freed when load_shard returns)
    assert mx.get_cache_memory() < 0.002 * mx.get_active_memory()
    del sharded
    caplog.clear()
    monkeypatch.setattr(
        mx, "get_memory_limit", lambda: 1_000_000
    )  # 1 MB: the demo's weights are past it
    with caplog.at_level(logging.WARNING, logger="moe_cluster.node.moe.load"):
        load_shard(MODEL_DIR, None, 0, keepalive="none", warm_up=False)
    assert "within 10% of its memory limit (0.0 GB)" in caplog.text


def test_on_a_gpu_the_structure_probe_computes_float32_on_the_cpu(monkeypatch):
    """A GPU's float32 matmuls are TF32 unless MLX_ENABLE_TF32=0 (CUDA, M5), and TF32's rounding
    fails the probe's linearity check on blocks that are linear: where the default device is a
    GPU, the probe runs on the CPU stream. Half precision, which has no TF32 path, is left where
    it is."""
    import contextlib

    from mlx_lm.utils import load_model

    from moe_cluster.node.device import ieee_float32

    streams = []
    real_stream = mx.stream
    monkeypatch.setattr(mx, "stream", lambda s: streams.append(s) or real_stream(s))
    model, _ = load_model(MODEL_DIR)
    find_moe_blocks(model)
    assert streams == []  # this machine's default device is the CPU already
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    assert isinstance(ieee_float32(mx.bfloat16), contextlib.nullcontext)
    blocks = find_moe_blocks(model)
    assert [b.layer for b in blocks] == [0, 1, 2, 3] and streams == [
        mx.cpu
    ]  # one block type, probed once


def test_on_a_gpu_every_local_expert_is_read_once_before_the_route_is_timed(monkeypatch):
    """Metal pages out idle buffers and CUDA's managed memory migrates each page on its first
    device read: on either, the loader reads every local expert before it times the routes (a
    route timed on unread experts measures the migration); on a CPU it reads nothing ahead."""
    from moe_cluster.node.moe import load, route
    from moe_cluster.node.moe.experts import ExpertShard

    order = []
    monkeypatch.setattr(ExpertShard, "warm_up", lambda self: order.append(("warm", self.layer)))
    choose = route.choose
    monkeypatch.setattr(
        route, "choose", lambda *a, **k: (order.append(("timed", None)), choose(*a, **k))[1]
    )
    load.load_shard(MODEL_DIR, None, 0, keepalive="none")
    assert order == [("timed", None)]  # the CPU: nothing to touch
    order.clear()
    monkeypatch.setattr(load, "on_cuda", lambda: True)
    load.load_shard(MODEL_DIR, None, 0, keepalive="none")
    assert order == [("warm", layer) for layer in range(4)] + [("timed", None)], order
