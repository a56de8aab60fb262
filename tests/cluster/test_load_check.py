"""The load-time check: a node whose weights differ from the checkpoint stops `up`, naming the layer.

Two node agents on loopback, one of them in a mount namespace of its own where the checkpoint's
safetensors file is a copy with layer 2's experts 8..15 swapped in pairs (the experts that node
holds): its shard is wrong while the coordinator reads the true checkpoint. The passing case (`up`
reports that the layers match) is asserted on the 2-node demo cluster of test_up.py's TLS test,
started there anyway (a cluster of its own here cost ~5 s).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest


LAYER = 2
SWAPPED = [(8, 9), (10, 11), (12, 13), (14, 15)]  # rank 1's experts under an even split of 16


@pytest.mark.needs(
    None if os.geteuid() == 0 and shutil.which("unshare") else "not root, or no `unshare` on PATH",
    "run the tests as root, with util-linux's unshare for a private mount namespace "
    "(apt-get install util-linux)",
)
def test_a_node_with_swapped_experts_stops_up_naming_the_layer(tmp_path):
    import mlx.core as mx

    from moe_cluster.common.ports import free_ports
    from moe_cluster.node.demo import MODEL_DIR

    ckpt = tmp_path / "ckpt"
    shutil.copytree(MODEL_DIR, ckpt)
    weights = mx.load(str(ckpt / "model.safetensors"))
    for proj in ("gate_proj", "up_proj", "down_proj"):
        key = f"model.layers.{LAYER}.mlp.switch_mlp.{proj}.weight"
        order = list(range(weights[key].shape[0]))
        for a, b in SWAPPED:
            order[a], order[b] = b, a
        weights[key] = weights[key][mx.array(order)]
    bad = tmp_path / "bad.safetensors"
    mx.save_safetensors(str(bad), weights, metadata={"format": "mlx"})

    secret = "load-check-secret"
    env = dict(os.environ, MOE_CLUSTER_SECRET=secret, PYTHONUNBUFFERED="1")
    agent_ports, envoy_ports = free_ports(2), free_ports(2)
    node = [
        sys.executable,
        "-m",
        "moe_cluster.coordinator.cli",
        "node",
        "--host",
        "127.0.0.1",
        "--no-mdns",
    ]
    good = node + ["--name", "n0", "--port", str(agent_ports[0])]
    wrong = [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        f'mount --bind "{bad}" "{ckpt}/model.safetensors" && exec "$@"',
        "sh",
        *node,
        "--name",
        "n1",
        "--port",
        str(agent_ports[1]),
    ]
    agents = [
        subprocess.Popen(
            cmd, stdout=open(tmp_path / f"n{i}.log", "w"), stderr=subprocess.STDOUT, env=env
        )
        for i, cmd in enumerate((good, wrong))
    ]
    try:
        deadline = time.monotonic() + 60
        while not all("ready on port" in (tmp_path / f"n{i}.log").read_text() for i in range(2)):
            assert time.monotonic() < deadline, [
                (tmp_path / f"n{i}.log").read_text() for i in range(2)
            ]
            assert all(a.poll() is None for a in agents), [
                (tmp_path / f"n{i}.log").read_text() for i in range(2)
            ]
            time.sleep(0.2)
        cfg = tmp_path / "cluster.yaml"
        cfg.write_text(f"""name: check
model: {ckpt}
launch: remote
nodes:
  - name: n0
    address: 127.0.0.1:{agent_ports[0]}
    envoy_port: {envoy_ports[0]}
  - name: n1
    address: 127.0.0.1:{agent_ports[1]}
    envoy_port: {envoy_ports[1]}
timeouts:
  collective: 3s
""")
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "moe_cluster.coordinator.cli",
                "up",
                str(cfg),
                "--api-port",
                "0",
            ],
            capture_output=True,
            text=True,
            timeout=180,
            env=env,
        )
    finally:
        for a in agents:
            a.kill()
            a.wait(timeout=10)
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert (
        len(errors) == 1
        and f"load check failed at layer {LAYER} (model.layers.{LAYER}.mlp)" in errors[0]
    ), r.stderr
