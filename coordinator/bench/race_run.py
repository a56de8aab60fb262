"""One `bench race` run: the prompts, every row run (ours through simulated nodes, mlx-lm's
pipeline and tensor parallelism, stock mlx-lm on one device), the bare collectives and each row's
physical bound (race_rows.py compares the rows)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from ...proto.errors import MoeClusterError, UserError
from ...proto.placement import Placement
from ...proto.records import Sampling
from .race_rows import (
    AUTO_ROWS,
    BY_STREAM_ROWS,
    OVERLAP_ROWS,
    PEER_MODE,
    ROWS,
    TRANSPORT,
    agreement,
    alternated,
    collective_path,
    hidden,
    losses,
    timing,
)
from .serve import PROMPTS


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
    route: str | None = (
        None  # ours: every node's decode route (cluster.yaml's `route:`); None: measure
    )
    placement: str | None = None  # ours: a placement file every row loads; None: an even split
    # every row's process r on its own share of the cores (node/cores.py), as N machines would be;
    # not with --gpus, whose hosts were never measured so
    pin: bool = True

    def cores(self) -> list[tuple[int, ...]] | None:
        """Each process's cores in every row; None: not pinned (off, GPUs, or too few cores)."""
        from ...node.cores import shares

        return shares(self.nodes) if self.pin and not self.gpus else None


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


def _ours(
    spec: RaceBench,
    path: str,
    name: str,
    prompts: list[list[int]],
    moe_layers: int,
    eos: tuple[int, ...],
    placement: tuple[str, Placement, dict[int, int]] | None = None,
) -> list[dict]:
    from ...node.sim import SimTask
    from ..dev.simulate import run_nodes
    from .decode_figures import breakdown, expected_experts

    transport = TRANSPORT[name]
    sampling = Sampling(max_tokens=spec.max_tokens)
    tasks = [
        SimTask(
            path,
            tuple(prompts[0]),
            sampling,
            placement[1].to_json() if placement else None,
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
            route=spec.route,
        )
        for i, b in enumerate(spec.streams)
    ]
    from ...node.collective.mlx import mlx_backend

    entry = {
        "name": name,
        "nodes": spec.nodes,
        # on the row, not the race: `--merge` joins rows of calls that may have placed differently
        "placement": _placement_summary(placement),
        "transport": transport,
        "backend": mlx_backend(spec.gpus, spec.mlx_backend)
        if transport == "mlx"
        else "envoy (gRPC over TCP)",
    }
    try:
        reports = run_nodes(
            tasks,
            spec.nodes,
            # a step of long prompts on a busy machine can outlast the default 60 s watchdog
            timeout_s=spec.timeout_s,
            transport=transport,
            gpus=spec.gpus,
            mlx_backend=spec.mlx_backend,
            cores=spec.cores(),
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
                "expected_experts_measured": expected_experts(reps, "none"),
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
                "cores_per_node": [r.get("cores") for r in reps],  # where each node's threads ran
                # rank 0's micro-batch all-reduces: seconds in flight, seconds of it waited for
                "overlap_s": (r0.get("overlap_in_flight_s", 0.0), r0.get("overlap_waited_s", 0.0)),
                "route": r0.get("route"),  # rank 0's decode route and where wide calls go
                # one MoE layer of a batch-1 step on rank 0's route (node/moe/opcount.py); None
                # where that route reads the routing on the host
                "primitives_per_moe_layer": r0.get("primitives_per_moe_layer"),
                **_synced(reps),
            }
        )
    return rows


def _synced(reps: list[dict]) -> dict:
    """Rank 0's synced pass (SimTask.synced_pass), per decode step: its step time, its timers'
    split of it (`breakdown`), and whether it gave the timed pass's tokens; and every rank's wait
    on the collectives per step (one node always behind shows as the others waiting, a late peer
    by turns as all waiting alike); {} where none ran."""
    r0 = reps[0]
    synced = r0.get("synced")
    if not synced:
        return {}
    from .decode_figures import breakdown

    steps = max(synced["decode_steps"], 1)
    step = synced["decode_seconds"] / steps
    return {
        "synced_step_s": step,
        "synced_breakdown_per_step_s": breakdown(synced["timers"], steps, step),
        "synced_same_tokens": synced["tokens"] == r0["tokens"],
        "synced_wait_per_rank_s": [
            r["synced"]["timers"]["collective"] / max(r["synced"]["decode_steps"], 1) for r in reps
        ],
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
        mode=PEER_MODE[name],
        streams=tuple(tuple(tuple(p) for p in prompts[:b]) for b in multi),
        cores=spec.cores(),
    )
    entry = {
        "name": name,
        "nodes": spec.nodes,
        "backend": got.get("backend"),
        "mlx_lm_name": got["name"],
        "cores_per_node": got.get("cores"),
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


def collectives(spec: RaceBench, hidden: int, act_bytes: int, names: list[str]) -> dict:
    """The bare all-reduce per call (seconds, p50) of each transport the rows use, at each batch's
    payload (B hidden vectors): `bench allreduce`'s mlx ring and envoy workers."""
    from .allreduce import Case, run_case

    from ...node.collective.mlx import mlx_backend

    dtype = {4: "float32", 2: "bfloat16"}.get(act_bytes, "float32")
    paths = {"envoy" if TRANSPORT.get(n) == "envoy" else "mlx_ring" for n in names}
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


def bounds(spec: RaceBench, model, rows: list[dict], coll: dict) -> None:
    """Per row: the weight bytes each node reads per step and the physical bound (plan/race.py);
    the share of that bound the row reached."""
    from ..plan import race as race_model
    from ..plan.perfmodel import HardwareSpec, NetworkSpec

    hardware = HardwareSpec("bench", 1 << 60, spec.bandwidth_Bps or 1.0, 1e30, 0.0)
    network = NetworkSpec("measured", 0.0, 1e30, 0.0)
    for r in rows:
        strategy = race_model.row_strategy(r["name"], r["streams"])
        bare = coll.get(collective_path(r), {}).get(str(r["streams"]))
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


def _placement(spec: RaceBench, ckpt) -> tuple[str, Placement, dict[int, int]] | None:
    """(the file, its placement, the model's {MoE layer: experts}) for ours' rows, checked against
    the model; None: none given."""
    if spec.placement is None:
        return None
    from ...node.describe import describe
    from ..dev.simulate import checked_placement

    desc = describe(ckpt)
    return spec.placement, checked_placement(spec.placement, spec.nodes, desc), desc.moe_layers()


def _placement_summary(placement: tuple[str, Placement, dict[int, int]] | None) -> dict:
    """Where ours' experts were: the file, and the most experts a node held in a layer and how
    many of a layer's experts were held by more than one node (replicas)."""
    if placement is None:
        return {"file": None, "split": "even"}
    path, p, experts = placement
    held = [n for r in range(p.world_size) for n in p.experts_per_layer(r).values()]
    copies = [
        sum(len(rs) > 1 for rs in p.holders(layer, n).values()) for layer, n in experts.items()
    ]
    return {"file": path, "most_held": max(held, default=0), "replicated": max(copies, default=0)}


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
    placement = _placement(spec, ckpt)  # refused before any process starts
    stock = _stock(spec, path, prompts)
    passes: list[list[dict]] = []
    for _ in range(spec.alternate):
        rows: list[dict] = []
        for name in spec.rows:
            rows += (
                _ours(spec, path, name, prompts, model.moe_layers, eos, placement)
                if name in TRANSPORT
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
