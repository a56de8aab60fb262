"""`moe-cluster plan`: capacity planning with the performance model (Eq. 1) — the table, JSON, plot,
and `--calibrate` to fit the model to a bench run. Heavy imports (mlx, mlx-lm, matplotlib) are
deferred to the paths that need them, so the CLI starts fast."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ...proto.profile import RoutingProfile, parse_profile
from ...proto.records import KEEPALIVES
from . import presets
from . import expert_cache as cache_model
from . import race as race_model
from .link import MEASURED
from .calibration import (
    Calibration,
    _load_json,
    fit,
    parse_bench,
    read_calibration,
    write_calibration,
)
from .expected import (
    ExpectedExperts,
    expected_experts,
    even_split,
    placement_for,
)
from .perfmodel import (
    Estimate,
    HardwareSpec,
    ModelSpec,
    NetworkSpec,
    TRANSPORTS,
    PlanError,
    estimate,
    requantized,
)

logger = logging.getLogger(__name__)

DEFAULT_HARDWARE = "m2-ultra-192"
DEFAULT_NETWORK = "10gbe"
DEFAULT_NODES = "2,3,4,6,8"
GiB = 1 << 30


def add_arguments(p) -> None:
    p.description = (
        "Predict decode tok/s, memory per node and cost for a MoE model on a cluster of Macs with the "
        "performance model of Chen et al. (RACS '24, Eq. 1). E, the experts the busiest node computes per "
        "MoE layer, is computed from the placement: the max over nodes bounds the step, so keepalive "
        "'none' and 'lru' share E[max] (lru pads every node up to it) and 'busy' computes every local "
        "expert (E = local expert count). See docs/plan.md."
    )
    p.add_argument(
        "--model",
        metavar="PATH|PRESET",
        help="checkpoint folder or config.json of an mlx-lm MoE model, 'demo', a Hugging Face repo "
        "id (org/name[@revision]: its config alone is fetched) or a preset: "
        + ", ".join(presets.MODELS),
    )
    p.add_argument(
        "--hardware",
        metavar="PRESET",
        help=f"node preset (default {DEFAULT_HARDWARE}): " + ", ".join(presets.HARDWARE),
    )
    p.add_argument(
        "--network",
        metavar="PRESET[,PRESET]",
        help=f"network preset(s), comma-separated (default {DEFAULT_NETWORK}): "
        + ", ".join(presets.NETWORKS)
        + "; or measured: the link of a --calibration from `moe-cluster bench link` (the default "
        "with one)",
    )
    p.add_argument(
        "--nodes", metavar="N[,N]", help=f"node counts, comma-separated (default {DEFAULT_NODES})"
    )
    p.add_argument(
        "--expected-experts",
        metavar="E,...",
        help="override E per node count (one value, or one per --nodes entry)",
    )
    p.add_argument(
        "--profile",
        metavar="FILE",
        help="routing profile (moe-cluster profile) for E and hot-expert replication",
    )
    p.add_argument(
        "--replication",
        choices=("none", "auto"),
        default="none",
        help="auto: replicate experts into each node's spare memory (default none)",
    )
    p.add_argument(
        "--keepalive",
        choices=KEEPALIVES,
        default="lru",
        help="none and lru give the same E[max]; busy computes all local experts (default lru)",
    )
    p.add_argument(
        "--batch",
        metavar="B",
        default="1",
        help="sequences decoded together (continuous batching): E becomes the distinct experts of B "
        "tokens and tok/s the aggregate of all B (default 1)",
    )
    p.add_argument(
        "--context",
        metavar="TOKENS",
        default="0",
        help="KV-cache tokens: counted in memory and read per token (default 0: weights only, as the paper)",
    )
    p.add_argument(
        "--price-per-node",
        metavar="USD",
        help="all-in price of one node (default: list price + NIC)",
    )
    p.add_argument(
        "--memory-fraction",
        metavar="FRACTION",
        default="0.75",
        help="share of a node's memory the GPU may use (macOS default wired limit ~0.75)",
    )
    p.add_argument(
        "--stack-latency",
        metavar="SECONDS",
        help="software-stack cost per MoE-layer all-reduce, replacing every network preset's",
    )
    p.add_argument(
        "--bits",
        metavar="N",
        help="quantize a bf16 preset or unquantized checkpoint to this many bits (affine)",
    )
    p.add_argument(
        "--group-size",
        metavar="N",
        default="64",
        help="quantization group size with --bits (default 64)",
    )
    p.add_argument("--calibration", metavar="FILE", help="calibration file from --calibrate")
    p.add_argument(
        "--calibrate",
        metavar="BENCH.json",
        help="fit the model to `moe-cluster bench decode --json` output; writes --out (or stdout)",
    )
    p.add_argument(
        "--out", metavar="FILE", help="with --calibrate: where to write the calibration JSON"
    )
    p.add_argument(
        "--plot", metavar="FILE.png", help="draw tok/s against node count (needs matplotlib)"
    )
    p.add_argument(
        "--expert-cache",
        metavar="PCT[,PCT]",
        help="also predict each node keeping only this share of its experts resident (e.g. 100%%,50%%,25%%), "
        "misses read from its SSD",
    )
    p.add_argument(
        "--skew",
        metavar="Z[,Z]",
        default=None,
        help="routing skew for --expert-cache: Zipf exponents of expert popularity (0 uniform; default 0, "
        "or the calibrated one)",
    )
    p.add_argument(
        "--ssd-bandwidth",
        metavar="BYTES/S",
        help="SSD read bandwidth, replacing the hardware preset's",
    )
    p.add_argument(
        "--race",
        action="store_true",
        help="predict ours against mlx-lm's pipeline and tensor parallelism at batch 1 and at --streams "
        "(docs/race.md)",
    )
    p.add_argument(
        "--link",
        metavar="LINK[,LINK]",
        help="with --race: "
        + ", ".join(race_model.LINKS)
        + " or any network preset (default all three)",
    )
    p.add_argument(
        "--transport",
        choices=TRANSPORTS,
        default="envoy",
        help="ours' collective: the envoy (transport: envoy, the default) or mx.distributed "
        "(transport: mlx); with --race mlx-lm's strategies always run over mx.distributed",
    )
    p.add_argument(
        "--streams",
        metavar="B[,B]",
        default="1,8,32",
        help="with --race: concurrent streams (default 1,8,32)",
    )
    p.add_argument(
        "--check-against",
        metavar="RACE.json",
        help="compare the race model with `bench race --json` rows: fitted on the ours_mlx rows, the "
        "other rows held out; prints each relative miss",
    )
    p.add_argument(
        "--fit",
        choices=("split", "bandwidth", "each"),
        default="split",
        help="with --check-against: on the ours_mlx rows, fit a fixed cost per layer and a cost per "
        "token per layer split into attention, expert passes and ours' own by ours' synced pass "
        "(split, the default); or fit the bandwidth and a fixed cost per layer (bandwidth); or, "
        "for each row kind, a fixed cost per layer and one per token per layer on its rows at its "
        "fewest nodes, the other node counts held out (each)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


# --- parsing --------------------------------------------------------------------------------


def _ints(text: str, flag: str) -> list[int]:
    out = []
    for part in text.split(","):
        try:
            n = int(part.strip())
        except ValueError:
            raise PlanError(f"{flag}: {part.strip()!r} is not a whole number") from None
        if n < 1:
            raise PlanError(f"{flag}: node count {n} must be at least 1")
        out.append(n)
    if len(set(out)) != len(out):
        raise PlanError(f"{flag}: {text!r} repeats a value")
    return out


def _number(
    text: str | None, flag: str, *, minimum: float = 0.0, positive: bool = False
) -> float | None:
    if text is None:
        return None
    try:
        v = float(text)
    except ValueError:
        raise PlanError(f"{flag}: {text!r} is not a number") from None
    if not math.isfinite(v) or v < minimum or (positive and v <= 0):
        raise PlanError(f"{flag}: {text!r} must be {'>' if positive else '>='} {minimum:g}")
    return v


def _floats(text: str, flag: str) -> list[float]:
    return [_number(part.strip(), flag, positive=True) for part in text.split(",")]


def load_model(
    spec: str, bits: int | None = None, group_size: int = 64
) -> tuple[ModelSpec, int | None]:
    """A preset by name, or a checkpoint folder / config.json described with mlx-lm."""
    if bits is not None and bits not in (2, 3, 4, 5, 6, 8):
        raise PlanError(f"--bits {bits}: choose 2, 3, 4, 5, 6 or 8")
    if group_size not in (32, 64, 128):
        raise PlanError(f"--group-size {group_size}: choose 32, 64 or 128")
    if spec in presets.MODELS:
        model = presets.model_preset(spec)
        return (requantized(model, bits, group_size) if bits else model), None
    from ...node.checkpoint import config_folder
    from ...node.hub import parse_repo_id

    path, name = Path(spec).expanduser(), None
    if spec == "demo" or (not path.exists() and parse_repo_id(spec) is not None):
        # a Hugging Face repo: its config and index alone, never its weights
        spec, name = str(config_folder(spec)), spec
    elif not path.exists():
        raise PlanError(
            f"--model {spec!r} is neither a preset ({', '.join(presets.MODELS)}), an existing "
            "path nor a Hugging Face repo id (org/name)"
        )
    from .describe import describe_path  # mlx and mlx-lm: only when a checkpoint is described

    return describe_path(spec, bits=bits, group_size=group_size, name=name)


def read_profile(path: str, model: ModelSpec) -> RoutingProfile:
    try:
        obj = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise PlanError(f"--profile {path}: no such file") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PlanError(f"--profile {path} is not readable JSON: {exc}") from exc
    profile = parse_profile(obj, path)
    if profile.num_experts != model.num_experts or profile.top_k != model.top_k:
        raise PlanError(
            f"--profile {path}: {profile.num_experts} experts top-{profile.top_k}, but {model.name} has "
            f"{model.num_experts} experts top-{model.top_k}"
        )
    stray = sorted(set(profile.layers) - set(model.moe_layer_ids))
    if stray:
        raise PlanError(f"--profile {path}: layers {stray} are not MoE layers of {model.name}")
    missing = len(model.moe_layer_ids) - len(profile.layers)
    if missing:
        logger.warning(
            "--profile %s covers %d of %d MoE layers; the others assume uniform routing",
            path,
            len(profile.layers),
            model.moe_layers,
        )
    return profile


# --- the plan -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    keepalive: str = "lru"
    replication: str = "none"
    context: int = 0
    memory_fraction: float = 0.75
    batch: int = 1
    price_per_node_usd: float | None = None
    transport: str = "envoy"


def replicas_per_node(model: ModelSpec, hardware: HardwareSpec, nodes: int, s: Settings) -> int:
    """Replica slots per node for `--replication auto`: spare memory after the replicated weights,
    the KV cache and the largest even share of experts, in whole experts (every MoE layer)."""
    if s.replication != "auto" or nodes == 1:
        return 0
    own = max(len(es) for es in even_split(model.num_experts, nodes).values())
    spare = (
        hardware.memory_bytes * s.memory_fraction
        - model.replicated_bytes
        - model.kv_cache_bytes(s.context)
        - own * model.expert_bytes
    )
    if spare <= 0:
        return 0
    return min(int(spare // model.expert_bytes), model.num_experts - own)


def expected_for(
    model: ModelSpec,
    nodes: int,
    replicas: int,
    keepalive: str,
    profile: RoutingProfile | None,
    batch: int = 1,
) -> tuple[list[float], list[list[int]], str]:
    """E per MoE layer (for a step of `batch` tokens), experts held per rank per MoE layer, and how
    E was obtained."""
    uniform = placement_for(model.num_experts, nodes, replicas)
    cache: dict[tuple, ExpectedExperts] = {}
    values, slots, methods = [], [], []
    for lid in model.moe_layer_ids:
        layer = profile.layers.get(lid) if profile else None
        placement = (
            placement_for(model.num_experts, nodes, replicas, layer.counts) if layer else uniform
        )
        if layer is not None:
            ee = expected_experts(
                placement, model.num_experts, model.top_k, keepalive, layer.sets, batch
            )
        else:
            key = tuple(tuple(placement[r]) for r in sorted(placement))
            if key not in cache:
                cache[key] = expected_experts(
                    placement, model.num_experts, model.top_k, keepalive, batch=batch
                )
            ee = cache[key]
        values.append(ee.value)
        slots.append([len(placement[r]) for r in range(nodes)])
        methods.append(ee.method)
    distinct = list(dict.fromkeys(methods))
    method = distinct[0] if len(distinct) == 1 else "; ".join(distinct)
    return values, slots, method


def make_plan(
    model: ModelSpec,
    hardware: HardwareSpec,
    networks: list[NetworkSpec],
    nodes: list[int],
    settings: Settings,
    *,
    expected_override: list[float] | None = None,
    profile: RoutingProfile | None = None,
    calibration: Calibration | None = None,
) -> list[Estimate]:
    """Every (network, node count) row of the plan."""
    if expected_override is not None and len(expected_override) not in (1, len(nodes)):
        raise PlanError(
            f"--expected-experts has {len(expected_override)} values for {len(nodes)} node counts "
            f"({','.join(map(str, nodes))}); give one value or one per node count"
        )
    rows = []
    for i, n in enumerate(nodes):
        if n > model.num_experts:
            raise PlanError(
                f"--nodes {n}: more nodes than {model.name}'s {model.num_experts} experts"
            )
        replicas = replicas_per_node(model, hardware, n, settings)
        values, slots, method = expected_for(
            model, n, replicas, settings.keepalive, profile, settings.batch
        )
        per_token = (
            values
            if settings.batch == 1
            else expected_for(model, n, replicas, settings.keepalive, profile)[0]
        )
        if expected_override is not None:
            e = expected_override[0 if len(expected_override) == 1 else i]
            if e > model.num_experts:
                raise PlanError(
                    f"--expected-experts {e} exceeds {model.name}'s {model.num_experts} experts"
                )
            computed = sum(values) / len(values)
            values, method = [e], f"given by --expected-experts (computed: {computed:.3f})"
            per_token = values if settings.batch == 1 else per_token
        for net in networks:
            overheads = None
            if calibration is not None:
                apply = calibration.network in (None, net.name)
                overheads = calibration.overheads(apply_collective=apply)
                if net.name == MEASURED and calibration.link is not None:
                    # the all-reduce measured for a step of this batch, its bytes included, and
                    # the wait beyond it a bench fitted (Calibration.with_link)
                    measured = calibration.link.collective_s(settings.transport, settings.batch)
                    if measured is None:
                        raise PlanError(
                            f"the calibration's link has no {settings.transport} all-reduce "
                            "measured (bench link --transports)"
                        )
                    wait = calibration.collective_base_s or 0.0  # the nodes waiting for each other
                    overheads = replace(
                        overheads, collective_base_s=measured + wait, collective_per_node_s=0.0
                    )
            row = estimate(
                model,
                hardware,
                net,
                n,
                values,
                expert_slots=slots,
                context=settings.context,
                memory_fraction=settings.memory_fraction,
                price_per_node_usd=settings.price_per_node_usd,
                batch=settings.batch,
                token_experts_per_layer=per_token,
                transport=settings.transport,
                **({"overheads": overheads} if overheads is not None else {}),
            )
            rows.append(
                replace(
                    row,
                    extra={
                        "batch": settings.batch,
                        "tokens_per_s_per_sequence": row.tokens_per_s / settings.batch,
                        "expected_experts_method": method,
                        "replicas_per_node": replicas,
                        "experts_per_node_max": max(max(s) for s in slots),
                    },
                )
            )
    return rows


# --- output ---------------------------------------------------------------------------------


def _gib(b: float) -> str:
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


def render_table(
    model: ModelSpec,
    hardware: HardwareSpec,
    networks: list[NetworkSpec],
    rows: list[Estimate],
    settings: Settings,
    calibration: Calibration | None,
    checkpoint_bytes: int | None,
) -> str:
    lines = [
        f"model     {model.name} ({model.weights}): {_gib(model.total_bytes)} = {_gib(model.replicated_bytes)} replicated"
        f" + {model.num_experts} experts x {_gib(model.expert_bytes)}; top-{model.top_k}, "
        f"{model.moe_layers}/{model.layers} MoE layers"
        + (f"; checkpoint {_gib(checkpoint_bytes)}" if checkpoint_bytes else ""),
        f"hardware  {hardware.name}: {_gib(hardware.memory_bytes)}, {hardware.bandwidth_Bps / 1e9:g} GB/s, "
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
    for net in networks:
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
                    _gib(r.memory_per_node_bytes),
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
            f"does not fit in {settings.memory_fraction:.0%} of {_gib(hardware.memory_bytes)} at "
            f"{', '.join(map(str, misfits))} node(s)."
        )
    return "\n".join(lines)


def plan_json(
    model: ModelSpec,
    hardware: HardwareSpec,
    networks: list[NetworkSpec],
    rows: list[Estimate],
    settings: Settings,
    calibration: Calibration | None,
    checkpoint_bytes: int | None,
) -> dict:
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
            "checkpoint_bytes": checkpoint_bytes,
        },
        "hardware": asdict(hardware),
        "networks": [asdict(n) for n in networks],
        "settings": asdict(settings),
        "calibration": calibration.to_json() if calibration else None,
        "rows": [r.to_json() for r in rows],
    }


# --- the command ----------------------------------------------------------------------------


def _calibrate(args) -> Calibration:
    nets = args.network.split(",") if args.network else []
    if len(nets) > 1:
        raise PlanError(
            f"--calibrate: name the one network the bench ran on (got --network {args.network})"
        )
    network = presets.network_preset(nets[0]).name if nets else None
    hardware = presets.hardware_preset(args.hardware).name if args.hardware else None
    raw = _load_json(args.calibrate)
    bench = parse_bench(raw, str(args.calibrate))
    cal = fit(bench, network=network, hardware=hardware)
    cached = sorted({r.get("nodes") for r in raw.get("expert_cache") or () if isinstance(r, dict)})
    fitted = cache_model.calibrate(raw, cached[-1], bench.moe_layers) if cached else None
    if fitted is not None:  # the largest node count with cache rows
        cal = replace(
            cal,
            cache_per_miss_s=fitted["per_miss_s"],
            cache_per_layer_s=fitted["per_layer_s"],
            cache_skew=fitted["skew"],
        )
    if args.out:
        write_calibration(cal, args.out)
    return cal


def main(args) -> int:
    if args.race or args.check_against:
        return _race(args)
    calibration = None
    if args.calibrate:
        if args.calibration:
            raise PlanError("give either --calibrate BENCH.json or --calibration FILE, not both")
        calibration = _calibrate(args)
        if not args.model:
            if args.out and not args.json:
                print(
                    f"wrote {args.out}: BW_eff {calibration.bandwidth_Bps / 1e9:.1f} GB/s, "
                    f"{calibration.layer_overhead_s * 1e6:.1f} us/layer fixed, collective "
                    + (
                        f"{calibration.collective_base_s * 1e6:.0f} us/layer at 2 nodes "
                        f"+ {calibration.collective_per_node_s * 1e6:.0f} us per extra node"
                        if calibration.collective_base_s is not None
                        else "not fitted"
                    )
                    + f", rms error {calibration.residual_rms_s * 1e3:.2f} ms/token"
                )
                for note in calibration.notes:
                    print(f"note: {note}")
            else:
                print(json.dumps(calibration.to_json(), indent=None if args.json else 2))
            return 0
    elif args.out:
        raise PlanError("--out is for --calibrate")
    if not args.model:
        raise PlanError(
            "--model is required (a preset or a checkpoint folder), unless --calibrate is given"
        )
    if args.calibration:
        calibration = read_calibration(args.calibration)

    bits = None
    if args.bits is not None:
        bits = int(_number(args.bits, "--bits", positive=True))
    group_size = int(_number(args.group_size, "--group-size", positive=True))
    model, checkpoint_bytes = load_model(args.model, bits, group_size)
    hardware = presets.hardware_preset(args.hardware or DEFAULT_HARDWARE)
    networks = _networks(args.network, calibration)
    stack = _number(args.stack_latency, "--stack-latency")
    if stack is not None:
        networks = [n.with_stack(stack) for n in networks]
    if calibration is not None and calibration.hardware and calibration.hardware != hardware.name:
        logger.warning(
            "calibration was fitted on %s; planning for %s", calibration.hardware, hardware.name
        )
    nodes = _ints(args.nodes or DEFAULT_NODES, "--nodes")
    batch = _number(args.batch, "--batch", positive=True)
    if batch != int(batch):
        raise PlanError(f"--batch: {args.batch!r} is not a whole number of sequences")
    context = _number(args.context, "--context")
    if context != int(context):
        raise PlanError(f"--context: {args.context!r} is not a whole number of tokens")
    settings = Settings(
        keepalive=args.keepalive,
        replication=args.replication,
        context=int(context),
        batch=int(batch),
        memory_fraction=_number(args.memory_fraction, "--memory-fraction", positive=True),
        price_per_node_usd=_number(args.price_per_node, "--price-per-node", positive=True),
        transport=args.transport,
    )
    if settings.memory_fraction > 1:
        raise PlanError(f"--memory-fraction: {args.memory_fraction!r} must be at most 1")
    override = (
        _floats(args.expected_experts, "--expected-experts") if args.expected_experts else None
    )
    profile = read_profile(args.profile, model) if args.profile else None

    rows = make_plan(
        model,
        hardware,
        networks,
        nodes,
        settings,
        expected_override=override,
        profile=profile,
        calibration=calibration,
    )
    if args.plot:
        from .plot import plot

        measured = calibration.points if calibration else ()
        plot(
            rows,
            args.plot,
            title=f"{model.name} on {hardware.name}: predicted decode throughput",
            subtitle=f"Eq. 1 (Chen et al., RACS '24); keepalive {settings.keepalive}, replication "
            f"{settings.replication}, context {settings.context}"
            + ("; calibrated" if calibration else ""),
            measured=measured,
            measured_label=f"measured ({calibration.network or calibration.transport})"
            if calibration
            else "measured",
        )
    cache_rows = []
    ssd = _number(args.ssd_bandwidth, "--ssd-bandwidth", positive=True) or hardware.ssd_read_Bps
    if args.expert_cache:
        cache_rows = cache_plan(
            model,
            rows,
            _shares(args.expert_cache),
            _skews(args.skew, calibration),
            ssd,
            calibration,
            settings,
        )
    misfits = misfit_speeds(model, rows, _skews(args.skew, calibration), ssd, calibration)
    if args.json:
        out = plan_json(model, hardware, networks, rows, settings, calibration, checkpoint_bytes)
        if cache_rows:
            out["expert_cache"] = cache_rows
        out["misfits"] = misfits
        print(json.dumps(out))
    else:
        print(
            render_table(model, hardware, networks, rows, settings, calibration, checkpoint_bytes)
        )
        for line in render_misfits(misfits):
            print(line)
        if cache_rows:
            print(render_cache(cache_rows))
        if args.plot:
            print(f"plot: {args.plot}")
    return 0


def _networks(names: str | None, calibration: Calibration | None) -> list[NetworkSpec]:
    """--network's presets; `measured` is the link of a calibration from `bench link`, and the
    default where the calibration has one."""
    measured = calibration.link.network() if calibration and calibration.link else None
    out = []
    for name in (names or (MEASURED if measured else DEFAULT_NETWORK)).split(","):
        name = name.strip()
        if name == MEASURED:
            if measured is None:
                raise PlanError(
                    "--network measured needs --calibration FILE written by `moe-cluster bench link`"
                )
            out.append(measured)
        else:
            out.append(presets.network_preset(name))
    return out


def _race(args) -> int:
    """`--race` or `--check-against` (plan/race_command.py), on arguments parsed as the plan's."""
    from .race_command import main as race_main

    if not args.model:
        raise PlanError("--race and --check-against need --model (a preset or a checkpoint folder)")
    bits = int(_number(args.bits, "--bits", positive=True)) if args.bits is not None else None
    model, _ = load_model(
        args.model, bits, int(_number(args.group_size, "--group-size", positive=True))
    )
    hardware = presets.hardware_preset(args.hardware or DEFAULT_HARDWARE)
    return race_main(
        args,
        model,
        hardware,
        _ints(args.nodes or DEFAULT_NODES, "--nodes"),
        _ints(args.streams, "--streams"),
        _number(args.memory_fraction, "--memory-fraction", positive=True),
        _number(args.stack_latency, "--stack-latency"),
    )


