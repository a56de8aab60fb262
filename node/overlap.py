"""Two micro-batches per decode step: while one half's all-reduce is in flight, the node computes
the other half's layer, as DeepSeek's serving overlaps its dispatch and combine.

The running batch (node/batch.py) keeps its decoding sequences in two lanes, each with its own
batched KV cache, and runs the model once per lane. Where the collective is a graph operation
(`transport: mlx`) both lanes go into one lazy graph and MLX orders the work; elsewhere (the envoy,
shared memory) the MoE layer hands its lazy partial to `Interleave`, which runs the two forward
passes on the one thread that drives MLX, switching twice at each MoE all-reduce: once when a
lane's layer is queued on the device (`mx.async_eval`), once when its partial is handed over
(`Interleave` is then every MoE layer's hand-over, set once when the runtime starts).

    thread: build A(l)  collect B(l-1)  build B(l)  start A(l)  collect A(l)  start B(l)  build A(l+1) ...
    device:           [ A(l) computes ............ ][ B(l) computes ............. ]

So the device computes one lane's layer while the thread collects and sums the other lane's
all-reduce and builds the next graph: the host's share of a step (graph building, the exchange,
the sums) runs beside the device's, where evaluating each partial before handing it over left the
device idle for all of it. One all-reduce is in flight at a time (the envoy's link and the shared
slots hold one), so every node starts them in the same order: A's layer 0, B's layer 0, A's
layer 1, ... A lane's sum is the same all-reduce of the same rows as in the unsplit step, so the
tokens are too.

The forward passes are greenlets (the `greenlet` package): mlx-lm's model code calls the MoE layer
from inside its own loop, and a greenlet can leave and resume it there without a second thread.
"""

from __future__ import annotations

import time
from typing import Callable

import mlx.core as mx

from .moe.combine import HostCombine


def start(collective, partial: mx.array, layer: int) -> Callable[[], mx.array]:
    """`collective.start` where the transport has the two halves, else a whole all-reduce now."""
    if collective.caps.halves:
        return collective.start(partial, layer)
    out = collective.all_reduce(partial, layer)
    return lambda: out


class Interleave:
    """Runs forward passes (lanes) on the calling thread, switching lanes at each all-reduce: the
    MoE layers' `Combine` (node/moe/combine.py) where the node runs two micro-batches. Outside
    `run` (a prefill, a lone lane) it hands a partial over as `HostCombine` does."""

    def __init__(self, collective, timers):
        self.collective = collective
        self._timers = timers
        self._host = HostCombine(collective, timers)
        self._main = None
        self._lanes: list = []
        # (the lane whose all-reduce is in flight, its finish, when it was handed over)
        self._inflight: tuple | None = None
        self._sums: dict = {}
        self.waited_s = 0.0  # time spent waiting for sums (the collective not hidden)
        # time the all-reduces spent in flight, from the hand-over to their sums: what the thread
        # did not wait of it (in_flight_s - waited_s) ran the other lanes, hidden
        self.in_flight_s = 0.0
        self.overlapped = 0  # all-reduces that travelled while another lane computed

    @property
    def running(self) -> bool:
        """Whether the caller is inside `run`."""
        return self._main is not None

    def run(self, lanes: list[Callable[[], object]]) -> list:
        """Each lane's result, in order; a lane runs until its next all-reduce is in flight, then
        the next lane runs. An error in any lane ends the run with it."""
        from greenlet import getcurrent, greenlet

        self._main = getcurrent()
        self._lanes = [greenlet(fn) for fn in lanes]
        out: list = [None] * len(lanes)
        try:
            while not all(g.dead for g in self._lanes):
                for i, g in enumerate(self._lanes):
                    if not g.dead:
                        r = g.switch()
                        if g.dead:
                            out[i] = r
            return out
        finally:
            self._main, self._lanes, self._inflight = None, [], None
            self._sums.clear()

    def __call__(self, layer, x, *args, **kwargs) -> mx.array:
        if self._main is None:
            return self._host(layer, x, *args, **kwargs)
        partial = layer.partial(x, *args, **kwargs)
        t0 = time.perf_counter()
        out, away, evaluated = self._all_reduce(partial, layer.layer)
        # the other lanes' work meanwhile is timed there; this lane's own partial was evaluated
        # inside (its wait counts as the experts')
        self._timers.experts += evaluated
        self._timers.wait(time.perf_counter() - t0 - away - evaluated)
        return out

    def _all_reduce(self, partial: mx.array, layer: int) -> tuple[mx.array, float, float]:
        """From a lane: queue `partial` (lazy) on the device and let the other lanes build and
        queue theirs; then hand it over and let them collect and compute while it travels; then
        (its sum, seconds spent in other lanes, seconds waiting for its own evaluation)."""
        from greenlet import getcurrent

        me = getcurrent()
        others = any(not g.dead and g is not me for g in self._lanes)
        away = 0.0
        if others:
            mx.async_eval(partial)
            t0 = time.perf_counter()
            self._main.switch()
            away = time.perf_counter() - t0
        self._drain()  # the link holds one all-reduce: the one in flight is summed first
        t0 = time.perf_counter()
        mx.eval(partial)
        evaluated = time.perf_counter() - t0
        self._inflight = (me, start(self.collective, partial, layer), time.perf_counter())
        if others:
            t0 = time.perf_counter()
            self._main.switch()
            away += time.perf_counter() - t0
            self.overlapped += 1
        if self._inflight is not None and self._inflight[0] is me:
            self._drain()
        return self._sums.pop(me), away, evaluated

    def _drain(self) -> None:
        if self._inflight is None:
            return
        lane, finish, handed = self._inflight
        self._inflight = None
        t0 = time.perf_counter()
        self._sums[lane] = finish()
        t1 = time.perf_counter()
        self.waited_s += t1 - t0
        self.in_flight_s += t1 - handed
