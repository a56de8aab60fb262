"""The cluster on one GPU host at DBRX scale: decode tok/s for 1, 2 and 4 nodes (one GPU each,
envoys on loopback), keepalive none and lru, stock mlx-lm on one GPU, the per-token breakdown,
measured experts per node per layer, and `moe-cluster plan`'s prediction before and after
calibration. Writes bench.json, plan.json, plan_calibrated.json, calibration.json and table.md
into OUT.

Usage (after scripts/gpu/setup.sh; PYTHONPATH=/tmp/site):
    python3 scripts/gpu/dbrx_bench.py --layers 8 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def cli(*args: str, capture: bool = True) -> str:
    cmd = [sys.executable, "-m", "moe_cluster.coordinator.cli", *args]
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=capture, text=True)
    print(f"[{time.time() - t0:6.1f}s] moe-cluster {' '.join(args)}", flush=True)
    if r.returncode:
        print(r.stdout[-4000:] if r.stdout else "", r.stderr[-4000:] if r.stderr else "", flush=True)
        raise SystemExit(f"failed: {' '.join(args)}")
    return r.stdout


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--model-dir", default="/tmp/dbrx")
    p.add_argument("--out", required=True)
    p.add_argument("--nodes", default="1,2,4")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = Path(args.model_dir)
    if not (model / "config.json").exists():
        # DBRX's shapes: hidden 6144, 48 heads of 128 (8 KV heads), expert FFN 10752, 16 experts, top-4
        info = cli("demo-model", "--arch", "dbrx", "--out", str(model), "--hidden", "6144", "--heads", "48",
                   "--kv-heads", "8", "--ffn", "10752", "--experts", "16", "--top-k", "4",
                   "--layers", str(args.layers), "--dtype", "bfloat16", "--shard-size", "5GB")
        (out / "checkpoint.json").write_text(info)
    bench = cli("bench", "decode", "--model", str(model), "--nodes", args.nodes, "--keepalive", "none,lru",
                "--transport", "envoy", "--gpus", "--max-tokens", str(args.max_tokens), "--rounds",
                str(args.rounds), "--calibrate", "--json")
    (out / "bench.json").write_text(bench)
    nodes = args.nodes
    plan = cli("plan", "--model", str(model), "--hardware", "h200", "--network", "loopback", "--nodes", nodes,
               "--keepalive", "lru", "--json")
    (out / "plan.json").write_text(plan)
    cli("plan", "--calibrate", str(out / "bench.json"), "--network", "loopback", "--hardware", "h200",
        "--out", str(out / "calibration.json"))
    planc = cli("plan", "--model", str(model), "--hardware", "h200", "--network", "loopback", "--nodes", nodes,
                "--keepalive", "lru", "--calibration", str(out / "calibration.json"), "--json")
    (out / "plan_calibrated.json").write_text(planc)
    (out / "table.md").write_text(table(json.loads(bench), json.loads(plan), json.loads(planc)))
    print((out / "table.md").read_text())
    return 0


def table(bench: dict, plan: dict, planc: dict) -> str:
    pred = {r["nodes"]: r["tokens_per_s"] for r in plan["rows"]}
    predc = {r["nodes"]: r["tokens_per_s"] for r in planc["rows"]}
    lines = [
        f"stock mlx-lm, one GPU: {bench['mlx_lm_tps']:.1f} tok/s; our single-node path: {bench['ours_tps']:.1f} "
        f"tok/s (ratio {bench['ratio']:.3f})",
        "",
        "| nodes | keepalive | tok/s | s/token | experts | collective wait | attention+router | other | E[n] measured | plan tok/s | plan calibrated |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in bench["clusters"]:
        b = c["breakdown_s"]
        lines.append(
            f"| {c['nodes']} | {c['keepalive']} | {c['generation_tps']:.1f} | {c['time_per_token_s']:.4f} | "
            f"{b['experts']:.4f} | {b['collective_wait']:.4f} | {b['attention_router']:.4f} | {b['other']:.4f} | "
            f"{c['expected_experts']:.2f} | {pred.get(c['nodes'], float('nan')):.1f} | "
            f"{predc.get(c['nodes'], float('nan')):.1f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
