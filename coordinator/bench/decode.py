"""`moe-cluster bench decode`: decode speed of our path against stock mlx-lm, in one run.

One node: our engine and `mlx_lm.stream_generate` alternate on the same loaded model, several
rounds each, and the medians are compared. N > 1: N simulated node processes per keepalive policy,
with the per-token breakdown of the paper's Table 3 (attention+router, experts, waiting on the
collective, other) and the measured experts computed per node per MoE layer.

This module is the command (its arguments and table); decode_run.py runs the rows,
decode_figures.py computes their figures and decode_calibrate.py fits the models to them.
"""

from __future__ import annotations

import json
import sys

from ...node.checkpoint import resolve_model_path
from ...proto.errors import UserError
from ...proto.expert_cache import ExpertCacheSpec
from ...proto.records import KEEPALIVES
from .decode_calibrate import calibrate, calibrate_cache
from .decode_run import DEFAULT_PROMPT, DecodeBench, run

TRANSPORTS = ("shm", "envoy", "mlx")


def _prefetch(text: str | None) -> int | None:
    """--prefetch: auto (None), off (0) or a depth."""
    if text in (None, "auto"):
        return None
    if text == "off":
        return 0
    if not str(text).isdigit():
        raise UserError(
            f"--prefetch must be auto, off or a number of experts per layer (got {text!r})"
        )
    return int(text)


def _route(text: str | None) -> str | None:
    """--route: the decode route every node takes at load (cluster.yaml's `route:`)."""
    from ...node.moe.experts import ROUTES

    if text is None:
        return None
    if text not in ROUTES + ("measure",):
        raise UserError(f"--route must be one of {', '.join(ROUTES)}, measure (got {text!r})")
    return text


def _routes(text: str | None, nodes: tuple[int, ...]) -> tuple[str, ...]:
    """--routes: decode routes to alternate (node/moe/experts.py ROUTES), at N > 1 only."""
    from ...node.moe.experts import ROUTES

    if not text:
        return ()
    routes = tuple(r.strip() for r in text.split(","))
    bad = [r for r in routes if r not in ROUTES]
    if bad:
        raise UserError(f"--routes: unknown route {bad[0]!r} ({', '.join(ROUTES)})")
    if len(set(routes)) != len(routes):
        raise UserError(f"--routes names a route twice: {text}")
    if max(nodes) < 2:
        raise UserError("--routes needs a node count above 1 (--nodes): one node has no routes")
    return routes


