"""`bench decode`'s figures from the node processes' reports, without running anything: the time
breakdown per step, the experts computed per MoE layer, the expert bytes each route reads, what a
cluster adds per MoE layer, and a run's tokens against stock mlx-lm's."""

from __future__ import annotations

import statistics


def breakdown(timers: dict, steps: int, per_step: float) -> dict:
    """A node's timers (node/moe/experts.py Timers) over `steps` decode steps, per step in seconds:
    attention+router, experts, waiting on the collective, and the rest of `per_step`."""
    out = {
        "attention_router": timers["attention_router"] / steps,
        "experts": timers["experts"] / steps,
        "collective_wait": timers["collective"] / steps,
    }
    out["other"] = max(per_step - sum(out.values()), 0.0)
    return out


def expected_experts(reports: list[dict], keepalive: str) -> float:
    """Mean over MoE-layer calls of the largest per-node computed count (what bounds a layer)."""
    if keepalive == "busy":
        return float(max(max(r["experts_per_layer"].values()) for r in reports))
    layers = reports[0]["layer_counters"]
    calls = sum(c["calls"] for c in layers.values())
    if not calls:
        return 0.0
    if keepalive == "lru":
        return (
            max(sum(c["computed"] for c in r["layer_counters"].values()) for r in reports) / calls
        )
    return sum(c["cluster_max"] for c in layers.values()) / calls


def by_route(reports: list[dict]) -> dict:
    """Per decode route alternated in a row (SimTask.routes): rank 0's tok/s in every round and
    their median, each round's tok/s over the first route's in the same round (a pair run seconds
    apart: what a drifting machine cannot move), its tokens, and its expert reads."""
    runs = reports[0]["routes"]
    first = next(iter(runs), None)
    out = {}
    for route, run in runs.items():
        tps = run["generation_tps"]
        out[route] = {
            "generation_tps": statistics.median(tps),
            "rounds_tps": tps,
            "over_first_by_round": [a / b for a, b in zip(tps, runs[first]["generation_tps"])],
            "route": run["route"],
            "tokens": run["tokens"],
            "generated": run["generated"],
            "expert_reads": expert_reads([{**r, **r["routes"][route]} for r in reports]),
        }
    return out


def expert_reads(reports: list[dict]) -> dict:
    """Per node, the routed-expert bytes its decode steps read, counted rather than timed: per MoE
    layer and call, the expert matrices the layer's route reads (skip and host: the experts this
    node computes; device, redirected rows: one matrix per routed position, k per token, since
    every position another node computes is redirected to a local slot), times the bytes of one
    local expert. A repeated slot may come from the GPU's cache rather than its memory: these are
    the reads the kernel issues. Bench decode's steps carry one token, so per call is per token."""
    nodes = []
    for r in reports:
        per_layer, total = [], 0.0
        for layer, c in r["layer_counters"].items():
            if not c["calls"] or layer not in r["layer_routes"]:
                continue
            route = r["layer_routes"][layer]
            read = (c["positions"] if route == "device" else c["computed"]) / c["calls"]
            per_layer.append(read)
            total += read * r["expert_matrix_bytes"][layer]
        nodes.append(
            {
                "rank": r["rank"],
                "route": r["route"],
                "routes": sorted(set(r["layer_routes"].values())),
                "matrices_per_layer": statistics.mean(per_layer) if per_layer else 0.0,
                "computed_per_layer": r["counters"]["computed"],
                "bytes_per_token": total,
            }
        )
    return {
        "counts": "routed-expert bytes read per node per token: per MoE layer, the matrices "
        "its route reads (skip, host: experts computed; device: one per routed "
        "position) x one local expert's bytes",
        "nodes": nodes,
        "max_bytes_per_token": max((n["bytes_per_token"] for n in nodes), default=0.0),
    }


def fixed_cost_us(
    time_per_token_s: float, stock_tps: float, generated: int, moe_layers: int
) -> float:
    """What the cluster adds to each MoE layer beyond stock mlx-lm's time per token, in µs. Stock's
    tok/s counts n tokens over n - 1 intervals (mlx-lm's convention, and the engine's), while a row's
    time_per_token_s is the interval itself: compared as intervals."""
    stock_s = (generated / (generated - 1) if generated > 1 else 1.0) / stock_tps
    return 1e6 * (time_per_token_s - stock_s) / moe_layers


def compare(tokens: list[int], stock: list[int], choices: list[list] | None = None) -> dict:
    """same_tokens, and where a run that differs from stock mlx-lm first does (None: it does not),
    so a bfloat16 near-tie late in a run is told from a wrong first token. Counts must agree too:
    a run that stops early (or generated nothing) differs where it stopped. With stock's `choices`
    there (`stock_choices`), `at_mismatch` says how stock ranked the run's token at that point
    (None: not among stock's best) and how far below stock's best it was. In bfloat16 stock's one
    pass can rank first another token than its decode took: rank 1 with gap 0 then says stock's
    own two passes part there, a tie at that precision."""
    if stock is None:  # stock mlx-lm could not run this model here (bench decode's stock_error)
        return {
            "same_tokens": None,
            "first_mismatch": None,
            "generated": len(tokens),
            "stock_generated": None,
        }
    first = next(
        (i for i, (a, b) in enumerate(zip(tokens, stock)) if a != b),
        None if len(tokens) == len(stock) and stock else min(len(tokens), len(stock)),
    )
    out = {
        "same_tokens": first is None,
        "first_mismatch": first,
        "generated": len(tokens),
        "stock_generated": len(stock),
    }
    if first is not None and choices and first < min(len(tokens), len(choices)):
        best = choices[first]
        rank = next((r for r, (t, _) in enumerate(best, 1) if t == tokens[first]), None)
        out["at_mismatch"] = {
            "token": tokens[first],
            "stock_token": stock[first],
            "rank": rank,
            "gap": best[0][1] - best[rank - 1][1] if rank else None,
        }
    return out
