"""Does a node at N > 1 read only its own quantized experts per MoE layer? The quantized skip kernel
(node/moe/qskip.py) against gather_qmm, in two parts, one JSON line each:

1. `exact`: per format (affine 4/8-bit with groups of 32/64/128, mxfp4) and activation dtype, the
   kernel against gather_qmm (as the device route runs it, and in float32) on random inputs, positions skipped (-1) and not, k
   positions sharing one input row (gate/up) and one row each (down): the largest |diff|, the same
   relative to the output's largest value, whether skipped positions are exactly zero, and the
   load-time check's answer (qskip.check) at this shape.
2. `time`: one decode token's expert step (gate, up, SiLU, down over k positions) with m of the k
   positions this node's (m distinct local experts) and the rest another node's, two ways: gather_qmm
   (the device route: the other positions go to slot 0 and are zeroed) and qskip (nothing read for
   them), for a DBRX-like and a Qwen3-30B-A3B-like expert shape (local experts at N = 2). If the
   kernel reads E[n] experts, its time grows with m; gather_qmm's stays at k experts' bytes.
3. `route`: rank 0 of two's ExpertShard of those shapes (bfloat16, and 4-bit group 64; keepalive none)
   timed on each decode route as a node does at load (node/moe/route.py: one token, k experts drawn
   from all 2E, median of 7), and the route it would keep.

    PYTHONPATH=/tmp/site python3 scripts/gpu/qskip_probe.py [--small] > qskip.jsonl
`--small`: 256 x 512 experts and a few formats (a quick run; on a CPU only part 1's reference runs).
"""

import itertools
import json
import sys

import mlx.core as mx

from distinct_probe import timed  # this folder's probes (python3 scripts/gpu/qskip_probe.py)
from moe_cluster.node.moe import qskip
from skip_probe import (
    SHAPES,
)  # local experts at N = 2, expert width, hidden, k: DBRX, Qwen3-30B-A3B

FORMATS = [
    ("affine", 4, 32),
    ("affine", 4, 64),
    ("affine", 4, 128),
    ("affine", 8, 32),
    ("affine", 8, 64),
    ("affine", 8, 128),
    ("mxfp4", 4, 32),
]
TIMED = [("affine", 4, 64), ("affine", 8, 64), ("mxfp4", 4, 32)]  # mlx-community's usual ones


def quantized(w, mode, bits, group):
    q = mx.quantize(w, group_size=group, bits=bits, mode=mode)
    return (
        q[0],
        q[1],
        (q[2] if len(q) > 2 else None),
        {"mode": mode, "bits": bits, "group_size": group},
    )


def nbytes(*arrays):
    return sum(a.nbytes for a in arrays if a is not None)


