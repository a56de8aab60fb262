"""Does a node read E[n] experts' bytes per MoE layer, or k? Time one decode step's expert matmuls
(3 projections, one token, k positions) against the number of distinct experts among the k
positions, as the device-routed path computes them (node/moe/experts.py: positions another node
computes are redirected to a slot this node computes anyway, or to slot 0).

Prints one JSON line per (shape, variant, distinct): ms and the GB/s that reading `distinct`
experts would mean. If the time follows `distinct`, duplicates are read once (cache or kernel);
if it follows k, every position reads its expert's bytes.
"""

import json
import sys
import time

import mlx.core as mx

SHAPES = {  # name: (local experts, expert width, hidden, k)
    "dbrx": (8, 10752, 6144, 4),
    "qwen3-30b-a3b": (64, 768, 2048, 8),
}


def timed(fn, n=30):
    mx.eval(fn())
    t0 = time.perf_counter()
    for _ in range(n):
        mx.eval(fn())
    return (time.perf_counter() - t0) / n


def main() -> int:
    dtype = mx.bfloat16 if mx.default_device().type == mx.DeviceType.gpu else mx.float32
    small = "--small" in sys.argv  # a quick run on a CPU
    for name, (E, F, D, k) in SHAPES.items():
        if small:
            F, D = F // 16, D // 16
        w = [mx.random.normal((E, F, D)).astype(dtype) * 0.01 for _ in range(3)]
        mx.eval(w)
        x = mx.random.normal((1, 1, 1, D)).astype(dtype)
        for distinct in range(1, k + 1):
            slots = mx.array([i % distinct for i in range(k)], dtype=mx.uint32).reshape(1, k)
            for sort in (False, True):

                def step():
                    return [
                        mx.gather_mm(x, wi.swapaxes(-1, -2), rhs_indices=slots, sorted_indices=sort)
                        for wi in w
                    ]

                t = timed(step)
                print(
                    json.dumps(
                        {
                            "shape": name,
                            "k": k,
                            "distinct": distinct,
                            "sorted": sort,
                            "ms": round(1e3 * t, 4),
                            "GB_per_s_if_distinct_read": round(
                                3 * distinct * F * D * dtype.size / t / 1e9, 1
                            ),
                            "GB_per_s_if_k_read": round(3 * k * F * D * dtype.size / t / 1e9, 1),
                        }
                    ),
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
