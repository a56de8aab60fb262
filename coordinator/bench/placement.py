"""`moe-cluster bench placement`: does profile-guided placement lower the per-node expert load?

Profiles the model's routing on some prompts, plans two placements for N nodes with the same
memory — the even split, and the profile-guided one (hot experts spread, the hottest copied to
every node while the spare room allows) — and measures, on other prompts, the mean over MoE layers and steps of the
largest number of experts any node computes (what bounds a layer's time, the paper's E).
"""

from __future__ import annotations

import json

from ...node.checkpoint import Checkpoint
from ...proto.records import Sampling
from ...node.sim import SimTask
from ..serve.placement import NodeBudget, plan_placement

PROFILE_PROMPTS = [
    "To be, or not to be, that is the question:",
    "Shall I compare thee to a summer's day?",
    "Friends, Romans, countrymen, lend me your ears;",
    "Now is the winter of our discontent",
    "If music be the food of love, play on;",
    "All the world's a stage, and all the men and women merely players;",
]
MEASURE_PROMPTS = [
    "O Romeo, Romeo, wherefore art thou Romeo?",
    "The quality of mercy is not strained;",
    "Double, double toil and trouble;",
    "What's in a name? That which we call a rose",
]


def _measured_e(reports: list[dict]) -> float:
    """Mean over MoE-layer calls of the largest per-node computed count (keepalive none)."""
    calls = sum(c["calls"] for c in reports[0]["layer_counters"].values())
    return sum(c["cluster_max"] for c in reports[0]["layer_counters"].values()) / max(calls, 1)


def run(model: str, nodes: int, spare_experts: int, max_tokens: int) -> dict:
    from ..dev.profile import profile
    from ..dev.simulate import run_nodes
    from ...node.describe import describe
    from ..serve.placement import footprint

    path = str(Checkpoint.open(model).path)
    prof = profile(path, PROFILE_PROMPTS, max_tokens)
    fp = footprint(describe(Checkpoint.open(path)))
    E = next(iter(fp.num_experts.values()))
    per_node = (
        -(-E // nodes) + spare_experts
    )  # room for the even share plus spare experts per layer
    memory = fp.replicated_bytes + per_node * fp.expert_set_bytes
    budgets = [NodeBudget(f"n{i}", memory) for i in range(nodes)]
    counts = {int(l): v["counts"] for l, v in prof["layers"].items()}
    plans = {
        "even": plan_placement(fp, budgets, strategy="even", memory_fraction=1.0),
        "profile": plan_placement(
            fp, budgets, strategy="profile", memory_fraction=1.0, profile_counts=counts
        ),
    }
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from ..dev.run_local import encode_prompt

    tok = load_tokenizer(Checkpoint.open(path).path)
    out = {
        "model": path,
        "nodes": nodes,
        "experts": E,
        "spare_experts_per_node": spare_experts,
        "profile_tokens": next(iter(prof["layers"].values()))["tokens"],
        "placements": {},
    }
    for name, plan in plans.items():
        tasks = [
            SimTask(
                path,
                tuple(encode_prompt(tok, p)),
                Sampling(max_tokens=max_tokens),
                plan.placement.to_json(),
                "none",
            )
            for p in MEASURE_PROMPTS
        ]
        reports = run_nodes(tasks, nodes)
        es = [_measured_e(r) for r in reports]
        out["placements"][name] = {
            "measured_expected_experts": sum(es) / len(es),
            "experts_per_node": [
                sum(len(v[r]) for v in plan.placement.layers.values()) for r in range(nodes)
            ],
            "tokens": [r[0]["tokens"] for r in reports],
        }
    even, guided = out["placements"]["even"], out["placements"]["profile"]
    out["same_tokens"] = even.pop("tokens") == guided.pop("tokens")
    out["reduction"] = 1 - guided["measured_expected_experts"] / even["measured_expected_experts"]
    return out


def main(args) -> int:
    out = run(args.model, args.nodes, args.spare_experts, args.max_tokens)
    if args.json:
        print(json.dumps(out))
        return 0
    e, g = out["placements"]["even"], out["placements"]["profile"]
    print(
        f"{out['nodes']} nodes, {out['experts']} experts per layer, room for {out['spare_experts_per_node']} more per node:"
    )
    print(
        f"  even split     : E = {e['measured_expected_experts']:.3f} experts computed by the busiest node per layer"
    )
    print(
        f"  profile-guided : E = {g['measured_expected_experts']:.3f} ({100 * out['reduction']:.1f}% lower; "
        f"tokens {'identical' if out['same_tokens'] else 'DIFFER'})"
    )
    return 0
