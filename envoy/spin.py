"""When a waiter on the node <-> envoy link may busy-wait instead of sleeping: only on idle cores, bounded.

A process that sleeps in the kernel until the other end writes pays a wake-up (a few µs on a busy
core, tens of µs on an idle one leaving a sleep state), and an all-reduce through the envoy has
several on its critical path. Polling instead removes them, but only where a core is free: on a
machine with fewer idle cores than spinning processes a spinner takes the CPU from the very
process it waits for. So spinning is allowed only when the cores this process may run on,
less the load average, leave room (`spin_allowed`), re-checked once a second; every spin is
bounded in time by its caller; `MOE_CLUSTER_ENVOY_SPIN_US` overrides (0: never spin).
"""

from __future__ import annotations

import os
import platform
import time
from typing import Callable, Mapping

SPIN_ENV = "MOE_CLUSTER_ENVOY_SPIN_US"  # microseconds; unset: decided from idle cores; 0: never
MIN_CORES = 4  # fewer cores than a node, its envoy and some room: never spin
MIN_IDLE = 2.0  # cores left idle by the load average (which counts spinners themselves)
_RECHECK_S = 1.0  # seconds between looks at the load average


def spin_allowed(cores: int, load: float) -> bool:
    """Whether a process may spin on a machine with `cores` usable cores and 1-minute `load`."""
    return cores >= MIN_CORES and cores - load >= MIN_IDLE


def usable_cores() -> int:
    try:
        return len(
            os.sched_getaffinity(0)
        )  # Linux: what this process may run on (cgroups, taskset)
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def shared_memory_ordered() -> bool:
    """Whether a reader that sees a flag written after a payload also sees the payload, without
    fences: true of x86-64's store order (TSO), not of ARM's."""
    return platform.machine().lower() in ("x86_64", "amd64")


class SpinPolicy:
    """How long a waiter may spin now: `max_s`, or 0 where cores are short (or the override says)."""

    def __init__(
        self,
        max_s: float,
        *,
        env: Mapping[str, str] | None = None,
        cores: Callable[[], int] = usable_cores,
        load: Callable[[], float] = lambda: os.getloadavg()[0],
        clock: Callable[[], float] = time.monotonic,
    ):
        env = os.environ if env is None else env
        raw = env.get(SPIN_ENV, "").strip()
        self.forced: float | None = None
        if raw:
            try:
                self.forced = max(float(raw), 0.0) * 1e-6
            except ValueError:
                raise ValueError(
                    f"${SPIN_ENV} must be a number of microseconds, got {raw!r}"
                ) from None
        self.max_s = max_s
        self._cores = cores
        self._load = load
        self._clock = clock
        self._checked = float("-inf")
        self._allowed = False

    def budget_s(self) -> float:
        """Seconds a waiter may spin before it sleeps (0: sleep at once)."""
        if self.forced is not None:
            return self.forced
        now = self._clock()
        if now - self._checked > _RECHECK_S:
            self._checked = now
            try:
                self._allowed = spin_allowed(self._cores(), self._load())
            except OSError:  # no load average (some containers)
                self._allowed = False
        return self.max_s if self._allowed else 0.0
