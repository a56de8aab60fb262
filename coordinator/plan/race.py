"""The race on paper: expert parallelism (ours) against mlx-lm's pipeline and tensor parallelism.

Per decode step of B tokens (B = 1 at batch 1), on N nodes, each strategy pays weight reads
(bytes over the memory bandwidth, or FLOPs over the GPU, whichever is longer) and collectives:

- pipeline: the nodes run their layers one after another, so the step reads every active byte
  (attention, router, the distinct experts of the B tokens) in sequence, plus one hop of the
  hidden state per boundary (N - 1);
- ours: every node reads the replicated attention and router plus E_B experts of its own (the
  busiest node's expectation, plan/expected.py) at the same time, plus one all-reduce per MoE layer;
- by-stream (ours with attention by stream): the same reads, but each node attends for B/N of the
  streams, and each MoE layer pays an all-gather and a reduce-scatter (two collectives of the
  step's rows) where ours pays one all-reduce;
- tensor: every node reads 1/N of every active byte at the same time, plus two all-reduces per
  decoder layer (after attention and after the MLP).

A collective or hop costs the link's latency (wire + the transport's software stack, or the
calibrated collective) plus its bytes (B × hidden × activation bytes) over the link's bandwidth; it
is paid once per step whatever B is, which is how batching spreads it until the step is bound by
bandwidth or compute. mlx-lm's strategies run over mx.distributed (`mlx`); ours and by-stream over
the envoy (`transport: envoy`, the default) or over mx.distributed (`transport: mlx`), as chosen.

Calibrated (`plan --check-against`), a layer also costs a fixed time (launches) and, per token of
the batch, its attention and router (every node under expert parallelism and in the pipeline, 1/N of
it under tensor parallelism), its passes through experts (k per token in the pipeline, k/N per node
under the other two) and, under ours alone, ours' own per-token work. On GPUs these costs, not the
bytes, decide the race (docs/race.md).
Everything here is pure arithmetic on the frozen records of perfmodel.py.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Sequence

from .perfmodel import TRANSPORTS, HardwareSpec, ModelSpec, NetworkSpec, Overheads, PlanError

STRATEGIES = ("ours", "by-stream", "pipeline", "tensor")
# `--link` names a Mac owner knows, onto the network presets
LINKS = {"10gbe": "10gbe", "tb-ip": "tb5", "tb5-rdma": "tb5-rdma"}


@dataclass(frozen=True)
class RacePoint:
    """One strategy at one node count and batch: bytes read, the step's terms and tok/s."""

    strategy: str
    nodes: int
    batch: int
    bytes_per_node: float  # weight bytes the busiest node reads per step
    read_s: float  # weight reads on the step's critical path, seconds
    compute_s: float  # FLOPs on the critical path, seconds
    overhead_s: float  # calibrated costs per decoder layer (fixed and per token), critical path
    comm_s: float  # collectives or hops per step, seconds
    collectives: int  # collectives (or hops) per step
    time_s: float  # one step of `batch` tokens
    tokens_per_s: float  # all `batch` streams together
    memory_per_node_bytes: int
    fits: bool
    transport: str = "mlx"  # the collective it runs over: mlx-lm's is mx.distributed

    def to_json(self) -> dict:
        return dict(vars(self))


def active_bytes(model: ModelSpec, experts_per_layer: float | list[float]) -> float:
    """Weight bytes a step reads over the whole model when each MoE layer computes
    `experts_per_layer` distinct experts: replicated reads, shared experts and those experts."""
    e = _per_layer(model, experts_per_layer)
    return (
        model.replicated_read_bytes
        + model.shared_bytes
        + sum(b * x for b, x in zip(model.expert_layer_bytes, e))
    )


def _per_layer(model: ModelSpec, values: float | list[float]) -> list[float]:
    e = [float(values)] * model.moe_layers if isinstance(values, (int, float)) else list(values)
    if len(e) != model.moe_layers:
        raise PlanError(f"{len(e)} expected-expert values for {model.moe_layers} MoE layers")
    return e


