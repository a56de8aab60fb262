"""A simulated node's failure after load names the decode route it chose, so that a device fault on
one route (a kernel, a copy) can be told from another's in a benchmark's error line; a user's
mistake reads as itself."""

from __future__ import annotations

import queue

import pytest

from moe_cluster.node import sim
from moe_cluster.node.demo import MODEL_DIR
from moe_cluster.node.runtime import NodeRuntime
from moe_cluster.proto.errors import UserError
from moe_cluster.proto.records import Sampling


def _task(prompt=(1, 2, 3)) -> sim.SimTask:
    return sim.SimTask(str(MODEL_DIR), tuple(prompt), Sampling(max_tokens=2), keepalive="none")


def _failure(task: sim.SimTask) -> dict:
    job = sim.SimJob(0, 1, None, (task,))
    with pytest.raises(BaseException) as info:
        sim._run(job, 0, task, sim._load(job, task, None), sim.Beats(queue.Queue(), 0, 0))
    return sim._error(0, 0, info.value)


def test_a_device_fault_after_load_names_the_route(monkeypatch):
    def fault(self, req, result=None):
        raise RuntimeError("cudaGetLastError() failed: an illegal memory access was encountered")
        yield

    monkeypatch.setattr(NodeRuntime, "generate", fault)
    rep = _failure(_task())
    assert rep["route"] and rep["route"].startswith("device")  # alone: every expert is local
    assert rep["error"] == (
        "RuntimeError: cudaGetLastError() failed: an illegal memory access was encountered "
        f"(decode route: {rep['route']})"
    )


def test_a_token_past_the_embedding_is_refused_by_name_not_read():
    """Reading it would read outside the embedding (the process died of a segmentation fault
    before simulate's nodes checked a request as an agent does)."""
    rep = _failure(_task(prompt=(1, 10**9)))
    assert rep["kind"] == sim.kind_of(UserError("x")).value
    assert "decode route" not in rep["error"] and "10000000" in rep["error"], rep["error"]
