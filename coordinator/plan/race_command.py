"""`moe-cluster plan --race` and `--check-against`: the race model (plan/race.py) as a table or
JSON, and its predictions against the rows of a `bench race --json` run."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from . import presets
from . import race as race_model
from .calibration import _load_json, read_calibration
from .link import MEASURED
from .perfmodel import HardwareSpec, Overheads, PlanError

DEFAULT_LINKS = "10gbe,tb-ip,tb5-rdma"
GiB = 1 << 30


def _network(name: str, measured=None):
    """A link by the name a Mac owner knows, a network preset, or `measured`: the link a
    calibration from `bench link` measured."""
    if name == MEASURED:
        if measured is None:
            raise PlanError(
                "--link measured needs --calibration FILE written by `moe-cluster bench link`"
            )
        return measured
    return presets.network_preset(race_model.LINKS.get(name, name))


def main(
    args,
    model,
    hardware: HardwareSpec,
    nodes: list[int],
    batches: list[int],
    fraction: float,
    stack: float | None,
) -> int:
    """The race or the check, on what `plan`'s own parsing made of the arguments."""
    if args.check_against:
        return _check(args, model, hardware)
    nodes = [n for n in nodes if n > 1]
    if not nodes:
        raise PlanError(
            "--race compares ways of splitting a model over nodes: give --nodes of 2 or more"
        )
    overheads, measured = Overheads(), None
    if args.calibration:
        cal = read_calibration(args.calibration)
        overheads = cal.overheads(apply_collective=False)
        measured = cal.link.network() if cal.link is not None else None
    default = MEASURED if measured is not None else DEFAULT_LINKS
    links = [x.strip() for x in (args.link or args.network or default).split(",")]
    nets = {
        link: _network(link, measured).with_stack(stack)
        if stack is not None
        else _network(link, measured)
        for link in links
    }
    context = int(getattr(args, "context", 0) or 0)
    out = race_points(
        model, hardware, nets, nodes, batches, overheads, fraction, args.transport, context
    )
    if args.json:
        print(
            json.dumps(
                {
                    "model": model.name,
                    "weights": model.weights,
                    "hardware": hardware.name,
                    "prediction": True,
                    "networks": {link: asdict(net) for link, net in nets.items()},
                    **out,
                }
            )
        )
        return 0
    print(render(model, hardware, out, nets))
    return 0


def race_points(
    model,
    hardware: HardwareSpec,
    nets: dict,
    nodes: list[int],
    batches: list[int],
    overheads: Overheads = Overheads(),
    fraction: float = 0.75,
    transport: str = "envoy",
    context: int = 0,
) -> dict:
    """{"points": every strategy per link, node count and batch; "sensitivity": per link, node
    count and batch, the winner and its lead over the next strategy with the link's cost times
    each of race.LINK_FACTORS}."""
    points, moves = [], []
    for link, net in nets.items():
        for p in race_model.race(
            model,
            hardware,
            net,
            nodes,
            batches,
            overheads=overheads,
            memory_fraction=fraction,
            transport=transport,
            context=context,
        ):
            points.append({"link": link, **p.to_json()})
        for n in nodes:
            for b in batches:
                for f, (best, by) in race_model.link_sensitivity(
                    model,
                    hardware,
                    net,
                    n,
                    b,
                    overheads=overheads,
                    memory_fraction=fraction,
                    transport=transport,
                    context=context,
                ).items():
                    moves.append(
                        {
                            "link": link,
                            "nodes": n,
                            "batch": b,
                            "link_cost_factor": f,
                            "winner": best.strategy,
                            "transport": best.transport,
                            "lead": by,
                            "tokens_per_s": best.tokens_per_s,
                        }
                    )
    return {"points": points, "sensitivity": moves}


def _said(strategy: str, transport: str, lead: float) -> str:
    name = f"ours ({transport})" if strategy == "ours" else strategy
    return f"{name} {lead:.2f}x" if lead != float("inf") else f"{name} (alone fits)"