def _shares(text: str) -> list[float]:
    from ...proto.expert_cache import ExpertCacheSpec

    out = []
    for part in text.split(","):
        spec = ExpertCacheSpec.parse(part.strip())
        if spec.mode != "fraction":
            raise PlanError(
                f"--expert-cache takes percents of each node's experts, e.g. 100%,50%,25% (got {part!r})"
            )
        out.append(spec.value)
    return out


def _skews(text: str | None, calibration: Calibration | None) -> list[float]:
    if text is None:
        return [
            calibration.cache_skew if calibration and calibration.cache_skew is not None else 0.0
        ]
    return [_number(z.strip(), "--skew") for z in text.split(",")]


def _miss_cost(
    model: ModelSpec, ssd_Bps: float, calibration: Calibration | None
) -> tuple[cache_model.MissCost, str]:
    """What one expert-cache miss costs, and where that figure comes from."""
    if calibration is not None and calibration.cache_per_miss_s is not None:
        return cache_model.MissCost(
            calibration.cache_per_miss_s, calibration.cache_per_layer_s
        ), "calibrated"
    if ssd_Bps > 0:
        return cache_model.ssd_miss_cost(_per_expert(model), ssd_Bps), f"SSD {ssd_Bps / 1e9:g} GB/s"
    raise PlanError(
        "--expert-cache needs the SSD's read bandwidth: this hardware preset has none; "
        "pass --ssd-bandwidth or a --calibration with an expert cache fit"
    )


