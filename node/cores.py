"""Node processes that share one machine, each on its own share of the cores.

A race or a simulation runs its N nodes as N processes of one host, standing in for N machines.
Left to the scheduler, a node's threads move onto the cores another node is computing on: the
ring's socket threads poll while they wait for a peer, an MLX worker wakes on whichever core is
free, and a step's time then depends on where the scheduler put whom. Each node given cores of its
own is what N machines are, and the rows of one race run alike from pass to pass (docs/race.md).
"""

from __future__ import annotations

import os


def usable() -> list[int]:
    """The cores this process may run on (cgroups, taskset); [] where the OS does not say."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # macOS: no affinity to read or set
        return []


def shares(nodes: int, cores: list[int] | None = None) -> list[tuple[int, ...]] | None:
    """An even, disjoint share of `cores` (default: this process's) for each of `nodes` processes,
    in rank order; None where there are fewer cores than nodes (or none known)."""
    cores = usable() if cores is None else sorted(cores)
    if nodes < 1 or len(cores) < nodes:
        return None
    each = len(cores) // nodes
    return [tuple(cores[r * each : (r + 1) * each]) for r in range(nodes)]


def pin(cores: tuple[int, ...] | None) -> None:
    """Keep every thread of this process, and those it starts later, on `cores` (None: leave
    them). Linux sets affinity per thread, so each one already running is set in turn."""
    if not cores or not hasattr(os, "sched_setaffinity"):
        return
    try:
        os.sched_setaffinity(0, cores)  # this thread, and the threads it starts from now on
    except OSError:  # not allowed here (a container's policy): the node's report says where it ran
        return
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:  # a thread that ended meanwhile
            pass
