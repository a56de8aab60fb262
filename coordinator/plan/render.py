"""The plan as `moe-cluster plan` prints it: the table per network, the JSON object, the warning
for rows that do not fit and the expert cache's table."""

from __future__ import annotations

from dataclasses import asdict

from .perfmodel import NetworkSpec
from .planner import Plan
from .presets import GiB


def gib(b: float) -> str:
    return f"{b / GiB:.1f} GiB"


def _s(x: float) -> str:
    return "<0.001" if 0 < x < 0.0005 else f"{x:.3f}"


def _describe_network(n: NetworkSpec) -> str:
    return (
        f"{n.name}: wire {n.wire_latency_s * 1e6:.3g} us + stack {n.stack_s * 1e6:.3g} us per "
        "MoE layer (envoy"
        + (f"; mx.distributed {n.mlx_stack_s * 1e6:.3g} us" if n.mlx_stack_s is not None else "")
        + f"), {n.bandwidth_Bps / 1e9:.3g} GB/s"
        + (f", NIC {n.price_per_node_usd:g} USD/node" if n.price_per_node_usd else "")
    )


def render_table(plan: Plan) -> str:
    model, hardware, settings, calibration = (
        plan.model,
        plan.hardware,
        plan.settings,
        plan.calibration,
    )
    rows, checkpoint_bytes = plan.rows, plan.checkpoint_bytes
    lines = [
        f"model     {model.name} ({model.weights}): {gib(model.total_bytes)} = {gib(model.replicated_bytes)} replicated"
        f" + {model.num_experts} experts x {gib(model.expert_bytes)}; top-{model.top_k}, "
        f"{model.moe_layers}/{model.layers} MoE layers"
        + (f"; checkpoint {gib(checkpoint_bytes)}" if checkpoint_bytes else ""),
        f"hardware  {hardware.name}: {gib(hardware.memory_bytes)}, {hardware.bandwidth_Bps / 1e9:g} GB/s, "
        f"{hardware.flops / 1e12:g} TFLOP/s, {hardware.price_usd:,.0f} USD",
        f"settings  keepalive {settings.keepalive}, replication {settings.replication}, context {settings.context} tokens, "
        + (
            f"batch {settings.batch} sequences (tok/s: all of them; E[n]: distinct experts of {settings.batch} tokens), "
            if settings.batch > 1
            else ""
        )
        + f"usable memory {settings.memory_fraction:.0%} per node",
    ]
    if calibration is not None:
        lines.append(
            (
                f"calibrated from {calibration.model}: BW_eff {calibration.bandwidth_Bps / 1e9:.1f} "
                f"GB/s, {calibration.layer_overhead_s * 1e6:.1f} us/layer fixed"
                if calibration.bandwidth_Bps is not None
                else "calibrated: compute from the hardware preset"
            )
            + (
                f", collective {calibration.collective_base_s * 1e6:.0f} us/layer at 2 nodes "
                f"+ {calibration.collective_per_node_s * 1e6:.0f} us per extra node"
                f" (applied to {calibration.network or 'every network'})"
                if calibration.collective_base_s is not None
                else ""
            )
        )
    show_overhead = any(r.overhead_s for r in rows)
    head = (
        ["nodes", "E[n]", "load s", "compute s"]
        + (["overhead s"] if show_overhead else [])
        + [
            "latency s",
            "transfer s",
            "time s",
            "tok/s" if settings.batch == 1 else "tok/s, all",
            "memory/node",
            "fits",
            "tok/s/USD",
        ]
    )
    for net in plan.networks:
        lines += ["", "network   " + _describe_network(net)]
        table = [head]
        for r in (r for r in rows if r.network == net.name):
            table.append(
                [str(r.nodes), f"{r.expected_experts:.3f}", _s(r.load_s), _s(r.compute_s)]
                + ([_s(r.overhead_s)] if show_overhead else [])
                + [
                    _s(r.latency_s),
                    _s(r.transfer_s),
                    _s(r.time_s),
                    f"{r.tokens_per_s:.1f}",
                    gib(r.memory_per_node_bytes),
                    "yes" if r.fits else "NO",
                    f"{r.tokens_per_s_per_usd:.6f}",
                ]
            )
        widths = [max(len(row[i]) for row in table) for i in range(len(head))]
        lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in table]
    lines.append("")
    methods = list(
        dict.fromkeys(
            (r.nodes, r.extra["expected_experts_method"], r.extra["replicas_per_node"])
            for r in rows
        )
    )
    for n, method, replicas in methods:
        lines.append(
            f"E[n] at {n} node{'s' * (n > 1)}: {method}"
            + (f"; {replicas} replica slot(s) per node" if replicas else "")
        )
    if settings.context == 0:
        lines.append("KV cache not counted (--context 0).")
    elif not model.caches:
        lines.append("KV cache size unknown for this model; not counted.")
    misfits = sorted({r.nodes for r in rows if not r.fits})
    if misfits:
        lines.append(
            f"does not fit in {settings.memory_fraction:.0%} of {gib(hardware.memory_bytes)} at "
            f"{', '.join(map(str, misfits))} node(s)."
        )
    return "\n".join(lines)


