"""Does `up`'s load-time check pass a float32 checkpoint on a GPU? MLX computes a GPU's float32
matmuls in TF32 unless MLX_ENABLE_TF32=0, and the check holds float32 layers to 1e-4. This runs
coordinator/serve/verify.py's check_load on the demo checkpoint against two in-process node shards
(their `ShardedModel.probe`, as a node agent answers it), as shipped and with node/device.py's
ieee_float32 disabled. One JSON line each.

    PYTHONPATH=/tmp/site python3 scripts/gpu/load_check_probe.py
"""

import asyncio
import contextlib
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx

from moe_cluster.coordinator.serve import verify
from moe_cluster.node.demo import MODEL_DIR
from moe_cluster.node.moe import load, structure

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rank_alone_probe import AloneCollective  # noqa: E402


async def _check(shards):
    async def probe(sm, layer, x, timeout=None):
        return sm.probe(layer, x)

    members = [
        SimpleNamespace(
            rank=r, client=SimpleNamespace(probe=lambda l, x, timeout=None, sm=sm: probe(sm, l, x))
        )
        for r, sm in enumerate(shards)
    ]
    from moe_cluster.node.checkpoint import Checkpoint
    from moe_cluster.node.describe import describe

    return await verify.check_load(members, describe(Checkpoint.open(MODEL_DIR)))


def main() -> int:
    shards = [
        load.load_shard(str(MODEL_DIR), None, r, keepalive="none", collective=AloneCollective(r, 2))
        for r in range(2)
    ]
    base = {
        "device": str(mx.default_device()),
        "MLX_ENABLE_TF32": os.environ.get("MLX_ENABLE_TF32", "(default: 1)"),
    }
    for variant in ("as shipped", "without ieee_float32"):
        if variant != "as shipped":
            load.ieee_float32 = structure.ieee_float32 = lambda dtype=None: contextlib.nullcontext()
        try:
            checks = asyncio.run(_check(shards))
            row = {
                "passed": True,
                "layers": [[c.layer, c.max_abs_diff, c.tolerance] for c in checks],
            }
        except verify.LoadCheckError as e:
            row = {"passed": False, "error": str(e)}
        print(json.dumps({**base, "variant": variant, **row}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
