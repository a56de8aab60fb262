"""`gpu:` on a node of a local cluster (a multi-GPU host: one GPU per node process) reaches the node
agent as CUDA_VISIBLE_DEVICES, through the real `up` (the path `bench serve --gpus` takes). On this
CPU-only machine MLX ignores the variable; what is checked is that each agent has its own."""

from __future__ import annotations

from pathlib import Path

from moe_cluster.coordinator.bench.prompt_cache import local_cluster


def _agents() -> dict[str, dict[str, str]]:
    """{node name: environment} of every running node agent of a bench cluster."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if b"node" not in argv or b"--name" not in argv:
                continue
            name = argv[argv.index(b"--name") + 1].decode()
            env = dict(
                item.decode().partition("=")[::2]
                for item in (proc / "environ").read_bytes().split(b"\0")
                if item
            )
        except (OSError, ValueError, IndexError):
            continue
        if name.startswith("bench-"):
            found[name] = env
    return found


def test_each_local_node_sees_only_its_gpu():
    with local_cluster(2, "demo", "0", gpus=True):
        agents = _agents()
    assert {n: env.get("CUDA_VISIBLE_DEVICES") for n, env in agents.items()} == {
        "bench-0": "0",
        "bench-1": "1",
    }


def test_without_gpu_a_node_inherits_the_environment():
    with local_cluster(1, "demo", "0"):
        agents = _agents()
    assert list(agents) == ["bench-0"] and "CUDA_VISIBLE_DEVICES" not in agents["bench-0"]
