"""The local launcher starts node agents without holding the coordinator's event loop: a child that
is slow or stuck between fork and exec (gRPC's postfork handler resetting its poller in the child,
a Python at-fork hook) must not stop the loop from answering /health or seeing a node's death."""

from __future__ import annotations

import asyncio
import os
import sys
import time

from moe_cluster.common.process import run_grpc_loop
from moe_cluster.coordinator.serve.launcher import Launcher, LocalNode

STUCK_S = 4.0  # seconds a forked child spends in the at-fork hook before it can exec
# A fake agent: its ready line, then it waits to be stopped.
AGENT = "import time; print('moe-cluster node {name} ready on port 1', flush=True); time.sleep(60)"

_armed = False  # read by the hook in the forked child: a copy of the parent's value at the fork


def _stuck_in_child() -> None:
    if _armed:
        time.sleep(STUCK_S)


# Every fork of this process that runs Python's at-fork hooks runs this one in the child; it does
# nothing unless a test arms it, so other tests' forks are not slowed.
os.register_at_fork(after_in_child=_stuck_in_child)


class FakeAgents(Launcher):
    def _command(self, node: LocalNode) -> list[str]:
        return [sys.executable, "-c", AGENT.format(name=node.name)]


def test_a_child_stuck_before_exec_does_not_stall_the_event_loop(tmp_path):
    """An agent is started (on the coordinator's own loop, uvloop where installed) while every
    forked child would sit STUCK_S in an at-fork hook: the loop keeps ticking, the agent starts,
    and it is stopped and reaped."""
    global _armed

    async def main() -> tuple[float, int | None, int | None]:
        launcher = FakeAgents("secret", tmp_path / "logs", "test")
        gaps: list[float] = []
        ticking = True

        async def tick() -> None:
            last = time.monotonic()
            while ticking:
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0.05)  # ticking before the start begins
        node = LocalNode("node-0", 1, tmp_path / "logs" / "node-0.log")
        try:
            await launcher.start(node)
            pid = launcher.pid("node-0")
        finally:
            await launcher.close()
            ticking = False
            await ticker
        return max(gaps), pid, node.process.returncode if node.process else None

    _armed = True
    try:
        stall, pid, code = run_grpc_loop(main)
    finally:
        _armed = False
    assert pid is not None
    assert code is not None, "the agent was stopped and reaped"
    assert stall < STUCK_S / 2, f"the event loop stalled {stall:.2f} s while an agent started"
