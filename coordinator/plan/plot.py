"""The plan as a picture: predicted tok/s against node count, one line per network, measured points
from a calibration (the paper's Figure 8). Needs matplotlib (`pip install 'moe-cluster[plot]'`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

from .calibration import MeasuredPoint
from .perfmodel import Estimate, PlanError

logger = logging.getLogger(__name__)

# Paper-like styles: triangles for bounds; measured points as filled circles.
_COLORS = {
    "10gbe": "#2ca02c",
    "tb5": "#1f77b4",
    "tb5-rdma": "#9467bd",
    "rocev2": "#ff7f0e",
    "infiniband": "#d62728",
}


class PlotError(PlanError):
    """The plot cannot be drawn (matplotlib missing, unwritable file)."""


def pyplot():
    """matplotlib's pyplot drawing to files (Agg), for every `--plot`; PlotError without it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotError("--plot needs matplotlib: pip install 'moe-cluster[plot]'") from None
    return plt


def plot(
    rows: Sequence[Estimate],
    path: str | Path,
    *,
    title: str,
    subtitle: str = "",
    measured: Sequence[MeasuredPoint] = (),
    measured_label: str = "measured",
) -> Path:
    plt = pyplot()
    path = Path(path)
    fig, ax = plt.subplots(figsize=(8, 5), dpi=150)
    networks = list(dict.fromkeys(r.network for r in rows))
    top = max([r.tokens_per_s for r in rows] + [p.tokens_per_s for p in measured])
    markers: dict[int, list[float]] = {}
    for x, y in [(r.nodes, r.tokens_per_s) for r in rows] + [
        (p.nodes, p.tokens_per_s) for p in measured
    ]:
        markers.setdefault(x, []).append(y)
    labelled: dict[int, list[float]] = {}

    def label(x: int, y: float, color: str, dy: int) -> None:
        # Write a value only where it covers no other marker or label at this node count.
        side = 1 if dy > 0 else -1
        if any(0 < side * (other - y) < 0.07 * top for other in markers.get(x, [])):
            return
        if any(abs(y - other) < 0.05 * top for other in labelled.get(x, [])):
            return
        labelled.setdefault(x, []).append(y)
        ax.annotate(
            f"{y:.1f}",
            (x, y),
            textcoords="offset points",
            xytext=(0, dy),
            ha="center",
            fontsize=7,
            color=color,
        )

    for i, net in enumerate(networks):
        pts = sorted((r for r in rows if r.network == net), key=lambda r: r.nodes)
        color = _COLORS.get(net, f"C{i}")
        xs, ys = [r.nodes for r in pts], [r.tokens_per_s for r in pts]
        ax.plot(xs, ys, "-", color=color, alpha=0.6, linewidth=1.5)
        fit = [r for r in pts if r.fits]
        over = [r for r in pts if not r.fits]
        ax.plot(
            [r.nodes for r in fit],
            [r.tokens_per_s for r in fit],
            "^",
            color=color,
            markersize=8,
            label=f"{net} (Eq. 1 bound)",
        )
        if over:
            ax.plot(
                [r.nodes for r in over],
                [r.tokens_per_s for r in over],
                "^",
                color=color,
                markersize=8,
                markerfacecolor="white",
                label=f"{net}: does not fit in memory",
            )
        for r in pts:
            label(r.nodes, r.tokens_per_s, color, 7)
    if measured:
        ax.plot(
            [p.nodes for p in measured],
            [p.tokens_per_s for p in measured],
            "o",
            color="#1f3b73",
            markersize=7,
            label=measured_label,
        )
        for p in measured:
            label(p.nodes, p.tokens_per_s, "#1f3b73", -12)
    nodes = sorted({r.nodes for r in rows} | {p.nodes for p in measured})
    ax.set_xticks(nodes)
    ax.set_xlabel("nodes")
    ax.set_ylabel("decode tokens / s (one user)")
    ax.set_ylim(0, top * 1.12)
    ax.grid(True, alpha=0.3)
    ax.set_title(title, fontsize=11)
    if subtitle:
        fig.text(0.5, 0.005, subtitle, ha="center", va="bottom", fontsize=7, color="#555555")
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    try:
        fig.savefig(path)
    except OSError as exc:
        raise PlotError(f"cannot write the plot to {path}: {exc}") from exc
    finally:
        plt.close(fig)
    logger.info("wrote %s", path)
    return path
