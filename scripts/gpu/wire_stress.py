"""The node side of an envoy all-reduce, alone on one GPU, many times: does reading an evaluated
MLX array through the buffer protocol and making a new array from host memory, between big
kernels, ever fault? (Ours over the envoy died with an illegal memory access on the DeepSeek-V3
shape where the same model over NCCL did not: docs/gpu/run17.) Each layer: a 4-bit gather_qmm of
8 local experts of DeepSeek-V3's size over the token, then the partial to the host the way
`node/collective/base.py` `to_wire` does (a zero-copy view of the managed buffer), a copy into a
host buffer standing in for the shared area, and `from_wire`'s `mx.array` back, added to the
residual. One JSON line per 1,000 layers; an exception ends it.

    PYTHONPATH=/tmp/site python3 scripts/gpu/wire_stress.py [LAYERS] [--async]
(default 20000 layers; --async also keeps the next layer's matmul in flight while the host reads)
"""

import json
import sys
import time

import mlx.core as mx
import numpy as np

from moe_cluster.node.collective.base import from_wire, to_wire


def main() -> int:
    layers = int(next((a for a in sys.argv[1:] if a.isdigit()), "20000"))
    overlap = "--async" in sys.argv
    E, F, D, K = 64, 2048, 7168, 8
    w = (mx.random.normal((E, F, D), key=mx.random.key(0)) * 0.02).astype(mx.bfloat16)
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    down = (mx.random.normal((E, D, F), key=mx.random.key(1)) * 0.02).astype(mx.bfloat16)
    dq, ds, db = mx.quantize(down, group_size=64, bits=4)
    mx.eval(wq, s, b, dq, ds, db)
    del w, down
    h = (mx.random.normal((1, D), key=mx.random.key(2)) * 0.1).astype(mx.bfloat16)
    shared = np.empty(D * 4, dtype=np.uint8)  # the shared area the envoy writes the sum into
    t0, rng = time.perf_counter(), np.random.default_rng(0)
    for i in range(layers):
        inds = mx.array(rng.choice(E, K, replace=False).astype(np.uint32))
        x = h[:, None, None, :]
        up = mx.gather_qmm(x, wq, s, b, rhs_indices=inds[None], transpose=True, group_size=64)
        y = mx.gather_qmm(
            mx.sigmoid(up) * up, dq, ds, db, rhs_indices=inds[None], transpose=True, group_size=64
        )
        partial = y.sum(axis=-3).reshape(1, D)
        ahead = mx.gather_qmm(x, wq, s, b, rhs_indices=inds[None], transpose=True, group_size=64)
        if overlap:
            mx.async_eval(ahead)
        raw, dtype = to_wire(partial)
        n = raw.nbytes
        shared[:n] = raw.reshape(-1).view(np.uint8)
        back = from_wire(shared[:n].view(raw.dtype), dtype, partial.shape)
        h = (h + back * 0.01).astype(mx.bfloat16)
        if (i + 1) % 1000 == 0 or i + 1 == layers:
            mx.eval(h)
            print(
                json.dumps(
                    {"layers": i + 1, "s": round(time.perf_counter() - t0, 1), "async": overlap}
                ),
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