def main(args) -> int:
    try:
        nodes = tuple(int(n) for n in str(args.nodes).split(","))
    except ValueError:
        raise UserError(f"--nodes must list whole numbers, e.g. 1,2,4 (got {args.nodes})") from None
    if any(n < 1 for n in nodes):
        raise UserError(f"--nodes must list numbers >= 1 (got {args.nodes})")
    keepalive = tuple(args.keepalive.split(","))
    bad = [k for k in keepalive if k not in KEEPALIVES]
    if bad:
        raise UserError(f"--keepalive: unknown policy {bad[0]!r} ({', '.join(KEEPALIVES)})")
    transports = tuple(args.transport.split(","))
    bad = [t for t in transports if t not in TRANSPORTS]
    if bad:
        raise UserError(f"--transport: unknown transport {bad[0]!r} ({', '.join(TRANSPORTS)})")
    if args.speculative != "off":
        from .speculative import main as speculative

        return speculative(args, nodes, transports, args.prompt or DEFAULT_PROMPT)
    if args.spoil is not None or args.draft_model or args.streams > 1 or args.mtp_experts != "auto":
        raise UserError("--spoil, --draft-model, --mtp-experts and --streams need --speculative")
    caches = tuple(c for c in (args.expert_cache or "").split(",") if c)
    for c in caches:
        ExpertCacheSpec.parse(c)
    spec = DecodeBench(
        str(resolve_model_path(args.model)),  # a repo is fetched here once; the nodes read folders
        nodes,
        keepalive,
        args.max_tokens,
        args.rounds,
        args.prompt or DEFAULT_PROMPT,
        transports,
        args.gpus,
        caches,
        args.routing_profile,
        _prefetch(args.prefetch),
        not args.no_peers,
        _routes(args.routes, nodes),
        _route(args.route),
        args.mlx_backend,
    )
    out = run(spec)
    if args.calibrate:
        out["calibration"] = calibrate(out)
        if out["expert_cache"]:
            out["expert_cache_calibration"] = calibrate_cache(out)
    if args.json:
        print(json.dumps(out))
        return 0
    for c in out.get("expert_cache_calibration", ()):
        h = c["break_even"]["hit_rate"]
        print(
            f"expert cache at {c['nodes']} nodes: {c['per_miss_s'] * 1e6:.0f} us per miss, "
            f"{c['per_layer_s'] * 1e6:.0f} us per cached MoE layer, routing skew {c['skew']:.2f}; break-even hit "
            f"rate {'-' if h is None else f'{h:.0%}'} ({c['break_even']['note']})"
        )
        for p in c["points"]:
            print(
                f"  {p['expert_cache']:>5} profile {'yes' if p['profile'] else 'no':>3}: measured "
                f"{p['measured_tps']:.1f} tok/s, predicted {p['predicted_tps']:.1f} ({100 * p['error']:+.1f}%)"
            )
    for transport, cal in out["calibration"].items() if args.calibrate else ():
        print(
            f"calibration over {transport}: bandwidth {cal['bandwidth_Bps'] / 1e9:.2f} GB/s, {cal['layer_overhead_s'] * 1e6:.0f} us per layer, "
            f"collective {1e6 * (cal['collective_base_s'] or 0):.0f} us per MoE layer at 2 nodes "
            f"+{1e6 * (cal['collective_per_node_s'] or 0):.0f} us per extra node"
        )
        for p in cal["points"]:
            held = p["held_out_error"]
            print(
                f"  {p['nodes']} nodes {p['keepalive']:>4}: measured {p['measured_tps']:.1f} tok/s, "
                f"predicted {p['predicted_tps']:.1f} tok/s ({100 * p['error']:+.1f}%; fitted without it: "
                + ("-" if held is None else f"{100 * held:+.1f}%")
                + ")"
            )
    if out["stock_error"]:
        print(f"single node: stock mlx-lm failed here: {out['stock_error']}")
    else:
        print(
            f"single node: ours {out['ours_tps']:.1f} tok/s, stock mlx-lm "
            f"{out['mlx_lm_tps']:.1f} tok/s, ratio {out['ratio']:.3f}"
        )
    print(
        "cluster path at N = 1:"
        + (f" ratio {out['cluster_ratio']:.3f}" if out["cluster_ratio"] is not None else " -")
    )
    for p in out["peers"]:
        print(
            f"peer {p['name']} at {p['nodes']} processes: "
            + (f"{p['tps']:.1f} tok/s" if "tps" in p else p["error"])
        )
    print(
        f"{'nodes':>5} {'keepalive':>9} {'tok/s':>7} {'s/token':>8} {'E[n]':>5} {'attn+router':>11} "
        f"{'experts':>8} {'collective':>10} {'other':>7}"
    )
    for c in out["clusters"]:
        b = c["breakdown_s"] or {}
        fmt = lambda k: f"{b[k]:.4f}" if k in b else "-"  # noqa: E731
        print(
            f"{c['nodes']:>5} {c['keepalive']:>9} {c['generation_tps']:>7.1f} {c['time_per_token_s']:>8.4f} "
            f"{c['expected_experts'] or 0:>5.2f} {fmt('attention_router'):>11} {fmt('experts'):>8} "
            f"{fmt('collective_wait'):>10} {fmt('other'):>7}"
        )
        for route, r in c.get("routes", {}).items():
            ratios = ", ".join(f"{x:.3f}" for x in r["over_first_by_round"])
            reads = r["expert_reads"]["nodes"]
            print(
                f"      route {route:<6} {r['generation_tps']:>7.1f} tok/s (rounds: "
                + ", ".join(f"{x:.1f}" for x in r["rounds_tps"])
                + f"; over the first route, round by round: {ratios}); matrices per layer "
                + ", ".join(f"{n['matrices_per_layer']:.2f}" for n in reads)
                + "; stock's tokens: "
                + (
                    "-"
                    if r["same_tokens"] is None
                    else "yes"
                    if r["same_tokens"]
                    else f"from {r['first_mismatch']} on, no"
                )
            )
    if out["expert_cache"]:
        print(
            f"{'nodes':>5} {'cache':>6} {'profile':>7} {'tok/s':>7} {'hit rate':>8} {'misses/tok':>10} "
            f"{'MB read/tok':>11} {'read s/tok':>10} {'prefetched':>10} {'peak MB':>8} {'experts MB':>10} "
            f"{'stock tokens':>12}"
        )
    for c in out["expert_cache"]:
        print(
            f"{c['nodes']:>5} {c['expert_cache']:>6} {'yes' if c['profile'] else 'no':>7} {c['generation_tps']:>7.1f} "
            f"{c['hit_rate']:>8.1%} {c['misses_per_token']:>10.2f} {c['bytes_read_per_token'] / 1e6:>11.3f} "
            f"{c['read_seconds_per_token']:>10.5f} "
            f"{c['prefetch_hits_per_token']:>4.2f}/{c['prefetched_per_token']:<5.2f} "
            f"{c['peak_memory_decode_bytes'] / 1e6:>8.2f} {c['resident_expert_bytes'] / 1e6:>10.2f} "
            f"{'yes' if c['same_tokens'] else 'NO':>12}"
        )
    sys.stdout.flush()
    return 0
