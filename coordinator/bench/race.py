"""`moe-cluster bench race`: ours against mlx-lm's pipeline and tensor parallelism, one checkpoint,
one prompt set, N processes each.

Rows: ours over `transport: mlx` (NCCL with one GPU per node, else the ring) and over the envoy
(N simulated node processes, coordinator/dev/simulate.py), mlx-lm pipeline and mlx-lm tensor
parallelism (N processes, coordinator/bench/tensor_parallel.py). Each at batch 1 and at B concurrent
streams (ours: the node's running batch; mlx-lm: its BatchGenerator), every token's time taken the
same way: time to first token, the gaps between a stream's tokens (p50, p99; their mean is the
step; those over twice the median listed where they fell), decode tok/s = B / step and tok/s
over the whole run including prefill. Greedy tokens of every row are compared with the others
and with stock mlx-lm's at batch 1 on the same prompts where one device holds the model. Per row, the weight bytes each node reads per step and the
physical bound (plan/race.py: those bytes over the memory bandwidth plus the bare collectives,
measured here by `bench allreduce`'s workers). Where ours is slower than a peer, where its time
per MoE layer goes (`bench decode`'s breakdown).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass

from ...proto.errors import MoeClusterError, UserError
from ...proto.records import Sampling
from .serve import PROMPTS, _ints, _pct

ROWS = (
    "ours_mlx",
    "ours_envoy",
    "ours_by_stream",
    "ours_envoy_by_stream",
    "mlx_lm_pipeline",
    "mlx_lm_tensor",
)
# ours with attention by stream (serving.attention: by-stream): each stream's owner attends for it
BY_STREAM_ROWS = ("ours_by_stream", "ours_envoy_by_stream")
# serving.attention: auto (replicated for a stream that finds nothing else running): by name
AUTO_ROWS = ("ours_auto", "ours_envoy_auto")
# ours with two micro-batches per decode step (node/overlap.py): asked for by name (--rows)
OVERLAP_ROWS = ("ours_mlx_overlap", "ours_envoy_overlap")
_PEER_MODE = {"mlx_lm_pipeline": "pipeline", "mlx_lm_tensor": "tensor"}
_TRANSPORT = {
    "ours_mlx": "mlx",
    "ours_envoy": "envoy",
    "ours_mlx_overlap": "mlx",
    "ours_envoy_overlap": "envoy",
    "ours_by_stream": "mlx",
    "ours_envoy_by_stream": "envoy",
    "ours_auto": "mlx",
    "ours_envoy_auto": "envoy",
}


@dataclass(frozen=True)
class RaceBench:
    model: str
    nodes: int = 2
    streams: tuple[int, ...] = (1, 8, 32)
    max_tokens: int = 32
    rounds: int = (
        1  # timed batch-1 rounds of mlx-lm's stream_generate and of ours (the last is kept)
    )
    rows: tuple[str, ...] = ROWS
    gpus: bool = False  # process r on GPU r
    bandwidth_Bps: float | None = None  # the device's memory bandwidth, for the physical bound
    bandwidth_source: str = ""
    stock: bool | None = None  # compare with stock mlx-lm; None: where one device holds the model
    collective_iters: int = 200
    timeout_s: float = 900.0
    mlx_backend: str = "auto"  # the mx.distributed rows: `ring` forces the ring over NCCL
    prompt_tokens: int | None = None  # each stream's prompt this long (its context); None: short
    kv_budget: int = 0  # ours: each node's KV budget, bytes (0: none): streams then wait for room
    # every row this many times, the rows in turn each time: a drifting machine slows them alike;
    # each row's decode_tps is then the median of its passes (all of them in decode_tps_passes)
    alternate: int = 1


def prompt_ids(tokenizer, count: int, tokens: int | None = None) -> list[list[int]]:
    """`count` distinct prompts, the first one the batch-1 prompt; `tokens`: each that long, its
    text repeated (the context attention reads grows with it; the streams' texts differ)."""
    from ..dev.run_local import encode_prompt

    out = []
    for i in range(count):
        text = PROMPTS[i % len(PROMPTS)] + (f" ({i})" if i >= len(PROMPTS) else "")
        ids = encode_prompt(tokenizer, text)
        if tokens:
            ids = (ids * (tokens // max(len(ids), 1) + 1))[:tokens]
        out.append(ids)
    return out


def timing(streams: int, t0: float, tokens: list[list[int]], times: list[list[float]]) -> dict:
    """The row's figures from each stream's token times (all rows are counted by this one rule)."""
    gaps = [b - a for ts in times for a, b in zip(ts, ts[1:])]
    firsts = [ts[0] - t0 for ts in times if ts]
    last = max((ts[-1] for ts in times if ts), default=t0)
    step = statistics.mean(gaps) if gaps else None
    return {
        "streams": streams,
        "generated": sum(len(t) for t in tokens),
        "ttft_s": statistics.median(firsts) if firsts else None,
        "ttft_max_s": max(firsts, default=None),
        "step_s": step,  # mean gap between a stream's tokens: one decode step of the batch
        "decode_tps": streams / step if step else None,  # all streams together, decode steps only
        "aggregate_tps": sum(len(t) for t in tokens) / (last - t0)
        if last > t0
        else None,  # prefill included
        "itl_p50_s": _pct(gaps, 0.5) if gaps else None,
        "itl_p99_s": _pct(gaps, 0.99) if gaps else None,
        "slow_gaps": slow_gaps(times),
    }


SLOW_GAP = 2.0  # a gap this many times the row's median gap is reported where it fell
SLOW_GAPS_LISTED = 8


def slow_gaps(times: list[list[float]]) -> dict | None:
    """The gaps between a stream's tokens that took over SLOW_GAP times the median gap: how many,
    what they added to the row's mean step, and the longest few with the stream and the token
    they came before (1: the first decode step). A mean step over the median is then told apart:
    a stall once a pass (a kernel built, a collective set up) against every step being slower."""
    gaps = [
        (s, i + 1, b - a) for s, ts in enumerate(times) for i, (a, b) in enumerate(zip(ts, ts[1:]))
    ]
    if not gaps:
        return None
    median = statistics.median(g for *_, g in gaps)
    slow = sorted((g for g in gaps if g[2] > SLOW_GAP * median), key=lambda g: -g[2])
    return {
        "count": len(slow),
        "of": len(gaps),
        "added_to_mean_step_s": sum(g - median for *_, g in slow) / len(gaps),
        "longest": [{"stream": s, "token": i, "s": g} for s, i, g in slow[:SLOW_GAPS_LISTED]],
    }


def _ours(
    spec: RaceBench,
    path: str,
    name: str,
    prompts: list[list[int]],
    moe_layers: int,
    eos: tuple[int, ...],
) -> list[dict]:
    from ...node.sim import SimTask
    from ..dev.simulate import run_nodes
    from .decode import _expected_experts, breakdown

    transport = _TRANSPORT[name]
    sampling = Sampling(max_tokens=spec.max_tokens)
    tasks = [
        SimTask(
            path,
            tuple(prompts[0]),
            sampling,
            keepalive="none",
            eos_token_ids=eos,  # every row stops where stock's stream_generate does
            repeats=spec.rounds + 1,  # the first warms up, as the peers do
            streams=tuple(tuple(p) for p in prompts[:b]),
            overlap=name in OVERLAP_ROWS,
            kv_budget=spec.kv_budget,
            attention="by-stream"
            if name in BY_STREAM_ROWS
            else "auto"
            if name in AUTO_ROWS
            else "replicated",
            # transport mlx's step is one graph whose timers see nothing: a synced pass splits it
            synced_pass=transport == "mlx",
            reuse_load=i > 0,  # one load serves the row's every batch (no resident experts)
        )
        for i, b in enumerate(spec.streams)
    ]
    from ...node.collective.mlx import mlx_backend

    entry = {
        "name": name,
        "nodes": spec.nodes,
        "transport": transport,
        "backend": mlx_backend(spec.gpus, spec.mlx_backend)
        if transport == "mlx"
        else "envoy (gRPC over TCP)",
    }
    try:
        reports = run_nodes(
            tasks,
            spec.nodes,
            transport=transport,
            gpus=spec.gpus,
            mlx_backend=spec.mlx_backend,
        )
    except (MoeClusterError, UserError, OSError, RuntimeError) as exc:
        return [
            {**entry, "streams": b, "error": f"{type(exc).__name__}: {exc}"} for b in spec.streams
        ]
    rows = []
    for b, reps in zip(spec.streams, reports):
        r0 = reps[0]
        row = timing(b, r0["t0"], r0["tokens"], r0["times"])
        # the timers cover the decode steps; the rest of a step is what its token gap leaves
        rows.append(
            {
                **entry,
                **row,
                "tokens": r0["tokens"],
                "expected_experts_measured": _expected_experts(reps, "none"),
                "breakdown_per_step_s": breakdown(
                    r0["timers"], max(r0["decode_steps"], 1), row["step_s"] or 0.0
                ),
                "moe_layers": moe_layers,
                "micro_batches": r0.get("micro_batches", "off"),
                # the most streams running at once, and per node its own streams and their KV
                # reserved at their peaks (by stream: each node holds only its own streams' KV)
                "peak_running": r0.get("peak_running"),
                "peak_streams_per_node": [r.get("peak_streams") for r in reps],
                "peak_kv_bytes_per_node": [r.get("peak_kv_bytes") for r in reps],
                # rank 0's micro-batch all-reduces: seconds in flight, seconds of it waited for
                "overlap_s": (r0.get("overlap_in_flight_s", 0.0), r0.get("overlap_waited_s", 0.0)),
                "route": r0.get("route"),  # rank 0's decode route and where wide calls go
                # one MoE layer of a batch-1 step on rank 0's route (node/moe/opcount.py); None
                # where that route reads the routing on the host
                "primitives_per_moe_layer": r0.get("primitives_per_moe_layer"),
                **_synced(r0),
            }
        )
    return rows


def _synced(r0: dict) -> dict:
    """Rank 0's synced pass (SimTask.synced_pass), per decode step: its step time, its timers'
    split of it (`breakdown`), and whether it gave the timed pass's tokens; {} where none ran."""
    synced = r0.get("synced")
    if not synced:
        return {}
    from .decode import breakdown

    steps = max(synced["decode_steps"], 1)
    step = synced["decode_seconds"] / steps
    return {
        "synced_step_s": step,
        "synced_breakdown_per_step_s": breakdown(synced["timers"], steps, step),
        "synced_same_tokens": synced["tokens"] == r0["tokens"],
    }


def hidden(rows: list[dict]) -> None:
    """Each overlap row beside its row without: per MoE layer, rank 0's wait on the collective
    with and without; and of the time its all-reduces were in flight (handed over -> summed), the
    share the other micro-batch's work filled (`in_flight_hidden`: the rest the node waited)."""
    for r in rows:
        if r["name"] not in OVERLAP_ROWS or "breakdown_per_step_s" not in r:
            continue
        base = next(
            (
                b
                for b in rows
                if b["name"] == r["name"].removesuffix("_overlap")
                and b["streams"] == r["streams"]
                and "breakdown_per_step_s" in b
            ),
            None,
        )
        if base is None:
            continue
        per = r["moe_layers"] or 1
        wait = r["breakdown_per_step_s"]["collective_wait"] / per
        was = base["breakdown_per_step_s"]["collective_wait"] / per
        flight, waited = r.get("overlap_s") or (0.0, 0.0)
        r["overlap"] = {
            "collective_wait_per_layer_s": wait,
            "without_s": was,
            "hidden": 1 - wait / was if was else None,
            "in_flight_s": flight,
            "in_flight_waited_s": waited,
            "in_flight_hidden": 1 - waited / flight if flight else None,
            "speedup": r["decode_tps"] / base["decode_tps"]
            if r.get("decode_tps") and base.get("decode_tps")
            else None,
            "note": "rank 0's timers; where the step is one lazy graph (transport mlx) the "
            "collective runs inside it and its wait reads 0 (and nothing is in flight); the "
            "collective wait of pipelined lanes holds the peer's device time",
        }


def _peer(spec: RaceBench, path: str, name: str, prompts: list[list[int]]) -> list[dict]:
    from .tensor_parallel import measure

    multi = [b for b in spec.streams if b > 1]
    got = measure(
        path,
        spec.nodes,
        prompts[0],
        spec.max_tokens,
        spec.rounds,
        timeout_s=spec.timeout_s,
        gpus=spec.gpus,
        mode=_PEER_MODE[name],
        streams=tuple(tuple(tuple(p) for p in prompts[:b]) for b in multi),
    )
    entry = {
        "name": name,
        "nodes": spec.nodes,
        "backend": got.get("backend"),
        "mlx_lm_name": got["name"],
        **{k: got[k] for k in ("nccl_error", "nccl_where") if k in got},
    }
    if "error" in got:
        return [
            {**entry, "streams": b, "error": got["error"], "where": got.get("where", "")}
            for b in spec.streams
        ]
    rows = []
    batches = dict(zip(multi, got["streams"]))
    for b in spec.streams:
        if b == 1:
            rows.append(
                {
                    **entry,
                    **timing(1, got["t0"], [got["tokens"]], [got["times"]]),
                    "tokens": [got["tokens"]],
                    "mlx_lm_generation_tps": got["tps"],
                }
            )
        else:
            r = batches[b]
            rows.append(
                {**entry, **timing(b, r["t0"], r["tokens"], r["times"]), "tokens": r["tokens"]}
            )
    return rows


def _stock(spec: RaceBench, path: str, prompts: list[list[int]]) -> dict:
    """Stock mlx-lm's greedy tokens for every prompt, at batch 1, on this one device."""
    from mlx_lm.generate import stream_generate

    from ...node.checkpoint import Checkpoint
    from ...node.device import device_info, release_memory
    from ..dev.run_local import load_stock

    if spec.stock is False:
        return {"skipped": "--no-stock"}
    size, memory = Checkpoint.open(path).total_bytes(), device_info().memory_bytes
    if spec.stock is None and size > 0.9 * memory:
        return {
            "skipped": f"the checkpoint ({size / 1e9:.1f} GB) does not fit one device ({memory / 1e9:.1f} GB)"
        }
    _, model, tokenizer = load_stock(path)
    tokens = [
        [r.token for r in stream_generate(model, tokenizer, p, max_tokens=spec.max_tokens)]
        for p in prompts
    ]
    del model
    release_memory()
    return {"tokens": tokens}


def _first_mismatch(a: list[int], b: list[int]) -> int | None:
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return first if first is not None or len(a) == len(b) else min(len(a), len(b))


def agreement(rows: list[dict], stock: dict) -> dict:
    """Per batch: whether every row that ran gave the same greedy tokens on every stream (None where
    fewer than two ran), and each row's streams against stock's batch-1 tokens of the same
    prompts. Sets each row's same_as_stock."""
    out = {}
    for b in dict.fromkeys(r["streams"] for r in rows):
        ran = [r for r in rows if r["streams"] == b and "tokens" in r]
        ref = ran[0] if ran else None
        differ = []
        for r in ran[1:]:
            for s, (x, y) in enumerate(zip(r["tokens"], ref["tokens"])):
                at = _first_mismatch(x, y)
                if at is not None:
                    differ.append(
                        {
                            "row": r["name"],
                            "stream": s,
                            "first_mismatch": at,
                            "against": ref["name"],
                        }
                    )
                    break
        for r in ran:
            if "tokens" in stock:
                wrong = [
                    (s, _first_mismatch(t, stock["tokens"][s])) for s, t in enumerate(r["tokens"])
                ]
                wrong = [(s, at) for s, at in wrong if at is not None]
                r["same_as_stock"] = not wrong
                if wrong:
                    r["stock_mismatch"] = {
                        "streams": len(wrong),
                        "first": {"stream": wrong[0][0], "token": wrong[0][1]},
                    }
        out[str(b)] = {
            "rows": [r["name"] for r in ran],
            "same": not differ if len(ran) > 1 else None,  # None: fewer than two rows to compare
            "differences": differ,
            "missing": [r["name"] for r in rows if r["streams"] == b and "tokens" not in r],
        }
    return out


def collectives(spec: RaceBench, hidden: int, act_bytes: int, names: list[str]) -> dict:
    """The bare all-reduce per call (seconds, p50) of each transport the rows use, at each batch's
    payload (B hidden vectors): `bench allreduce`'s mlx ring and envoy workers."""
    from .allreduce import Case, run_case

    from ...node.collective.mlx import mlx_backend

    dtype = {4: "float32", 2: "bfloat16"}.get(act_bytes, "float32")
    paths = {"envoy" if _TRANSPORT.get(n) == "envoy" else "mlx_ring" for n in names}
    if (
        "mlx_ring" in paths and mlx_backend(spec.gpus, spec.mlx_backend) == "nccl"
    ):  # NCCL rows pay their own
        paths.add("mlx_nccl")
    out: dict = {
        "dtype": dtype,
        "iters": spec.collective_iters,
        "note": "each mx.distributed row pays its backend's (mlx_nccl: one GPU per rank; mlx_ring: "
        "the ring over TCP); a pipeline hop is counted as one",
    }
    for path in sorted(paths):
        out[path] = {}
        for b in spec.streams:
            case = Case(
                spec.nodes,
                b,
                hidden,
                dtype,
                spec.collective_iters,
                max(spec.collective_iters // 10, 1),
            )
            try:
                row = run_case(case, [path], timeout_s=300.0)
                out[path][str(b)] = row[f"{path}_p50_us"] * 1e-6
            except (RuntimeError, OSError) as exc:
                out[path][str(b)] = None
                out.setdefault("errors", []).append(f"{path} at {b} tokens: {exc}")
    return out


def _collective_path(row: dict) -> str:
    """The bare collective (collectives()) that stands for `row`'s: its transport and backend."""
    if _TRANSPORT.get(row["name"]) == "envoy":
        return "envoy"
    return "mlx_nccl" if row.get("backend") == "nccl" else "mlx_ring"


def bounds(spec: RaceBench, model, rows: list[dict], coll: dict) -> None:
    """Per row: the weight bytes each node reads per step and the physical bound (plan/race.py);
    the share of that bound the row reached."""
    from ..plan import race as race_model
    from ..plan.perfmodel import HardwareSpec, NetworkSpec

    hardware = HardwareSpec("bench", 1 << 60, spec.bandwidth_Bps or 1.0, 1e30, 0.0)
    network = NetworkSpec("measured", 0.0, 1e30, 0.0)
    for r in rows:
        strategy = race_model.row_strategy(r["name"], r["streams"])
        bare = coll.get(_collective_path(r), {}).get(str(r["streams"]))
        measured = race_model.MeasuredRow(r["name"], spec.nodes, r["streams"], 1.0, bare)
        p = race_model.predict_row(model, hardware, network, measured, hardware.bandwidth_Bps)
        r["strategy"] = strategy
        r["bytes_per_node_per_step"] = p.bytes_per_node
        r["collective_s"] = bare
        r["collectives_per_step"] = p.collectives
        if spec.bandwidth_Bps and bare is not None:
            r["bound"] = {
                "step_s": p.time_s,
                "read_s": p.read_s,
                "collective_s": p.comm_s,
                "decode_tps": p.tokens_per_s,
            }
            if r.get("decode_tps"):
                r["share_of_bound"] = r["decode_tps"] / p.tokens_per_s
        else:
            r["bound"] = None
            r["bound_missing"] = (
                "no --bandwidth or --hardware"
                if not spec.bandwidth_Bps
                else "the bare collective was not measured"
            )


def losses(rows: list[dict]) -> None:
    """Where an ours row is slower than a peer at the same batch: which peers, and where its time per
    MoE layer goes (attention+router, experts, the bare collective, waiting for the slowest node
    beyond it, the rest)."""
    for r in (r for r in rows if r["name"] in _TRANSPORT and r.get("decode_tps")):
        faster = [
            p["name"]
            for p in rows
            if p["name"] in _PEER_MODE
            and p["streams"] == r["streams"]
            and (p.get("decode_tps") or 0) > r["decode_tps"]
        ]
        if not faster:
            continue
        per = r["moe_layers"] or 1
        synced = "synced_breakdown_per_step_s" in r
        b = r["synced_breakdown_per_step_s" if synced else "breakdown_per_step_s"]
        bare = r.get("collective_s")
        wait = b["collective_wait"] / per
        r["loses_to"] = faster
        r["per_moe_layer_s"] = {
            "attention_router": b["attention_router"] / per,
            "experts": b["experts"] / per,
            "collective_bare": bare,
            "waiting": max(wait - bare, 0.0) if bare is not None else wait,
            "other": b["other"] / per,
            "note": (
                "timers of rank 0 in a pass with a host sync at each MoE layer's input, partial "
                "and sum (the step is one lazy graph): attention_router is everything since the "
                "last MoE layer, experts the router and the experts; the synced step took "
                f"{r['synced_step_s'] * 1e3:.1f} ms against the graph's {r['step_s'] * 1e3:.1f} ms"
                if synced
                else "timers of rank 0"
            ),
        }


def run(spec: RaceBench) -> dict:
    from mlx_lm.utils import load_tokenizer

    from ...node.checkpoint import Checkpoint
    from ..plan.describe import describe_path

    t_start = time.perf_counter()
    ckpt = Checkpoint.open(spec.model)
    path = str(ckpt.path)
    model, _ = describe_path(path)
    tokenizer = load_tokenizer(ckpt.path, eos_token_ids=ckpt.config.get("eos_token_id"))
    prompts = prompt_ids(tokenizer, max(spec.streams), spec.prompt_tokens)
    eos = tuple(sorted(tokenizer.eos_token_ids or ()))
    stock = _stock(spec, path, prompts)
    passes: list[list[dict]] = []
    for _ in range(spec.alternate):
        rows: list[dict] = []
        for name in spec.rows:
            rows += (
                _ours(spec, path, name, prompts, model.moe_layers, eos)
                if name in _TRANSPORT
                else _peer(spec, path, name, prompts)
            )
        passes.append(rows)
    rows = alternated(passes)
    coll = collectives(spec, model.hidden, model.act_bytes, list(spec.rows))
    bounds(spec, model, rows, coll)
    losses(rows)
    hidden(rows)
    agree = agreement(rows, stock)
    return {
        "model": path,
        "nodes": spec.nodes,
        "streams": list(spec.streams),
        "max_tokens": spec.max_tokens,
        "prompts": [len(p) for p in prompts],
        "gpus": spec.gpus,
        "bandwidth_Bps": spec.bandwidth_Bps,
        "bandwidth_source": spec.bandwidth_source,
        "model_bytes": {
            "replicated_read": model.replicated_read_bytes,
            "expert_one_all_layers": model.expert_bytes,
            "layers": model.layers,
            "moe_layers": model.moe_layers,
            "num_experts": model.num_experts,
            "top_k": model.top_k,
            "hidden": model.hidden,
            "act_bytes": model.act_bytes,
            "weights": model.weights,
        },
        "collective": coll,
        "stock": {k: v for k, v in stock.items() if k != "tokens"} | {"ran": "tokens" in stock},
        "agreement": agree,
        "rows": rows,
        "seconds": time.perf_counter() - t_start,
    }


def merge(parts: list[dict]) -> dict:
    """One race from the JSON of calls that each ran some of its rows on the same checkpoint
    (`bench race --merge`: on a GPU host each row runs in its own call, so that a row that crashes
    loses only itself): the rows together, each call's other fields from the first call that has
    them, and what compares rows with each other (agreement, losses, the overlap rows' hidden
    share) done again over all of them, since no single call saw its row beside the others."""
    if not parts:
        raise UserError("nothing to merge: no race JSON given")
    out: dict = {}
    rows: list[dict] = []
    for part in parts:
        rows += part["rows"]
        for k, v in part.items():
            if k not in ("rows", "agreement", "failed"):
                out.setdefault(k, v)
    for r in rows:  # set again below from all the rows
        for k in ("loses_to", "per_moe_layer_s", "overlap"):
            r.pop(k, None)
    losses(rows)
    hidden(rows)
    out["agreement"] = agreement(rows, {})
    out["rows"] = rows
    return out


def plot(out: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib (pip install matplotlib)") from None
    names = list(dict.fromkeys(r["name"] for r in out["rows"]))
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=120)
    ones = [
        next((r for r in out["rows"] if r["name"] == n and r["streams"] == 1), {}) for n in names
    ]
    a.bar(names, [r.get("decode_tps") or 0 for r in ones])
    a.set_ylabel("decode tok/s at batch 1")
    a.tick_params(axis="x", labelrotation=20)
    for n in names:
        rs = [r for r in out["rows"] if r["name"] == n and r.get("decode_tps")]
        b.plot([r["streams"] for r in rs], [r["decode_tps"] for r in rs], "o-", label=n)
    b.set_xscale("log", base=2)
    b.set_xlabel("concurrent streams")
    b.set_ylabel("decode tok/s, all streams")
    b.legend(fontsize=8)
    fig.suptitle(f"{out['model'].rstrip('/').split('/')[-1]} on {out['nodes']} processes each")
    fig.tight_layout()
    fig.savefig(path)


def _streams(text: str) -> tuple[int, ...]:
    out = tuple(_ints(text, "--streams"))
    if len(set(out)) != len(out):
        raise UserError(f"--streams must list distinct numbers (got {text!r})")
    return out


def add_arguments(p) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="a checkpoint folder, 'demo', or a Hugging Face repo id (org/name)",
    )
    p.add_argument(
        "--merge",
        nargs="+",
        metavar="RACE.json",
        help="run nothing: merge the JSON of earlier calls that each ran some rows of one race "
        "(their rows compared again) and report it as one race",
    )
    p.add_argument(
        "--nodes", type=int, default=2, help="processes per row (ours: nodes; mlx-lm: ranks)"
    )
    p.add_argument(
        "--streams", default="1,8,32", help="concurrent streams, comma list (1: batch 1)"
    )
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument(
        "--alternate",
        type=int,
        default=1,
        metavar="N",
        help="run the rows N times in turn; each row's decode tok/s is the median of its passes",
    )
    p.add_argument(
        "--kv-budget",
        default=None,
        metavar="SIZE",
        help="ours: each node's KV budget (e.g. 64MiB): how many streams run at once then depends "
        "on where their KV lives; default: no limit",
    )
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=None,
        metavar="N",
        help="each stream's prompt N tokens long (its text repeated): attention's share of a step "
        "grows with the context; default: the short prompts",
    )
    p.add_argument(
        "--rounds", type=int, default=1, help="timed rounds after one warm-up (the last is kept)"
    )
    p.add_argument(
        "--rows",
        default=",".join(ROWS),
        help="which rows, comma list of "
        + ", ".join(ROWS + OVERLAP_ROWS + AUTO_ROWS)
        + " (the _overlap rows: two micro-batches per decode step; the _auto rows: serving.attention "
        "auto)",
    )
    p.add_argument(
        "--gpus", action="store_true", help="process r on CUDA GPU r (NCCL where MLX has it)"
    )
    p.add_argument(
        "--mlx-backend",
        choices=("auto", "ring"),
        default="auto",
        help="the mx.distributed rows' backend: auto (NCCL with --gpus where MLX has it, else the "
        "ring) or ring (to compare the host-mediated ring with the envoy)",
    )
    p.add_argument(
        "--bandwidth",
        type=float,
        default=None,
        metavar="GBps",
        help="the device's memory bandwidth, GB/s, for the physical bound",
    )
    p.add_argument("--hardware", default=None, help="or a hardware preset of `plan` for it")
    p.add_argument(
        "--no-stock",
        action="store_true",
        help="do not run stock mlx-lm (default: where it fits one device)",
    )
    p.add_argument(
        "--plot", metavar="FILE.png", help="tok/s per row at batch 1 and against streams"
    )
    p.add_argument("--json", action="store_true")


def _read_race(path: str) -> dict:
    try:
        with open(path) as f:
            part = json.load(f)
    except (OSError, ValueError) as exc:
        raise UserError(f"--merge: cannot read {path}: {exc}") from exc
    if not isinstance(part, dict) or not isinstance(part.get("rows"), list):
        raise UserError(f"--merge: {path} is not the JSON of a `bench race` call (no rows)")
    return part


def _spec(args) -> RaceBench:
    rows = tuple(r.strip() for r in args.rows.split(","))
    bad = [r for r in rows if r not in ROWS + OVERLAP_ROWS + AUTO_ROWS]
    if bad:
        raise UserError(
            f"--rows: unknown row {bad[0]!r} ({', '.join(ROWS + OVERLAP_ROWS + AUTO_ROWS)})"
        )
    if args.nodes < 2:
        raise UserError(f"--nodes must be at least 2: a race splits the model (got {args.nodes})")
    if args.max_tokens < 2 or args.rounds < 1:
        raise UserError(
            f"--max-tokens must be >= 2 and --rounds >= 1 (got {args.max_tokens}, {args.rounds})"
        )
    bandwidth, source = None, ""
    if args.bandwidth is not None:
        if not args.bandwidth > 0:
            raise UserError(f"--bandwidth must be > 0 GB/s (got {args.bandwidth})")
        bandwidth, source = args.bandwidth * 1e9, "--bandwidth"
    elif args.hardware:
        from ..plan.presets import hardware_preset

        bandwidth, source = (
            hardware_preset(args.hardware).bandwidth_Bps,
            f"--hardware {args.hardware}",
        )
    return RaceBench(
        args.model,
        args.nodes,
        _streams(args.streams),
        args.max_tokens,
        args.rounds,
        rows,
        args.gpus,
        bandwidth,
        source,
        False if args.no_stock else None,
        mlx_backend=args.mlx_backend,
        prompt_tokens=_prompt_tokens(args.prompt_tokens),
        kv_budget=_kv_budget(args.kv_budget),
        alternate=max(1, args.alternate),
    )


def main(args) -> int:
    if args.merge:
        out = merge([_read_race(path) for path in args.merge])
    elif args.model is None:
        raise UserError("bench race needs --model (to run a race) or --merge (to join calls)")
    else:
        out = run(_spec(args))
    if args.plot:
        plot(out, args.plot)
    if args.json:
        print(json.dumps(out))
        return 0
    print(
        f"{out['model']}: {out['nodes']} processes per row, {out['max_tokens']} tokens per stream"
    )
    print(
        f"{'row':>16} {'B':>3} {'decode tok/s':>12} {'ttft s':>7} {'itl p50':>8} {'itl p99':>8} "
        f"{'bound tok/s':>11} {'stock':>5}"
    )
    for r in out["rows"]:
        if "error" in r:
            print(f"{r['name']:>16} {r['streams']:>3} failed: {r['error']}")
            continue
        bound = r["bound"]["decode_tps"] if r.get("bound") else None
        print(
            f"{r['name']:>16} {r['streams']:>3} {r['decode_tps'] or 0:>12.1f} {r['ttft_s'] or 0:>7.3f} "
            f"{r['itl_p50_s'] or 0:>8.4f} {r['itl_p99_s'] or 0:>8.4f} "
            f"{'-' if bound is None else f'{bound:.1f}':>11} "
            f"{'-' if 'same_as_stock' not in r else ('yes' if r['same_as_stock'] else 'NO'):>5}"
        )
    for b, a in out["agreement"].items():
        if a["same"] is None:
            print(f"B = {b}: fewer than two rows ran, no tokens compared")
        else:
            print(
                f"B = {b}: rows agree" if a["same"] else f"B = {b}: rows differ: {a['differences']}"
            )
    return 0


def alternated(passes: list[list[dict]]) -> list[dict]:
    """One row per (row, streams) from passes over the same rows: the last pass's figures, with
    decode_tps the median of every pass's and each pass's in `decode_tps_passes`."""
    if len(passes) == 1:
        return passes[0]
    out = []
    for i, row in enumerate(passes[-1]):
        tps = [p[i].get("decode_tps") for p in passes]
        if any(t is None for t in tps):
            out.append(row)
            continue
        out.append({**row, "decode_tps": statistics.median(tps), "decode_tps_passes": tps})
    return out


def _prompt_tokens(n: int | None) -> int | None:
    if n is not None and n < 2:
        raise UserError(f"--prompt-tokens must be at least 2 (got {n})")
    return n


def _kv_budget(text: str | None) -> int:
    if text is None:
        return 0
    import re

    from ...proto.expert_cache import SIZE_UNITS

    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-zA-Z]*)", text.strip())
    if not m or m[2].lower() not in SIZE_UNITS or float(m[1]) <= 0:
        raise UserError(f"--kv-budget must be a positive size, e.g. 64MiB (got {text!r})")
    return int(float(m[1]) * SIZE_UNITS[m[2].lower()])
