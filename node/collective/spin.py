"""When the node's exchange may busy-wait on a peer's socket instead of sleeping: only on idle
cores, bounded.

A process that sleeps in the kernel until a peer's frame arrives pays a wake-up (a few µs on a
busy core, tens of µs on an idle one leaving a sleep state). Polling instead removes it, but only
where a core is free: on a machine with fewer idle cores than spinning processes a spinner takes
the CPU from the very process it waits for. So spinning is allowed only when the cores this
process may run on, less the load average, leave room (`spin_allowed`), re-checked once a second;
every spin is bounded in time by its caller.
"""

from __future__ import annotations

import os
import time
from typing import Callable

from ..cores import usable

SPIN_MAX_S = 1e-3  # seconds a waiter spins at most
MIN_CORES = 4  # fewer cores than the nodes of a machine and some room: never spin
MIN_IDLE = 2.0  # cores left idle by the load average (which counts spinners themselves)
_RECHECK_S = 1.0  # seconds between looks at the load average


def spin_allowed(cores: int, load: float) -> bool:
    """Whether a process may spin on a machine with `cores` usable cores and 1-minute `load`."""
    return cores >= MIN_CORES and cores - load >= MIN_IDLE


def usable_cores() -> int:
    """How many cores this process may run on (a node pinned to its share: that share)."""
    return len(usable()) or os.cpu_count() or 1


class SpinPolicy:
    """How long a waiter may spin now: `max_s`, or 0 where cores are short."""

    def __init__(
        self,
        max_s: float = SPIN_MAX_S,
        *,
        cores: Callable[[], int] = usable_cores,
        load: Callable[[], float] = lambda: os.getloadavg()[0],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_s = max_s
        self._cores = cores
        self._load = load
        self._clock = clock
        self._checked = float("-inf")
        self._allowed = False

    def budget_s(self) -> float:
        """Seconds a waiter may spin before it sleeps (0: sleep at once)."""
        now = self._clock()
        if now - self._checked > _RECHECK_S:
            self._checked = now
            try:
                self._allowed = spin_allowed(self._cores(), self._load())
            except OSError:  # no load average (some containers)
                self._allowed = False
        return self.max_s if self._allowed else 0.0
