"""Node processes forked from a server that imported their heavy dependencies (node/prefork.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from moe_cluster.node import prefork

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="spawn elsewhere: nothing forked")

PROBE = "MOE_CLUSTER_PREFORK_PROBE"


def report(var: str, results) -> None:
    """A child's entry point: what it found when it started."""
    results.put(
        {
            "probe": __import__("os").environ.get(var),
            "mlx": "mlx.core" in sys.modules,
            "transformers": "transformers" in sys.modules,
            # objects the server made, which the child's cycle collections skip
            "frozen": __import__("gc").get_freeze_count(),
            "transformers_objects": sum(
                1
                for o in __import__("gc").get_objects()
                if str(getattr(type(o), "__module__", "")).startswith("transformers")
            ),
        }
    )


def _start(ctx) -> dict:
    results = ctx.Queue()
    p = prefork.process(ctx, f"{__name__}:report", (PROBE, results), daemon=True)
    p.start()
    try:
        return results.get(timeout=120)
    finally:
        p.join(30)


def test_a_forked_node_has_the_callers_environment_of_now_and_no_mlx_yet(monkeypatch):
    ctx = prefork.context()
    assert ctx.get_start_method() == "forkserver"
    monkeypatch.setenv(PROBE, "before")
    first = _start(ctx)  # the server is up from here, with the environment of this moment
    monkeypatch.setenv(PROBE, "after")
    second = _start(ctx)
    assert first["probe"] == "before" and second["probe"] == "after", (first, second)
    # the heavy import came with the fork; MLX is the child's to start, after its environment
    assert second["transformers"] and not second["mlx"], second
    # what came with the fork is frozen: a collection (one per model swap) does not walk it
    assert second["frozen"] > 10_000 and second["transformers_objects"] == 0, second


@pytest.mark.parametrize("module", [prefork.PRELOAD, "moe_cluster.node.sim"])
def test_what_a_node_imports_before_its_environment_is_set_starts_no_mlx(module):
    """The server's preload, and node.sim (unpickling a node's job imports it before `_enter`)."""
    code = f"import sys, {module}; print('mlx.core' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "False", (r.stdout, r.stderr)


def test_a_node_bound_to_a_gpu_sees_that_gpu_alone(monkeypatch):
    """`simulate --gpus` (and the benches on a GPU host) bind node r to GPU r."""
    from moe_cluster.coordinator.dev.simulate import start_node

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    ctx = prefork.context()
    results = ctx.Queue()
    procs = [
        start_node(ctx, r, ("CUDA_VISIBLE_DEVICES", results), gpu, target=f"{__name__}:report")
        for r, gpu in enumerate((2, None))
    ]
    try:
        got = sorted(str(results.get(timeout=120)["probe"]) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
    assert got == ["0,1,2,3", "2"]