def render(model, hardware: HardwareSpec, out: dict, nets: dict) -> str:
    """One table per link: tok/s of each strategy per node count and batch, the winner and its
    lead over the next, and who would win, by how much, were the link's cost 2x higher or lower."""
    points, moves = out["points"], out["sensitivity"]
    lines = [
        f"race (predicted): {model.name} ({model.weights}), {model.layers} layers, {model.num_experts} experts "
        f"top-{model.top_k}, on {hardware.name} ({hardware.bandwidth_Bps / 1e9:g} GB/s, "
        f"{hardware.memory_bytes / GiB:.0f} GiB)"
    ]
    head = (
        ["nodes", "streams"]
        + [f"{s} tok/s" for s in race_model.STRATEGIES]
        + ["winner (lead)", "ours/pipeline", "ours/tensor"]
        + [f"link x{f:g}" for f in race_model.LINK_FACTORS]
    )
    for link, net in nets.items():
        lines += [
            "",
            f"link {link} ({net.name}: envoy {net.latency_s('envoy') * 1e6:.0f} us, "
            f"mx.distributed {net.latency_s('mlx') * 1e6:.0f} us per collective, "
            f"{net.bandwidth_Bps * 8 / 1e9:.3g} Gb/s)",
        ]
        if net.note:
            lines.append(f"  {net.note}")
        table = [head]
        rows = [p for p in points if p["link"] == link]
        for key in dict.fromkeys((p["nodes"], p["batch"]) for p in rows):
            group = {p["strategy"]: p for p in rows if (p["nodes"], p["batch"]) == key}
            best, by = race_model.lead(
                [
                    race_model.RacePoint(**{k: v for k, v in p.items() if k != "link"})
                    for p in group.values()
                ]
            )
            moved = {
                m["link_cost_factor"]: _said(m["winner"], m["transport"], m["lead"])
                for m in moves
                if (m["link"], m["nodes"], m["batch"]) == (link, *key)
            }
            cells = [
                f"{group[s]['tokens_per_s']:.1f}" + ("" if group[s]["fits"] else " (no fit)")
                for s in race_model.STRATEGIES
            ]
            table.append(
                [
                    str(key[0]),
                    str(key[1]),
                    *cells,
                    _said(best.strategy, best.transport, by),
                    f"{group['ours']['tokens_per_s'] / group['pipeline']['tokens_per_s']:.2f}x",
                    f"{group['ours']['tokens_per_s'] / group['tensor']['tokens_per_s']:.2f}x",
                    *(moved[f] for f in race_model.LINK_FACTORS),
                ]
            )
        widths = [max(len(r[i]) for r in table) for i in range(len(head))]
        lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in table]
    lines += [
        "",
        "tok/s at B streams is all B together; a collective is paid once per step for all of them.",
        "winner: its tok/s over the next strategy's; link x2, x0.5: the winner and its lead were the "
        "link's every cost (latency, bytes) twice or half what it is here. mlx-lm's strategies run "
        "over mx.distributed; ours over --transport (default envoy).",
    ]
    return "\n".join(lines)


def _measured_rows(raw: dict, where: str) -> list[race_model.MeasuredRow]:
    rows = []
    if not isinstance(raw, dict) or not isinstance(raw.get("rows"), list):
        raise PlanError(f'{where}: not `moe-cluster bench race --json` output (no "rows" list)')
    for r in raw["rows"]:
        if not isinstance(r, dict) or "error" in r or r.get("name") not in race_model.ROW_STRATEGY:
            continue
        step = r.get("step_s")
        if not isinstance(step, (int, float)) or step <= 0:
            continue
        synced = r.get("synced_breakdown_per_step_s")
        rows.append(
            race_model.MeasuredRow(
                r["name"],
                int(r["nodes"]),
                int(r["streams"]),
                float(step),
                r.get("collective_s"),
                synced if isinstance(synced, dict) else None,
            )
        )
    if not rows:
        raise PlanError(f"{where}: no measured rows to check against")
    return rows


