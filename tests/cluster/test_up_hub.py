"""`up` with `model: org/demo-moe`, a Hugging Face repo id, through the real huggingface_hub client
against a hub on loopback (tests/hub_server.py, HF_ENDPOINT): downloaded once, shipped, stock
mlx-lm's tokens; refused before any weight where the model is dense or does not fit."""

from __future__ import annotations

import os
import re
import threading
import time

import pytest

from cluster_fixture import cluster, http, stock_tokens, yaml_for
from conftest import assert_one_line_error, cli
from hub_server import GOOD_TOKEN, Hub, demo_repo, dense_repo

REPO = "org/demo-moe"
PROMPT = "To be, or not to be, that is the question:"
SHARDS = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
NEEDED = [
    "config.json",
    *SHARDS,
    "model.safetensors.index.json",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
]


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    with Hub({REPO: demo_repo(tmp_path_factory.mktemp("hub")), "org/dense": dense_repo()}) as h:
        yield h


def _env(hub: Hub, tmp_path) -> dict:
    # a token is sent, as a logged-in user's would be (and none from this machine's environment)
    return {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "HF_TOKEN": GOOD_TOKEN}


def _shipped(lines: list[str]) -> int:
    line = next(x for x in lines if x.startswith("shipped: "))
    return int(re.search(r"total (\d+) bytes", line)[1])


def test_up_downloads_once_ships_and_serves_stock_tokens(hub, tmp_path):
    """The first `up` downloads what a checkpoint needs, each file once, while the API's address
    shows the download (a shard is held until the test has seen it); the second downloads and
    ships nothing."""
    hub.reset()
    held = threading.Event()
    hub.faults.hold[SHARDS[2]] = held
    seen: dict = {}

    def watch(page: str) -> None:
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                status = http(page, "/v1/cluster/status", timeout=10)[1]
                if (status.get("download") or {}).get("done_bytes"):
                    break
                time.sleep(0.1)
            seen["status"] = status
            seen["health"] = http(page, "/health", timeout=10)
            seen["dashboard"] = http(page, "/", timeout=10)
            seen["chat"] = http(page, "/v1/chat/completions", {"messages": []}, timeout=10)
        finally:
            held.set()

    def on_line(line: str) -> None:
        m = re.search(r"progress on (http://\S+)/$", line)
        if m:
            threading.Thread(target=watch, args=(m[1],), daemon=True).start()

    yaml = yaml_for(2, model=REPO, extra="ship:\n  port: 0\n")  # checkpoint: coordinator, implied
    env = _env(hub, tmp_path)
    with cluster(tmp_path, yaml, env=env, on_line=on_line) as (url, proc, lines):
        status, out = http(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 24})
        assert status == 200, out
        snapshot = tmp_path / "hf/hub/models--org--demo-moe/snapshots" / hub.repos[REPO].commit
        assert out["moe_cluster"]["tokens"] == stock_tokens(snapshot, PROMPT, 24)
        assert http(url, "/v1/models")[1]["data"][0]["id"] == REPO
        assert _shipped(lines) > 0
    s = seen["status"]
    assert s["state"] == "downloading" and s["reason"].startswith(f"downloading {REPO}: "), s
    assert s["download"]["files"] == len(NEEDED) - 2  # its config and index came first
    assert [n["name"] for n in s["nodes"]] == ["node-0", "node-1"]
    assert seen["health"][0] == 503 and seen["dashboard"][0] == 200
    assert "<html" in seen["dashboard"][1].lower()
    assert seen["chat"][0] == 503 and "not serving yet" in seen["chat"][1]["error"]["message"]
    assert sorted(hub.gets()) == NEEDED  # each once; never README.md nor pytorch_model.bin

    hub.reset()
    with cluster(tmp_path, yaml, env=env) as (url, proc, lines):
        assert hub.gets() == [] and _shipped(lines) == 0
        assert not any(x.startswith("downloading") for x in lines), lines


@pytest.mark.parametrize(
    "model, memory, needles",
    [
        ("org/dense", "", ["org/dense", "no MoE layers"]),
        (REPO, "    memory: 64MB\n", [f"{REPO}, not downloaded: the model does not fit"]),
    ],
)
def test_up_refuses_before_any_weight(hub, tmp_path, model, memory, needles):
    hub.reset()
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(f"model: {model}\nnodes:\n  - name: node-0\n{memory}")
    env = dict(os.environ, XDG_RUNTIME_DIR=str(tmp_path), **_env(hub, tmp_path))
    r = cli("up", str(cfg), "--api-port", "0", "--log-dir", str(tmp_path / "logs"), env=env)
    assert_one_line_error(r, *needles)
    assert not [p for _, p, _ in hub.log if p.endswith(".safetensors")]
