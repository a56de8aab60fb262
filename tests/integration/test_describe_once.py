"""`up` reads a checkpoint's metadata once: the coordinator's steps — placement, shipping, the API's
vocabulary, the load check — and a node's load all take one description (node/describe.py). Each
read is counted while they run on the demo checkpoint, two ranks in this process."""

from __future__ import annotations

import asyncio
import numpy as np

from moe_cluster.node import checkpoint as checkpoint_mod
from moe_cluster.node import describe as describe_mod


def test_up_reads_the_checkpoint_once(monkeypatch, tmp_path):
    from moe_cluster.coordinator.serve.placement import NodeBudget, plan_placement
    from moe_cluster.coordinator.serve.ship import Shipper
    from moe_cluster.coordinator.serve.placement import footprint
    from moe_cluster.coordinator.serve.verify import check_load
    from moe_cluster.node.catalog import Catalog
    from moe_cluster.node.moe.load import _Seat, load_shard

    reads = {"config": 0, "headers": 0, "probes": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            reads[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(
        checkpoint_mod, "_config_bytes", counted("config", checkpoint_mod._config_bytes)
    )
    monkeypatch.setattr(
        checkpoint_mod, "_read_header", counted("headers", checkpoint_mod._read_header)
    )
    monkeypatch.setattr(
        describe_mod, "find_moe_blocks", counted("probes", describe_mod.find_moe_blocks)
    )

    ckpt = checkpoint_mod.Checkpoint.open("demo")
    files = len({t.file for t in ckpt.tensors.values()})
    desc = describe_mod.describe(ckpt)
    fp = footprint(desc)
    plan = plan_placement(fp, [NodeBudget("a", 1 << 30), NodeBudget("b", 1 << 30)])
    shipper = Shipper(desc, report=lambda line: None)
    assert shipper.catalog == Catalog.of(desc) and desc.vocab > 0
    shards = [
        load_shard(desc, plan.placement, r, collective=_Seat(r, 2), warm_up=False, route="device")
        for r in range(2)
    ]

    members = [_Member(r, sm) for r, sm in enumerate(shards)]
    checks = asyncio.run(check_load(members, desc))
    assert checks and all(
        np.isfinite(c.max_abs_diff) and c.max_abs_diff <= c.tolerance for c in checks
    )
    assert reads == {"config": 1, "headers": files, "probes": 1}, reads


class _Member:
    """A cluster member as the load check sees it: its client answers with its shard's share."""

    def __init__(self, rank, sharded):
        self.rank, self.client, self._sharded = rank, self, sharded

    async def probe(self, layer, x, timeout=None):
        return self._sharded.probe(layer, x)
