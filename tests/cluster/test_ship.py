"""Only the coordinator has the checkpoint (issue 17): nodes on other hosts (network namespaces whose
mount namespace hides the checkpoint folder) receive their shards, keep them, and serve stock
mlx-lm's tokens. One set of hosts and node agents for the module; each `up` is counted in bytes."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

import netns
from cluster_fixture import cluster, http, stock_tokens

pytestmark = pytest.mark.needs(netns.available(), netns.INSTALL)

PROMPT = "Friends, Romans, countrymen, lend me your ears;"
SECRET = "ship-test-secret"
SHIPPED = re.compile(r"^shipped: (.*) \(total (\d+) bytes\)$")


def shipped(lines: list[str]) -> dict[str, int]:
    """{node: bytes} from `up`'s `shipped:` line (exactly one)."""
    found = [SHIPPED.match(l) for l in lines if l.startswith("shipped:")]
    assert len(found) == 1 and found[0], lines
    return {name: int(n) for name, n in re.findall(r"(\w+) (\d+) bytes", found[0][1])}


def journaled(cache: Path, sizes: dict[str, int]) -> int:
    """Bytes an interrupted fill recorded as written (complete journal lines)."""
    js = list(cache.glob("*/journal"))
    if not js:
        return 0
    return sum(
        sizes[line.split("\t")[1]]
        for line in js[0].read_text().splitlines(keepends=True)
        if line.endswith("\n") and len(line.split("\t")) == 3
    )


def manifest(cache: Path) -> dict:
    (d,) = [p for p in cache.iterdir() if p.is_dir()]
    return json.loads((d / "manifest.json").read_text())


def yaml_text(coord_ip: str, nodes: dict, ckpt: Path, extra: str = "") -> str:
    listed = "\n".join(
        f"  - name: {n}\n    address: {ip}:7700" + (f"\n    memory: {mem}" if mem else "")
        for n, (ip, mem) in nodes.items()
    )
    return f"""name: shiplab
model: {ckpt}
checkpoint: coordinator
ship:
  port: 7702
{extra}launch: remote
verify: false
nodes:
{listed}
placement:
  strategy: memory
  kv_reserve: 1MB
api:
  host: {coord_ip}
timeouts:
  collective: 3s
  load: 60s
serving:
  prompt_cache: 1MB
"""


def start_agent(h, name: str, ckpt: Path, cache: Path, log: Path) -> subprocess.Popen:
    """A node agent in its namespace; a tmpfs over the checkpoint folder makes it absent there."""
    ns, _ = h[name]
    node = (
        f"mount -t tmpfs none {ckpt} && exec {sys.executable} -m moe_cluster.coordinator.cli node --name {name} "
        f"--host 0.0.0.0 --port 7700 --no-mdns --cache-dir {cache}"
    )
    env = dict(os.environ, MOE_CLUSTER_SECRET=SECRET, PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, "unshare", "-m", "sh", "-c", node],
        stdout=open(log, "a"),
        stderr=subprocess.STDOUT,
        env=env,
    )


def wait_port(ns: str, ip: str, port: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                ns,
                sys.executable,
                "-c",
                f"import socket; socket.create_connection(('{ip}', {port}), 1).close()",
            ],
            capture_output=True,
        )
        if r.returncode == 0:
            return
        time.sleep(0.3)
    raise AssertionError(f"nothing listens on {ip}:{port}")


