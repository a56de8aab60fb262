"""Tables of scripts/gpu/issue_run.sh's raw output (a folder of A-*.json and B-*.json), as text.

A: per model and forced decode route at N = 2, tok/s, tokens against stock and against the other
route's run (=stock: yes, or @ the first token that differs), and the expert bytes each node reads
per token (bench decode's `expert_reads`).
B: per model and transport, each speculative scenario's tok/s, ratio to off, acceptance and
all-reduces per generated token.
D: bench race's rows without and with two micro-batches per step: decode tok/s, the wait on the
collective per MoE layer and the share the overlap hid.
X: bench race per installed tree and route (X-<tree>-<route>.json): tok/s and inter-token p50.

    python3 scripts/gpu/issue_summary.py DIR [--part A|B|D|X]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _load(path: Path) -> tuple[dict | None, str]:
    try:
        return json.loads(path.read_text()), ""
    except (OSError, ValueError) as exc:
        err = path.with_suffix(".err")
        tail = err.read_text(errors="replace")[-300:].strip() if err.exists() else ""
        return None, f"no JSON ({type(exc).__name__}); stderr ends: {tail}"


def _runs(d: Path, pattern: str):
    """(file, its JSON) of each file matching `pattern` in `d`; a file that has none is said and
    skipped."""
    for f in sorted(d.glob(pattern)):
        b, why = _load(f)
        if b is None:
            print(f"{f.stem}: failed: {why}")
            continue
        yield f, b


def _against_stock(row: dict) -> str:
    """yes, or @ the first token where a row parts from stock; "-" where stock could not run."""
    if row["same_tokens"] is None:
        return "-"
    return "yes" if row["same_tokens"] else f"@{row['first_mismatch']}"


def part_a(d: Path) -> None:
    print("A: bench decode at N = 2 over transport mlx, route forced (MOE_CLUSTER_ROUTE)")
    print(
        f"{'model':<12} {'route':<7} {'tok/s':>7} {'stock':>7} {'gen':>4} {'=stock':>6} {'=other':>6} "
        f"{'E[n]':>5} {'mat/layer n0,n1':>16} {'MB/token n0,n1':>18}  chosen (node 0)"
    )
    tokens: dict[str, dict[str, list]] = {}
    rows = []
    for f in sorted(d.glob("A-*-paired.json")):
        _paired(f)
    for f in sorted(d.glob("A-*.json")):
        if f.stem.endswith("-paired"):
            continue
        model, route = f.stem[2:].rsplit("-", 1)
        if route.isdigit():  # A_ALTERNATE: A-model-route-i
            model, route = model.rsplit("-", 1)[0], f"{model.rsplit('-', 1)[1]}-{route}"
        b, why = _load(f)
        if b is None or not b.get("clusters"):
            print(f"{model:<12} {route:<7} failed: {why or 'no cluster row'}")
            continue
        c = b["clusters"][0]
        tokens.setdefault(model, {}).setdefault(route.split("-")[0], c.get("tokens"))
        rows.append((model, route, b, c))
    for model, route, b, c in rows:
        others = [t for r, t in tokens[model].items() if r != route.split("-")[0]]
        same_other = (
            "-"
            if not others or others[0] is None
            else ("yes" if others[0] == c.get("tokens") else "NO")
        )
        reads = c.get("expert_reads") or {}
        nodes = reads.get("nodes", [])
        mats = ",".join(f"{n['matrices_per_layer']:.2f}" for n in nodes) or "-"
        mb = ",".join(f"{n['bytes_per_token'] / 1e6:.1f}" for n in nodes) or "-"
        chosen = nodes[0]["route"] if nodes else "-"
        stock = _against_stock(c)
        stock_tps = f"{b['mlx_lm_tps']:>7.1f}" if b.get("mlx_lm_tps") else f"{'-':>7}"
        print(
            f"{model:<12} {route:<7} {c['generation_tps']:>7.1f} {stock_tps} {c['generated']:>4} "
            f"{stock:>6} {same_other:>6} {c['expected_experts']:>5.2f} {mats:>16} "
            f"{mb:>18}  {chosen}"
        )
    for model, route, b, c in rows:
        m = c.get("at_mismatch")
        if m:  # how stock ranked the token where this run parted from it (bench decode)
            how = (
                f"stock's #{m['rank']}, {m['gap']:.4g} below its best"
                if m["rank"]
                else "not among stock's best 8"
            )
            print(f"{model} {route}: parts from stock at token {c['first_mismatch']}: {how}")
        if b.get("stock_error"):
            print(f"{model} {route}: stock mlx-lm failed: {b['stock_error']}")
    for model, by in tokens.items():
        if len(by) == 2 and None not in by.values():
            a, b = by.values()
            print(
                f"{model}: tokens of the two routes {'equal' if a == b else 'DIFFER'} ({len(a)} tokens)"
            )


def _paired(f: Path) -> None:
    """A_PAIRED: one load, the routes alternated round by round (bench decode --routes)."""
    model = f.stem[2:].removesuffix("-paired")
    b, why = _load(f)
    if b is None or not b.get("clusters") or "routes" not in b["clusters"][0]:
        print(f"{model:<12} paired   failed: {why or 'no routes in the row'}")
        return
    runs = b["clusters"][0]["routes"]
    first = next(iter(runs))
    print(f"{model}: routes alternated within one load, rounds after a warm-up pass")
    for route, r in runs.items():
        reads = r["expert_reads"]["nodes"]
        m = r.get("at_mismatch")
        stock = _against_stock(r) + (
            f" (stock's #{m['rank']}, {m['gap']:.3g} below)" if m and m["rank"] else ""
        )
        print(
            f"  {route:<7} {r['generation_tps']:>7.1f} tok/s  rounds "
            + " ".join(f"{x:.1f}" for x in r["rounds_tps"])
            + f"  / {first} by round "
            + " ".join(f"{x:.3f}" for x in r["over_first_by_round"])
            + "  matrices/layer "
            + ",".join(f"{n['matrices_per_layer']:.2f}" for n in reads)
            + "  MB/token "
            + ",".join(f"{n['bytes_per_token'] / 1e6:.1f}" for n in reads)
            + f"  stock {stock}  tokens = {first}'s: "
            + ("yes" if r["tokens"] == runs[first]["tokens"] else "NO")
        )


def part_b(d: Path) -> None:
    print("B: bench decode --speculative prompt-lookup at N = 2")
    for f, b in _runs(d, "B-*.json"):
        for r in b.get("runs", []):
            print(
                f"{f.stem}: N = {r['nodes']} over {r['transport']}, {b['moe_layers']} MoE layers, tokens "
                f"{'equal' if r['tokens_equal_stock'] else 'DIFFER from'} stock's"
            )
            for t in r["rows"]:
                acc = "-" if t["acceptance"] is None else f"{t['acceptance']:.0%}"
                ar = (
                    "-" if t["allreduces_per_token"] is None else f"{t['allreduces_per_token']:.2f}"
                )
                ratio = "-" if t["ratio_vs_off"] is None else f"{t['ratio_vs_off']:.2f}"
                print(
                    f"  {t['scenario']:<48} {t['tps']:7.1f} tok/s x{ratio:<5} accepted {acc:>4} "
                    f"{ar:>6} all-reduces/token, tokens {'same' if t['tokens_equal_off'] else 'DIFFER'}"
                )


def part_d(d: Path) -> None:
    print("D: bench race, two micro-batches per step (_overlap rows) beside the rows without")
    b, why = _load(d / "D-race.json")
    if b is None:
        print(f"failed: {why}")
        return
    for r in b["rows"]:
        if "error" in r:
            print(f"  {r['name']:<20} {r['streams']:>3} streams: {r['error'][:200]}")
            continue
        ov = r.get("overlap") or {}
        per = r.get("moe_layers") or 1
        wait = r["breakdown_per_step_s"]["collective_wait"] / per
        hid = ov.get("hidden")
        print(
            f"  {r['name']:<20} {r['streams']:>3} streams: {r['decode_tps']:8.1f} tok/s, "
            f"collective wait {1e6 * wait:7.0f} us per MoE layer"
            + (f", hidden {hid:.0%}" if hid is not None else "")
            + (f", x{ov['speedup']:.2f}" if ov.get("speedup") else "")
            + f" ({r.get('micro_batches', '')})"
        )
    agree = b.get("agreement") or {}
    print(f"  agreement: {json.dumps(agree)[:400]}")


def part_x(d: Path) -> None:
    print("X: bench race at N = 2 per tree and route (X-<tree>-<route>.json; X-peers.json: mlx-lm)")
    for f, b in _runs(d, "X-*.json"):
        for r in b["rows"]:
            if "error" in r:
                print(f"  {f.stem:<18} {r['name']:<16} {r['streams']:>3}: {r['error'][:200]}")
                continue
            p50 = r.get("itl_p50_s")
            print(
                f"  {f.stem:<18} {r['name']:<16} {r['streams']:>3} streams: "
                f"{r['decode_tps']:8.1f} tok/s, ITL p50 {1e3 * p50 if p50 else float('nan'):6.2f} ms"
                f"  {(r.get('route') or '')[:150]}"
            )


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("--part", choices=("A", "B", "D", "X"), default=None)
    args = p.parse_args()
    d = Path(args.dir)
    for name, fn in (("A", part_a), ("B", part_b), ("D", part_d), ("X", part_x)):
        if args.part in (None, name):
            try:
                fn(d)
            except Exception as exc:  # noqa: BLE001 - a summary never hides the raw files
                print(f"part {name} summary failed: {type(exc).__name__}: {exc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
