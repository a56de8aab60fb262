"""The shared-memory collective across real processes (simulate's and `bench decode`'s transport)."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import numpy as np
import pytest

from moe_cluster.node.collective.shm import unlink_segment
from moe_cluster.node.collective.shm import ShmCollective


def _rank(spec, rank: int, out, done) -> None:
    import mlx.core as mx

    c = ShmCollective(spec, rank)
    total = c.all_reduce(mx.full((4,), float(rank + 1), dtype=mx.float32), layer=0)
    out.put((rank, np.array(total).tolist()))
    done.wait(30)  # keeps its mapping while the parent looks at /dev/shm
    c.close()


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm here")
def test_the_segment_loses_its_name_after_the_first_all_reduce():
    """Once every rank has mapped it, nothing names the segment: a creator killed together with its
    resource tracker (kill -9 of the process group) leaves nothing in /dev/shm."""
    ctx = mp.get_context("spawn")
    spec, shm = ShmCollective.create(2, 64, ctx, timeout_s=30)
    out, done = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_rank, args=(spec, r, out, done)) for r in range(2)]
    try:
        assert (Path("/dev/shm") / spec.name.lstrip("/")).exists()
        for p in procs:
            p.start()
        results = dict(out.get(timeout=60) for _ in procs)
        assert results == {0: [3.0] * 4, 1: [3.0] * 4}  # 1 + 2, on both ranks
        assert not (Path("/dev/shm") / spec.name.lstrip("/")).exists()
        assert all(p.is_alive() for p in procs)  # dropped while both still map it
    finally:
        done.set()
        for p in procs:
            p.join(timeout=30)
        shm.close()
        unlink_segment(shm)  # already gone: no error
    assert [p.exitcode for p in procs] == [0, 0]