def _flops(model: ModelSpec, experts_per_token: float | list[float], batch: int) -> float:
    e = _per_layer(model, experts_per_token)
    shared = sum(model.shared_layer_flops)
    return batch * (
        model.replicated_flops + shared + sum(f * x for f, x in zip(model.expert_layer_flops, e))
    )


def collective_s(
    network: NetworkSpec,
    overheads: Overheads,
    nodes: int,
    payload_bytes: float,
    transport: str = "envoy",
) -> float:
    """One all-reduce (or hop) of `payload_bytes`: the calibrated collective where there is one
    (it includes its bytes), else the link's latency over `transport` plus the bytes over its
    bandwidth."""
    measured = overheads.collective_s(nodes)
    if measured is not None:
        return measured
    return network.latency_s(transport) + payload_bytes / network.bandwidth_Bps


def race_point(
    strategy: str,
    model: ModelSpec,
    hardware: HardwareSpec,
    network: NetworkSpec,
    nodes: int,
    batch: int,
    *,
    ours_experts: float | list[float],
    distinct_experts: float | list[float],
    overheads: Overheads = Overheads(),
    memory_fraction: float = 0.75,
    transport: str = "envoy",
    context: int = 0,
) -> RacePoint:
    """One strategy's step of `batch` tokens on `nodes` nodes.

    Args:
        transport: the collective ours runs over (`envoy` or `mlx`); mlx-lm's strategies always
            run over mx.distributed.
        ours_experts: E_B per MoE layer, the distinct experts the busiest node computes for the
            batch under expert parallelism (plan/expected.py).
        distinct_experts: the distinct experts the batch selects per MoE layer on one device
            (k at batch 1): what pipeline and tensor parallelism read.
        context: tokens in each stream's KV cache: a step reads them (and a node holds them)
            for the streams it attends for, which is where attention by stream saves.
    """
    if strategy not in STRATEGIES:
        raise PlanError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")
    if nodes < 1 or batch < 1:
        raise PlanError(f"nodes ({nodes}) and batch ({batch}) must be at least 1")
    bandwidth = overheads.bandwidth_Bps or hardware.bandwidth_Bps
    if transport not in TRANSPORTS:
        raise PlanError(f"unknown transport {transport!r}; choose from {', '.join(TRANSPORTS)}")
    if strategy not in ("ours", "by-stream"):
        transport = "mlx"
    payload = batch * model.hidden * model.act_bytes  # bytes, one hidden state per token
    if strategy == "by-stream":  # a gather or a scatter moves each node's share of the rows
        payload = -(-batch // nodes) * model.hidden * model.act_bytes
    one = collective_s(network, overheads, nodes, payload, transport) if nodes > 1 else 0.0
    every = active_bytes(model, distinct_experts)
    per_token_k = float(model.top_k)  # FLOPs: each token multiplies through its own k experts
    # per token per layer: (attention's share, expert passes, ours' own work); see the docstring
    token_terms = {
        "pipeline": (1.0, per_token_k, 0.0),
        "tensor": (1.0 / nodes, per_token_k / nodes, 0.0),
        "ours": (1.0, per_token_k / nodes, 1.0),
        # the busiest node attends for ceil(B / N) of the B streams
        "by-stream": (-(-batch // nodes) / batch, per_token_k / nodes, 1.0),
    }[strategy]
    kv = model.kv_cache_bytes(context) if context else 0  # one stream's, bytes
    if strategy == "pipeline":
        # one node after another: the step's critical path reads all of it, every stream's KV
        read = every + batch * kv
        per_node = read / nodes
        flops = _flops(model, per_token_k, batch)
        collectives = nodes - 1
        memory = (model.total_bytes + batch * kv) / nodes
    elif strategy == "tensor":  # heads, and so each stream's KV, split over the nodes
        read = per_node = (every + batch * kv) / nodes
        flops = _flops(model, per_token_k, batch) / nodes
        collectives = 2 * model.layers if nodes > 1 else 0
        memory = (model.total_bytes + batch * kv) / nodes
    else:
        shared_b, _ = model.shared_max(nodes)
        e = _per_layer(model, ours_experts)
        # the streams the busiest node attends for: all of them, or by stream its own
        attended = -(-batch // nodes) if strategy == "by-stream" else batch
        read = per_node = (
            model.replicated_read_bytes
            + shared_b
            + sum(b * x for b, x in zip(model.expert_layer_bytes, e))
            + attended * kv
        )
        flops = _flops(model, [min(per_token_k, x) for x in e], batch)
        # by stream: a gather and a scatter per MoE layer where ours pays one all-reduce
        collectives = (2 if strategy == "by-stream" else 1) * model.moe_layers if nodes > 1 else 0
        memory = (
            model.replicated_bytes
            + -(-model.num_experts // nodes) * model.expert_bytes
            + attended * kv
        )
    read_s = read / bandwidth
    compute_s = flops / hardware.flops
    a, e, o = token_terms
    per_token_s = (
        a * overheads.token_attention_s + e * overheads.token_expert_s + o * overheads.token_ours_s
    )
    overhead_s = (overheads.layer_overhead_s + batch * per_token_s) * model.layers
    comm_s = collectives * one
    time_s = max(read_s, compute_s) + overhead_s + comm_s
    return RacePoint(
        strategy,
        nodes,
        batch,
        per_node,
        read_s,
        compute_s,
        overhead_s,
        comm_s,
        collectives,
        time_s,
        batch / time_s,
        int(memory),
        memory <= hardware.memory_bytes * memory_fraction,
        transport,
    )


def winner(points: list[RacePoint]) -> RacePoint:
    """The fastest point that fits (the fastest of all where none fits)."""
    fitting = [p for p in points if p.fits] or points
    return max(fitting, key=lambda p: p.tokens_per_s)


def lead(points: list[RacePoint]) -> tuple[RacePoint, float]:
    """The winner and how many times faster it is than the next strategy (inf: the only one that
    fits)."""
    best = winner(points)
    rest = [p for p in points if p is not best and (p.fits or not best.fits)]
    if not rest:
        return best, float("inf")
    return best, best.tokens_per_s / max(p.tokens_per_s for p in rest)


LINK_FACTORS = (2.0, 0.5)  # how `plan --race` tests its advice: the link's cost 2x higher, 2x lower


def link_sensitivity(
    model: ModelSpec,
    hardware: HardwareSpec,
    network: NetworkSpec,
    nodes: int,
    batch: int,
    *,
    overheads: Overheads = Overheads(),
    memory_fraction: float = 0.75,
    transport: str = "envoy",
    context: int = 0,
) -> dict[float, tuple[RacePoint, float]]:
    """{factor: (winner, its lead)} with every cost of the link (latencies, the inverse bandwidth,
    a calibrated collective) `factor` times what it is: whether the advice holds if the link is
    not what the plan assumed."""
    out = {}
    for f in LINK_FACTORS:
        net = network.scaled(f)
        over = overheads
        if overheads.collective_base_s is not None:
            over = replace(
                overheads,
                collective_base_s=overheads.collective_base_s * f,
                collective_per_node_s=overheads.collective_per_node_s * f,
            )
        pts = every_strategy(
            model,
            hardware,
            net,
            nodes,
            batch,
            overheads=over,
            memory_fraction=memory_fraction,
            transport=transport,
            context=context,
        )
        out[f] = lead(pts)
    return out


@functools.lru_cache(maxsize=256)  # pure, and a Monte-Carlo estimate at N > 1: the race asks again
def expected_batch(model: ModelSpec, nodes: int, batch: int) -> tuple[float, float]:
    """(E_B of the busiest node under an even split, distinct experts of the batch on one device),
    per MoE layer, uniform routing."""
    from .expected import expected_distinct_alone, expected_experts, placement_for

    ours = (
        expected_experts(
            placement_for(model.num_experts, nodes),
            model.num_experts,
            model.top_k,
            "none",
            batch=batch,
        ).value
        if nodes > 1
        else expected_distinct_alone(model.num_experts, model.top_k, batch)
    )
    return ours, expected_distinct_alone(model.num_experts, model.top_k, batch)


def race(
    model: ModelSpec,
    hardware: HardwareSpec,
    network: NetworkSpec,
    nodes: list[int],
    batches: list[int],
    *,
    overheads: Overheads = Overheads(),
    memory_fraction: float = 0.75,
    transport: str = "envoy",
    context: int = 0,
) -> list[RacePoint]:
    """Every strategy at every node count and batch (node counts > 1; one node races nobody);
    ours over `transport`."""
    out = []
    for n in nodes:
        for b in batches:
            out += every_strategy(
                model,
                hardware,
                network,
                n,
                b,
                overheads=overheads,
                memory_fraction=memory_fraction,
                transport=transport,
                context=context,
            )
    return out


def every_strategy(
    model: ModelSpec,
    hardware: HardwareSpec,
    network: NetworkSpec,
    nodes: int,
    batch: int,
    *,
    overheads: Overheads,
    memory_fraction: float,
    transport: str,
    context: int,
) -> list[RacePoint]:
    """Every strategy's step of `batch` tokens on `nodes` nodes, with the experts each reads under
    uniform routing (`expected_batch`)."""
    ours, distinct = expected_batch(model, nodes, batch)
    return [
        race_point(
            s,
            model,
            hardware,
            network,
            nodes,
            batch,
            ours_experts=ours,
            distinct_experts=distinct,
            overheads=overheads,
            memory_fraction=memory_fraction,
            transport=transport,
            context=context,
        )
        for s in STRATEGIES
    ]


# bench race's row names onto the strategies here, with the bare collective each one pays
ROW_STRATEGY = {
    "ours_mlx": ("ours", "mlx"),
    "ours_envoy": ("ours", "envoy"),
    # two micro-batches per step (bench race --rows ..._overlap): the same reads and collectives
    "ours_mlx_overlap": ("ours", "mlx"),
    "ours_envoy_overlap": ("ours", "envoy"),
    # attention by stream (serving.attention: by-stream)
    "ours_by_stream": ("by-stream", "mlx"),
    "ours_envoy_by_stream": ("by-stream", "envoy"),
    # auto: one stream alone is replicated; under load the streams are owned
    "ours_auto": ("by-stream", "mlx"),
    "ours_envoy_auto": ("by-stream", "envoy"),
    "mlx_lm_pipeline": ("pipeline", "mlx"),
    "mlx_lm_tensor": ("tensor", "mlx"),
}


def row_strategy(name: str, batch: int) -> str:
    """The strategy a bench race row runs at `batch` streams (auto: replicated when alone)."""
    strategy = ROW_STRATEGY[name][0]
    return "ours" if name in ("ours_auto", "ours_envoy_auto") and batch == 1 else strategy


@dataclass(frozen=True)
class MeasuredRow:
    """One row of `bench race --json`, as the check needs it."""

    name: str
    nodes: int
    batch: int
    step_s: float  # one decode step of all `batch` streams, seconds
    collective_s: float | None  # the bare collective (or hop) this row's transport pays, seconds
    # ours' synced pass, seconds per step: attention_router, experts, collective_wait, other
    breakdown: dict | None = None


def predict_row(
    model: ModelSpec,
    hardware: HardwareSpec,
    network: NetworkSpec,
    row: MeasuredRow,
    bandwidth_Bps: float,
    layer_overhead_s: float = 0.0,
    **token_costs: float,
) -> RacePoint:
    """`row`'s step as the model has it; `token_costs`: Overheads' token_* fields."""
    strategy, transport = row_strategy(row.name, row.batch), ROW_STRATEGY[row.name][1]
    ours, distinct = expected_batch(model, row.nodes, row.batch)
    over = Overheads(
        bandwidth_Bps=bandwidth_Bps,
        layer_overhead_s=layer_overhead_s,
        collective_base_s=row.collective_s,
        **token_costs,
    )
    return race_point(
        strategy,
        model,
        hardware,
        network,
        row.nodes,
        row.batch,
        ours_experts=ours,
        distinct_experts=distinct,
        overheads=over,
        transport=transport,
    )


@dataclass(frozen=True)
class RaceRun:
    """A `bench race` run as `plan --check-against` checks the model on it: the model, the device
    and the link it ran on, and the rows it measured."""

    model: ModelSpec
    hardware: HardwareSpec
    network: NetworkSpec
    rows: Sequence[MeasuredRow]

    def predict(self, row: MeasuredRow, bandwidth_Bps: float, **costs: float) -> RacePoint:
        """`row`'s step as the model has it at `bandwidth_Bps` (`predict_row`)."""
        return predict_row(self.model, self.hardware, self.network, row, bandwidth_Bps, **costs)


def check(run: RaceRun, fit_on: str = "ours_mlx") -> dict:
    """Fit the model to `fit_on`'s rows, then predict every row: the fitted rows' misses are ~0
    by construction, the others are held out. With rows at two batches or more, the step less its
    collectives is fitted as bytes / bandwidth + layers × a fixed cost per layer (least squares);
    with one, the bandwidth alone. Without `fit_on` rows, the hardware's bandwidth is used."""
    model, hardware = run.model, run.hardware
    fitted = [r for r in run.rows if r.name == fit_on]
    bandwidth, per_layer = hardware.bandwidth_Bps, 0.0
    note = f"{hardware.name}'s bandwidth, not fitted (no {fit_on} rows)"
    points = []
    for r in fitted:
        probe = run.predict(r, hardware.bandwidth_Bps)
        points.append((probe.bytes_per_node, r.step_s - probe.comm_s))
    if len({b for b, _ in points}) >= 2:
        intercept, slope = _least_squares(points)
        if slope > 0 and intercept >= 0:
            bandwidth, per_layer = 1.0 / slope, intercept / model.layers
            note = f"fitted to {fit_on}'s {len(points)} rows: bandwidth and a fixed cost per layer"
            points = []
    if points and points[0][1] > 0:  # one row, or a two-term fit without physical meaning
        bandwidth, per_layer = points[0][0] / points[0][1], 0.0
        note = f"bandwidth fitted to {fit_on} at batch {fitted[0].batch} on {fitted[0].nodes} nodes"
        fitted = fitted[:1]
    elif points:
        note, fitted = (
            f"{fit_on}'s collectives alone exceed its measured step: {hardware.name}'s bandwidth kept",
            [],
        )
    costs = {"layer_overhead_s": per_layer}
    return _misses(run, fitted, bandwidth, lambda r: costs) | {
        "layer_overhead_s": per_layer,
        "bandwidth_source": note,
    }


def _misses(run: RaceRun, fitted, bandwidth, costs) -> dict:
    """Each row predicted (`costs(row)`: predict_row's cost arguments) against what it measured."""
    out = []
    for r in run.rows:
        p = run.predict(r, bandwidth, **costs(r))
        measured = r.batch / r.step_s
        out.append(
            {
                "row": r.name,
                "strategy": p.strategy,
                "nodes": r.nodes,
                "batch": r.batch,
                "measured_tps": measured,
                "predicted_tps": p.tokens_per_s,
                "miss": p.tokens_per_s / measured - 1.0,
                "held_out": r not in fitted,
            }
        )
    held = [abs(x["miss"]) for x in out if x["held_out"]]
    return {
        "bandwidth_Bps": bandwidth,
        "rows": out,
        "max_abs_held_out_miss": max(held) if held else None,
    }


def check_each(run: RaceRun) -> dict:
    """Fit each row kind (ours over a transport, the pipeline, tensor parallelism) on its rows at
    its fewest nodes: at the hardware's bandwidth, what a step measured beyond its bytes and
    collectives is L × (f + c × B), a fixed cost per layer f and a cost per token per layer c
    (launches, attention over each stream's cache, the batch's compute), both fitted where that
    node count has two batches or more, f alone where it has one. Then predict every row of the
    kind: the other node counts are held out, and their misses say whether a kind's costs carry
    over to them."""
    hardware = run.hardware
    fixed: dict[str, float] = {}
    per_token: dict[str, float] = {}
    fitted: list[MeasuredRow] = []
    for name in dict.fromkeys(r.name for r in run.rows):
        kind = [r for r in run.rows if r.name == name]
        fewest = min(r.nodes for r in kind)
        base = sorted((r for r in kind if r.nodes == fewest), key=lambda r: r.batch)
        points = _per_layer_excess(run, base, hardware.bandwidth_Bps)
        fixed[name], per_token[name] = _line(points)
        fitted += base if len({b for b, _ in points}) >= 2 else base[:1]
    return _misses(
        run,
        fitted,
        hardware.bandwidth_Bps,
        lambda r: {"layer_overhead_s": fixed[r.name] + per_token[r.name] * r.batch},
    ) | {
        "layer_overhead_s": fixed,
        "token_overhead_s": per_token,
        "bandwidth_source": f"{hardware.name}'s bandwidth; per row kind a fixed cost per layer and a "
        "cost per token per layer, fitted on its rows at its fewest nodes",
    }


def check_split(run: RaceRun, fit_on: str = "ours_mlx") -> dict:
    """Fit on `fit_on`'s rows at one node count (the one with the most batches) what a step
    measured beyond its bytes and collectives (at the hardware's bandwidth): L × (f + c × B), a
    fixed cost per layer f and a cost per token per layer c. Split c by where ours' synced pass
    grew with the batch (its `breakdown`, smallest batch to largest): attention and the router,
    the experts (c's share over the k/N passes a node makes per token), ours' own (the rest:
    bookkeeping, waiting). Then predict every row with the strategy's share of each
    (race_point): the pipeline and tensor parallelism pay f and the attention and expert costs,
    not ours' own. Without a breakdown, c is split by FLOPs (no own share)."""
    model, hardware = run.model, run.hardware
    fitted_rows = [r for r in run.rows if r.name == fit_on]
    if not fitted_rows:
        out = _misses(run, [], hardware.bandwidth_Bps, lambda r: {})
        return out | {
            "layer_overhead_s": 0.0,
            "token_costs_s": {},
            "bandwidth_source": f"{hardware.name}'s bandwidth, nothing fitted (no {fit_on} rows)",
        }
    by_nodes: dict[int, list[MeasuredRow]] = {}
    for r in fitted_rows:
        by_nodes.setdefault(r.nodes, []).append(r)
    nodes = max(sorted(by_nodes), key=lambda n: len({r.batch for r in by_nodes[n]}))
    base = sorted(by_nodes[nodes], key=lambda r: r.batch)
    # a row faster than its bytes at the given bandwidth says the device is faster than that:
    # the bandwidth rises until every fitted row's bytes and collectives fit its measured step
    bandwidth, raised = hardware.bandwidth_Bps, ""
    for r in base:
        bare = run.predict(r, hardware.bandwidth_Bps)
        room = r.step_s - bare.comm_s
        if room > 0 and bare.read_s * hardware.bandwidth_Bps > room * bandwidth:
            bandwidth = bare.read_s * hardware.bandwidth_Bps / room
            raised = (
                f" (bandwidth raised to {bandwidth / 1e9:.3g} GB/s: its bytes exceeded its step)"
            )
    points = _per_layer_excess(run, base, bandwidth)
    fixed, per_token = _line(points)
    shares, how = _token_shares(model, base, nodes)
    per_pass = model.top_k / nodes
    costs = {
        "layer_overhead_s": fixed,
        "token_attention_s": per_token * shares[0],
        "token_expert_s": per_token * shares[1] / per_pass,
        "token_ours_s": per_token * shares[2],
    }
    if len({b for b, _ in points}) >= 2:
        fitted = base
        what = "a fixed cost per layer and a cost per token per layer, split " + how
    else:
        fitted = base[:1]
        what = f"a fixed cost per layer alone (one batch, {base[0].batch})"
    out = _misses(run, fitted, bandwidth, lambda r: costs)
    return out | {
        "layer_overhead_s": fixed,
        "token_costs_s": {k: v for k, v in costs.items() if k != "layer_overhead_s"},
        "bandwidth_source": f"{hardware.name}'s bandwidth{raised}; fitted to {fit_on}'s "
        f"{len(fitted)} row(s) at {nodes} nodes: " + what,
    }


def _per_layer_excess(
    run: RaceRun, rows: list[MeasuredRow], bandwidth_Bps: float
) -> list[tuple[int, float]]:
    """[(batch, what each of `rows`' steps took beyond its bytes and collectives, per layer)]: the
    points the costs per layer are fitted to."""
    out = []
    for r in rows:
        bare = run.predict(r, bandwidth_Bps)
        out.append((r.batch, max(r.step_s - bare.time_s, 0.0) / run.model.layers))
    return out


def _token_shares(
    model: ModelSpec, base: list[MeasuredRow], nodes: int
) -> tuple[tuple[float, float, float], str]:
    """(attention, experts, ours' own) shares of ours' cost per token, and how they were found."""
    synced = [r for r in base if r.breakdown]
    if len({r.batch for r in synced}) >= 2:
        lo, hi = synced[0].breakdown, synced[-1].breakdown
        grew = [max(0.0, hi.get(k, 0.0) - lo.get(k, 0.0)) for k in ("attention_router", "experts")]
        grew.append(
            max(0.0, sum(hi.get(k, 0.0) - lo.get(k, 0.0) for k in ("collective_wait", "other")))
        )
        if sum(grew) > 0:
            total = sum(grew)
            shares = (grew[0] / total, grew[1] / total, grew[2] / total)
            return shares, (
                f"by its synced pass from {synced[0].batch} to {synced[-1].batch} streams "
                f"(attention {shares[0]:.0%}, experts {shares[1]:.0%}, own {shares[2]:.0%})"
            )
    attention = model.replicated_flops + sum(model.shared_layer_flops)
    experts = sum(model.expert_layer_flops) * model.top_k / nodes
    share = attention / (attention + experts) if attention + experts > 0 else 0.5
    return (share, 1.0 - share, 0.0), (
        f"by FLOPs (no synced pass at two batches): attention {share:.0%}"
    )


def _line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(f, c) ≥ 0 of y = f + c × B through `points` [(B, y)] by least squares; f = the smallest
    batch's y where there is one batch, or where the line would need a negative term."""
    if len({b for b, _ in points}) < 2:
        return points[0][1], 0.0
    f, c = _least_squares(points)
    if c < 0:
        return points[0][1], 0.0
    if f < 0:
        return 0.0, sum(b * y for b, y in points) / sum(b * b for b, _ in points)
    return f, c


def _least_squares(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through `points` [(x, y)], two x's or more."""
    n = len(points)
    mx_, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    slope = sum((x - mx_) * (y - my) for x, y in points) / sum((x - mx_) ** 2 for x, _ in points)
    return my - slope * mx_, slope