def plan_json(plan: Plan) -> dict:
    model = plan.model
    return {
        "model": {
            "name": model.name,
            "weights": model.weights,
            "source": model.source,
            "num_experts": model.num_experts,
            "top_k": model.top_k,
            "layers": model.layers,
            "moe_layers": model.moe_layers,
            "hidden": model.hidden,
            "total_bytes": model.total_bytes,
            "replicated_bytes": model.replicated_bytes,
            "replicated_read_bytes": model.replicated_read_bytes,
            "expert_bytes": model.expert_bytes,
            "shared_expert_bytes": model.shared_bytes,
            "comm_bytes_per_token": model.comm_bytes,
            "kv_bytes_per_token": sum(c.per_token_bytes for c in model.caches)
            if model.caches
            else None,
            "checkpoint_bytes": plan.checkpoint_bytes,
        },
        "hardware": asdict(plan.hardware),
        "networks": [asdict(n) for n in plan.networks],
        "settings": asdict(plan.settings),
        "calibration": plan.calibration.to_json() if plan.calibration else None,
        "rows": [r.to_json() for r in plan.rows],
    }


def _kept(m: dict) -> str:
    return f"{m['resident_experts']} of its {m['local_experts']} experts per layer resident ({m['resident_share']:.0%})"


def render_misfits(rows: list[dict]) -> list[str]:
    """The warning for rows that do not fit: what `expert_cache: auto` would keep, and its tok/s."""
    lines = []
    for m in rows:
        head = (
            (
                f"at {m['nodes']} node{'s' * (m['nodes'] > 1)} ({m['network']}) a node needs "
                f"{gib(m['memory_per_node_bytes'])}, has {gib(m['usable_memory_bytes'])}: "
            )
            if m["servable"]
            else f"at {m['nodes']} node{'s' * (m['nodes'] > 1)} ({m['network']}) "
        )
        if not m["servable"]:
            lines.append(
                head + f"the replicated weights and KV cache alone need "
                f"{gib(m['memory_without_experts_bytes'])} of {gib(m['usable_memory_bytes'])}; "
                "no expert cache helps"
            )
        elif "tokens_per_s" not in m:
            lines.append(
                head
                + f"with placement.expert_cache: auto it keeps {_kept(m)}; tok/s {m['miss_cost']}"
            )
        else:
            routing = "uniform routing" if m["skew"] == 0 else f"routing skew {m['skew']:g}"
            lines.append(
                head
                + f"with placement.expert_cache: auto it keeps {_kept(m)} and reads the rest from "
                f"disk: expected {m['tokens_per_s']:.2f} tok/s against {m['full_tokens_per_s']:.2f} if every "
                f"expert fit (hit rate {m['hit_rate']:.0%}, "
                f"{m['disk_bytes_per_token'] / 1e9:.2f} GB read per token, miss cost {m['miss_cost']}, "
                f"{routing})"
            )
    return lines


def render_cache(rows: list[dict]) -> str:
    head = [
        "nodes",
        "network",
        "cache",
        "skew",
        "hit rate",
        "disk MB/tok",
        "disk s",
        "tok/s",
        "memory/node",
        "fits",
    ]
    table = [head] + [
        [
            str(r["nodes"]),
            r["network"],
            r["expert_cache"],
            f"{r['skew']:g}",
            f"{r['hit_rate']:.1%}",
            f"{r['disk_bytes_per_token'] / 1e6:.1f}",
            _s(r["disk_s"]),
            f"{r['tokens_per_s']:.1f}",
            gib(r["memory_per_node_bytes"]),
            "yes" if r["fits"] else "NO",
        ]
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines = ["", f"expert cache (misses read from disk; cost per miss: {rows[0]['miss_cost']})"]
    return "\n".join(lines + ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in table])
