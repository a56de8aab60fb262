"""GPU figures of the cluster against one GPU and against mlx-lm's tensor parallelism (issues 15, 20).

Steps, each writing JSON into OUT (one device call cannot hold them all: 10 minutes a call):

    probe                      what MLX's CUDA build offers: GPUs, mx.distributed backends, and
                               whether ring and nccl each all-reduce GPU arrays between 2 processes
    build  --model M           a random bf16 checkpoint with M's shapes in /tmp/<M>
    bench  --model M           `moe-cluster bench decode` at the given node counts, one GPU per
                               node (stock mlx-lm, our single-node path, the cluster path at N = 1,
                               N > 1 over each transport, mlx-lm tensor parallel), calibrated per
                               transport: <M>.json
    allreduce                  `moe-cluster bench allreduce` on the host's idle CPU cores
    report --runs DIR          (here, not on the GPU host) table.md and figure.png from DIR's JSON

Models (real shapes, random weights, bf16):
    dbrx           hidden 6144, 48 heads of 128 (8 KV), 16 experts of width 10752, top-4
    qwen3-30b-a3b  48 layers, hidden 2048, 128 experts of width 768, top-8, 16 heads of 128 (4 KV)

Usage on the GPU host, after scripts/gpu/setup.sh (PYTHONPATH=/tmp/site):
    python3 scripts/gpu/figures.py probe --out $OUT
    python3 scripts/gpu/figures.py build --model qwen3-30b-a3b
    python3 scripts/gpu/figures.py bench --model qwen3-30b-a3b --transport mlx,envoy --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

MODELS = {
    "dbrx": [
        "--arch",
        "dbrx",
        "--hidden",
        "6144",
        "--heads",
        "48",
        "--kv-heads",
        "8",
        "--ffn",
        "10752",
        "--experts",
        "16",
        "--top-k",
        "4",
        "--layers",
        "8",
    ],
    "qwen3-30b-a3b": [
        "--arch",
        "qwen3_moe",
        "--hidden",
        "2048",
        "--heads",
        "16",
        "--kv-heads",
        "4",
        "--ffn",
        "768",
        "--experts",
        "128",
        "--top-k",
        "8",
        "--layers",
        "48",
    ],
}

# bytes on disk of each model as built (bf16), and a margin
SIZES = {"dbrx": 53e9, "qwen3-30b-a3b": 62e9}


def _layers(model: str) -> int:
    return int(MODELS[model][MODELS[model].index("--layers") + 1])


def cli(*args: str) -> str:
    cmd = [sys.executable, "-m", "moe_cluster.coordinator.cli", *args]
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True)
    print(f"[{time.time() - t0:6.1f}s] moe-cluster {' '.join(args)}", flush=True)
    if r.returncode:
        print(r.stdout[-4000:], r.stderr[-4000:], flush=True)
        raise SystemExit(f"failed: {' '.join(args)}")
    return r.stdout


def model_dir(name: str) -> Path:
    """Where a model is built: MODELS_ROOT (e.g. /dev/shm where /tmp's disk is too small), else /tmp."""
    return Path(os.environ.get("MODELS_ROOT", "/tmp")) / name


def build(args) -> None:
    out = model_dir(args.model)
    if (out / "config.json").exists():
        print(f"{out} exists")
        return
    need = SIZES[args.model] * (args.layers / _layers(args.model) if args.layers else 1)
    for (
        other
    ) in MODELS:  # the others go only where this one would not fit beside them (a 64 GiB disk)
        if (
            other != args.model
            and model_dir(other).exists()
            and shutil.disk_usage(out.parent).free < need
        ):
            print(f"removing {model_dir(other)}: no room for {args.model} beside it", flush=True)
            shutil.rmtree(model_dir(other))
    extra = ["--layers", str(args.layers)] if args.layers else []
    print(
        cli(
            "demo-model",
            *MODELS[args.model],
            *extra,
            "--out",
            str(out),
            "--dtype",
            "bfloat16",
            "--shard-size",
            "5GB",
        )
    )


def gpu_count() -> int:
    return len(os.popen("nvidia-smi -L 2>/dev/null").read().strip().splitlines())


def bench(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # one GPU per node where the host has enough; else the node processes share the GPU
    # (sharing one GPU, mlx-lm's tensor parallel processes hold a copy each and page: not measured)
    gpus = (
        ["--gpus"] if gpu_count() >= max(int(n) for n in args.nodes.split(",")) else ["--no-peers"]
    )
    text = cli(
        "bench",
        "decode",
        "--model",
        str(model_dir(args.model)),
        "--nodes",
        args.nodes,
        "--keepalive",
        "none",
        "--transport",
        args.transport,
        *gpus,
        "--max-tokens",
        str(args.max_tokens),
        "--rounds",
        str(args.rounds),
        "--calibrate",
        "--json",
    )
    (out / f"{args.model}.json").write_text(text)
    (model_dir(args.model) / "config.json").exists() and shutil.copy(
        model_dir(args.model) / "config.json", out / f"{args.model}-config.json"
    )
    summary(json.loads(text), args.model)


def summary(b: dict, what: str) -> None:
    print(
        f"{what}: stock {b['mlx_lm_tps']:.1f} tok/s, cluster_ratio {b['cluster_ratio']:.3f}, "
        f"same tokens {b['same_tokens']} / {b['cluster_path']['same_tokens']}"
    )
    for c in b["clusters"]:
        print(
            f"  N={c['nodes']} {c['transport']}: {c['generation_tps']:.1f} tok/s, fixed cost "
            f"{c['fixed_cost_per_moe_layer_us']:.0f} us/MoE layer, E[n] {c['expected_experts']:.2f}, "
            f"same tokens {c['same_tokens']}"
        )
    for p in b["peers"]:
        print(
            f"  peer {p['name']} N={p['nodes']}: "
            + (f"{p['tps']:.1f} tok/s" if "tps" in p else p["error"])
        )
    for transport, cal in b.get("calibration", {}).items():
        print(f"  calibration over {transport}: max |error| {100 * cal['max_abs_error']:.1f}%")


def allreduce(args) -> None:
    text = cli(
        "bench",
        "allreduce",
        "--nodes",
        "2,4",
        "--hidden",
        "6144",
        "--tokens",
        "1,32",
        "--dtype",
        "bfloat16",
        "--json",
    )
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "allreduce.json").write_text(text)
    print(text[:3000])


_PROBE = r"""
import os, sys, json, time
backend, rank = sys.argv[1], int(sys.argv[2])
import mlx.core as mx
g = mx.distributed.init(strict=True, backend=backend)
x = mx.ones((1, 6144), dtype=mx.bfloat16) * (rank + 1)
for op in ("all_sum", "all_gather"):
    y = getattr(mx.distributed, op)(x, group=g); mx.eval(y)
    t0 = time.perf_counter()
    for _ in range(200):
        y = getattr(mx.distributed, op)(x, group=g); mx.eval(y)
    dt = (time.perf_counter() - t0) / 200
    if rank == 0:
        print(json.dumps({"backend": backend, "op": op, "device": str(mx.default_device()), "shape": list(y.shape),
                          "first": float(y.reshape(-1)[0].astype(mx.float32).item()), "us": dt * 1e6}), flush=True)
"""


def probe(args) -> None:
    import mlx.core as mx

    from moe_cluster.common.ports import free_ports

    found = {
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "cuda": bool(getattr(mx, "cuda", None) and mx.cuda.is_available()),
        "backends": {b: mx.distributed.is_available(b) for b in ("ring", "nccl", "mpi", "jaccl")},
        "gpus": os.popen("nvidia-smi -L").read().strip().splitlines(),
        "runs": [],
    }
    for backend in ("ring", "nccl"):
        if not found["backends"][backend]:
            continue
        port = free_ports(2)
        hostfile = Path("/tmp/probe-hosts.json")
        hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in port]))
        procs = []
        for rank in range(2):
            env = dict(
                os.environ,
                MLX_RANK=str(rank),
                MLX_WORLD_SIZE="2",
                MLX_HOSTFILE=str(hostfile),
                NCCL_HOST_IP="127.0.0.1",
                NCCL_PORT=str(port[0]),
                CUDA_VISIBLE_DEVICES=str(rank % max(1, gpu_count())),
            )
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", _PROBE, backend, str(rank)],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        for p in procs:
            try:
                o, e = p.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                p.kill()
                o, e = "", "timed out"
            for line in o.splitlines():
                found["runs"].append(json.loads(line))
            if p.returncode:
                found["runs"].append({"backend": backend, "error": e[-800:]})
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "probe.json").write_text(json.dumps(found, indent=1))
    print(json.dumps(found, indent=1))


