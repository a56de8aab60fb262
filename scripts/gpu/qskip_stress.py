"""The quantized skip kernel (node/moe/qskip.py) at one expert shape, called many times with random
valid slots at several position counts, each call evaluated on its own: does it ever fault or
differ from gather_qmm? (A DeepSeek-V3 node at N = 4 died with an illegal memory access on its
skip route, not on gather_qmm's.) One JSON line per case; the first fault ends the process.

    PYTHONPATH=/tmp/site python3 scripts/gpu/qskip_stress.py [E D_FF D_MODEL K] [ITERS]
(default: 64 local experts of 2048 x 7168, top-8: DeepSeek-V3 at N = 4; 200 iterations a case)
"""

import json
import sys
import time

import mlx.core as mx

from moe_cluster.node.moe import qskip


def main() -> int:
    args = [int(a) for a in sys.argv[1:]]
    E, F, D, K = args[:4] if len(args) >= 4 else (64, 2048, 7168, 8)
    iters = args[4] if len(args) >= 5 else 200
    quant = {"mode": "affine", "bits": 4, "group_size": 64}
    mats = {}
    for name, shape in (("gate", (E, F, D)), ("down", (E, D, F))):
        w = (mx.random.normal(shape, key=mx.random.key(len(name))) * 0.02).astype(mx.bfloat16)
        wq, s, b = mx.quantize(w, group_size=64, bits=4)
        mx.eval(wq, s, b)
        mats[name] = (wq, s, b)
        del w
        print(json.dumps({"check": name, "why": qskip.check(wq, s, b, quant)}), flush=True)
    for tokens in (1, 8, 18, 64, 512):
        for name, per_x, d_in in (("gate", K, D), ("down", 1, F)):
            wq, s, b = mats[name]
            worst, t0 = 0.0, time.perf_counter()
            for i in range(iters):
                key = mx.random.key(1000 * tokens + i)
                k1, k2, k3 = mx.random.split(key, 3)
                slots = mx.random.randint(-1, E, (tokens * K,), key=k1).astype(mx.int32)
                slots = mx.where(mx.random.uniform(key=k2, shape=slots.shape) < 0.7, -1, slots)
                x = mx.random.normal((tokens * K // per_x, d_in), key=k3).astype(mx.bfloat16)
                got = qskip.qskip(x, wq, s, b, slots, per_x, quant)
                want = qskip.gather_qmm(x, wq, s, b, slots, per_x, quant)
                err = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max() / mx.maximum(
                    mx.abs(want.astype(mx.float32)).max(), 1e-6
                )
                worst = max(worst, err.item())
            print(
                json.dumps(
                    {
                        "tokens": tokens,
                        "proj": name,
                        "iters": iters,
                        "worst_rel": worst,
                        "s": round(time.perf_counter() - t0, 2),
                    }
                ),
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