def _check(args, model, hardware: HardwareSpec) -> int:
    raw = _load_json(args.check_against)
    rows = _measured_rows(raw, str(args.check_against))
    if raw.get("bandwidth_Bps") and not args.hardware:
        # the bench's own host: its bandwidth, and no FLOP figure (the fit absorbs compute)
        hardware = HardwareSpec("bench host", 1 << 60, float(raw["bandwidth_Bps"]), 1e30, 0.0)
    net = _network((args.link or "loopback").split(",")[0])
    run = race_model.RaceRun(model, hardware, net, rows)
    fit = getattr(args, "fit", "split")
    if fit == "each":
        out = race_model.check_each(run)
    elif fit == "bandwidth":
        out = race_model.check(run)
    else:
        out = race_model.check_split(run)
    out["model"] = model.name
    out["race"] = str(Path(args.check_against))
    if args.json:
        print(json.dumps(out))
        return 0
    print(
        f"{model.name} against {args.check_against}: bandwidth {out['bandwidth_Bps'] / 1e9:.2f} GB/s "
        f"({out['bandwidth_source']})"
    )
    print(f"{'row':>16} {'nodes':>5} {'streams':>7} {'measured':>9} {'predicted':>9} {'miss':>7}")
    for r in out["rows"]:
        print(
            f"{r['row']:>16} {r['nodes']:>5} {r['batch']:>7} {r['measured_tps']:>9.1f} {r['predicted_tps']:>9.1f} "
            f"{100 * r['miss']:>+6.1f}%" + ("" if r["held_out"] else "  (fitted)")
        )
    if isinstance(out["layer_overhead_s"], dict):
        tok = out.get("token_overhead_s", {})
        print(
            "costs per layer fitted (fixed + per token): "
            + ", ".join(
                f"{k} {1e6 * v:.0f} + {1e6 * tok.get(k, 0.0):.0f} us"
                for k, v in out["layer_overhead_s"].items()
            )
        )
    if out.get("token_costs_s"):
        t = out["token_costs_s"]
        print(
            f"costs per layer fitted: {1e6 * out['layer_overhead_s']:.0f} us fixed; per token "
            f"{1e6 * t['token_attention_s']:.1f} us attention, {1e6 * t['token_expert_s']:.2f} us "
            f"an expert pass, {1e6 * t['token_ours_s']:.1f} us ours' own"
        )
    worst = out["max_abs_held_out_miss"]
    print("largest held-out miss: " + ("-" if worst is None else f"{100 * worst:.1f}%"))
    return 0


def advice(model, hardware: HardwareSpec, net, calibration, nodes: int, transport: str) -> dict:
    """What `plan --race` says for `model` on `nodes` nodes over the link `net` (a measured one),
    ours over `transport` (cluster.yaml's): {"points", "text"}; and which transport the link
    favours."""
    overheads = calibration.overheads(apply_collective=False) if calibration else Overheads()
    nets = {MEASURED: net}
    out = race_points(model, hardware, nets, [nodes], [1, 8, 32], overheads, 0.75, transport)
    cheaper = min(("envoy", "mlx"), key=net.latency_s)
    lines = [
        render(model, hardware, out, nets),
        "",
        f"on this link an all-reduce costs {net.latency_s('envoy') * 1e6:.0f} us over the envoy "
        f"and {net.latency_s('mlx') * 1e6:.0f} us over mx.distributed: transport: {cheaper} "
        f"is the cheaper (cluster.yaml has transport: {transport})",
    ]
    if calibration is None or calibration.bandwidth_Bps is None:
        lines.append(
            f"compute from the {hardware.name} preset (--hardware; or --calibration BASE.json "
            "from `plan --calibrate` to use this cluster's own)"
        )
    return {"points": out, "text": "\n".join(lines)}
