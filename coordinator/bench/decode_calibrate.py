"""`bench decode --calibrate`: the performance model (plan/calibration.py) and the expert cache's
(plan/expert_cache.py) fitted to a run, their predictions put beside its measurements."""

from __future__ import annotations

from dataclasses import replace


def calibrate(bench_out: dict) -> dict:
    """Fit the performance model to this run, once per transport (with the N = 1 points, which
    exchange nothing), and put its prediction beside each measurement: {transport: calibration}."""

    from ..plan.calibration import CalibrationError, fit, parse_bench, predict_time

    bench = parse_bench(bench_out, "bench decode")
    multi = sorted({c.transport for c in bench.clusters if c.nodes > 1}) or [
        bench.clusters[0].transport
    ]
    out = {}
    for transport in multi:
        part = replace(
            bench,
            clusters=tuple(c for c in bench.clusters if c.nodes == 1 or c.transport == transport),
        )
        cal = fit(part)
        points = []
        for i, c in enumerate(part.clusters):
            # errors on the time per token the fit is made of; the predicted tok/s is put in the
            # measured tok/s's own convention (n tokens over n - 1 intervals, as mlx-lm counts)
            error = (
                c.time_per_token_s
                / predict_time(cal, part, c.nodes, c.expected_experts, c.nodes_per_host)
                - 1.0
            )
            # held out: fitted on the other points only, a prediction rather than a fit
            others = replace(part, clusters=part.clusters[:i] + part.clusters[i + 1 :])
            try:
                held = fit(others) if len(others.clusters) >= 2 else None
            except CalibrationError:
                held = None
            held_error = (
                None
                if held is None
                else c.time_per_token_s
                / predict_time(held, part, c.nodes, c.expected_experts, c.nodes_per_host)
                - 1.0
            )
            points.append(
                {
                    "nodes": c.nodes,
                    "keepalive": c.keepalive,
                    "measured_tps": c.generation_tps,
                    "predicted_tps": c.generation_tps * (1.0 + error),
                    "error": error,
                    "held_out_error": held_error,
                }
            )
        held = [abs(p["held_out_error"]) for p in points if p["held_out_error"] is not None]
        out[transport] = {
            "bandwidth_Bps": cal.bandwidth_Bps,
            "layer_overhead_s": cal.layer_overhead_s,
            "collective_base_s": cal.collective_base_s,
            "collective_per_node_s": cal.collective_per_node_s,
            "points": points,
            "max_abs_error": max(abs(p["error"]) for p in points),
            # with no more points than the fit has terms, `error` is ~0 by construction
            "max_abs_held_out_error": max(held) if held else None,
        }
    return out


def calibrate_cache(bench_out: dict) -> list[dict]:
    """Fit the expert cache's miss cost and routing skew to this run's --expert-cache rows, per node
    count, and put the prediction beside each row (plan/expert_cache.py), with the break-even hit rate."""
    from ..plan import expert_cache as cache_model
    from ..plan.calibration import parse_bench

    bench = parse_bench(bench_out, "bench decode")
    out = []
    for n in sorted({r["nodes"] for r in bench_out.get("expert_cache") or ()}):
        cal = cache_model.calibrate(bench_out, n, bench.moe_layers)
        if cal is not None:
            cal["break_even"] = _break_even(bench, cal, cache_model)
            out.append(cal)
    return out


def _break_even(bench, cal: dict, cache_model) -> dict:
    """The hit rate below which the node's misses cost more per token than the node saves the
    cluster, t(N − 1) − t(N), both measured in this run (keepalive none)."""
    n = cal["nodes"]
    t = {c.nodes: c.time_per_token_s for c in bench.clusters if c.keepalive == "none"}
    if n - 1 not in t or n not in t:
        return {
            "saved_s": None,
            "hit_rate": None,
            "note": f"needs clusters of {n - 1} and {n} nodes in the run",
        }
    saved = t[n - 1] - t[n]
    cost = cache_model.MissCost(cal["per_miss_s"], cal["per_layer_s"])
    h = cache_model.break_even_hit_rate(cal["selected_per_token"], cost, bench.moe_layers, saved)
    return {
        "saved_s": saved,
        "hit_rate": h,
        "note": "a cached node never pays here: a node more saves less than a cached layer's fixed cost"
        if h is None
        else "below this hit rate, streaming a node costs more than the node saves",
    }
