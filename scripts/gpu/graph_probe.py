"""Does skip_gemv slow a 48-layer model down where 12 layers of the same shape gained 1.61x (run 9:
the 48-layer Qwen3-30B-A3B shape at N = 2 ran 19.0 tok/s against gather_mm's 54.7)? Suspected: MLX's
CUDA-graph cache (400 entries, keyed by each captured subgraph's topology). One process, one GPU, a
synthetic decode chain with the device-routed step's ops per layer — norm, a stand-in for attention,
router, top-k, the global -> local slot table (half the experts here, as node 0 of 2), the expert
MLP, the weighted sum — pipelined with async_eval as mlx-lm's generate_step is. The expert MLP runs
two ways: gather_mm (other nodes' positions to slot 0, zeroed after) or skip_gemv (nothing read for
them).

With no argument it runs itself once per (MLX CUDA-graph setting, layers, method) in a fresh process
(MLX reads its environment once) and prints one JSON line each:

    python3 scripts/gpu/graph_probe.py > graph_probe.jsonl

Settings: MLX's defaults; MLX_CUDA_GRAPH_CACHE_SIZE raised from 400 to 4000; MLX_USE_CUDA_GRAPHS=0.
Run 10 (one H200, docs/gpu/run10): skip_gemv 1.27-1.54x gather_mm at 48 layers under every setting,
so neither the layer count nor the graph cache slows it.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

SETTINGS = {
    "default": {},
    "graph_cache_4000": {"MLX_CUDA_GRAPH_CACHE_SIZE": "4000"},
    "no_cuda_graphs": {"MLX_USE_CUDA_GRAPHS": "0"},
}
E, F, D, K, LOCAL = (
    128,
    768,
    2048,
    8,
    64,
)  # Qwen3-30B-A3B: experts, width, hidden, top-k; node 0 of 2 holds 64


def one(layers: int, method: str, tokens: int) -> dict:
    import mlx.core as mx

    from moe_cluster.node.moe import skip_gemv

    dt = getattr(mx, os.environ.get("DTYPE", "bfloat16"))
    mx.random.seed(0)

    def rand(*shape):
        a = (mx.random.normal(shape) * 0.02).astype(dt)
        mx.eval(a)
        return a

    lut = mx.array(
        [e // 2 if e % 2 == 0 else -1 for e in range(E)], dtype=mx.int32
    )  # even experts here
    ls = [
        dict(
            attn=rand(D, D),
            out=rand(D, D),
            router=rand(E, D),
            gate=rand(LOCAL, F, D),
            up=rand(LOCAL, F, D),
            down=rand(LOCAL, D, F),
            norm=mx.ones((D,), dtype=dt),
        )
        for _ in range(layers)
    ]

    def experts(p, h, inds):
        slots = lut[inds]  # (1, K)
        mine = slots >= 0
        if method == "skip_gemv":
            s = slots.reshape(-1)
            a = skip_gemv.skip_gemv(h, p["up"], s, K)
            g = skip_gemv.skip_gemv(h, p["gate"], s, K)
            return skip_gemv.skip_gemv(mx.sigmoid(g) * g * a, p["down"], s, 1)[None]  # (1, K, D)
        s = mx.where(mine, slots, 0).astype(mx.uint32)
        rows = mx.expand_dims(h, (-2, -3))  # (1, 1, 1, D)
        a = mx.gather_mm(rows, p["up"].swapaxes(-1, -2), rhs_indices=s)
        g = mx.gather_mm(rows, p["gate"].swapaxes(-1, -2), rhs_indices=s)
        y = mx.gather_mm(mx.sigmoid(g) * g * a, p["down"].swapaxes(-1, -2), rhs_indices=s).squeeze(
            -2
        )
        return mx.where(mine[..., None], y, mx.zeros_like(y))

    def step(x):
        for p in ls:
            h = mx.fast.rms_norm(x, p["norm"], 1e-6)
            x = x + (h @ p["attn"].T) @ p["out"].T * 0.01
            h = mx.fast.rms_norm(x, p["norm"], 1e-6)
            logits = h @ p["router"].T
            inds = mx.stop_gradient(mx.argpartition(-logits, kth=K - 1, axis=-1)[..., :K])
            scores = mx.softmax(
                mx.take_along_axis(logits, inds, axis=-1).astype(mx.float32), axis=-1
            ).astype(dt)
            y = experts(p, h, inds)
            x = x + (y * scores[..., None]).sum(axis=-2)
        return mx.fast.rms_norm(x, ls[0]["norm"], 1e-6)

    x = rand(1, D)
    y = step(x)
    mx.async_eval(y)
    times, last = [], time.perf_counter()
    for i in range(tokens):
        nxt = step(y)
        mx.async_eval(nxt)
        mx.eval(y)
        now = time.perf_counter()
        if i >= 4:  # warm-up: kernels compiled, graphs captured
            times.append(now - last)
        last, y = now, nxt
    mx.eval(y)
    t = statistics.median(times)
    return {
        "layers": layers,
        "method": method,
        "ms_per_token": round(1e3 * t, 3),
        "us_per_layer": round(1e6 * t / layers, 1),
        "tok_s": round(1 / t, 1),
        "p90_ms": round(1e3 * sorted(times)[int(0.9 * len(times))], 3),
    }


def main() -> int:
    if len(sys.argv) > 1:  # a child: layers method tokens
        print(json.dumps(one(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]))), flush=True)
        return 0
    tokens = int(os.environ.get("TOKENS", "48"))
    for name, env in SETTINGS.items():
        for layers in (12, 48):
            for method in ("gather_mm", "skip_gemv"):
                t0 = time.perf_counter()
                r = subprocess.run(
                    [sys.executable, __file__, str(layers), method, str(tokens)],
                    env={**os.environ, **env},
                    capture_output=True,
                    text=True,
                    timeout=240,
                )
                line = r.stdout.strip().splitlines()[-1:] or [
                    json.dumps({"error": r.stderr.strip()[-400:]})
                ]
                print(
                    json.dumps(
                        {
                            "setting": name,
                            **json.loads(line[0]),
                            "wall_s": round(time.perf_counter() - t0, 1),
                        }
                    ),
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