def _runs_of(runs: Path, model: str) -> list[dict]:
    """Every `bench decode` JSON of `model` in `runs`: <model>.json, then any <model>-<what>.json beside
    it (a later call's extra rows, e.g. dbrx-nccl.json); configs, probes, serve and peer files are not."""
    paths = [runs / f"{model}.json"] + sorted(runs.glob(f"{model}-*.json"))
    found = [json.loads(p.read_text()) for p in paths if p.exists()]
    return [b for b in found if isinstance(b, dict) and "clusters" in b]


def _peers_of(runs: Path, model: str, benches: list[dict]) -> list[dict]:
    """mlx-lm tensor parallel entries: those in the bench JSON, then any measured by hand beside it
    (<model>-tp-<backend>.json, one `tensor_parallel.measure` result) where the bench's own failed."""
    peers = [p for b in benches for p in b["peers"]]
    for path in sorted(runs.glob(f"{model}-tp-*.json")):
        peers.append({"backend": path.stem.rpartition("-tp-")[2], **json.loads(path.read_text())})
    return peers


def _peer_name(peer: dict) -> str:
    return "mlx-lm tensor parallel" + (f" ({peer['backend']})" if peer.get("backend") else "")


def _path_name(c: dict) -> str:
    if c["nodes"] == 1:
        return "ours, cluster path"
    return "ours, envoy" if c["transport"] == "envoy" else f"ours, mlx {c.get('backend', 'ring')}"


