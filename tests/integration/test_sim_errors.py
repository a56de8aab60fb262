"""A simulated node's failure after load names the decode route it chose, so that a device fault on
one route (a kernel, a copy) can be told from another's in a benchmark's error line; a user's
mistake reads as itself."""

from __future__ import annotations

import queue
import re
import threading
import time

import pytest
from conftest import cli

from moe_cluster.coordinator.dev import simulate
from moe_cluster.node import sim
from moe_cluster.node.collective.base import CollectiveError
from moe_cluster.node.demo import MODEL_DIR
from moe_cluster.node.runtime import NodeRuntime
from moe_cluster.proto.errors import UserError
from moe_cluster.proto.records import Sampling


def _task(prompt=(1, 2, 3)) -> sim.SimTask:
    return sim.SimTask(str(MODEL_DIR), tuple(prompt), Sampling(max_tokens=2), keepalive="none")


def _failure(task: sim.SimTask) -> dict:
    job = sim.SimJob(0, 1, None, (task,))
    with pytest.raises(BaseException) as info:
        sim._run(job, 0, task, sim._load(job, task, None), lambda what: None)
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


def _feed(q, items, every_s: float) -> None:
    def run():
        for item in items:
            time.sleep(every_s)
            q.put(item)

    threading.Thread(target=run, daemon=True).start()


def test_nodes_that_beat_get_a_bound_per_phase_not_per_task():
    """A big model's load and a first run's kernel builds take minutes: nodes that keep finishing
    phases are waited for past any one phase's bound, and nodes that stop are named with the last
    phase any of them finished."""
    q = queue.Queue()
    beats = [{"beat": f"pass {i}", "rank": 0, "task": 0} for i in range(6)]
    _feed(q, beats + [{"rank": 0, "task": 0, "tokens": [1]}], every_s=0.15)
    t0 = time.monotonic()
    reports = simulate.collect(q, [], 1, phase_s=0.5)
    assert time.monotonic() - t0 > 0.9  # longer than the bound: the beats carried it
    assert reports[(0, 0)]["tokens"] == [1]

    q = queue.Queue()
    _feed(q, beats[:2], every_s=0.1)
    with pytest.raises(
        CollectiveError, match=r"no progress in 0.4 s \(the last: rank 0 task 0 pass 1\)"
    ):
        simulate.collect(q, [], 1, phase_s=0.4)


def test_a_simulated_node_says_on_stderr_where_its_time_went():
    out = cli(
        "simulate", "--model", str(MODEL_DIR), "--nodes", "2", "--prompt", "hi", "--max-tokens", "2"
    )
    assert out.returncode == 0, out.stderr
    for rank in (0, 1):
        assert re.search(rf"rank {rank} task 0: loaded in \d+\.\d s", out.stderr), out.stderr
        assert re.search(rf"rank {rank} task 0: run 0 in \d+\.\d s \(\d+\.\d s since", out.stderr)
