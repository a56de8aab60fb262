"""The docs' tables made from the presets: the README's "Which to pick" (the race over the link
presets) and docs/plan.md's networks. tests/unit/test_docs.py fails when a page's copy differs
from what these make: regenerate with `python -m moe_cluster.coordinator.plan.tables`."""

from __future__ import annotations

from . import presets
from . import race as race_model
from .perfmodel import HardwareSpec, requantized
from .race_command import _network, race_points

NAMES = {"ours": "this", "by-stream": "this by stream", "pipeline": "pipeline", "tensor": "tensor"}
LINK_NAMES = {"10gbe": "10GbE", "tb-ip": "Thunderbolt IP", "tb5-rdma": "Thunderbolt 5 RDMA"}


def which_to_pick(
    model,
    hardware: HardwareSpec,
    links: list[str],
    nodes=(2, 4),
    streams=(1, 8, 32),
    context: int = 0,
):
    """The README's "Which to pick" table, from the race over the presets, ours over the transport
    that costs each link less: per link and number of users, the winner and its lead over the
    next strategy at each node count ("a / b": 2 Macs / 4 Macs), and after a semicolon who would
    win instead were the link's cost 2x or 0.5x (at either node count)."""
    head = "| link | " + " | ".join(f"{b} user{'s' * (b > 1)}" for b in streams) + " |"
    lines = [head, "|---" * (len(streams) + 1) + "|"]
    for link in links:
        net = _network(link)
        transport = min(("envoy", "mlx"), key=net.latency_s)
        out = race_points(
            model,
            hardware,
            {link: net},
            list(nodes),
            list(streams),
            transport=transport,
            context=context,
        )
        cells = []
        for b in streams:
            wins = []
            for n in nodes:
                group = [
                    race_model.RacePoint(**{k: v for k, v in p.items() if k != "link"})
                    for p in out["points"]
                    if (p["nodes"], p["batch"]) == (n, b)
                ]
                wins.append(race_model.lead(group))
            names = [NAMES[w.strategy] for w, _ in wins]
            if len(set(names)) == 1:
                cell = f"{names[0]} " + " / ".join(f"{by:.2f}×" for _, by in wins)
            else:
                cell = " / ".join(f"{name} {by:.2f}×" for name, (_, by) in zip(names, wins))
            flips = []
            for f in race_model.LINK_FACTORS:
                other = {
                    NAMES[m["winner"]]
                    for m in out["sensitivity"]
                    if (m["batch"], m["link_cost_factor"]) == (b, f)
                } - set(names)
                if other:
                    flips.append(f"{f:g}×: {', '.join(sorted(other))}")
            cells.append(cell + (f"; {', '.join(flips)}" if flips else ""))
        lines.append(
            f"| {LINK_NAMES.get(link, link)} (this over {transport}) | " + " | ".join(cells) + " |"
        )
    return lines


README_LINKS = ["10gbe", "tb-ip", "tb5-rdma"]
README_CONTEXT = 2048  # tokens in each stream's KV cache: a chat a few turns in


def readme_table() -> list[str]:
    """Qwen3-235B-A22B at 4-bit on 2 and 4 M4 Max Mac Studios: the README's case."""
    model = requantized(presets.model_preset("qwen3-235b-a22b"), 4)
    return which_to_pick(
        model, presets.hardware_preset("m4-max-128"), README_LINKS, context=README_CONTEXT
    )


def network_table() -> list[str]:
    """docs/plan.md's table of the network presets: wire, bandwidth, each transport's stack."""

    def us(s: float) -> str:
        return f"{s * 1e6:.3g} µs"

    lines = [
        "| network | wire | bandwidth | envoy's stack | mx.distributed's stack | NIC per node |",
        "|---|---|---|---|---|---|",
    ]
    for name, n in presets.NETWORKS.items():
        lines.append(
            f"| `{name}` | {us(n.wire_latency_s)} | {n.bandwidth_Bps * 8 / 1e9:g} Gb/s | "
            f"{us(n.stack('envoy'))} | {us(n.stack('mlx'))} | "
            + (f"{n.price_per_node_usd:,.0f} USD" if n.price_per_node_usd else "—")
            + " |"
        )
    return lines


if __name__ == "__main__":
    print("\n".join(readme_table()))
    print()
    print("\n".join(network_table()))