def _calibrated(bench: dict, alone: list[dict], path: list[dict], c: dict) -> str:
    """`plan`'s prediction for `c`, calibrated on the N = 1 cluster and this path's clusters
    (`bench decode --calibrate`'s fit, one path at a time), with its error."""
    from moe_cluster.coordinator.bench.decode import calibrate

    points = alone + [x for x in path if x["nodes"] > 1]
    if len(points) < 2 and c["nodes"] > 1:
        return "—"
    fitted = calibrate({**bench, "clusters": [{**x, "transport": "path"} for x in points]})["path"]
    p = next(p for p in fitted["points"] if p["nodes"] == c["nodes"])
    held = p["held_out_error"]  # fitted without this point: a prediction (with two points, none)
    return f"{p['predicted_tps']:.1f} (fit {100 * p['error']:+.0f}%" + (
        f", held out {100 * held:+.0f}%)" if held is not None else "; nothing left to hold out)"
    )


def report(args) -> None:
    """table.md and figure.png from the bench JSON in --runs: one row per (model, N, path)."""
    from moe_cluster.coordinator.bench.decode import fixed_cost_us

    runs = Path(args.runs)
    lines = [
        "| model | N | path | tok/s | × stock | tokens | fixed cost per MoE layer (µs) | plan calibrated |",
        "|---|---|---|---|---|---|---|---|",
    ]
    curves: dict[str, dict[str, list]] = {}
    for model in MODELS:
        benches = _runs_of(runs, model)
        if not benches:
            continue
        stock = benches[0]["mlx_lm_tps"]
        lines.append(f"| {model} | 1 | stock mlx-lm | {stock:.1f} | 1.00 | | | |")
        per = curves.setdefault(model, {"stock mlx-lm": [(1, stock)]})
        seen = set()
        alone = [c for b in benches for c in b["clusters"] if c["nodes"] == 1][:1]
        for b in benches:
            for c in sorted(b["clusters"], key=lambda c: c["nodes"]):
                name = _path_name(c)
                if (c["nodes"], name) in seen:
                    continue
                seen.add((c["nodes"], name))
                pred = _calibrated(b, alone, [x for x in b["clusters"] if _path_name(x) == name], c)
                mismatch = c.get("first_mismatch")
                tokens = (
                    "stock's"
                    if c["same_tokens"]
                    else f"differ from token {mismatch}"
                    if mismatch is not None
                    else "differ"
                )
                # against the stock run of the same call (each call measures its own), recomputed as
                # intervals (runs up to 8 stored stock's n-over-(n - 1)-intervals rate against them)
                fixed = fixed_cost_us(
                    c["time_per_token_s"],
                    b["mlx_lm_tps"],
                    b["generated_tokens"],
                    b["model_bytes"]["moe_layers"],
                )
                lines.append(
                    f"| {model} | {c['nodes']} | {name} | {c['generation_tps']:.1f} | "
                    f"{c['generation_tps'] / b['mlx_lm_tps']:.2f} | {tokens} | "
                    + (f"{fixed:.0f}" if fixed >= 0 else "— (faster than stock)")
                    + " | "
                    + pred
                    + " |"
                )
                per.setdefault(name if c["nodes"] > 1 else "ours, cluster path", []).append(
                    (c["nodes"], c["generation_tps"])
                )
        for peer in _peers_of(runs, model, benches):
            name = _peer_name(peer)
            if (peer["nodes"], name) in seen:
                continue
            seen.add((peer["nodes"], name))
            cell = (
                f"{peer['tps']:.1f} | {peer['tps'] / stock:.2f}"
                if "tps" in peer
                else f"— | {peer['error']}"
            )
            lines.append(f"| {model} | {peer['nodes']} | {name} | {cell} | | | |")
            if "tps" in peer:
                per.setdefault(name, []).append((peer["nodes"], peer["tps"]))
    serving = [
        (m, json.loads((runs / f"{m}-serve.json").read_text()))
        for m in MODELS
        if (runs / f"{m}-serve.json").exists()
    ]
    if serving:
        lines += [
            "",
            "Aggregate decode tok/s of streamed requests (`bench serve --gpus`), one GPU per node:",
            "",
            "| model | server | concurrent streams | aggregate tok/s | time to first token p50 (s) | "
            "inter-token p50 / p99 (s) |",
            "|---|---|---|---|---|---|",
        ]
        for model, out in serving:
            rows = [(f"ours, N = {r['nodes']}", r) for r in out["rows"]] + [
                ("mlx_lm.server, one GPU", r) for r in out["mlx_lm_server"]
            ]
            for name, r in rows:
                lines.append(
                    f"| {model} | {name} | {r['concurrency']} | {r['aggregate_tps']:.1f} | "
                    f"{r['ttft_p50_s']:.2f} | {r['itl_p50_s']:.3f} / {r['itl_p99_s']:.3f} |"
                )
    (runs / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: no figure")
        return
    fig, axes = plt.subplots(1, len(curves), figsize=(6 * len(curves), 4.5), dpi=130, squeeze=False)
    for ax, (model, per) in zip(axes[0], curves.items()):
        for name, pts in per.items():
            pts = sorted(pts)
            if name == "stock mlx-lm":
                ax.axhline(pts[0][1], color="black", linestyle="--", label="stock mlx-lm, one GPU")
            elif name == "ours, cluster path":
                ax.plot(*zip(*pts), "D", color="tab:gray", label="ours, N = 1")
            else:
                ax.plot(
                    *zip(
                        *(
                            [(1, per["ours, cluster path"][0][1])] + pts
                            if "ours, cluster path" in per and name.startswith("ours")
                            else pts
                        )
                    ),
                    "o-",
                    label=name,
                )
        ax.set_xticks(sorted({n for pts in per.values() for n, _ in pts}))
        ax.set_xlabel("GPUs (one node process each)")
        ax.set_ylabel("decode tok/s, batch 1")
        ax.set_title(model)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(runs / "figure.png")
    print(f"wrote {runs / 'figure.png'}")


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("step", choices=("probe", "build", "bench", "allreduce", "report"))
    p.add_argument("--model", choices=tuple(MODELS), default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, help="override the model's layer count")
    p.add_argument("--transport", default="mlx,envoy", help="comma list: mlx, envoy")
    p.add_argument("--nodes", default="1,2")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default="out")
    p.add_argument("--runs", help="with report: the folder of a run's JSON")
    args = p.parse_args()
    {"probe": probe, "build": build, "bench": bench, "allreduce": allreduce, "report": report}[
        args.step
    ](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
