"""`moe-cluster plan --race` and `--check-against`: the race model (plan/race.py) as a table or
JSON, and its predictions against the rows of a `bench race --json` run."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from . import presets
from . import race as race_model
from .calibration import _load_json, read_calibration
from .perfmodel import HardwareSpec, Overheads, PlanError

DEFAULT_LINKS = "10gbe,tb-ip,tb5-rdma"
GiB = 1 << 30


def _network(name: str):
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
    links = [x.strip() for x in (args.link or args.network or DEFAULT_LINKS).split(",")]
    nodes = [n for n in nodes if n > 1]
    if not nodes:
        raise PlanError(
            "--race compares ways of splitting a model over nodes: give --nodes of 2 or more"
        )
    overheads = Overheads()
    if args.calibration:
        overheads = read_calibration(args.calibration).overheads(apply_collective=False)
    out = []
    nets = {
        link: _network(link) if stack is None else replace(_network(link), stack_s=stack)
        for link in links
    }
    for link, net in nets.items():
        for p in race_model.race(
            model, hardware, net, nodes, batches, overheads=overheads, memory_fraction=fraction
        ):
            out.append({"link": link, **p.to_json()})
    if args.json:
        print(
            json.dumps(
                {
                    "model": model.name,
                    "weights": model.weights,
                    "hardware": hardware.name,
                    "prediction": True,
                    "points": out,
                }
            )
        )
        return 0
    print(render(model, hardware, out, nets))
    return 0


def render(model, hardware: HardwareSpec, points: list[dict], nets: dict) -> str:
    """One table per link: tok/s of each strategy per node count and batch, the winner marked."""
    lines = [
        f"race (predicted): {model.name} ({model.weights}), {model.layers} layers, {model.num_experts} experts "
        f"top-{model.top_k}, on {hardware.name} ({hardware.bandwidth_Bps / 1e9:g} GB/s, "
        f"{hardware.memory_bytes / GiB:.0f} GiB)"
    ]
    head = (
        ["nodes", "streams"]
        + [f"{s} tok/s" for s in race_model.STRATEGIES]
        + ["winner", "ours/pipeline", "ours/tensor"]
    )
    for link, net in nets.items():
        lines += [
            "",
            f"link {link} ({net.name}: {net.latency_per_layer_s * 1e6:g} us per collective, "
            f"{net.bandwidth_Bps * 8 / 1e9:g} Gb/s)",
        ]
        table = [head]
        rows = [p for p in points if p["link"] == link]
        for key in dict.fromkeys((p["nodes"], p["batch"]) for p in rows):
            group = {p["strategy"]: p for p in rows if (p["nodes"], p["batch"]) == key}
            best = race_model.winner(
                [
                    race_model.RacePoint(**{k: v for k, v in p.items() if k != "link"})
                    for p in group.values()
                ]
            )
            cells = [
                f"{group[s]['tokens_per_s']:.1f}" + ("" if group[s]["fits"] else " (no fit)")
                for s in race_model.STRATEGIES
            ]
            table.append(
                [
                    str(key[0]),
                    str(key[1]),
                    *cells,
                    best.strategy,
                    f"{group['ours']['tokens_per_s'] / group['pipeline']['tokens_per_s']:.2f}x",
                    f"{group['ours']['tokens_per_s'] / group['tensor']['tokens_per_s']:.2f}x",
                ]
            )
        widths = [max(len(r[i]) for r in table) for i in range(len(head))]
        lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in table]
    lines += [
        "",
        "tok/s at B streams is all B together; a collective is paid once per step for all of them.",
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
    fit = getattr(args, "fit", "split")
    if fit == "each":
        out = race_model.check_each(model, hardware, net, rows)
    elif fit == "bandwidth":
        out = race_model.check(model, hardware, net, rows)
    else:
        out = race_model.check_split(model, hardware, net, rows)
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
