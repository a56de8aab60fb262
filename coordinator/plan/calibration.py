"""Fit Eq. 1's overheads to a real cluster from `moe-cluster bench decode --json` output.

Fitted form, per decoded token on N nodes (bytes and E from the bench):

    compute(N) = [(R + X · E_N) / BW_eff + layers · o] · s_N   attention_router + experts + other
    comm(N)    = moe_layers · (a + b · (N − 2))   for N ≥ 2    collective_wait (0 on one node)

s_N = max(1, nodes per host / cores per host): nodes that share a host share its cores (a local
test cluster); one node per Mac gives s = 1.

R = replicated bytes read per token, X = one expert summed over the MoE layers, E_N = the
measured mean experts computed per node per MoE layer (max over nodes). Least squares gives
BW_eff (effective memory bandwidth) and o (fixed compute cost per decoder layer: kernel launches,
the host sync on the routing, sampling folded in) from every cluster including N = 1, and a
(per-layer collective cost at 2 nodes: software stack + wire + transfer as measured) and b (its
growth per extra node) from the N ≥ 2 clusters. Coefficients are kept non-negative; with a
single distinct point a term that cannot be separated is set to 0 and the fit says so.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Sequence

from .link import LinkFit, parse_link
from .perfmodel import Overheads, PlanError
from ...proto.errors import UserError

logger = logging.getLogger(__name__)

FORMAT = "moe-cluster-calibration/1"


class CalibrationError(UserError):
    """A bench or calibration file that cannot be used, naming the file and the field."""


@dataclass(frozen=True)
class BenchCluster:
    nodes: int
    keepalive: str
    transport: str
    generation_tps: float
    time_per_token_s: float
    expected_experts: float
    attention_router_s: float
    experts_s: float
    collective_wait_s: float
    other_s: float
    nodes_per_host: int = 1  # node processes that shared one host during the bench

    @property
    def compute_s(self) -> float:
        return self.attention_router_s + self.experts_s + self.other_s


@dataclass(frozen=True)
class Bench:
    model: str
    replicated_read_bytes: int
    expert_bytes: int  # one expert summed over the MoE layers
    layers: int
    moe_layers: int
    hidden: int
    dtype_bytes: int
    clusters: tuple[BenchCluster, ...]
    host_cores: int = 0  # CPU cores of the bench host (0: unknown, no sharing assumed)

    def share(self, nodes_per_host: int) -> float:
        """How much slower compute runs when `nodes_per_host` node processes share the host."""
        return max(1.0, nodes_per_host / self.host_cores) if self.host_cores else 1.0


@dataclass(frozen=True)
class MeasuredPoint:
    nodes: int
    tokens_per_s: float
    keepalive: str
    transport: str
    expected_experts: float


@dataclass(frozen=True)
class Calibration:
    model: str  # "" where nothing of a model was fitted (a link alone)
    bandwidth_Bps: float | None  # None: not fitted (a link alone): the hardware's
    layer_overhead_s: float
    collective_base_s: float | None  # None: the bench had no cluster of 2 nodes or more
    collective_per_node_s: float
    transport: str
    network: str | None  # network preset the bench ran on (given when calibrating)
    hardware: str | None
    residual_rms_s: float  # of the fitted time per token against the measured one
    points: tuple[MeasuredPoint, ...]
    notes: tuple[str, ...] = ()
    # the expert cache (plan/expert_cache.py), fitted to the bench's --expert-cache rows; None: not fitted
    cache_per_miss_s: float | None = None
    cache_per_layer_s: float = 0.0
    cache_skew: float | None = None
    # the link `bench link` measured between the cluster's nodes (plan/link.py); None: not measured
    link: LinkFit | None = None

    def overheads(self, apply_collective: bool) -> Overheads:
        return Overheads(
            bandwidth_Bps=self.bandwidth_Bps,
            layer_overhead_s=self.layer_overhead_s,
            collective_base_s=self.collective_base_s if apply_collective else None,
            collective_per_node_s=self.collective_per_node_s,
        )

    def to_json(self) -> dict:
        d = asdict(self)
        d["points"] = [asdict(p) for p in self.points]
        d["notes"] = list(self.notes)
        d["link"] = self.link.to_json() if self.link is not None else None
        return {"format": FORMAT, **d}

    def with_link(self, link: LinkFit) -> "Calibration":
        """This calibration with a measured link, for the network `measured`. The collective a
        bench fitted is its nodes' wait per MoE layer: the all-reduce over the bench's own link
        (loopback: the `loopback` preset's stack, measured by `bench allreduce`) and the nodes
        waiting for each other (on one host sharing its cores, most of it). The all-reduce is
        taken out and the wait kept (`collective_base_s`, added to the link's all-reduce)."""
        from .link import MEASURED
        from .presets import network_preset

        notes, wait = self.notes, None
        if self.collective_base_s is not None:
            transports = [t for t in self.transport.split(",") if t in ("envoy", "mlx")]
            own = network_preset("loopback").latency_s(transports[0]) if transports else 0.0
            wait = max(0.0, self.collective_base_s - own)
            notes += (
                f"the bench's collective ({self.collective_base_s * 1e6:.0f} us per MoE layer at 2 "
                f"nodes) less its own all-reduce over loopback ({own * 1e6:.0f} us): {wait * 1e6:.0f}"
                " us of nodes waiting for each other, added to the measured link's all-reduce",
            )
        return replace(
            self,
            link=link,
            network=MEASURED,
            collective_base_s=wait,
            collective_per_node_s=0.0,
            notes=notes,
        )


def link_only(link: LinkFit) -> Calibration:
    """A calibration of a link alone: the compute side stays the hardware preset's."""
    return Calibration(
        model="",
        bandwidth_Bps=None,
        layer_overhead_s=0.0,
        collective_base_s=None,
        collective_per_node_s=0.0,
        transport=",".join(sorted({a.transport for a in link.allreduce})),
        network=None,
        hardware=None,
        residual_rms_s=0.0,
        points=(),
        notes=("a link alone: compute from the hardware preset",),
        link=link,
    )


# --- reading --------------------------------------------------------------------------------


def _get(obj: Any, key: str, kind, where: str):
    if not isinstance(obj, dict) or key not in obj:
        raise CalibrationError(f"{where}: missing field {key!r}")
    v = obj[key]
    if kind is float and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    if not isinstance(v, kind) or isinstance(v, bool):
        raise CalibrationError(f"{where}: field {key!r} should be {kind.__name__}, got {v!r}")
    if kind in (int, float) and (v < 0 or (kind is float and not math.isfinite(v))):
        raise CalibrationError(f"{where}: field {key!r} must be a finite number >= 0, got {v!r}")
    return v


def parse_bench(obj: Any, where: str = "bench") -> Bench:
    """Check a `bench decode --json` object (unknown fields are ignored: the bench may grow)."""
    mb = _get(obj, "model_bytes", dict, where)
    w = f"{where}: model_bytes"
    clusters = []
    raw = _get(obj, "clusters", list, where)
    if not raw:
        raise CalibrationError(f"{where}: 'clusters' is empty; nothing to fit")
    for i, c in enumerate(raw):
        cw = f"{where}: clusters[{i}]"
        b = _get(c, "breakdown_s", dict, cw)
        nodes = _get(c, "nodes", int, cw)
        if nodes < 1:
            raise CalibrationError(f"{cw}: nodes must be >= 1, got {nodes}")
        clusters.append(
            BenchCluster(
                nodes=nodes,
                keepalive=_get(c, "keepalive", str, cw),
                transport=_get(c, "transport", str, cw),
                generation_tps=_get(c, "generation_tps", float, cw),
                time_per_token_s=_get(c, "time_per_token_s", float, cw),
                expected_experts=_get(c, "expected_experts", float, cw),
                attention_router_s=_get(b, "attention_router", float, f"{cw}.breakdown_s"),
                experts_s=_get(b, "experts", float, f"{cw}.breakdown_s"),
                collective_wait_s=_get(b, "collective_wait", float, f"{cw}.breakdown_s"),
                other_s=_get(b, "other", float, f"{cw}.breakdown_s"),
                nodes_per_host=int(c.get("nodes_per_host", 1)),
            )
        )
    bench = Bench(
        model=_get(obj, "model", str, where),
        replicated_read_bytes=_get(mb, "replicated_read_per_token", int, w),
        expert_bytes=_get(mb, "expert", int, w),
        layers=_get(mb, "layers", int, w),
        moe_layers=_get(mb, "moe_layers", int, w),
        hidden=_get(mb, "hidden", int, w),
        dtype_bytes=_get(mb, "dtype_bytes", int, w),
        clusters=tuple(clusters),
        host_cores=int((obj.get("host") or {}).get("cores", 0)),
    )
    if bench.layers < 1 or bench.moe_layers < 1:
        raise CalibrationError(
            f"{where}: layers ({bench.layers}) and moe_layers ({bench.moe_layers}) must be >= 1"
        )
    return bench


def read_bench(path: str | Path) -> Bench:
    return parse_bench(_load_json(path), str(path))


def _load_json(path: str | Path) -> Any:
    p = Path(path)
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        raise CalibrationError(f"{p}: no such file") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CalibrationError(f"{p} is not readable JSON: {exc}") from exc


_CAL_FIELDS = {
    "format",
    "model",
    "bandwidth_Bps",
    "layer_overhead_s",
    "collective_base_s",
    "collective_per_node_s",
    "transport",
    "network",
    "hardware",
    "residual_rms_s",
    "points",
    "notes",
    "cache_per_miss_s",
    "cache_per_layer_s",
    "cache_skew",
    "link",
}


def parse_calibration(obj: Any, where: str = "calibration") -> Calibration:
    """Strict: this file is ours, so unknown fields are errors."""
    if not isinstance(obj, dict):
        raise CalibrationError(f"{where}: expected a JSON object")
    unknown = sorted(set(obj) - _CAL_FIELDS)
    if unknown:
        raise CalibrationError(f"{where}: unknown field(s) {', '.join(unknown)}")
    if obj.get("format") != FORMAT:
        raise CalibrationError(f"{where}: format is {obj.get('format')!r}, expected {FORMAT!r}")
    base = obj.get("collective_base_s")
    if base is not None:
        base = _get(obj, "collective_base_s", float, where)
    points = []
    for i, p in enumerate(_get(obj, "points", list, where)):
        pw = f"{where}: points[{i}]"
        points.append(
            MeasuredPoint(
                _get(p, "nodes", int, pw),
                _get(p, "tokens_per_s", float, pw),
                _get(p, "keepalive", str, pw),
                _get(p, "transport", str, pw),
                _get(p, "expected_experts", float, pw),
            )
        )
    bw = None
    if obj.get("bandwidth_Bps") is not None or "bandwidth_Bps" not in obj:
        bw = _get(obj, "bandwidth_Bps", float, where)
        if bw <= 0:
            raise CalibrationError(f"{where}: bandwidth_Bps must be > 0, got {bw}")
    link = None
    if obj.get("link") is not None:
        try:
            link = parse_link(obj["link"], f"{where}: link", _get)
        except PlanError as exc:
            raise CalibrationError(str(exc)) from None
    optional = {k: obj.get(k) for k in ("network", "hardware")}
    for k, v in optional.items():
        if v is not None and not isinstance(v, str):
            raise CalibrationError(f"{where}: field {k!r} should be a string or null, got {v!r}")
    return Calibration(
        model=_get(obj, "model", str, where),
        bandwidth_Bps=bw,
        layer_overhead_s=_get(obj, "layer_overhead_s", float, where),
        collective_base_s=base,
        collective_per_node_s=_get(obj, "collective_per_node_s", float, where),
        transport=_get(obj, "transport", str, where),
        network=optional["network"],
        hardware=optional["hardware"],
        residual_rms_s=_get(obj, "residual_rms_s", float, where),
        points=tuple(points),
        notes=tuple(str(n) for n in obj.get("notes", [])),
        cache_per_miss_s=_get(obj, "cache_per_miss_s", float, where)
        if obj.get("cache_per_miss_s") is not None
        else None,
        cache_per_layer_s=_get(obj, "cache_per_layer_s", float, where)
        if "cache_per_layer_s" in obj
        else 0.0,
        cache_skew=_get(obj, "cache_skew", float, where)
        if obj.get("cache_skew") is not None
        else None,
        link=link,
    )


def read_calibration(path: str | Path) -> Calibration:
    return parse_calibration(_load_json(path), str(path))


# --- fitting --------------------------------------------------------------------------------


def _line_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float] | None:
    """Least-squares slope and intercept; None when the xs do not vary."""
    n = len(xs)
    mx_, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx_) ** 2 for x in xs)
    if sxx <= 1e-30 * max(1.0, mx_ * mx_):
        return None
    slope = sum((x - mx_) * (y - my) for x, y in zip(xs, ys)) / sxx
    return slope, my - slope * mx_


