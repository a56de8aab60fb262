"""Time the ways to multiply a node's selected experts on this device, DBRX-sized, decode batch.

Prints one JSON line per variant and, last, the fastest for 2 rows. node/experts.py uses unsorted
gather_mm below 64 rows because of what this found on an H200 (docs/performance.md, On GPUs).
"""

import json
import sys
import time

import mlx.core as mx


def timed(fn, n=50):
    mx.eval(fn())
    t0 = time.perf_counter()
    for _ in range(n):
        mx.eval(fn())
    return (time.perf_counter() - t0) / n


def main() -> int:
    E, F, D = 8, 10752, 6144  # a node's 8 local experts (16 over 2 nodes)
    w = [mx.random.normal((E, F, D)).astype(mx.bfloat16) * 0.01 for _ in range(3)]
    mx.eval(w)
    results = {}
    for rows in (1, 2, 4):
        x = mx.random.normal((rows, 1, D)).astype(mx.bfloat16)
        slots = mx.arange(rows, dtype=mx.uint32)

        def gather():
            return [
                mx.gather_mm(x, wi.swapaxes(-1, -2), rhs_indices=slots, sorted_indices=True)
                for wi in w
            ]

        def gather_unsorted():
            return [mx.gather_mm(x, wi.swapaxes(-1, -2), rhs_indices=slots) for wi in w]

        def per_expert():
            return [
                mx.concatenate([x[i : i + 1] @ wi[i].T for i in range(rows)], axis=0) for wi in w
            ]

        for name, fn in (
            ("gather", gather),
            ("gather_unsorted", gather_unsorted),
            ("per_expert", per_expert),
        ):
            t = timed(fn)
            gbs = 3 * rows * F * D * 2 / t / 1e9
            results[(rows, name)] = t
            print(
                json.dumps(
                    {
                        "rows": rows,
                        "variant": name,
                        "ms": round(1e3 * t, 3),
                        "GB_per_s": round(gbs, 1),
                    }
                )
            )
    empty = mx.zeros((1,))
    t = timed(lambda: empty + 1, 200)
    print(json.dumps({"variant": "eval of one tiny op", "ms": round(1e3 * t, 3)}))
    best = min(("gather", "gather_unsorted", "per_expert"), key=lambda v: results[(2, v)])
    print(best)
    return 0


if __name__ == "__main__":
    sys.exit(main())