def test_only_the_coordinator_has_the_checkpoint(tmp_path):
    from moe_cluster.node.catalog import Catalog
    from moe_cluster.node.describe import describe
    from moe_cluster.node.checkpoint import Checkpoint
    from moe_cluster.node.demo import MODEL_DIR

    ckpt = tmp_path / "ckpt"
    shutil.copytree(MODEL_DIR, ckpt)
    sizes = Catalog.of(describe(Checkpoint(ckpt))).blob_nbytes()
    expert_blobs = {b: n for b, n in sizes.items() if "switch_mlp" in b}
    per_expert = sum(
        n for b, n in expert_blobs.items() if b.startswith("model.layers.0.") and b.endswith("[0]")
    )
    replicated = sum(n for b, n in sizes.items() if b not in expert_blobs)
    caches = {n: tmp_path / f"cache-{n}" for n in ("n1", "n2")}
    with netns.hosts(["coord", "n1", "n2"]) as h:
        agents = {}
        try:
            for n in ("n1", "n2"):
                agents[n] = start_agent(h, n, ckpt, caches[n], tmp_path / f"{n}.log")
            for n in ("n1", "n2"):
                wait_port(h["coord"][0], h[n][1], 7700)
            coord_ns, coord_ip = h["coord"]
            even = {n: (h[n][1], None) for n in ("n1", "n2")}
            env = {"MOE_CLUSTER_SECRET": SECRET, "XDG_CACHE_HOME": str(tmp_path / "coord-cache")}

            # 1. a transfer killed half-way: both nodes start empty behind a slow link; n2 dies while
            #    fetching, so `up` fails once n1 has its whole shard
            cfg = tmp_path / "slow.yaml"
            cfg.write_text(yaml_text(coord_ip, even, ckpt, extra="  max_rate: 2MB\n"))
            up = subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    coord_ns,
                    sys.executable,
                    "-m",
                    "moe_cluster.coordinator.cli",
                    "up",
                    str(cfg),
                    "--api-port",
                    "0",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=dict(os.environ, XDG_RUNTIME_DIR=str(tmp_path), **env),
            )
            try:
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and not any(
                    j.stat().st_size > 2000 for j in caches["n2"].glob("*/journal")
                ):
                    time.sleep(0.05)
                agents["n2"].send_signal(signal.SIGKILL)
                agents["n2"].wait(timeout=10)
                out_text, _ = up.communicate(timeout=60)
            finally:
                if up.poll() is None:
                    up.kill()
                    up.wait(timeout=10)
            assert up.returncode != 0 and "n2" in out_text, out_text
            kept = journaled(caches["n2"], sizes)  # n2 is dead: its journal is final
            assert kept > 0
            held = {"n1": manifest(caches["n1"])["placement"]}  # n1 finished its shard

            # 2. n2 is back: the next up sends n2 only what its journal does not hold and n1 nothing
            #    (the same model and placement: a warm start), and the cluster serves stock mlx-lm's tokens
            agents["n2"] = start_agent(h, "n2", ckpt, caches["n2"], tmp_path / "n2.log")
            wait_port(coord_ns, h["n2"][1], 7700)
            with cluster(tmp_path, yaml_text(coord_ip, even, ckpt), netns=coord_ns, env=env) as (
                url,
                _,
                lines,
            ):
                code, out = http(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12})
                assert code == 200, out
            assert manifest(caches["n1"])["placement"] == held["n1"]
            held = {n: manifest(caches[n])["placement"] for n in caches}
            whole = replicated + per_expert * sum(len(v) for v in held["n2"].values())
            assert shipped(lines) == {"n1": 0, "n2": whole - kept}, (whole, kept)
            # the coordinator kept the digests of what it hashed in step 1 (all n1 needed, some of n2's)
            hashed = int(
                next(
                    re.match(r"digests: hashed (\d+) bytes", l)[1]
                    for l in lines
                    if l.startswith("digests:")
                )
            )
            assert hashed < whole - kept, (hashed, lines)
            stock = stock_tokens(ckpt, PROMPT, 12)
            assert out["moe_cluster"]["tokens"] == stock
            assert f"of {whole - kept} bytes (100%)" in (tmp_path / "n2.log").read_text()

            # 3. a flipped byte in n1's cache and a placement change (n1 reports more memory, so it
            #    gets more experts): n1 receives its new experts and the one corrupt blob, nothing else
            layer_file = next(
                p for p in next(caches["n1"].iterdir()).iterdir() if p.name.startswith("layer-0001")
            )
            with open(
                layer_file, "r+b"
            ) as f:  # the first tensor's first expert row, past the header
                (n,) = struct.unpack("<Q", f.read(8))
                f.seek(8 + n + 100)
                b = f.read(1)
                f.seek(8 + n + 100)
                f.write(bytes([b[0] ^ 0x10]))
            uneven = {"n1": (h["n1"][1], "3GB"), "n2": (h["n2"][1], "1GB")}
            with cluster(tmp_path, yaml_text(coord_ip, uneven, ckpt), netns=coord_ns, env=env) as (
                url,
                _,
                lines,
            ):
                code, out = http(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12})
                assert code == 200, out
            assert out["moe_cluster"]["tokens"] == stock
            after = {n: manifest(caches[n])["placement"] for n in caches}
            assert after != held, "the placement did not change: the test proves nothing"
            new = {
                n: sum(len(set(after[n][l]) - set(held[n][l])) for l in after[n]) for n in caches
            }
            flipped = min(held["n1"]["1"])  # the first expert row of the file's first tensor
            assert flipped in after["n1"]["1"], (
                "the flipped expert moved away: the repair is not exercised"
            )
            repaired = sizes[f"model.layers.1.mlp.switch_mlp.down_proj.weight[{flipped}]"]
            assert shipped(lines) == {
                "n1": new["n1"] * per_expert + repaired,
                "n2": new["n2"] * per_expert,
            }, (held, after)
            assert "fails its sha256" in (tmp_path / "n1.log").read_text()

            # 4. the same model and placement again: the nodes, loaded still, are adopted (the
            #    model's fingerprint matches; the new Ship service's port need not) and nothing is sent
            with cluster(tmp_path, yaml_text(coord_ip, uneven, ckpt), netns=coord_ns, env=env) as (
                url,
                _,
                lines,
            ):
                pass
            assert any(l.startswith("adopted 2 loaded nodes") for l in lines), lines
            assert shipped(lines) == {"n1": 0, "n2": 0}
            assert any(l.startswith("digests: hashed 0 bytes") for l in lines), lines
            assert list((tmp_path / "coord-cache" / "moe-cluster" / "digests").glob("*.jsonl"))
        finally:
            netns.stop(*agents.values())
