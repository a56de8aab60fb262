"""Whether mlx-lm's tensor parallelism runs on this host, per mx.distributed backend (runs 5 and 8 on
CUDA: NCCL fails in sharded_load with "There is no Stream(gpu, 1) in current thread"): a small
checkpoint of the same family, two processes, one GPU each where the host has two. One JSON line per
try, printed as it ends:

    python3 scripts/gpu/tp_probe.py [MODEL] > tp.jsonl      (MODEL: a folder; default the demo model)
"""

from __future__ import annotations

import json
import os
import sys
import time

import mlx.core as mx

from moe_cluster.coordinator.bench.tensor_parallel import measure
from moe_cluster.node.checkpoint import Checkpoint, load_tokenizer


def main() -> None:
    path = str(Checkpoint.open(sys.argv[1] if len(sys.argv) > 1 else "demo").path)
    ids = load_tokenizer(path).encode("The quick brown fox jumps over the lazy dog.")
    gpus = len(os.popen("nvidia-smi -L 2>/dev/null").read().strip().splitlines()) >= 2
    for backend in ("nccl", "ring"):
        if not mx.distributed.is_available(backend):
            print(json.dumps({"backend": backend, "error": "not in this MLX build"}), flush=True)
            continue
        t0 = time.time()
        r = measure(path, 2, ids, 16, 1, timeout_s=120, gpus=gpus, backend=backend)
        print(
            json.dumps(
                {
                    "gpus": gpus,
                    "seconds": round(time.time() - t0, 1),
                    **{k: v for k, v in r.items() if k != "tokens"},
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
