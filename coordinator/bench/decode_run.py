"""One `bench decode` run: our engine and the cluster path against stock mlx-lm in this process,
simulated node processes per node count, transport and keepalive, mlx-lm's tensor parallelism,
and the expert cache's rows (decode_figures.py computes each row's figures)."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, replace

from ...node.checkpoint import Checkpoint
from ...node.device import release_memory
from ...node.engine import Stats, generate_tokens
from ...proto.records import Sampling
from .decode_figures import (
    breakdown,
    by_route,
    compare,
    expected_experts,
    expert_reads,
    fixed_cost_us,
)

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
        **compare(tokens_ours, tokens_stock, choices),
        "generated_tokens": len(tokens_ours or []),
        "stock_tokens": tokens_stock,
        "stock_choices": choices,
        "stock_error": None,
    }


def stock_choices(model, ids: list[int], tokens: list[int], top: int = 8) -> list[list]:
    """Stock mlx-lm's `top` best tokens and their float32 logits at each of its generated
    `tokens`, from one pass over the prompt and them: [[(token, logit), ...] per token]. Where a run
    parts from stock, they say whether it took a near-tie (stock's second choice, a hair below)
    or something stock ranked far lower (`compare`)."""
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
                "expected_experts": expected_experts(reports, keepalive),
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
                **compare(r0["tokens"], stock),
            }
        )
    return out


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
        c.update(compare(c["tokens"], stock_tokens, choices))
        for r in c.get("routes", {}).values():
            r.update(compare(r["tokens"], stock_tokens, choices))
        c["primitives_per_moe_layer"]["stock"] = stock_ops
    from .tensor_parallel import measure

    peers = []
    for n in (n for n in spec.nodes if n > 1 and spec.peers):
        peer = measure(str(ckpt.path), n, ids, spec.max_tokens, spec.rounds, gpus=spec.gpus)
        if "tokens" in peer:
            peer.update(compare(peer.pop("tokens"), stock_tokens, choices))
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
            **compare(alone["tokens"], stock_tokens, choices),
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
