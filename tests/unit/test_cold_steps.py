"""Which all-reduces the envoy transport marks cold (they may build kernels, so the envoys wait
COLD_STEP_S for a peer instead of the step timeout): a node's first COLD_WAITS, and every one inside
a step the batch engine watches as cold; the others are bounded by the timeout."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from moe_cluster.node.collective.base import Rider, waiting
from moe_cluster.node.collective.envoy import EnvoyCollective
from moe_cluster.node.collective.reduce import Reducer
from moe_cluster.node.collective.steps import Complete
from moe_cluster.proto.records import COLD_WAITS


class _Envoy:
    """The node end of an envoy, answering at once as a world of one: the partial is the sum."""

    def __init__(self):
        self.cold: list[bool] = []

    def send(self, out, cold=False) -> int:
        self.cold.append(cold)
        self._raw = np.array(out.raw)
        return len(self.cold) - 1

    def collect_parts(self, step) -> Complete:
        return Complete(step, "float32", self._raw.nbytes, [self._raw])


def _collective() -> tuple[EnvoyCollective, _Envoy]:
    c = EnvoyCollective.__new__(EnvoyCollective)  # no child process: the marking is the subject
    envoy = _Envoy()
    c._envoy, c.rank, c.world_size = envoy, 0, 1
    c._rider, c._cold, c._reduced, c.trace = Rider(0, 1), False, 0, None
    c._reduce, c._eager_out = Reducer(), {}
    return c, envoy


def test_the_first_waits_and_the_steps_watched_cold_are_cold_the_rest_warm():
    c, envoy = _collective()
    x = mx.ones((1, 8))
    for _ in range(COLD_WAITS + 2):
        c.all_reduce(x, 0)
    assert envoy.cold == [True] * COLD_WAITS + [False, False]
    with waiting(c, "batch step 7", cold=True):
        c.all_reduce(x, 0)
        c.all_reduce(x, 1)
    with waiting(c, "batch step 8"):
        c.all_reduce(x, 0)
    c.all_reduce(x, 0)  # outside any watched step
    assert envoy.cold[-4:] == [True, True, False, False]
