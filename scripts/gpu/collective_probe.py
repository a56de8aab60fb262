"""What one collective costs inside a decode step's graph, the way ours and mlx-lm's tensor
parallelism put it there (issue 33: ours paid ~0.78 ms per MoE layer over NCCL at N = 4 where
mlx-lm's pipeline paid 0.38 ms for the whole layer, and launches did not explain the gap).

N processes, one GPU each (CUDA_VISIBLE_DEVICES), an mx.distributed group (NCCL on a GPU host,
else the ring). Each "token" is one lazy graph of L layers, evaluated at once as a decode step is:
per layer a (1, hidden) @ (hidden, hidden) matmul, then one of

    none        nothing (the layer's compute alone)
    all_sum     mx.distributed.all_sum, as mlx-lm's tensor parallelism
    all_sum_f32 the partial cast to float32, all_sum, cast back: ours at two ranks
    gather_sum  all_gather and the float32 rank-order sum, ours at three ranks and more
                (node/collective/mlx.py)

The collective's cost per layer is (variant - none) / L, the median of ITERS tokens after a warm-up.
One JSON line per (N, variant), printed by the parent:

    python3 scripts/gpu/collective_probe.py [--nodes 2,4] [--layers 94] [--hidden 4096]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

VARIANTS = ("none", "all_sum", "all_sum_f32", "gather_sum")


def _worker(rank: int, nodes: int, env: dict, gpus: bool, args, out) -> None:
    os.environ.update(env, MLX_RANK=str(rank))
    if gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
    import mlx.core as mx

    from moe_cluster.node.collective.base import rank_order_sum_rows

    group = mx.distributed.init(backend="nccl" if gpus else "ring", strict=True)
    mx.random.seed(0)
    w = (mx.random.normal((args.hidden, args.hidden)) / args.hidden**0.5).astype(mx.bfloat16)
    x0 = mx.random.normal((1, args.hidden)).astype(mx.bfloat16)
    mx.eval(w, x0)

    def step(variant: str) -> mx.array:
        x = x0
        for _ in range(args.layers):
            y = x @ w
            if variant == "all_sum":
                y = mx.distributed.all_sum(y, group=group)
            elif variant == "all_sum_f32":
                y = mx.distributed.all_sum(y.astype(mx.float32), group=group).astype(y.dtype)
            elif variant == "gather_sum":
                y = rank_order_sum_rows(mx.distributed.all_gather(y, group=group))
            x = y * (1.0 / nodes)  # keeps the values bounded whatever the variant
        return x

    report = {}
    for variant in VARIANTS * 2:  # the first pass warms every variant up
        times = []
        for _ in range(args.iters):
            t = time.perf_counter()
            mx.eval(step(variant))
            times.append(time.perf_counter() - t)
        report[variant] = statistics.median(times)
    out.put((rank, report))


def run(nodes: int, gpus: bool, args) -> dict:
    from moe_cluster.common.ports import free_ports

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    hostfile = f"/tmp/collective-probe-{os.getpid()}-{nodes}.json"
    with open(hostfile, "w") as f:
        json.dump([[f"127.0.0.1:{p}"] for p in free_ports(nodes)], f)
    env = {
        "MLX_WORLD_SIZE": str(nodes),
        "MLX_HOSTFILE": hostfile,
        "NCCL_HOST_IP": "127.0.0.1",
        "NCCL_PORT": str(free_ports(1)[0]),
    }
    procs = [
        ctx.Process(target=_worker, args=(r, nodes, env, gpus, args, out)) for r in range(nodes)
    ]
    for p in procs:
        p.start()
    reports = {}
    try:
        for _ in procs:
            rank, rep = out.get(timeout=args.timeout)
            reports[rank] = rep
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
        os.unlink(hostfile)
    slowest = {v: max(r[v] for r in reports.values()) for v in VARIANTS}
    return {
        "nodes": nodes,
        "backend": "nccl" if gpus else "ring",
        "layers": args.layers,
        "hidden": args.hidden,
        "token_ms": {v: round(s * 1e3, 3) for v, s in slowest.items()},
        "collective_us_per_layer": {
            v: round((slowest[v] - slowest["none"]) / args.layers * 1e6, 1) for v in VARIANTS[1:]
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="2,4")
    p.add_argument("--layers", type=int, default=94)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--timeout", type=float, default=300)
    args = p.parse_args()
    gpus = len(os.popen("nvidia-smi -L 2>/dev/null").read().strip().splitlines())
    for n in (int(v) for v in args.nodes.split(",")):
        if gpus and n > gpus:
            print(json.dumps({"nodes": n, "skipped": f"{gpus} GPUs"}), flush=True)
            continue
        try:
            print(json.dumps(run(n, bool(gpus), args)), flush=True)
        except Exception as exc:  # one node count's failure is that line's result
            print(json.dumps({"nodes": n, "error": f"{type(exc).__name__}: {exc}"}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
