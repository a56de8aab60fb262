"""Simulated nodes tell the parent each phase they finish (node.sim.Beats: loaded, each run or
pass) and each step inside one: the parent bounds each phase, not a whole task, so a big model's
load or a first run's kernel builds are not taken for a hang, and a failed row says on stderr where
its time went. A task may take the previous one's loaded model (`reuse_load`), never one whose
routes were forced."""

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
from moe_cluster.node.collective.specs import ShmSpec
from moe_cluster.node.demo import MODEL_DIR
from moe_cluster.proto.records import Sampling


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
    tick = {"beat": sim.TICK, "rank": 1, "task": 0}  # a step inside the phase: bound renewed
    _feed(q, beats[:2] + [tick, tick], every_s=0.1)
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


def _task(**kw) -> sim.SimTask:
    return sim.SimTask(
        str(MODEL_DIR), (1, 2, 3), Sampling(max_tokens=3), **{"keepalive": "none", **kw}
    )


def test_a_task_takes_the_previous_ones_model_unless_that_one_forced_routes():
    q = queue.Queue()
    tasks = (
        _task(),
        _task(reuse_load=True),
        _task(reuse_load=True, routes=("device",)),
        _task(reuse_load=True),  # its predecessor forced every layer's route: a fresh load
        _task(reuse_load=True, keepalive="lru"),  # another load key
    )
    sim.run(sim.SimJob(0, 1, ShmSpec("unused", 1, 0, ()), tasks), q)
    items = []
    while not q.empty():
        items.append(q.get())
    errors = [i for i in items if "error" in i]
    assert not errors, errors
    loads = [(i["task"], i["beat"]) for i in items if i.get("beat") in ("loaded", sim.REUSED)]
    assert loads == [(0, "loaded"), (1, sim.REUSED), (2, sim.REUSED), (3, "loaded"), (4, "loaded")]
    reports = sorted((i for i in items if "tokens" in i), key=lambda i: i["task"])
    assert len(reports) == 5 and all(r["tokens"] == reports[0]["tokens"] for r in reports)
