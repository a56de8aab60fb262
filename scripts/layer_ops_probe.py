"""Primitives one MoE layer puts in a decode step's graph, stock mlx-lm against this node's layer at
N = 2 (rank 0, `transport: mlx`'s graph, node/collective/mlx.py GraphOnly), by type, and the Python
time to build it; plus the whole step's count (logits of one token, KV cache warm).

    python scripts/layer_ops_probe.py node/demo/model --route device --keepalive none
    python scripts/layer_ops_probe.py /tmp/q3-4bit --rows 8 --json

Deterministic except the build times (medians of --repeats calls; alternate rounds on a busy host).
`--route skip` counts the skip route without CUDA: each skip kernel (node/moe/kernels.py skip_proj)
is a stand-in of the same inputs, reported as one CustomKernel primitive.
"""

import argparse
import json

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from moe_cluster.coordinator.dev.run_local import load_stock
from moe_cluster.node.collective.mlx import GraphOnly
from moe_cluster.node.moe.load import activation_dtype, load_shard, load_unsharded
from moe_cluster.node.moe.opcount import (
    SkipStandIn,
    build_seconds,
    kernels,
    moe_layer,
    primitives,
)


def _step_counts(model, rows: int):
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[1, 2, 3]] * rows), cache=cache))
    tokens = mx.array([[5]] * rows)
    counts = primitives(model(tokens, cache=cache)[:, -1, :])
    for c in cache:
        c.trim(1)
    return counts


def measure(path: str, route: str, keepalive: str, rows: int, world: int, repeats: int) -> dict:
    stock = load_unsharded(path)
    ours = load_shard(
        path,
        None,
        0,
        keepalive=keepalive,
        collective=GraphOnly(0, world),
        warm_up=False,
        route="device" if route == "skip" else route,
    )
    if route == "skip":
        SkipStandIn().install(ours)
    b, layer = stock.blocks[0], ours.layers[0]
    dtype = activation_dtype(b.block, b.bank_attr)
    x = mx.random.normal((rows, 1, b.width or layer.description.width)).astype(dtype)
    mx.eval(x)
    out = {"route": layer.shard.route, "keepalive": keepalive, "rows": rows, "world": world}
    for name, module, model in (("stock", b.block, stock.model), ("ours", layer, ours.model)):
        counts = SkipStandIn.relabel(moe_layer(module, x))
        call = lambda: module(x)  # noqa: E731
        step = _step_counts(model, rows)
        out[name] = {
            "layer": dict(sorted(counts.items())),
            "layer_primitives": sum(counts.values()),
            "layer_kernels": kernels(counts),
            "layer_build_us": build_seconds(call, repeats) * 1e6,
            "layer_build_p10_us": build_seconds(call, repeats, 0.1) * 1e6,
            "step_primitives": sum(step.values()),
            "step_kernels": kernels(step),
        }
        ours.state.reset_counters()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--route", default="device")
    p.add_argument("--keepalive", default="none")
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--repeats", type=int, default=300)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    out = measure(a.model, a.route, a.keepalive, a.rows, a.world, a.repeats)
    if a.json:
        print(json.dumps(out))
        return
    print(f"route {out['route']}, keepalive {out['keepalive']}, rows {a.rows}, N = {a.world}")
    names = sorted(set(out["stock"]["layer"]) | set(out["ours"]["layer"]))
    for n in names:
        print(
            f"  {n:>18} stock {out['stock']['layer'].get(n, 0):>3} ours {out['ours']['layer'].get(n, 0):>3}"
        )
    for side in ("stock", "ours"):
        o = out[side]
        print(
            f"{side:>6}: per MoE layer {o['layer_primitives']} primitives ({o['layer_kernels']} "
            f"kernels), build {o['layer_build_us']:.1f} us; step {o['step_primitives']} "
            f"({o['step_kernels']} kernels)"
        )


if __name__ == "__main__":
    main()
