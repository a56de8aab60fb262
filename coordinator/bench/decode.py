"""`moe-cluster bench decode`: decode speed of our path against stock mlx-lm, in one run.

One node: our engine and `mlx_lm.stream_generate` alternate on the same loaded model, several
rounds each, and the medians are compared. N > 1: N simulated node processes per keepalive policy,
with the per-token breakdown of the paper's Table 3 (attention+router, experts, waiting on the
collective, other) and the measured experts computed per node per MoE layer.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace

from ...node.checkpoint import Checkpoint, resolve_model_path
from ...node.device import release_memory
from ...node.engine import Stats, generate_tokens
from ...proto.errors import UserError
from ...proto.expert_cache import ExpertCacheSpec
from ...proto.records import KEEPALIVES, Sampling

TRANSPORTS = ("shm", "envoy", "mlx")
DEFAULT_PROMPT = "Shall I compare thee to a summer's day? Thou art more lovely and more temperate."


@dataclass(frozen=True)
class DecodeBench:
    model: str
    nodes: tuple[int, ...] = (1,)
    keepalive: tuple[str, ...] = ("none", "lru")
    max_tokens: int = 64
    rounds: int = 3
    prompt: str = DEFAULT_PROMPT
    transports: tuple[str, ...] = (
        "shm",
    )  # each N > 1 is measured over each (N = 1 exchanges nothing)
    gpus: bool = False  # bind node r to GPU r
    expert_cache: tuple[
        str, ...
    ] = ()  # resident shares to measure (proto.expert_cache), e.g. 100%,50%,25%
    routing_profile: str | None = (
        None  # the profile the cached runs pin from; None: one made on PROFILE_PROMPTS
    )
    prefetch: int | None = None  # the cached runs' read-ahead per layer (load_shard's); None: auto
    peers: bool = True  # measure mlx-lm's tensor parallelism at each N > 1
    # decode routes to alternate round by round in each cluster row at N > 1, within one load
    # (node/sim.py SimTask.routes); empty: each node's own choice
    routes: tuple[str, ...] = ()
    route: str | None = None  # every node's decode route at load (`route:`); None: measured
    mlx_backend: str = "auto"  # transport mlx: `ring` forces the ring where NCCL would be picked


# Prompts a routing profile is made from when none is given: not the benchmark's own prompt, so the
# profile predicts routing rather than replaying it.
PROFILE_PROMPTS = (
    "Once upon a time there was a king who had three daughters.",
    "The rain fell on the river and the boats came home before night.",
)


def _single_node(spec: DecodeBench, ids: list[int], tokenizer, model) -> dict:
    """Alternate our engine and stock mlx-lm on the same model; medians of `rounds` each."""
    from mlx_lm.generate import stream_generate

    sampling = Sampling(max_tokens=spec.max_tokens)
    ours, stock, tokens_ours, tokens_stock = [], [], None, None
    for i in range(spec.rounds + 1):  # the first round of each warms up and is not counted
        stats = Stats()
        toks = list(generate_tokens(model, ids, sampling, eos_token_ids=(), stats=stats))
        last = None
        stock_toks = []
        for last in stream_generate(model, tokenizer, ids, max_tokens=spec.max_tokens):
            stock_toks.append(last.token)
        if i == 0:
            continue
        ours.append(stats.generation_tps)
        stock.append(last.generation_tps)
        tokens_ours, tokens_stock = toks, stock_toks
    choices = stock_choices(model, ids, tokens_stock)
    return {
        "ours_tps": statistics.median(ours),
        "mlx_lm_tps": statistics.median(stock),
        "ours_rounds_tps": ours,
        "mlx_lm_rounds_tps": stock,
        **_compare(tokens_ours, tokens_stock, choices),
        "generated_tokens": len(tokens_ours or []),
        "stock_tokens": tokens_stock,
        "stock_choices": choices,
        "stock_error": None,
    }


def stock_choices(model, ids: list[int], tokens: list[int], top: int = 8) -> list[list]:
    """Stock mlx-lm's `top` best tokens and their float32 logits at each of its generated
    `tokens`, from one pass over the prompt and them: [[(token, logit), ...] per token]. Where a run
    parts from stock, they say whether it took a near-tie (stock's second choice, a hair below)
    or something stock ranked far lower (`_compare`)."""
    import mlx.core as mx

    if not tokens:
        return []
    logits = model(mx.array([ids + tokens[:-1]]))[0, len(ids) - 1 :].astype(mx.float32)
    order = mx.argsort(-logits, axis=-1)[:, :top]
    values = mx.take_along_axis(logits, order, axis=-1)
    return [list(zip(o, v)) for o, v in zip(order.tolist(), values.tolist())]


def _stock_failed(spec: DecodeBench, exc: BaseException) -> dict:
    import traceback

    where = traceback.extract_tb(exc.__traceback__)[-1]
    return {
        "ours_tps": None,
        "mlx_lm_tps": None,
        "ours_rounds_tps": [],
        "mlx_lm_rounds_tps": [],
        "same_tokens": None,
        "generated_tokens": spec.max_tokens,
        "stock_tokens": None,
        "stock_choices": None,
        "stock_error": f"{type(exc).__name__}: {exc} (at {where.filename}:{where.lineno}, "
        f"{where.line})",
    }


def _cluster_path_alone(
    spec: DecodeBench, ids: list[int], tokenizer, model, stock_tps: float
) -> dict:
    """The cluster path at N = 1 (the sharded model: ExpertShards in ClusterMoE layers, one node)
    alternating with stock mlx-lm (`model`) in this process, as `_single_node` alternates our engine:
    rounds interleaved, so a noisy machine slows both sides alike. Medians. Without `model` (both
    copies would not fit the device's memory: on a GPU, the oversubscribed one pages and both slow
    down ~2x), the cluster path runs alone and is compared with `stock_tps`, measured before."""
    from mlx_lm.generate import stream_generate

    from ...node.moe.load import load_shard

    sharded = load_shard(spec.model, None, 0, keepalive="none", warm_up=False)
    sampling = Sampling(max_tokens=spec.max_tokens)
    ours, stock, tokens = [], [], None
    for i in range(spec.rounds + 1):  # the first round of each warms up and is not counted
        stats = Stats()
        toks = list(generate_tokens(sharded.model, ids, sampling, eos_token_ids=(), stats=stats))
        last = None
        for last in (
            stream_generate(model, tokenizer, ids, max_tokens=spec.max_tokens)
            if model is not None
            else ()
        ):
            pass
        if i:
            ours.append(stats.generation_tps)
            if last is not None:
                stock.append(last.generation_tps)
            tokens = toks
    return {
        "cluster_tps": statistics.median(ours),
        "mlx_lm_tps": statistics.median(stock) if stock else stock_tps,
        "tokens": tokens,
        "interleaved": model is not None,
    }


def _fits_twice(model) -> bool:
    """Whether a second copy of `model`'s weights fits beside it in the device's memory (with a
    tenth to spare for activations and caches)."""
    from mlx.utils import tree_flatten

    from ...node.device import device_info

    weights = sum(p.nbytes for _, p in tree_flatten(model.parameters()))
    return 2.2 * weights <= device_info().memory_bytes


def _cluster(spec: DecodeBench, ids: list[int], nodes: int, transport: str) -> list[dict]:
    from ...node.collective.mlx import mlx_backend
    from ..dev.simulate import run_nodes
    from ...node.sim import SimTask

    sampling = Sampling(max_tokens=spec.max_tokens)
    routes = spec.routes if nodes > 1 else ()
    tasks = [
        SimTask(
            spec.model,
            tuple(ids),
            sampling,
            keepalive=k,
            repeats=spec.rounds,
            routes=routes,
            route=spec.route,
        )
        for k in spec.keepalive
    ]
    out = []
    for keepalive, reports in zip(
        spec.keepalive,
        run_nodes(tasks, nodes, transport=transport, gpus=spec.gpus, mlx_backend=spec.mlx_backend),
    ):
        r0 = reports[0]
        steps = max(r0["generated"] - 1, 1)
        per_token = r0["generation_seconds"] / steps
        out.append(
            {
                "nodes": nodes,
                "keepalive": keepalive,
                "transport": transport,
                "backend": mlx_backend(spec.gpus, spec.mlx_backend)
                if transport == "mlx"
                else transport,
                "generation_tps": r0["generation_tps"],
                "tokens": r0["tokens"],
                "time_per_token_s": per_token,
                "expected_experts": _expected_experts(reports, keepalive),
                "mean_computed_per_node": statistics.mean(
                    r["counters"]["computed"] for r in reports
                ),
                "expert_reads": expert_reads(reports),
                "breakdown_s": breakdown(r0["timers"], steps, per_token),
                # simulated nodes share this machine's CPU cores, unless each has its own GPU
                "nodes_per_host": 1 if spec.gpus else nodes,
                # one MoE layer of a batch-1 decode step: rank 0's graph; stock's is set by run()
                "primitives_per_moe_layer": {
                    "ours": r0.get("primitives_per_moe_layer"),
                    "stock": None,
                },
                **({"routes": by_route(reports)} if routes else {}),
            }
        )
    return out


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


def _skip_gemv_on() -> bool:
    """Whether the node processes (this process's environment and device) run skip_gemv where it applies."""
    from ...node.moe import skip_gemv

    return skip_gemv.available()


def _expert_cache(spec: DecodeBench, ids: list[int], nodes: int, stock: list[int]) -> list[dict]:
    """Decode at each resident share, without and with a routing profile: tok/s, hit rate, per node
    per token the misses, bytes and seconds the step waited on the disk, the prefetches, and the
    decode's peak memory against the resident weights (decode steps, last of `rounds`)."""
    from ..dev.simulate import cache_summary, profile_heat, run_nodes
    from ...node.sim import SimTask

    if spec.routing_profile:
        heat = profile_heat(spec.routing_profile)
    else:
        from ..dev.profile import profile

        heat = profile_heat(profile(spec.model, list(PROFILE_PROMPTS), spec.max_tokens))
    sampling = Sampling(max_tokens=spec.max_tokens)
    runs = [(c, p) for c in spec.expert_cache for p in (None, heat)]
    tasks = [
        SimTask(
            spec.model,
            tuple(ids),
            sampling,
            keepalive=spec.keepalive[0],
            repeats=spec.rounds,
            expert_cache=c,
            profile=p,
            prefetch=spec.prefetch,
        )
        for c, p in runs
    ]
    out = []
    for (cache, prof), reports in zip(
        runs,
        run_nodes(
            tasks,
            nodes,
            transport=spec.transports[0],
            gpus=spec.gpus,
            mlx_backend=spec.mlx_backend,
        ),
    ):
        r0 = reports[0]
        steps = max(r0["generated"] - 1, 1)
        total = cache_summary([r["expert_cache"] for r in reports])
        selected = total["hits"] + total["misses"]
        out.append(
            {
                "nodes": nodes,
                "expert_cache": cache,
                "profile": prof is not None,
                "generation_tps": r0["generation_tps"],
                "time_per_token_s": r0["generation_seconds"] / steps,
                "capacity": total["capacity"],
                "local": sum(r["expert_cache"]["local"] for r in reports),
                "hit_rate": total["hits"] / selected if selected else 1.0,
                "selected_per_token": selected
                / nodes
                / steps,  # per node, summed over its MoE layers
                "misses_per_token": total["misses"] / nodes / steps,  # per node
                "bytes_read_per_token": total["bytes_read"] / nodes / steps,  # per node
                "read_seconds_per_token": max(r["expert_cache"]["read_seconds"] for r in reports)
                / steps,
                # per node: reads started ahead, and misses whose bytes one of them had staged
                **{
                    f"{k}_per_token": sum(r["expert_cache"][k] for r in reports) / nodes / steps
                    for k in ("prefetched", "prefetch_hits")
                },
                # the busiest node's memory: MLX's decode peak, what it keeps resident (replicated weights
                # and expert slots; the slots are the cache's budget), and expert reads held outside them
                "peak_memory_decode_bytes": max(r["peak_memory_decode_bytes"] for r in reports),
                "resident_weight_bytes": max(r["resident_weight_bytes"] for r in reports),
                "resident_expert_bytes": max(r["expert_bytes"] for r in reports),
                "staged_peak_bytes": max(r["expert_cache"]["staged_peak_bytes"] for r in reports),
                **_compare(r0["tokens"], stock),
            }
        )
    return out


def _expected_experts(reports: list[dict], keepalive: str) -> float:
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


def model_bytes(model: str) -> dict:
    from ..plan.describe import describe_path

    spec, _ = describe_path(str(Checkpoint.open(model).path))
    return {
        "replicated_read_per_token": spec.replicated_read_bytes,
        "expert": sum(spec.expert_layer_bytes),  # one expert, summed over the MoE layers
        "layers": spec.layers,
        "moe_layers": spec.moe_layers,
        "hidden": spec.hidden,
        "dtype_bytes": spec.act_bytes,
        "top_k": spec.top_k,
        "num_experts": spec.num_experts,
    }


def _compare(tokens: list[int], stock: list[int], choices: list[list] | None = None) -> dict:
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


def run(spec: DecodeBench) -> dict:
    from ..dev.run_local import encode_prompt, load_stock

    ckpt, model, tokenizer = load_stock(spec.model)
    ids = encode_prompt(tokenizer, spec.prompt)
    t0 = time.perf_counter()
    try:
        stock_ops = _stock_layer_ops(ckpt, model)
        single = _single_node(spec, ids, tokenizer, model)
    except (RuntimeError, ValueError, IndexError) as exc:
        # mlx-lm's own module failed on this device (an MLX error): the cluster rows still run,
        # compared with each other instead of with stock
        stock_ops = None
        single = _stock_failed(spec, exc)
    alone = None
    stock_ran = not single["stock_error"]  # the cluster path at N = 1 is compared with stock
    if stock_ran and 1 in spec.nodes and _fits_twice(model):
        alone = _cluster_path_alone(spec, ids, tokenizer, model, single["mlx_lm_tps"])
    del model
    held = release_memory()  # the node processes need the memory (on a GPU: the same device)
    if stock_ran and 1 in spec.nodes and alone is None:
        alone = _cluster_path_alone(spec, ids, None, None, single["mlx_lm_tps"])
        held = release_memory()
    clusters = []
    for n in spec.nodes:
        # N = 1 runs the cluster path too (one node process, nothing to exchange), so every point
        # of the series has the same code and a breakdown.
        if n == 1:
            clusters += _cluster(replace(spec, keepalive=("none",)), ids, n, spec.transports[0])
        for t in spec.transports if n > 1 else ():
            clusters += _cluster(spec, ids, n, t)
    bytes_ = model_bytes(str(ckpt.path))
    stock_tokens = single["stock_tokens"]
    stock_tokens = stock_tokens[: spec.max_tokens] if stock_tokens is not None else None
    choices = single["stock_choices"]  # how stock ranked its tokens (None where it failed)
    for c in clusters:
        c["fixed_cost_per_moe_layer_us"] = (
            fixed_cost_us(
                c["time_per_token_s"],
                single["mlx_lm_tps"],
                single["generated_tokens"],
                bytes_["moe_layers"],
            )
            if single["mlx_lm_tps"]
            else None
        )
        # the tokens stay in the row: runs with another decode route are compared on them
        c.update(_compare(c["tokens"], stock_tokens, choices))
        for r in c.get("routes", {}).values():
            r.update(_compare(r["tokens"], stock_tokens, choices))
        c["primitives_per_moe_layer"]["stock"] = stock_ops
    from .tensor_parallel import measure

    peers = []
    for n in (n for n in spec.nodes if n > 1 and spec.peers):
        peer = measure(str(ckpt.path), n, ids, spec.max_tokens, spec.rounds, gpus=spec.gpus)
        if "tokens" in peer:
            peer.update(_compare(peer.pop("tokens"), stock_tokens, choices))
        peers.append(peer)
    caches = (
        [row for n in spec.nodes for row in _expert_cache(spec, ids, n, stock_tokens)]
        if spec.expert_cache
        else []
    )
    out = {
        "model": str(ckpt.path),
        "prompt_tokens": len(ids),
        "generated_tokens": single["generated_tokens"],
        "ours_tps": single["ours_tps"],
        "mlx_lm_tps": single["mlx_lm_tps"],
        "ratio": single["ours_tps"] / single["mlx_lm_tps"] if single["mlx_lm_tps"] else None,
        "stock_error": single["stock_error"],
        # the cluster path (sharded model, cluster MoE layers) at N = 1 against stock mlx-lm,
        # measured in alternating rounds in this process
        "cluster_ratio": alone["cluster_tps"] / alone["mlx_lm_tps"] if alone else None,
        "cluster_path": {
            "tps": alone["cluster_tps"],
            "mlx_lm_tps": alone["mlx_lm_tps"],
            "interleaved": alone["interleaved"],
            **_compare(alone["tokens"], stock_tokens, choices),
        }
        if alone
        else None,
        "same_tokens": single["same_tokens"],
        "rounds": {"ours": single["ours_rounds_tps"], "mlx_lm": single["mlx_lm_rounds_tps"]},
        "model_bytes": bytes_,
        "host": {"cores": os.cpu_count() or 1},
        # the node processes' decode kernel at N > 1 (node/moe/skip_gemv.py: CUDA only, unless --route forces another)
        "skip_gemv": _skip_gemv_on(),
        "bench_process_bytes": held,  # what this process held while the node processes ran
        "clusters": clusters,
        "peers": peers,
        "expert_cache": caches,
        "seconds": time.perf_counter() - t0,
    }
    return out


def _stock_layer_ops(ckpt, model) -> dict | None:
    """What stock mlx-lm's first MoE layer puts in a batch-1 decode step's graph
    (node/moe/opcount.py): beside each row's own, where a step is launch-bound (a GPU)."""
    from ...node.describe import describe
    from ...node.moe.opcount import layer_summary, stock_layer
    from ...node.moe.structure import rebind

    counts = stock_layer(rebind(describe(ckpt).blocks, model))
    return layer_summary(counts) if counts is not None else None


def fixed_cost_us(
    time_per_token_s: float, stock_tps: float, generated: int, moe_layers: int
) -> float:
    """What the cluster adds to each MoE layer beyond stock mlx-lm's time per token, in µs. Stock's
    tok/s counts n tokens over n - 1 intervals (mlx-lm's convention, and the engine's), while a row's
    time_per_token_s is the interval itself: compared as intervals."""
    stock_s = (generated / (generated - 1) if generated > 1 else 1.0) / stock_tps
    return 1e6 * (time_per_token_s - stock_s) / moe_layers


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
    if args.spoil is not None or args.draft_model:
        raise UserError("--spoil and --draft-model need --speculative")
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
