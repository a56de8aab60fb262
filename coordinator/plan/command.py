"""`moe-cluster plan`: capacity planning with the performance model (Eq. 1) — the table, JSON, plot,
and `--calibrate` to fit the model to a bench run. Heavy imports (mlx, mlx-lm, matplotlib) are
deferred to the paths that need them, so the CLI starts fast.

This module is the command: its arguments, their checks and what it runs; planner.py computes the
plan's rows and render.py prints them."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import replace

from ...proto.records import KEEPALIVES
from . import expert_cache as cache_model
from . import presets
from . import race as race_model
from .calibration import (
    Calibration,
    _load_json,
    fit,
    parse_bench,
    read_calibration,
    write_calibration,
)
from .link import MEASURED
from .perfmodel import TRANSPORTS, NetworkSpec, PlanError
from .planner import Plan, Settings, cache_plan, load_model, make_plan, misfit_speeds, read_profile
from .render import plan_json, render_cache, render_misfits, render_table

logger = logging.getLogger(__name__)

DEFAULT_HARDWARE = "m2-ultra-192"
DEFAULT_NETWORK = "10gbe"
DEFAULT_NODES = "2,3,4,6,8"


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
    plan = Plan(
        model,
        hardware,
        tuple(networks),
        tuple(rows),
        settings,
        calibration,
        checkpoint_bytes,
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
        out = plan_json(plan)
        if cache_rows:
            out["expert_cache"] = cache_rows
        out["misfits"] = misfits
        print(json.dumps(out))
    else:
        print(render_table(plan))
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
