"""When the node's exchange may busy-wait on a peer's socket (node/collective/spin.py): idle cores
only, bounded."""

from __future__ import annotations

import pytest

from moe_cluster.node.collective.spin import SpinPolicy, spin_allowed


@pytest.mark.parametrize(
    "cores, load, allowed",
    [
        (2, 0.0, False),  # this VM: a spinner takes the core its peer needs
        (3, 0.0, False),
        (16, 0.0, True),  # the GPU host, idle
        (16, 4.0, True),  # with a node and an envoy per rank spinning, 2 ranks
        (16, 14.5, False),  # the cores are busy with other work
        (4, 2.0, True),
        (4, 2.5, False),
    ],
)
def test_spin_only_where_cores_are_idle(cores, load, allowed):
    assert spin_allowed(cores, load) is allowed


def test_policy_rechecks_the_load_once_a_second():
    now, load = [0.0], [0.0]
    policy = SpinPolicy(1e-3, cores=lambda: 16, load=lambda: load[0], clock=lambda: now[0])
    assert policy.budget_s() == 1e-3
    load[0] = 15.0
    now[0] = 0.5
    assert policy.budget_s() == 1e-3  # not looked at again yet
    now[0] = 1.6
    assert policy.budget_s() == 0.0
    load[0] = 1.0
    now[0] = 3.0
    assert policy.budget_s() == 1e-3


def test_no_load_average_means_no_spin():
    def load() -> float:
        raise OSError("no /proc/loadavg")

    assert SpinPolicy(1e-3, cores=lambda: 16, load=load).budget_s() == 0.0
