"""`moe-cluster bench race`: ours against mlx-lm's pipeline and tensor parallelism, one checkpoint,
one prompt set, N processes each.

Rows: ours over `transport: mlx` (NCCL with one GPU per node, else the ring) and over the envoy
(N simulated node processes, coordinator/dev/simulate.py), mlx-lm pipeline and mlx-lm tensor
parallelism (N processes, coordinator/bench/tensor_parallel.py). Each at batch 1 and at B concurrent
streams (ours: the node's running batch; mlx-lm: its BatchGenerator), every token's time taken the
same way: time to first token, the gaps between a stream's tokens (p50, p99; their mean is the
step; those over twice the median listed where they fell), decode tok/s = B / step and tok/s
over the whole run including prefill. Greedy tokens of every row are compared with the others
and with stock mlx-lm's at batch 1 on the same prompts where one device holds the model. Per row, the weight bytes each node reads per step and the
physical bound (plan/race.py: those bytes over the memory bandwidth plus the bare collectives,
measured here by `bench allreduce`'s workers). Where ours is slower than a peer, where its time
per MoE layer goes (`bench decode`'s breakdown).

This module is the command (its arguments, table and plot); race_run.py runs the rows and
race_rows.py compares them.
"""

from __future__ import annotations

import json

from ...proto.errors import UserError
from .output import emitted
from .race_rows import AUTO_ROWS, OVERLAP_ROWS, ROWS, merge
from .race_run import RaceBench, run
from .decode import _route
from .serve import _ints


def plot(out: dict, path: str) -> None:
    from ..plan.plot import pyplot

    plt = pyplot()
    names = list(dict.fromkeys(r["name"] for r in out["rows"]))
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=120)
    ones = [
        next((r for r in out["rows"] if r["name"] == n and r["streams"] == 1), {}) for n in names
    ]
    a.bar(names, [r.get("decode_tps") or 0 for r in ones])
    a.set_ylabel("decode tok/s at batch 1")
    a.tick_params(axis="x", labelrotation=20)
    for n in names:
        rs = [r for r in out["rows"] if r["name"] == n and r.get("decode_tps")]
        b.plot([r["streams"] for r in rs], [r["decode_tps"] for r in rs], "o-", label=n)
    b.set_xscale("log", base=2)
    b.set_xlabel("concurrent streams")
    b.set_ylabel("decode tok/s, all streams")
    b.legend(fontsize=8)
    fig.suptitle(f"{out['model'].rstrip('/').split('/')[-1]} on {out['nodes']} processes each")
    fig.tight_layout()
    fig.savefig(path)


def _streams(text: str) -> tuple[int, ...]:
    out = tuple(_ints(text, "--streams"))
    if len(set(out)) != len(out):
        raise UserError(f"--streams must list distinct numbers (got {text!r})")
    return out


def add_arguments(p) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="a checkpoint folder, 'demo', or a Hugging Face repo id (org/name)",
    )
    p.add_argument(
        "--merge",
        nargs="+",
        metavar="RACE.json",
        help="run nothing: merge the JSON of earlier calls that each ran some rows of one race "
        "(their rows compared again) and report it as one race",
    )
    p.add_argument(
        "--nodes", type=int, default=2, help="processes per row (ours: nodes; mlx-lm: ranks)"
    )
    p.add_argument(
        "--streams", default="1,8,32", help="concurrent streams, comma list (1: batch 1)"
    )
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument(
        "--alternate",
        type=int,
        default=1,
        metavar="N",
        help="run the rows N times in turn; each row's decode tok/s is the median of its passes",
    )
    p.add_argument(
        "--kv-budget",
        default=None,
        metavar="SIZE",
        help="ours: each node's KV budget (e.g. 64MiB): how many streams run at once then depends "
        "on where their KV lives; default: no limit",
    )
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=None,
        metavar="N",
        help="each stream's prompt N tokens long (its text repeated): attention's share of a step "
        "grows with the context; default: the short prompts",
    )
    p.add_argument(
        "--route",
        default=None,
        metavar="ROUTE",
        help="ours: the decode route every node takes (cluster.yaml's `route:`: skip, device, host "
        "or measure); default: each node measures its own at load",
    )
    p.add_argument(
        "--placement",
        default=None,
        metavar="FILE",
        help="ours: the experts each node holds, a placement JSON as `simulate --placement` takes "
        "(replicas allowed); default: an even split",
    )
    p.add_argument(
        "--rounds", type=int, default=1, help="timed rounds after one warm-up (the last is kept)"
    )
    p.add_argument(
        "--rows",
        default=",".join(ROWS),
        help="which rows, comma list of "
        + ", ".join(ROWS + OVERLAP_ROWS + AUTO_ROWS)
        + " (the _overlap rows: two micro-batches per decode step; the _auto rows: serving.attention "
        "auto)",
    )
    p.add_argument(
        "--gpus", action="store_true", help="process r on CUDA GPU r (NCCL where MLX has it)"
    )
    p.add_argument(
        "--mlx-backend",
        choices=("auto", "ring"),
        default="auto",
        help="the mx.distributed rows' backend: auto (NCCL with --gpus where MLX has it, else the "
        "ring) or ring (to compare the host-mediated ring with the envoy)",
    )
    p.add_argument(
        "--bandwidth",
        type=float,
        default=None,
        metavar="GBps",
        help="the device's memory bandwidth, GB/s, for the physical bound",
    )
    p.add_argument("--hardware", default=None, help="or a hardware preset of `plan` for it")
    p.add_argument(
        "--no-pin",
        action="store_true",
        help="leave every row's processes wherever the OS puts them (default: process r of a row "
        "on its own share of this machine's cores, as N machines; not with --gpus)",
    )
    p.add_argument(
        "--no-stock",
        action="store_true",
        help="do not run stock mlx-lm (default: where it fits one device)",
    )
    p.add_argument(
        "--plot", metavar="FILE.png", help="tok/s per row at batch 1 and against streams"
    )
    p.add_argument("--json", action="store_true")


