"""Two micro-batches per step (node/overlap.py): the lanes' all-reduces interleave in one order on
every node, one in flight at a time, each lane gets its own sums, and a lane's failure ends the
step. Real processes: tests/integration/test_overlap.py; through `up`: tests/cluster/test_batching.py."""

from __future__ import annotations

import mlx.core as mx
import pytest

from moe_cluster.node.collective.base import Capabilities
from moe_cluster.node.moe.telemetry import Timers
from moe_cluster.node.overlap import Interleave


class Layer:
    """A MoE layer's stand-in: its partial is its input."""

    def __init__(self, layer: int):
        self.layer = layer

    def partial(self, x):
        return x


class Recorder:
    """A collective with two halves that notes every start and finish; its sum doubles."""

    world_size = 2
    caps = Capabilities(in_graph=False, halves=True)

    def __init__(self) -> None:
        self.log: list[tuple[str, str, int]] = []
        self.inflight = 0

    def start(self, partial, layer):
        assert self.inflight == 0, "two all-reduces in flight"
        self.inflight += 1
        lane = "A" if float(partial[0]) < 100 else "B"
        self.log.append(("start", lane, layer))

        def finish():
            self.inflight -= 1
            self.log.append(("finish", lane, layer))
            return partial * 2

        return finish


def _lane(il: Interleave, base: float, layers: int, got: list):
    def run():
        x = mx.array([base])
        for layer in range(layers):
            x = il(Layer(layer), x + 1)
            got.append((base, layer, float(x[0])))
        return float(x[0])

    return run


def test_lanes_take_turns_one_all_reduce_in_flight_and_each_gets_its_own_sums():
    c = Recorder()
    il = Interleave(c, Timers())
    got: list = []
    a, b = il.run([_lane(il, 0.0, 3, got), _lane(il, 100.0, 2, got)])
    assert a == ((0 + 1) * 2 + 1) * 2 * 2 + 2 and a == 14.0  # ((1*2+1)*2+1)*2
    assert b == ((100 + 1) * 2 + 1) * 2
    starts = [(lane, layer) for kind, lane, layer in c.log if kind == "start"]
    # A's layer l goes out, B computes its layer l meanwhile, then A's comes back, and so on; B
    # has fewer layers, and A's last all-reduce runs alone
    assert starts == [("A", 0), ("B", 0), ("A", 1), ("B", 1), ("A", 2)]
    assert c.log[:4] == [
        ("start", "A", 0),
        ("finish", "A", 0),
        ("start", "B", 0),
        ("finish", "B", 0),
    ]
    assert c.inflight == 0 and not il.running


def test_each_lane_builds_its_layer_before_the_other_lanes_is_handed_over():
    """A lane's layer is queued on the device and the other lane builds and queues its own before
    either is handed over: the device computes one while the thread works for the other."""
    c = Recorder()
    timers = Timers()
    il = Interleave(c, timers)
    events: list = []

    def lane(base: float, name: str):
        def run():
            x = mx.array([base])
            for layer in range(2):
                events.append(("built", name, layer))
                x = il(Layer(layer), x + 1)
            return float(x[0])

        return run

    real = c.start

    def start(partial, layer):
        events.append(("start", "A" if float(partial[0]) < 100 else "B", layer))
        return real(partial, layer)

    c.start = start
    il.run([lane(0.0, "A"), lane(100.0, "B")])
    assert events == [
        ("built", "A", 0),
        ("built", "B", 0),
        ("start", "A", 0),
        ("start", "B", 0),
        ("built", "A", 1),
        ("built", "B", 1),
        ("start", "A", 1),
        ("start", "B", 1),
    ]
    # every all-reduce travelled while the other lane was alive, and each wait was timed once
    assert il.overlapped == 4 and len(timers.waits) == 4


def test_a_failing_lane_ends_the_run_with_its_error():
    c = Recorder()
    il = Interleave(c, Timers())

    def broken():
        il(Layer(0), mx.array([1.0]))
        raise RuntimeError("lane B broke")

    with pytest.raises(RuntimeError, match="lane B broke"):
        il.run([_lane(il, 0.0, 3, []), broken])
    assert not il.running
    # the other lane's all-reduce was left in flight: the batch fails every sequence and its next
    # step begins a new epoch on the transport; the interleave itself keeps nothing of the run
    c.inflight = 0
    assert il.run([_lane(il, 0.0, 1, [])]) == [2.0]


class Clock:
    """perf_counter for node/overlap.py: time moves only when a lane builds or the link is waited
    for, so what each all-reduce hid is known from the schedule, not from the Interleave's books."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class Link:
    """A collective whose sums arrive TRAVEL seconds after the hand-over; it keeps its own books:
    each all-reduce's seconds in flight (hand-over to sum) and waited for."""

    world_size = 2
    caps = Capabilities(in_graph=False, halves=True)

    def __init__(self, clock: Clock, travel: float) -> None:
        self.clock, self.travel = clock, travel
        self.handed: float | None = None
        self.flight = self.waited = 0.0

    def start(self, partial, layer):
        self.handed = handed = self.clock.now

        def finish():
            wait = max(0.0, handed + self.travel - self.clock.now)
            self.clock.now += wait
            self.flight += self.clock.now - handed
            self.waited += wait
            self.handed = None
            return partial * 2

        return finish


def test_the_bench_s_in_flight_hidden_is_the_share_of_the_flights_the_other_lane_built_in(
    monkeypatch,
):
    """bench race's `in_flight_hidden` (coordinator/bench/race_rows.py `hidden`, from the
    Interleave's in-flight and waited seconds) against what the schedule says: the seconds a lane
    spent building its layer while the other lane's all-reduce travelled, over the seconds the link
    carried all-reduces. Build 3 ms, travel 5 ms, 4 layers a lane: A builds layers 1-3 while B's
    layers 0-2 travel (3 ms of each 5 ms flight hidden, 2 ms waited); B builds each layer before
    A's is handed over, so A's 4 flights and B's last hide nothing: 9 ms of 40."""
    from types import SimpleNamespace

    from moe_cluster.coordinator.bench.race_rows import hidden
    from moe_cluster.node import overlap

    clock = Clock()
    monkeypatch.setattr(overlap, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    link = Link(clock, travel=0.005)
    il = Interleave(link, Timers())
    behind = [0.0]  # build seconds spent while an all-reduce was in flight

    def lane(base: float, layers: int):
        def run():
            x = mx.array([base])
            for layer in range(layers):
                if link.handed is not None:
                    behind[0] += 0.003
                clock.now += 0.003  # building the layer's graph on the thread
                x = il(Layer(layer), x + 1)
            return float(x[0])

        return run

    il.run([lane(0.0, 4), lane(100.0, 4)])
    assert il.overlapped == 8
    assert (behind[0], link.flight) == pytest.approx((0.009, 0.040))
    base = {"name": "ours_envoy", "streams": 3, "breakdown_per_step_s": {"collective_wait": 1.0}}
    split = {
        **base,
        "name": "ours_envoy_overlap",
        "moe_layers": 4,
        "overlap_s": (il.in_flight_s, il.waited_s),  # as the batch reports them
    }
    hidden([base, split])
    assert split["overlap"]["in_flight_hidden"] == pytest.approx(behind[0] / link.flight), (
        split["overlap"],
        behind[0],
        link.flight,
    )
