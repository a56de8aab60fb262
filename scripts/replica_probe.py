"""Decode at N = 2 with replicated experts: half of every MoE layer's experts held by both nodes,
so the replica rule decides per call which node computes each selected one. Measures tok/s and the
mean experts a node computes per layer, through real node processes (`dev.simulate.run_nodes`).

    python scripts/replica_probe.py --model demo --transport mlx --rounds 3

Run it beside the same probe with another checkout's code first on PYTHONPATH to compare routes
(the replicas' rule read on the host, before routing.ArrayRule). Prints one JSON line.
`decode_arguments` and `decode` serve scripts/profile_placement_probe.py too.
"""

import argparse
import json
import os


def decode_arguments(ap: argparse.ArgumentParser, max_tokens: int, rounds: int) -> None:
    """The options every placement probe takes: the model and how its nodes decode."""
    ap.add_argument("--model", default="demo")
    ap.add_argument("--transport", default="mlx")
    ap.add_argument("--keepalive", default="none")
    ap.add_argument("--max-tokens", type=int, default=max_tokens)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--gpus", action="store_true", help="node r on GPU r")


def decode(path: str, placement, args) -> dict:
    """Decode bench decode's prompt through `placement` on its node count (real node processes);
    -> which checkout's code ran, the options, rank 0's tok/s and tokens, experts computed per node."""
    from moe_cluster.coordinator.bench.decode import DEFAULT_PROMPT
    from moe_cluster.coordinator.dev.run_local import encode_prompt
    from moe_cluster.coordinator.dev.simulate import run_nodes
    from moe_cluster.node import moe
    from moe_cluster.node.checkpoint import load_tokenizer
    from moe_cluster.node.sim import SimTask
    from moe_cluster.proto.records import Sampling
    from pathlib import Path

    ids = encode_prompt(load_tokenizer(Path(path)), DEFAULT_PROMPT)
    task = SimTask(
        path,
        tuple(ids),
        Sampling(max_tokens=args.max_tokens),
        placement.to_json(),
        args.keepalive,
        repeats=args.rounds,
    )
    (reports,) = run_nodes([task], placement.world_size, transport=args.transport, gpus=args.gpus)
    return {
        "code": os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(moe.__file__)))),
        "model": args.model,
        "nodes": placement.world_size,
        "transport": args.transport,
        "keepalive": args.keepalive,
        "generation_tps": reports[0]["generation_tps"],
        "tokens": reports[0]["tokens"],
        "computed_per_node": [r["counters"]["computed"] for r in reports],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    decode_arguments(ap, max_tokens=64, rounds=3)
    args = ap.parse_args()

    from moe_cluster.node.checkpoint import Checkpoint
    from moe_cluster.node.describe import describe
    from moe_cluster.proto.placement import Placement

    ckpt = Checkpoint.open(args.model)
    layers = describe(ckpt).moe_layers()
    placement = Placement(
        2, {l: {0: tuple(range(3 * n // 4)), 1: tuple(range(n // 4, n))} for l, n in layers.items()}
    )
    print(json.dumps(decode(str(ckpt.path), placement, args)))


if __name__ == "__main__":
    main()
