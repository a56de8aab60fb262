"""The `transport: mlx` stall guard (node/collective/mlx.py `_Watchdog`): the first waits, and those
marked cold (a step of a new shape), which may build MLX's kernels, get the longer cold bound; a
later wait past the timeout ends the node."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from moe_cluster.node.collective.mlx import COLD_WAITS, EXIT_STALLED


def test_the_first_and_the_cold_waits_get_the_cold_bound_and_a_later_one_the_timeout():
    script = textwrap.dedent(
        f"""
        import time
        from moe_cluster.node.collective.mlx import _Watchdog
        w = _Watchdog(0, 0.3, cold_s=3.0)
        for i in range({COLD_WAITS}):  # each longer than the timeout, within the cold bound
            w.enter(f"cold {{i}}")
            time.sleep(0.8)
            w.leave()
        w.enter("warm step")
        time.sleep(0.2)  # within the timeout
        w.leave()
        w.enter("a new shape's step", True)  # marked cold by its caller: the cold bound again
        time.sleep(0.8)
        w.leave()
        w.enter("stalled step")
        time.sleep(5)
        print("not stopped")
        """
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == EXIT_STALLED, (r.returncode, r.stdout, r.stderr)
    assert "not stopped" not in r.stdout
    assert (
        "rank 0: stalled step did not complete within 0.3 s (a peer stalled or the network is "
        "down); the MLX group cannot recover, exiting"
    ) in r.stderr, r.stderr
    assert "cold" not in r.stderr


def test_a_first_wait_past_the_cold_bound_says_so():
    script = textwrap.dedent(
        """
        import time
        from moe_cluster.node.collective.mlx import _Watchdog
        w = _Watchdog(1, 0.2, cold_s=0.5)
        w.enter("batch step 1")
        time.sleep(5)
        """
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == EXIT_STALLED
    assert (
        "rank 1: batch step 1 (one that may build kernels) did not complete within 0.5 s"
    ) in r.stderr, r.stderr
