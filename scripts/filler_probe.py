"""Where should a node send the positions another node computes? The device-routed decode step
(node/moe/experts.py, keepalive none) computes all k positions and zeroes the others' outputs, so
each of those positions reads some local expert's weights. This times one token's expert block
over many layers (so no layer's weights stay in cache between visits), with those positions
pointed at slot 0, an expert the node did not select, or at one of the node's own selected slots,
which it reads anyway.

    python scripts/filler_probe.py --layers 24 --hidden 1024 --width 1024

Prints one JSON line per round: ms per layer for each, and their ratio.
"""

import argparse
import json
import statistics
import time

import mlx.core as mx
import numpy as np
from mlx_lm.models.switch_layers import SwitchGLU


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--width", type=int, default=1024, help="expert FFN width")
    ap.add_argument("--local", type=int, default=16, help="experts this node holds per layer")
    ap.add_argument(
        "--mine", type=int, default=2, help="of k = 4 positions, how many are this node's"
    )
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    banks = []
    for _ in range(args.layers):
        bank = SwitchGLU(args.hidden, args.width, args.local)
        mx.eval(bank.parameters())
        banks.append(bank)
    x = mx.random.normal((1, 1, args.hidden))
    rng = np.random.default_rng(0)

    def per_layer(target: str) -> float:
        t0 = time.perf_counter()
        for bank in banks:
            mine = [
                int(s) for s in rng.choice(np.arange(1, args.local), args.mine, replace=False)
            ]  # never slot 0
            other = 0 if target == "slot0" else max(mine)
            slots = mx.array([[mine + [other] * (4 - args.mine)]], dtype=mx.uint32)
            mx.eval(bank(x, slots))
        return (time.perf_counter() - t0) / args.layers

    for r in range(args.rounds):
        ms = {
            t: 1e3 * statistics.median(per_layer(t) for _ in range(8))
            for t in ("slot0", "selected")
        }
        print(
            json.dumps(
                {
                    "round": r,
                    "ms_per_layer_slot0": round(ms["slot0"], 3),
                    "ms_per_layer_selected": round(ms["selected"], 3),
                    "selected_over_slot0": round(ms["selected"] / ms["slot0"], 3),
                    "expert_mb": round(3 * args.hidden * args.width * 4 / 1e6, 1),
                }
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
