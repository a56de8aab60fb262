"""Decode through the placement `up` plans with `strategy: profile` and replication, at N nodes:
each node gets room for its even share plus `--spare-experts` per layer, the routing profile comes
from bench placement's profile prompts (made once, kept in `--profile`), and N node processes
decode through real collectives (`dev.simulate.run_nodes`). Reports tok/s, the experts a node
computes per layer, and how the copies lie: experts held by one node, by all, by some.

    python scripts/profile_placement_probe.py --model demo --nodes 4 --spare-experts 4

Run beside the same probe with another checkout's code first on PYTHONPATH to compare planners
(before commit 8b8783b a hot expert got one more copy, read on the host per layer; since, a copy
on every node, assigned on the device). Prints one JSON line.
"""

import argparse
import json
import os
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--spare-experts", type=int, default=4)
    ap.add_argument("--profile", default=None, help="profile JSON to read, or to write if missing")
    ap.add_argument("--transport", default="mlx")
    ap.add_argument("--keepalive", default="none")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--gpus", action="store_true", help="node r on GPU r")
    args = ap.parse_args()

    from moe_cluster.coordinator.bench.decode import DEFAULT_PROMPT
    from moe_cluster.coordinator.bench.placement import PROFILE_PROMPTS
    from moe_cluster.coordinator.dev.profile import profile
    from moe_cluster.coordinator.dev.run_local import encode_prompt
    from moe_cluster.coordinator.dev.simulate import run_nodes
    from moe_cluster.coordinator.serve.placement import NodeBudget, plan_placement
    from moe_cluster.coordinator.serve.up import footprint
    from moe_cluster.node import moe
    from moe_cluster.node.checkpoint import Checkpoint, load_tokenizer
    from moe_cluster.node.sim import SimTask
    from moe_cluster.proto.records import Sampling

    path = str(Checkpoint.open(args.model).path)
    saved = Path(args.profile) if args.profile else None
    if saved is not None and saved.exists():
        prof = json.loads(saved.read_text())
    else:
        prof = profile(path, list(PROFILE_PROMPTS), 32)
        if saved is not None:
            saved.write_text(json.dumps(prof))
    fp = footprint(path)
    E = next(iter(fp.num_experts.values()))
    memory = fp.replicated_bytes + (-(-E // args.nodes) + args.spare_experts) * fp.expert_set_bytes
    counts = {int(l): v["counts"] for l, v in prof["layers"].items()}
    plan = plan_placement(fp, [NodeBudget(f"n{i}", memory) for i in range(args.nodes)], strategy="profile",
                          memory_fraction=1.0, profile_counts=counts)
    copies = {"one": 0, "all": 0, "some": 0}
    for layer, n in fp.num_experts.items():
        for holders in plan.placement.holders(layer, n).values():
            copies["one" if len(holders) == 1 else "all" if len(holders) == args.nodes else "some"] += 1
    ids = encode_prompt(load_tokenizer(Path(path)), DEFAULT_PROMPT)
    task = SimTask(path, tuple(ids), Sampling(max_tokens=args.max_tokens), plan.placement.to_json(), args.keepalive,
                   repeats=args.rounds)
    (reports,) = run_nodes([task], args.nodes, transport=args.transport, gpus=args.gpus)
    print(json.dumps({"code": os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(moe.__file__)))),
                      "model": args.model, "nodes": args.nodes, "spare_experts": args.spare_experts,
                      "transport": args.transport, "keepalive": args.keepalive, "copies": copies,
                      "generation_tps": reports[0]["generation_tps"], "tokens": reports[0]["tokens"],
                      "computed_per_node": [r["counters"]["computed"] for r in reports]}))


if __name__ == "__main__":
    main()
