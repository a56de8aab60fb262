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
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from replica_probe import decode, decode_arguments  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    decode_arguments(ap, max_tokens=32, rounds=2)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--spare-experts", type=int, default=4)
    ap.add_argument("--profile", default=None, help="profile JSON to read, or to write if missing")
    args = ap.parse_args()

    from moe_cluster.coordinator.bench.placement import PROFILE_PROMPTS
    from moe_cluster.coordinator.dev.profile import profile
    from moe_cluster.coordinator.serve.placement import NodeBudget, plan_placement
    from moe_cluster.coordinator.serve.up import footprint
    from moe_cluster.node.describe import describe
    from moe_cluster.node.checkpoint import Checkpoint

    path = str(Checkpoint.open(args.model).path)
    saved = Path(args.profile) if args.profile else None
    if saved is not None and saved.exists():
        prof = json.loads(saved.read_text())
    else:
        prof = profile(path, list(PROFILE_PROMPTS), 32)
        if saved is not None:
            saved.write_text(json.dumps(prof))
    fp = footprint(describe(Checkpoint.open(path)))
    E = next(iter(fp.num_experts.values()))
    memory = fp.replicated_bytes + (-(-E // args.nodes) + args.spare_experts) * fp.expert_set_bytes
    counts = {int(l): v["counts"] for l, v in prof["layers"].items()}
    plan = plan_placement(
        fp,
        [NodeBudget(f"n{i}", memory) for i in range(args.nodes)],
        strategy="profile",
        memory_fraction=1.0,
        profile_counts=counts,
    )
    copies = {"one": 0, "all": 0, "some": 0}
    for layer, n in fp.num_experts.items():
        for holders in plan.placement.holders(layer, n).values():
            copies[
                "one" if len(holders) == 1 else "all" if len(holders) == args.nodes else "some"
            ] += 1
    print(
        json.dumps(
            {
                **decode(path, plan.placement, args),
                "spare_experts": args.spare_experts,
                "copies": copies,
            }
        )
    )


if __name__ == "__main__":
    main()
