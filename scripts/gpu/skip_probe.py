"""Does a node at N > 1 read only its own experts per MoE layer? One decode token's expert step
(gate, up, activation, down; k positions) with m of the k positions this node's (m distinct local
experts) and the rest another node's, two ways:

- `gather_mm`: the device-routed step before skip_gemv: the other positions go to slot 0 and are
  zeroed afterwards (node/moe/kernels.py `Gather`);
- `skip_gemv`: the kernel (node/moe/skip_gemv.py): nothing read for the other positions.

Prints one JSON line per (shape, m): milliseconds each way and the GB/s reading m experts would
mean; first, per shape and projection, the kernel's largest difference from gather_mm (relative to
the output's largest value) on random slots. If skip_gemv's time follows m, a node reads E[n]
experts; gather_mm's stays at k.
"""

import json

import mlx.core as mx

from distinct_probe import timed  # this folder's run-4 probe (python3 scripts/gpu/skip_probe.py)
from moe_cluster.node.moe import skip_gemv

SHAPES = {  # name: (local experts at N = 2, expert width, hidden, k)
    "dbrx": (8, 10752, 6144, 4),
    "qwen3-30b-a3b": (64, 768, 2048, 8),
}


def main() -> int:
    dtype = mx.bfloat16
    for name, (E, F, D, k) in SHAPES.items():
        gate, up = (
            (mx.random.normal((E, F, D)) * 0.02).astype(dtype),
            (mx.random.normal((E, F, D)) * 0.02).astype(dtype),
        )
        down = (mx.random.normal((E, D, F)) * 0.02).astype(dtype)
        mx.eval(gate, up, down)
        x = mx.random.normal((1, D)).astype(dtype)
        for proj, w, rows in (
            ("gate", gate, x),
            ("down", down, mx.random.normal((k, F)).astype(dtype)),
        ):
            per_x = k if proj == "gate" else 1
            slots = mx.random.randint(-1, E, (k,)).astype(mx.int32)
            got = skip_gemv.skip_gemv(rows, w, slots, per_x).astype(mx.float32)
            src = rows[mx.arange(k) // per_x][:, None, :]
            want = mx.gather_mm(
                src, w.swapaxes(-1, -2), rhs_indices=mx.maximum(slots, 0).astype(mx.uint32)
            )[:, 0, :]
            want = mx.where((slots >= 0)[:, None], want.astype(mx.float32), 0.0)
            err = (mx.abs(got - want).max() / mx.maximum(mx.abs(want).max(), 1e-6)).item()
            print(
                json.dumps(
                    {
                        "shape": name,
                        "projection": proj,
                        "slots": slots.tolist(),
                        "max_rel_diff": err,
                        "check": skip_gemv.check(w),
                    }
                ),
                flush=True,
            )
        for m in range(0, k + 1):
            slots = mx.array(
                [i if i < m else -1 for i in range(k)], dtype=mx.int32
            )  # m distinct local experts
            mine = (slots >= 0)[:, None]

            def by_gather():
                s = mx.where(slots >= 0, slots, 0).astype(mx.uint32)
                rows = mx.broadcast_to(x, (k, D))[:, None, :]
                g = mx.gather_mm(rows, gate.swapaxes(-1, -2), rhs_indices=s)
                u = mx.gather_mm(rows, up.swapaxes(-1, -2), rhs_indices=s)
                y = mx.gather_mm(mx.sigmoid(g) * g * u, down.swapaxes(-1, -2), rhs_indices=s)[
                    :, 0, :
                ]
                return mx.where(mine, y, mx.zeros_like(y))

            def by_skip():
                h = skip_gemv.skip_gemv(x, gate, slots, k)
                h = mx.sigmoid(h) * h * skip_gemv.skip_gemv(x, up, slots, k)
                return skip_gemv.skip_gemv(h, down, slots, 1)

            diff = (
                mx.abs(by_skip().astype(mx.float32) - by_gather().astype(mx.float32)).max()
            ).item()
            tg, ts = timed(by_gather), timed(by_skip)
            bytes_m = 3 * m * F * D * dtype.size
            print(
                json.dumps(
                    {
                        "shape": name,
                        "k": k,
                        "mine": m,
                        "gather_mm_ms": round(1e3 * tg, 4),
                        "skip_gemv_ms": round(1e3 * ts, 4),
                        "max_abs_diff": diff,
                        "skip_GB_per_s_of_mine": round(bytes_m / ts / 1e9, 1) if m else None,
                        "gather_GB_per_s_if_k_read": round(
                            3 * k * F * D * dtype.size / tg / 1e9, 1
                        ),
                    }
                ),
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