def _through_origin(xs: Sequence[float], ys: Sequence[float]) -> float:
    return sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)


def fit(bench: Bench, *, network: str | None = None, hardware: str | None = None) -> Calibration:
    """Fit BW_eff, o, a and b (module docstring) to a bench run."""
    notes: list[str] = []
    cs = bench.clusters
    bytes_read = [bench.replicated_read_bytes + bench.expert_bytes * c.expected_experts for c in cs]
    if not any(bytes_read):
        raise CalibrationError(
            f"bench of {bench.model}: zero bytes read per token; model_bytes look empty"
        )
    compute = [c.compute_s / bench.share(c.nodes_per_host) for c in cs]
    line = _line_fit(bytes_read, compute)
    if line is not None and line[0] > 0 and line[1] >= 0:
        inv_bw, fixed = line
    else:
        inv_bw, fixed = _through_origin(bytes_read, compute), 0.0
        notes.append(
            "per-layer overhead not separable from bandwidth (one distinct bytes-per-token "
            "or a negative fit); set to 0"
        )
    if inv_bw <= 0:
        raise CalibrationError(
            f"bench of {bench.model}: compute time does not grow with bytes read; cannot fit bandwidth"
        )

    multi = [c for c in cs if c.nodes >= 2]
    if len({c.transport for c in multi}) > 1:
        raise CalibrationError(
            f"bench of {bench.model}: clusters of 2 or more nodes over several transports "
            f"({', '.join(sorted({c.transport for c in multi}))}) have different collective costs; "
            "fit one transport at a time (bench decode --calibrate fits each)"
        )
    base = per_node = None
    if multi:
        xs = [float(c.nodes - 2) for c in multi]
        ys = [c.collective_wait_s / bench.moe_layers for c in multi]
        line = _line_fit(xs, ys)
        if line is not None and line[0] >= 0 and line[1] >= 0:
            per_node, base = line
        else:
            per_node, base = 0.0, sum(ys) / len(ys)
            if line is not None:
                notes.append("collective cost did not grow with node count; fitted as constant")
            else:
                notes.append("one node count of 2 or more: collective growth per node set to 0")
    else:
        notes.append("no cluster of 2 or more nodes: collective cost not fitted")

    transports = sorted({c.transport for c in multi}) or sorted({c.transport for c in cs})
    by_parts = (inv_bw, fixed / bench.layers, base, per_node or 0.0)
    by_totals = _fit_totals(bench)
    if (
        by_totals is not None
        and _worst_error(bench, by_totals) < _worst_error(bench, by_parts) - 1e-9
    ):
        notes.append(
            "fitted on whole tokens, not on the timed parts: the parts' split did not fit (a collective "
            "inside the step's graph has no timer of its own; on a GPU the host waits for the whole "
            "layer in whichever part syncs first)"
        )
        inv_bw, layer_o, base, per_node = by_totals
        base = base if multi else None
    else:
        layer_o = fixed / bench.layers
    cal = Calibration(
        model=bench.model,
        bandwidth_Bps=1.0 / inv_bw,
        layer_overhead_s=layer_o,
        collective_base_s=base,
        collective_per_node_s=per_node or 0.0,
        transport=",".join(transports),
        network=network,
        hardware=hardware,
        residual_rms_s=0.0,
        points=tuple(
            MeasuredPoint(c.nodes, c.generation_tps, c.keepalive, c.transport, c.expected_experts)
            for c in cs
        ),
        notes=tuple(notes),
    )
    predicted = [
        predict_time(cal, bench, c.nodes, c.expected_experts, c.nodes_per_host) for c in cs
    ]
    rms = math.sqrt(sum((p - c.time_per_token_s) ** 2 for p, c in zip(predicted, cs)) / len(cs))
    logger.info(
        "calibration of %s: BW_eff %.3g B/s, o %.3g s/layer, a %s s/layer, b %.3g s/layer/node, rms %.3g s",
        bench.model,
        cal.bandwidth_Bps,
        cal.layer_overhead_s,
        base,
        cal.collective_per_node_s,
        rms,
    )
    return replace(cal, residual_rms_s=rms)


