"""`moe-cluster bench allreduce`: latency of one all-reduce, the envoy transport against
`mx.distributed`.

For each (nodes, tokens) case, in one run on this machine, over loopback:
- envoy: N processes each with the real EnvoyCollective (mx array -> its frame on every peer's
  data channel -> every peer's frame -> the rank-order sum -> mx array), what a node pays per MoE
  layer;
- mlx_ring: N processes running `mx.distributed.all_sum` on the ring backend;
- mlx_nccl: the same over NCCL, rank r on CUDA GPU r and its payload there (a host with N GPUs).
Latencies are per call, pooled over ranks, after a warm-up; `--rounds R` runs every path R times
in turn and pools those too. The envoy path's sum is checked once against the rank-order float32
sum, rounded.

`--trace` adds one more envoy run per case with every hop of every all-reduce stamped on one
clock across the processes (node/collective/trace.py), and prints the p50 of each hop. `--sum
numpy` has the envoy path sum bfloat16 in numpy, as an install without a C compiler does (`native`:
the C module, which must then have been built).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import queue
import sys
import time
from dataclasses import dataclass
from typing import Callable

from ...proto.errors import UserError

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
PATHS = ("envoy", "mlx_ring", "mlx_nccl")
DEFAULT_PATHS = PATHS[:-1]  # NCCL only where asked: it needs a GPU per rank
SUMS = ("native", "numpy")  # how the envoy path sums bfloat16 on the host (--sum)


@dataclass(frozen=True)
class Case:
    nodes: int
    tokens: int
    hidden: int
    dtype: str
    iters: int
    warmup: int

    @property
    def values(self) -> int:
        return self.tokens * self.hidden

    @property
    def nbytes(self) -> int:
        return self.values * _ITEMSIZE[self.dtype]


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated whole numbers, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected numbers >= 1, got {text!r}")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=_int_list, default=[2], help="node counts, e.g. 2,4")
    p.add_argument("--hidden", type=int, default=6144, help="hidden size (DBRX: 6144)")
    p.add_argument("--tokens", type=_int_list, default=[1], help="tokens per all-reduce, e.g. 1,32")
    p.add_argument("--dtype", choices=sorted(_ITEMSIZE), default="bfloat16")
    p.add_argument("--iters", type=int, default=1000, help="timed all-reduces per case and path")
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every path this many times in turn, fresh processes each time, and pool their "
        "samples (a machine whose speed drifts over the run then weighs on every path alike)",
    )
    p.add_argument(
        "--paths",
        default=",".join(DEFAULT_PATHS),
        help=f"which to measure, comma-separated, of {', '.join(PATHS)} (mlx_nccl: one CUDA GPU "
        "per node)",
    )
    p.add_argument(
        "--timeout", type=float, default=300.0, help="seconds one path of one case may take"
    )
    p.add_argument(
        "--trace",
        action="store_true",
        help="also run the envoy with every hop stamped, and print where its time goes",
    )
    p.add_argument(
        "--sum",
        choices=SUMS,
        default=None,
        help="how the envoy path sums bfloat16 on the host: native (the C module; an error where "
        "the install did not build it) or numpy (as an install without a C compiler); default: "
        "the C module where built",
    )
    p.add_argument("--json", action="store_true")


# ---------------------------------------------------------------------------------------------
# Workers (spawned processes); each puts (rank, latencies in seconds) or (rank, error text)


def _payload(case: Case, rank: int):
    import mlx.core as mx

    dtype = getattr(mx, case.dtype)
    return (mx.random.normal((case.tokens, case.hidden), key=mx.random.key(rank)) * 0.01).astype(
        dtype
    )


def _rank_order_sum(case: Case):
    """What every path's all-reduce must give: every rank's payload in rank order, summed in
    float32 (a path that rounds to the payload's dtype compares with this rounded)."""
    import mlx.core as mx

    return sum(_payload(case, r).astype(mx.float32) for r in range(case.nodes))


def _timed(fn, case: Case) -> list[float]:
    for _ in range(case.warmup):
        fn()
    out = []
    for _ in range(case.iters):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def _envoy_worker(spec, rank: int, native: bool, case: Case, results) -> None:
    try:
        import mlx.core as mx

        from ...node.collective.envoy import EnvoyCollective
        from ...node.collective.reduce import Reducer

        collective = EnvoyCollective(spec, rank, Reducer(native))
        try:
            x = _payload(case, rank)
            mx.eval(x)
            collective.begin("bench")
            # the sum checked once, rounded to the payload's dtype as the collective hands it back
            want = _rank_order_sum(case).astype(x.dtype)
            if not mx.array_equal(collective.all_reduce(x, 0), want).item():
                raise RuntimeError("the envoy's sum differs from the rank-order float32 sum")
            # evaluated, as the ring's is: a node may sum the partials lazily, in MLX
            latencies = _timed(lambda: mx.eval(collective.all_reduce(x, 0)), case)
            results.put(
                (rank, latencies if collective.trace is None else (latencies, collective.trace))
            )
        finally:
            collective.close()
    except Exception as exc:  # noqa: BLE001 - reported to the parent as a value
        results.put((rank, f"{type(exc).__name__}: {exc}"))


def _mlx_worker(spec, rank: int, case: Case, results) -> None:
    try:
        import os
        import tempfile

        if spec.backend == "nccl":  # before anything imports MLX (it opens the GPUs): one per rank
            os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
        from ...node.collective.mlx import write_hostfile

        with tempfile.TemporaryDirectory() as tmp:
            os.environ.update(write_hostfile(spec, tmp))
            os.environ["MLX_RANK"] = str(rank)
            import mlx.core as mx

            group = mx.distributed.init(strict=True, backend=spec.backend)
            x = _payload(case, rank)
            mx.eval(x)
            results.put(
                (rank, _timed(lambda: mx.eval(mx.distributed.all_sum(x, group=group)), case))
            )
    except Exception as exc:  # noqa: BLE001
        results.put((rank, f"{type(exc).__name__}: {exc}"))


# ---------------------------------------------------------------------------------------------


def _run_workers(target, make_args, case: Case, timeout_s: float) -> list[float]:
    """Spawn one process per rank running `target(*make_args(r), case, results)`; the latencies
    of the N ranks, pooled."""
    return [x for _, got in _gather(target, make_args, case, timeout_s) for x in got]


def _gather(target, make_args, case: Case, timeout_s: float) -> list[tuple[int, object]]:
    """What each of the N ranks reported, as (rank, report)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=target, args=(*make_args(r), case, results), daemon=True)
        for r in range(case.nodes)
    ]
    for p in procs:
        p.start()
    reports: list[tuple[int, object]] = []
    try:
        deadline = time.monotonic() + timeout_s
        for _ in range(case.nodes):
            try:
                rank, got = results.get(timeout=max(deadline - time.monotonic(), 0.1))
            except queue.Empty:
                raise RuntimeError(
                    f"{target.__name__} with {case.nodes} nodes did not finish within {timeout_s:g} s"
                ) from None
            if isinstance(got, str):
                raise RuntimeError(f"{target.__name__} rank {rank}: {got}")
            reports.append((rank, got))
        return reports
    finally:
        from ..dev.simulate import stop_processes

        stop_processes(procs, grace_s=10.0)


def _percentiles(samples: list[float]) -> tuple[float, float]:
    import numpy as np

    p50, p99 = np.percentile(np.asarray(samples) * 1e6, [50, 99])
    return round(float(p50), 1), round(float(p99), 1)


def run_case(
    case: Case,
    paths: list[str],
    timeout_s: float,
    traced: bool = False,
    rounds: int = 1,
    sums: str | None = None,
) -> dict:
    """One case's row: each path's p50 and p99 (microseconds), pooled over `rounds`; `sums`: how
    the envoy path sums bfloat16 on the host (SUMS; None: the product's choice)."""
    row: dict = {
        "nodes": case.nodes,
        "tokens": case.tokens,
        "hidden": case.hidden,
        "dtype": case.dtype,
        "iters": case.iters,
        "rounds": rounds,
    }
    if sums is not None:
        row["sum"] = sums
    native = sums != "numpy"
    samplers = _samplers(case, timeout_s, native)
    chosen = [p for p in PATHS if p in paths]
    pooled: dict[str, list[float]] = {p: [] for p in chosen}
    for r in range(rounds):
        # every round runs each path once, so a drift of the machine's speed over the run (other
        # load, clocks) falls on every path alike: their samples are pooled over the rounds
        for path in chosen:
            got = samplers[path]()
            pooled[path].extend(got)
            if rounds > 1:
                row.setdefault(f"{path}_p50_by_round_us", []).append(_percentiles(got)[0])
    for path, samples in pooled.items():
        row[f"{path}_p50_us"], row[f"{path}_p99_us"] = _percentiles(samples)
    if traced:
        row["trace"] = _trace(case, timeout_s, native)
    if row.get("envoy_p50_us") and row.get("mlx_ring_p50_us"):
        row["envoy_over_ring"] = round(row["envoy_p50_us"] / row["mlx_ring_p50_us"], 2)
    return row


def _envoy_spec(case: Case, trace: bool = False):
    """A fresh EnvoySpec on free loopback ports, with a fresh secret."""
    import secrets

    from ...common.ports import free_ports
    from ...node.collective.specs import EnvoySpec

    addresses = tuple(f"127.0.0.1:{p}" for p in free_ports(case.nodes))
    return EnvoySpec(addresses, secret=secrets.token_hex(16), trace=trace)


def _samplers(case: Case, timeout_s: float, native: bool) -> dict:
    """Per path, a call that runs it once (fresh processes, ports and secret) and returns its
    latencies in seconds, pooled over ranks."""
    from ...common.ports import free_ports
    from ...node.collective.specs import MlxSpec

    def envoy() -> list[float]:
        spec = _envoy_spec(case)
        return _run_workers(_envoy_worker, lambda r: (spec, r, native), case, timeout_s)

    def mlx(backend: str) -> Callable[[], list[float]]:
        def run() -> list[float]:
            spec = MlxSpec(tuple((f"127.0.0.1:{p}",) for p in free_ports(case.nodes)), backend)
            return _run_workers(_mlx_worker, lambda r: (spec, r), case, timeout_s)

        return run

    return {"envoy": envoy, "mlx_ring": mlx("ring"), "mlx_nccl": mlx("nccl")}


def _trace(case: Case, timeout_s: float, native: bool) -> dict:
    """An envoy run with every hop stamped: the traced run's p50 and each hop's p50 and p90."""
    from ...node.collective import trace

    spec = _envoy_spec(case, trace=True)
    reports = _gather(_envoy_worker, lambda r: (spec, r, native), case, timeout_s)
    p50, p99 = _percentiles([x for _, (latencies, _) in reports for x in latencies])
    records = {rank: rows for rank, (_, rows) in reports}
    return {
        "p50_us": p50,
        "p99_us": p99,
        # the sum's check (_envoy_worker) and the warmup are steps the table leaves out
        "hops": trace.table(trace.hops(records, 1 + case.warmup)),
    }


def main(args: argparse.Namespace) -> int:
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    unknown = sorted(set(paths) - set(PATHS))
    if unknown:
        raise UserError(f"--paths: unknown {', '.join(unknown)} (expected {', '.join(PATHS)})")
    if "mlx_nccl" in paths:
        from ...node.collective.mlx import mlx_backend

        if mlx_backend(True) != "nccl":
            raise UserError(
                "--paths mlx_nccl needs MLX's CUDA build with its NCCL backend and a GPU per node "
                "(not here)"
            )
    if args.iters < 1 or args.warmup < 0 or args.rounds < 1:
        raise UserError(
            f"--iters and --rounds must be >= 1 and --warmup >= 0 (got {args.iters}, "
            f"{args.rounds}, {args.warmup})"
        )
    if min(args.nodes) < 2:
        raise UserError(f"--nodes: an all-reduce needs at least 2 nodes (got {args.nodes})")
    if args.sum == "native" and "envoy" in paths:
        from ...node.collective.reduce import unbuilt_note

        note = unbuilt_note()
        if note is not None:
            raise UserError(f"--sum native: {note}")
    cases = [
        Case(n, t, args.hidden, args.dtype, args.iters, args.warmup)
        for n in args.nodes
        for t in args.tokens
    ]
    rows = []
    for case in cases:
        rows.append(
            run_case(
                case, paths, args.timeout, traced=args.trace, rounds=args.rounds, sums=args.sum
            )
        )
        if not args.json:
            _print_row(rows[-1], header=len(rows) == 1)
            if args.trace:
                _print_trace(rows[-1])
    if args.json:
        print(json.dumps({"cases": rows}))
    return 0


def _print_trace(row: dict) -> None:
    t = row["trace"]
    print(
        f"  trace of {row['nodes']} nodes, {row['tokens']} token(s): traced envoy p50 {t['p50_us']} us, "
        f"p99 {t['p99_us']} us; per hop (microseconds, pooled over ranks; hops overlap, see docs/envoy.md):"
    )
    for h in t["hops"]:
        print(f"    {h['hop']:<34} p50 {h['p50_us']:>8}  p90 {h['p90_us']:>8}   {h['covers']}")
    sys.stdout.flush()


def _print_row(row: dict, header: bool) -> None:
    cols = [
        ("nodes", "nodes"),
        ("tokens", "tokens"),
        ("envoy_p50_us", "envoy p50"),
        ("envoy_p99_us", "envoy p99"),
        ("mlx_ring_p50_us", "mlx ring p50"),
        ("mlx_nccl_p50_us", "mlx nccl p50"),
        ("envoy_over_ring", "envoy/ring"),
    ]
    if header:
        print("  ".join(f"{title:>12}" for _, title in cols) + "   (microseconds)")
    print("  ".join(f"{row.get(key, '-'):>12}" for key, _ in cols), flush=True)
    sys.stdout.flush()