def exact(small: bool, on_gpu: bool) -> None:
    run = qskip.qskip if on_gpu else qskip.reference
    for dtype in (mx.bfloat16, mx.float16):
        for mode, bits, group in FORMATS if not small else FORMATS[::3]:
            for e, d_out, d_in, k in ((8, 256, 512, 4), (4, 96, 384, 8)):
                w = (mx.random.normal((e, d_out, d_in), key=mx.random.key(1)) * 0.05).astype(dtype)
                wq, scales, biases, quant = quantized(w, mode, bits, group)
                for per_x in (k, 1):  # gate/up: k positions share a row; down: a row each
                    rows = (mx.random.normal((k // per_x, d_in), key=mx.random.key(2))).astype(
                        dtype
                    )
                    slots = mx.random.randint(-1, e, (k,), key=mx.random.key(3 + per_x)).astype(
                        mx.int32
                    )
                    slots = mx.concatenate(
                        [slots[:-1], mx.array([-1], dtype=mx.int32)]
                    )  # one skipped at least
                    case = {
                        "part": "exact",
                        "dtype": str(dtype),
                        "mode": mode,
                        "bits": bits,
                        "group": group,
                        "shape": [e, d_out, d_in],
                        "per_x": per_x,
                    }
                    try:
                        got = run(rows, wq, scales, biases, slots, per_x, quant).astype(mx.float32)
                        mx.eval(got)
                    except Exception as exc:  # noqa: BLE001 - said, and the other cases still run
                        print(
                            json.dumps({**case, "error": f"{type(exc).__name__}: {exc}"[:500]}),
                            flush=True,
                        )
                        continue
                    want = qskip.gather_qmm(rows, wq, scales, biases, slots, per_x, quant).astype(
                        mx.float32
                    )
                    exact32 = qskip.gather_qmm(
                        rows, wq, scales, biases, slots, per_x, quant, float32=True
                    )
                    diff = mx.abs(got - want).max().item()
                    diff32 = mx.abs(got - exact32).max().item()
                    skipped = mx.abs(mx.where((slots < 0)[:, None], got, 0.0)).max().item()
                    print(
                        json.dumps(
                            {
                                **case,
                                "kernel": "qskip" if on_gpu else "reference",
                                "slots": slots.tolist(),
                                "max_abs_diff": diff,
                                "max_rel_diff": diff / max(mx.abs(want).max().item(), 1e-6),
                                # against gather_qmm with float32 activations and scales: the sum
                                # both approximate (the load-time check's reference)
                                "max_abs_diff_f32": diff32,
                                "max_rel_diff_f32": diff32
                                / max(mx.abs(exact32).max().item(), 1e-6),
                                "skipped_zero": skipped == 0.0,
                                "check": qskip.check(wq, scales, biases, quant) if on_gpu else None,
                            }
                        ),
                        flush=True,
                    )


def timing(small: bool) -> None:
    dtype = mx.bfloat16
    for name, (E, F, D, k) in SHAPES.items():
        if small:
            F, D = 256, 512
        for mode, bits, group in TIMED:
            ws = []
            for shape in ((E, F, D), (E, F, D), (E, D, F)):
                w = (mx.random.normal(shape) * 0.02).astype(dtype)
                ws.append(quantized(w, mode, bits, group))
                mx.eval(ws[-1][:3])
                del w
            (gq, gs, gb, quant), (uq, us, ub, _), (dq, ds, db, _) = ws
            expert_bytes = nbytes(gq, gs, gb, uq, us, ub, dq, ds, db) / E
            x = mx.random.normal((1, D)).astype(dtype)
            why = {"gate": qskip.check(gq, gs, gb, quant), "down": qskip.check(dq, ds, db, quant)}
            print(
                json.dumps(
                    {
                        "part": "check",
                        "shape": name,
                        "mode": mode,
                        "bits": bits,
                        "group": group,
                        **why,
                    }
                ),
                flush=True,
            )
            if any(why.values()):  # the kernel does not build or differs here: nothing to time
                continue
            for m in range(0, k + 1):
                slots = mx.array(
                    [i if i < m else -1 for i in range(k)], dtype=mx.int32
                )  # m distinct local experts

                def by_gather():
                    h = qskip.gather_qmm(x, gq, gs, gb, slots, k, quant)
                    h = mx.sigmoid(h) * h * qskip.gather_qmm(x, uq, us, ub, slots, k, quant)
                    return qskip.gather_qmm(h, dq, ds, db, slots, 1, quant)

                def by_skip():
                    h = qskip.qskip(x, gq, gs, gb, slots, k, quant)
                    h = mx.sigmoid(h) * h * qskip.qskip(x, uq, us, ub, slots, k, quant)
                    return qskip.qskip(h, dq, ds, db, slots, 1, quant)

                diff = (
                    mx.abs(by_skip().astype(mx.float32) - by_gather().astype(mx.float32))
                    .max()
                    .item()
                )
                tg, ts = timed(by_gather), timed(by_skip)
                print(
                    json.dumps(
                        {
                            "part": "time",
                            "shape": name,
                            "mode": mode,
                            "bits": bits,
                            "group": group,
                            "k": k,
                            "mine": m,
                            "gather_qmm_ms": round(1e3 * tg, 4),
                            "qskip_ms": round(1e3 * ts, 4),
                            "speedup": round(tg / ts, 2),
                            "max_abs_diff": diff,
                            "qskip_GB_per_s_of_mine": round(m * expert_bytes / ts / 1e9, 1)
                            if m
                            else None,
                            "gather_GB_per_s_if_k_read": round(k * expert_bytes / tg / 1e9, 1),
                        }
                    ),
                    flush=True,
                )
            mx.clear_cache()


def routes(small: bool) -> None:
    from mlx_lm.models.switch_layers import SwiGLU

    from moe_cluster.node.moe import route
    from moe_cluster.node.moe.experts import ExpertShard, ShardLinear, ShardState
    from moe_cluster.proto.placement import Placement

    for (name, (E, F, D, k)), fmt in itertools.product(
        SHAPES.items(), ("bfloat16", "affine 4-bit g64")
    ):
        if small:
            F, D = 256, 512
        placement = Placement.even({0: 2 * E}, 2)
        projs = {}
        for proj, shape in (
            ("gate_proj", (E, F, D)),
            ("up_proj", (E, F, D)),
            ("down_proj", (E, D, F)),
        ):
            w = (mx.random.normal(shape) * 0.02).astype(mx.bfloat16)
            if fmt == "bfloat16":
                projs[proj] = ShardLinear(w)
                mx.eval(w)
                continue
            wq, scales, biases, quant = quantized(w, "affine", 4, 64)
            projs[proj] = ShardLinear(wq, scales=scales, biases=biases, quant=quant)
            mx.eval(wq, scales, biases)
            del w
        shard = ExpertShard(
            0,
            placement.layers[0][0],
            placement.holders(0, 2 * E),
            projs,
            "glu",
            SwiGLU(),
            ShardState(0, 2, "none"),
        )
        why = shard.enable_skip_gemv()
        choice = route.choose([shard], [k], "measure")
        print(
            json.dumps(
                {
                    "part": "route",
                    "shape": name,
                    "experts": 2 * E,
                    "k": k,
                    "format": fmt,
                    "skip": why or "on",
                    "times_us": choice.times_us,
                    "chosen": choice.route,
                }
            ),
            flush=True,
        )
        del shard, projs
        mx.clear_cache()


def main() -> int:
    small = "--small" in sys.argv
    on_gpu = qskip.available()
    print(
        json.dumps(
            {
                "part": "device",
                "device": str(mx.default_device()),
                "qskip_available": on_gpu,
                "mlx": mx.__version__,
            }
        ),
        flush=True,
    )
    exact(small, on_gpu)
    if on_gpu:
        timing(small)
    routes(small)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