def _terms(bench: Bench, c: BenchCluster) -> list[float]:
    """The fitted form's time per token of `c`, as coefficients of (1/BW, o, a, b)."""
    s = bench.share(c.nodes_per_host)
    multi = c.nodes >= 2
    return [
        s * (bench.replicated_read_bytes + bench.expert_bytes * c.expected_experts),
        s * bench.layers,
        bench.moe_layers * multi,
        bench.moe_layers * (c.nodes - 2) * multi,
    ]


def _fit_totals(bench: Bench) -> tuple[float, float, float, float] | None:
    """(1/BW, o, a, b) >= 0 by least squares on each cluster's whole time per token, relative to it
    (every point weighs alike): the best over every subset of free coefficients (four: sixteen small
    solves), the others held at 0. None when no subset gives a positive bandwidth."""
    import itertools

    import numpy as np

    cs = bench.clusters
    A = np.array([[x / c.time_per_token_s for x in _terms(bench, c)] for c in cs])
    y = np.ones(len(cs))
    best, best_err = None, math.inf
    for k in range(1, 5):
        for free in itertools.combinations(range(4), k):
            if 0 not in free or not A[:, list(free)].any(axis=0).all():
                continue
            sol, *_ = np.linalg.lstsq(A[:, list(free)], y, rcond=None)
            if (sol < 0).any() or sol[0] <= 0:
                continue
            x = np.zeros(4)
            x[list(free)] = sol
            err = float(np.abs(A @ x - y).max())
            if err < best_err - 1e-12:
                best, best_err = tuple(float(v) for v in x), err
    return best


def _worst_error(bench: Bench, coeffs: tuple) -> float:
    """The largest |predicted / measured − 1| of time per token over the bench's clusters."""
    inv_bw, o, a, b = (0.0 if v is None else v for v in coeffs)
    return max(
        abs(
            sum(t * v for t, v in zip(_terms(bench, c), (inv_bw, o, a, b))) / c.time_per_token_s
            - 1.0
        )
        for c in bench.clusters
    )


def predict_time(
    cal: Calibration, bench: Bench, nodes: int, expected_experts: float, nodes_per_host: int = 1
) -> float:
    """The fitted form's time per token for a bench's model (compute side + collective)."""
    t = (bench.replicated_read_bytes + bench.expert_bytes * expected_experts) / cal.bandwidth_Bps
    t += cal.layer_overhead_s * bench.layers
    t *= bench.share(nodes_per_host)
    if nodes >= 2 and cal.collective_base_s is not None:
        t += bench.moe_layers * max(
            0.0, cal.collective_base_s + cal.collective_per_node_s * (nodes - 2)
        )
    return t


def write_calibration(cal: Calibration, path: str | Path) -> None:
    Path(path).write_text(json.dumps(cal.to_json(), indent=2) + "\n")
