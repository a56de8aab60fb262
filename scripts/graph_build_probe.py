"""Python time to build one decode token's graph (no evaluation), stock mlx-lm against the cluster
path at N = 1 on the same checkpoint: on a GPU this building, not the GPU, can bound the step, so
whatever the cluster adds per layer in Python adds to every token.

    moe-cluster demo-model --arch qwen3_moe --out /tmp/q48 --hidden 64 --experts 128 --top-k 8 --layers 48
    python scripts/graph_build_probe.py /tmp/q48 --rounds 6

Prints the median per token of each, per round, and the difference per layer.
"""

import argparse
import statistics
import time

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from moe_cluster.coordinator.dev.run_local import load_stock
from moe_cluster.node.moe.load import load_shard


def build_time(model, steps: int) -> float:
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[1, 2, 3]]), cache=cache))
    token, times = mx.array([[5]]), []
    for _ in range(steps):
        t0 = time.perf_counter()
        y = model(token, cache=cache)
        times.append(time.perf_counter() - t0)
        mx.eval(y)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()
    ckpt, stock, _ = load_stock(args.model)
    ours = load_shard(args.model, None, 0, keepalive="none", warm_up=False).model
    layers = len(stock.layers)
    diffs = []
    for _ in range(args.rounds):  # alternating, so a noisy machine slows both alike
        a, b = build_time(stock, args.steps), build_time(ours, args.steps)
        diffs.append((b - a) / layers)
        print(
            f"stock {a * 1e6:.0f} us, cluster path {b * 1e6:.0f} us per token: {diffs[-1] * 1e6:+.1f} us per layer"
        )
    print(f"median over rounds: {statistics.median(diffs) * 1e6:+.1f} us per layer")


if __name__ == "__main__":
    main()