def _per_expert(model: ModelSpec) -> float:
    return sum(model.expert_layer_bytes) / model.moe_layers  # bytes, one expert of one layer


def _cached_row(
    model: ModelSpec, r: Estimate, share: float, z: float, cost: cache_model.MissCost, source: str
) -> dict:
    """Plan row `r` with each node keeping `share` of its experts resident (plan/expert_cache.py)."""
    local = math.ceil(model.num_experts / r.nodes)  # the busiest node's experts per layer
    p = cache_model.predict(
        r.time_s, r.expected_experts * model.moe_layers, share, local, z, cost, model.moe_layers
    )
    memory = r.memory_per_node_bytes - int((1 - share) * r.expert_shard_bytes)
    return {
        "nodes": r.nodes,
        "network": r.network,
        "expert_cache": f"{share:.0%}",
        "skew": z,
        "hit_rate": p["hit_rate"],
        "misses_per_token": p["misses_per_token"],
        "disk_bytes_per_token": p["misses_per_token"] * _per_expert(model),
        "disk_s": p["disk_s"],
        "tokens_per_s": p["tokens_per_s"],
        "memory_per_node_bytes": memory,
        "fits": memory <= r.usable_memory_bytes,
        "miss_cost": source,
    }


def cache_plan(
    model: ModelSpec,
    rows: list[Estimate],
    shares: list[float],
    skews: list[float],
    ssd_Bps: float,
    calibration: Calibration | None,
    settings: Settings,
) -> list[dict]:
    """Each plan row again with each node keeping `share` of its experts resident, per routing skew:
    hit rate, bytes read from disk per token, tok/s and memory (plan/expert_cache.py)."""
    cost, source = _miss_cost(model, ssd_Bps, calibration)
    return [
        _cached_row(model, r, share, z, cost, source)
        for r in rows
        for share in shares
        for z in skews
    ]