def _read_race(path: str) -> dict:
    try:
        with open(path) as f:
            part = json.load(f)
    except (OSError, ValueError) as exc:
        raise UserError(f"--merge: cannot read {path}: {exc}") from exc
    if not isinstance(part, dict) or not isinstance(part.get("rows"), list):
        raise UserError(f"--merge: {path} is not the JSON of a `bench race` call (no rows)")
    return part


def _spec(args) -> RaceBench:
    rows = tuple(r.strip() for r in args.rows.split(","))
    bad = [r for r in rows if r not in ROWS + OVERLAP_ROWS + AUTO_ROWS]
    if bad:
        raise UserError(
            f"--rows: unknown row {bad[0]!r} ({', '.join(ROWS + OVERLAP_ROWS + AUTO_ROWS)})"
        )
    if args.nodes < 2:
        raise UserError(f"--nodes must be at least 2: a race splits the model (got {args.nodes})")
    if args.max_tokens < 2 or args.rounds < 1:
        raise UserError(
            f"--max-tokens must be >= 2 and --rounds >= 1 (got {args.max_tokens}, {args.rounds})"
        )
    bandwidth, source = None, ""
    if args.bandwidth is not None:
        if not args.bandwidth > 0:
            raise UserError(f"--bandwidth must be > 0 GB/s (got {args.bandwidth})")
        bandwidth, source = args.bandwidth * 1e9, "--bandwidth"
    elif args.hardware:
        from ..plan.presets import hardware_preset

        bandwidth, source = (
            hardware_preset(args.hardware).bandwidth_Bps,
            f"--hardware {args.hardware}",
        )
    return RaceBench(
        args.model,
        args.nodes,
        _streams(args.streams),
        args.max_tokens,
        args.rounds,
        rows,
        args.gpus,
        bandwidth,
        source,
        False if args.no_stock else None,
        mlx_backend=args.mlx_backend,
        prompt_tokens=_prompt_tokens(args.prompt_tokens),
        kv_budget=_kv_budget(args.kv_budget),
        alternate=max(1, args.alternate),
        route=_route(args.route),
        placement=args.placement,
        pin=not args.no_pin,
    )


def main(args) -> int:
    if args.merge:
        out = merge([_read_race(path) for path in args.merge])
    elif args.model is None:
        raise UserError("bench race needs --model (to run a race) or --merge (to join calls)")
    else:
        out = run(_spec(args))
    if emitted(out, args, plot):
        return 0
    print(
        f"{out['model']}: {out['nodes']} processes per row, {out['max_tokens']} tokens per stream"
    )
    print(
        f"{'row':>16} {'B':>3} {'decode tok/s':>12} {'ttft s':>7} {'itl p50':>8} {'itl p99':>8} "
        f"{'bound tok/s':>11} {'stock':>5}"
    )
    for r in out["rows"]:
        if "error" in r:
            print(f"{r['name']:>16} {r['streams']:>3} failed: {r['error']}")
            continue
        bound = r["bound"]["decode_tps"] if r.get("bound") else None
        print(
            f"{r['name']:>16} {r['streams']:>3} {r['decode_tps'] or 0:>12.1f} {r['ttft_s'] or 0:>7.3f} "
            f"{r['itl_p50_s'] or 0:>8.4f} {r['itl_p99_s'] or 0:>8.4f} "
            f"{'-' if bound is None else f'{bound:.1f}':>11} "
            f"{'-' if 'same_as_stock' not in r else ('yes' if r['same_as_stock'] else 'NO'):>5}"
        )
    for b, a in out["agreement"].items():
        if a["same"] is None:
            print(f"B = {b}: fewer than two rows ran, no tokens compared")
        else:
            print(
                f"B = {b}: rows agree" if a["same"] else f"B = {b}: rows differ: {a['differences']}"
            )
    return 0


def _prompt_tokens(n: int | None) -> int | None:
    if n is not None and n < 2:
        raise UserError(f"--prompt-tokens must be at least 2 (got {n})")
    return n


def _kv_budget(text: str | None) -> int:
    if text is None:
        return 0
    import re

    from ...proto.expert_cache import SIZE_UNITS

    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-zA-Z]*)", text.strip())
    if not m or m[2].lower() not in SIZE_UNITS or float(m[1]) <= 0:
        raise UserError(f"--kv-budget must be a positive size, e.g. 64MiB (got {text!r})")
    return int(float(m[1]) * SIZE_UNITS[m[2].lower()])
