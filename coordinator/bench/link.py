"""`moe-cluster bench link`: the link between the running nodes of a cluster.yaml, measured by
the nodes themselves over their own path, both ways, and what `plan` advises once it knows it.

Run from the coordinator against the node agents (`moe-cluster node`, `launch: remote`, the
cluster secret authenticating every call). For each ordered pair of nodes, the second listens
and the first probes it: round trips at the payloads one MoE layer sends (1 and 32 tokens of
the model's hidden size, in its activations' dtype: bfloat16 for bfloat16 and quantized
checkpoints) and a bulk transfer. Then every node at once times the
all-reduce among them over the envoy and over mx.distributed's ring. The result is a calibration
(plan/calibration.py, its `link`) that `plan --calibration` reads: the measured link becomes the
network `measured`. With `--calibration BASE` (from `plan --calibrate`) the base's compute fit is
kept and the link added.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

from ...proto.errors import UserError

TOKENS = (1, 32)  # the payloads one MoE layer sends: one token, and a batch of 32
DTYPE_OF = {2: "bfloat16", 4: "float32"}  # the activations' bytes per value -> the dtype sent
DEFAULT_TRANSFER = 64 << 20  # bytes: a shard's worth of streaming, at most a second on 10GbE


def add_arguments(p) -> None:
    p.add_argument(
        "file", nargs="?", default="cluster.yaml", help="the cluster.yaml (launch: remote)"
    )
    p.add_argument(
        "--out", default="link-calibration.json", help="where to write the calibration JSON"
    )
    p.add_argument(
        "--calibration",
        metavar="BASE.json",
        help="a calibration from `plan --calibrate` to extend: its compute fit is kept",
    )
    p.add_argument("--iters", type=int, default=200, help="round trips and all-reduces per size")
    p.add_argument(
        "--transfer",
        type=int,
        default=DEFAULT_TRANSFER,
        metavar="BYTES",
        help=f"bytes of the bulk transfer each way (default {DEFAULT_TRANSFER >> 20} MiB)",
    )
    p.add_argument(
        "--transports",
        default="envoy,mlx",
        help="the all-reduces to time, of envoy and mlx (mx.distributed's ring)",
    )
    p.add_argument(
        "--hardware",
        metavar="PRESET",
        help="the nodes' hardware preset for the advice (default plan's); compute comes from "
        "--calibration's fit where it has one",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds for each measurement")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _p50(xs) -> float:
    return statistics.median(xs)


async def measure(c, args, hidden: int, act_bytes: int, secret: str):
    """The LinkFit of the nodes of `c`, measured by them."""
    from ..plan.link import AllReduce, LinkFit, RoundTrip, Transfer
    from ..serve.client import NodeClient
    from ..serve.config import tls_files
    from ..serve.discover import remote_members
    from ...proto.link import LinkAllReduceSpec, LinkProbeSpec
    from ...proto.transport import EnvoySpec, MlxSpec

    found = await remote_members(c)
    tls = tls_files(c)
    clients = [
        NodeClient(
            name,
            addr,
            secret,
            tls_ca=tls.ca if tls else None,
            tls_cert=tls.cert if tls else None,
            tls_key=tls.key if tls else None,
        )
        for name, addr, _ in found
    ]
    names = [name for name, _, _ in found]
    hosts = [host for _, _, host in found]
    sizes = tuple(t * hidden * act_bytes for t in TOKENS)
    trips, transfers, ports = [], [], {}
    try:
        for i, src in enumerate(clients):
            for j, dst in enumerate(clients):
                if i == j:
                    continue
                listen = await dst.link_listen()
                ports[j] = listen.free_ports
                got = await src.link_probe(
                    LinkProbeSpec(
                        f"{hosts[j]}:{listen.port}", listen.token, sizes, args.iters, args.transfer
                    ),
                    timeout=args.timeout,
                )
                for size, seconds in got.round_trips:
                    trips.append(RoundTrip(names[i], names[j], size, _p50(seconds), min(seconds)))
                if got.transfer_bytes:
                    transfers.append(
                        Transfer(names[i], names[j], got.transfer_bytes, got.transfer_s)
                    )
                _say(args, f"{names[i]} -> {names[j]}: " + _trips_line(trips[-len(sizes) :]))
        reduces = []
        for transport in _transports(args.transports):
            specs = [
                EnvoySpec(
                    tuple(f"{h}:{ports[r][0]}" for r, h in enumerate(hosts)),
                    listen=f"0.0.0.0:{ports[rank][0]}",
                    tls=tls,  # each node's own TLS files where the cluster has TLS
                )
                if transport == "envoy"
                else MlxSpec(tuple((f"{h}:{ports[r][1]}",) for r, h in enumerate(hosts)))
                for rank in range(len(clients))
            ]
            got = await asyncio.gather(
                *(
                    cl.link_allreduce(
                        LinkAllReduceSpec(
                            specs[rank],
                            rank,
                            hidden,
                            TOKENS,
                            args.iters,
                            20,
                            args.timeout,
                            DTYPE_OF[act_bytes],
                        ),
                        timeout=args.timeout + 30,
                    )
                    for rank, cl in enumerate(clients)
                )
            )
            for tokens in TOKENS:
                pooled = sorted(
                    s for r in got for t, seconds in r.times if t == tokens for s in seconds
                )
                reduces.append(
                    AllReduce(
                        transport, tokens, _p50(pooled), pooled[int(0.99 * (len(pooled) - 1))]
                    )
                )
            _say(
                args,
                f"all-reduce over {transport}: "
                + ", ".join(
                    f"{a.tokens} token(s) {a.p50_s * 1e6:.0f} us" for a in reduces[-len(TOKENS) :]
                ),
            )
    finally:
        for cl in clients:
            await cl.close()
    date = datetime.date.today().isoformat()
    return LinkFit(
        tuple(names), hidden, act_bytes, date, tuple(trips), tuple(transfers), tuple(reduces)
    )


async def _measured(c, args, hidden: int, act_bytes: int, secret: str):
    """`measure`, a failed call to a node one line naming the call (not a traceback)."""
    import grpc

    from ..serve.client import ClusterError, describe_rpc_error

    try:
        return await measure(c, args, hidden, act_bytes, secret)
    except grpc.RpcError as exc:
        raise ClusterError(f"bench link: a node's call failed: {describe_rpc_error(exc)}") from None


def _transports(text: str) -> list[str]:
    from ..plan.perfmodel import TRANSPORTS

    out = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in out if t not in TRANSPORTS]
    if bad or not out:
        raise UserError(f"--transports: {text!r}; choose from {', '.join(TRANSPORTS)}")
    return out


def _trips_line(trips) -> str:
    return ", ".join(
        f"round trip {r.payload_bytes} B {r.p50_s * 1e6:.0f} us (min {r.min_s * 1e6:.0f})"
        for r in trips
    )


def _say(args, line: str) -> None:
    print(line, file=sys.stderr if args.json else sys.stdout, flush=True)


def main(args) -> int:
    from ..plan.calibration import link_only, read_calibration, write_calibration
    from ..plan.command import DEFAULT_HARDWARE
    from ..plan.planner import load_model
    from ..plan.race_command import advice
    from ..plan import presets
    from ..serve.config import load_config, read_credentials
    from ...node.checkpoint import Checkpoint
    from ...common.process import run_grpc_loop

    if args.iters < 1 or args.transfer < 0 or args.timeout <= 0:
        raise UserError(
            f"--iters must be >= 1, --transfer >= 0 and --timeout > 0 (got {args.iters}, "
            f"{args.transfer}, {args.timeout})"
        )
    c = load_config(args.file)
    if c.launch != "remote" or len(c.nodes) < 2:
        raise UserError(
            f"{c.source}: bench link measures the link between running node agents: it needs "
            f"launch: remote and two nodes or more (has launch: {c.launch}, {len(c.nodes)} nodes)"
        )
    _transports(args.transports)
    secret, _ = read_credentials(c)
    base = read_calibration(args.calibration) if args.calibration else None
    hardware = presets.hardware_preset(args.hardware or DEFAULT_HARDWARE)
    model, _ = load_model(str(Checkpoint.open(c.model).path))
    act_bytes = model.act_bytes if model.act_bytes in DTYPE_OF else 2
    link = run_grpc_loop(lambda: _measured(c, args, model.hidden, act_bytes, secret))
    cal = base.with_link(link) if base is not None else link_only(link)
    write_calibration(cal, args.out)
    net = link.network()
    said = advice(model, hardware, net, cal, len(c.nodes), c.transport)
    if args.json:
        print(
            json.dumps(
                {
                    "link": link.to_json(),
                    "network": asdict(net),
                    "calibration": str(Path(args.out)),
                    "advice": said["points"],
                    "advice_text": said["text"],
                }
            )
        )
        return 0
    bw = ", ".join(
        f"{t.src} -> {t.dst} {t.bandwidth_Bps * 8 / 1e9:.3g} Gb/s ({t.bytes} B in {t.seconds:.3f} s)"
        for t in link.transfers
    )
    print(f"bandwidth: {bw}")
    print(f"wrote {args.out}; `moe-cluster plan --calibration {args.out}` plans with this link")
    print(said["text"])
    return 0