def misfit_speeds(
    model: ModelSpec,
    rows: list[Estimate],
    skews: list[float],
    ssd_Bps: float,
    calibration: Calibration | None,
) -> list[dict]:
    """Rows whose nodes cannot hold their share of the experts, as `placement.expert_cache: auto`
    serves them: each node keeps what its usable memory holds after the replicated weights and the
    KV cache (at least one expert per layer) and reads the rest from disk. The expected tok/s per
    skew (plan/expert_cache.py), or why no cache helps (the rest alone does not fit)."""
    out = []
    for r in (r for r in rows if not r.fits):
        room = r.usable_memory_bytes - (r.memory_per_node_bytes - r.expert_shard_bytes)
        local = math.ceil(model.num_experts / r.nodes)
        if room <= 0 or not r.expert_shard_bytes:
            out.append(
                {
                    "nodes": r.nodes,
                    "network": r.network,
                    "servable": False,
                    "memory_without_experts_bytes": r.memory_per_node_bytes - r.expert_shard_bytes,
                    "usable_memory_bytes": r.usable_memory_bytes,
                }
            )
            continue
        slots = max(
            1, min(local, math.floor(room / r.expert_shard_bytes * local))
        )  # as ExpertCacheSpec sizes them
        share = slots / local
        try:
            cost, source = _miss_cost(model, ssd_Bps, calibration)
        except PlanError:
            cost, source = (
                None,
                "unknown: this hardware preset has no SSD bandwidth (--ssd-bandwidth)",
            )
        for z in skews:
            row = {
                "nodes": r.nodes,
                "network": r.network,
                "servable": True,
                "resident_share": share,
                "resident_experts": slots,
                "local_experts": local,
                "skew": z,
                "full_tokens_per_s": r.tokens_per_s,
                "miss_cost": source,
                "memory_per_node_bytes": r.memory_per_node_bytes,
                "usable_memory_bytes": r.usable_memory_bytes,
            }
            if cost is not None:
                cached = _cached_row(model, r, share, z, cost, source)
                row.update(
                    {k: cached[k] for k in ("hit_rate", "disk_bytes_per_token", "tokens_per_s")}
                )
            out.append(row)
    return out


def _kept(m: dict) -> str:
    return f"{m['resident_experts']} of its {m['local_experts']} experts per layer resident ({m['resident_share']:.0%})"


def render_misfits(rows: list[dict]) -> list[str]:
    """The warning for rows that do not fit: what `expert_cache: auto` would keep, and its tok/s."""
    lines = []
    for m in rows:
        head = (
            (
                f"at {m['nodes']} node{'s' * (m['nodes'] > 1)} ({m['network']}) a node needs "
                f"{_gib(m['memory_per_node_bytes'])}, has {_gib(m['usable_memory_bytes'])}: "
            )
            if m["servable"]
            else f"at {m['nodes']} node{'s' * (m['nodes'] > 1)} ({m['network']}) "
        )
        if not m["servable"]:
            lines.append(
                head + f"the replicated weights and KV cache alone need "
                f"{_gib(m['memory_without_experts_bytes'])} of {_gib(m['usable_memory_bytes'])}; "
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
            _gib(r["memory_per_node_bytes"]),
            "yes" if r["fits"] else "NO",
        ]
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines = ["", f"expert cache (misses read from disk; cost per miss: {rows[0]['miss_cost']})"]
    return "\n".join(lines + ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in table])
