"""Models by repo id through the real huggingface_hub client, against a hub on loopback
(tests/hub_server.py): `plan` fetches the config alone, `run` downloads, resumes and works offline,
and every refusal is one line naming the repo. The commands run through the CLI's own parser in
this process (huggingface_hub's endpoint, cache and offline switch pointed at the test's)."""

from __future__ import annotations

import json

import pytest

from conftest import assert_one_line_error, cli_in_process
from hub_server import GOOD_TOKEN, Hub, Repo, demo_repo, dense_repo

REPO = "org/demo-moe"
SHARDS = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
NEEDED = {"config.json", "model.safetensors.index.json", *SHARDS} | {
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
}


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    demo = demo_repo(tmp_path_factory.mktemp("hub"))
    repos = {
        REPO: demo,
        "org/dense": dense_repo(),
        "org/gated-moe": Repo(dict(demo.files), gated=True),
        "org/huge-moe": Repo({**demo.files, "model-00001-of-00003.safetensors": b"\0" * 64}),
    }
    with Hub(repos) as h:
        yield h


@pytest.fixture
def hf(hub, tmp_path, monkeypatch):
    """huggingface_hub pointed at the test hub, with an empty cache of this test's own."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(
        constants,
        "HUGGINGFACE_CO_URL_TEMPLATE",
        hub.url + "/{repo_id}/resolve/{revision}/{filename}",
    )
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    hub.reset()
    return hub


def _touched(hub: Hub, name: str) -> list[str]:
    """Requests (HEAD or GET) for a file of the repos."""
    return [f"{m} {p}" for m, p, _ in hub.log if p.endswith("/" + name)]


def test_plan_fetches_the_config_and_index_alone(hf):
    r = cli_in_process("plan", "--model", REPO, "--nodes", "2", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["model"]["name"] == REPO and out["model"]["num_experts"] == 16
    assert (
        out["model"]["checkpoint_bytes"]
        == json.loads(hf.repos[REPO].files["model.safetensors.index.json"])["metadata"][
            "total_size"
        ]
    )
    assert sorted(hf.gets()) == ["config.json", "model.safetensors.index.json"]
    assert not [line for s in SHARDS for line in _touched(hf, s)]  # not even asked about


def test_run_resumes_a_stopped_download_then_runs_offline(hf, monkeypatch):
    """The first run: shard 1's connection drops halfway (the client resumes it with a Range
    request from the last chunk it wrote, in the run; chunks of 256 KiB here instead of the
    client's 10 MiB, so a 4 MB shard has some), shard 2 answers 500: the run stops, one line.
    The second fetches shard 2 and the files the first never started, and generates. Offline,
    the third asks the hub nothing."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 256 << 10)
    args = ("run", "--model", REPO, "--prompt", "To be, or not", "--max-tokens", "4", "--json")
    hf.faults.cut_once.add(SHARDS[0])
    hf.faults.fail_once.add(SHARDS[1])
    r = cli_in_process(*args)
    assert r.returncode == 1, (r.stdout, r.stderr)
    last = r.stderr.strip().splitlines()[-1]
    assert f"downloading {REPO} stopped (HTTP 500" in last and "run again to resume" in last, last
    ((path, asked),) = hf.ranges()
    assert path.endswith(SHARDS[0]) and int(asked.removeprefix("bytes=").rstrip("-")) > 0, asked
    first = hf.gets()
    # the client cancels the files not yet started when one fails: which those are is timing
    assert first.count(SHARDS[0]) == 2 and SHARDS[1] in first and set(first) <= NEEDED, first
    arrived = set(first) - {SHARDS[1]}

    hf.reset()
    r = cli_in_process(*args)
    assert r.returncode == 0, r.stderr
    assert sorted(hf.gets()) == sorted(NEEDED - arrived)  # what had arrived stayed in the cache
    assert len(json.loads(r.stdout)["tokens"]) == 4

    hf.reset()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    r = cli_in_process(*args)
    assert r.returncode == 0, r.stderr
    assert hf.log == []


@pytest.mark.parametrize(
    "model, token, offline, needles",
    [
        ("org/nope", None, False, ["org/nope is neither a folder", "nor a model repository"]),
        (f"{REPO}@v9", None, False, [REPO, "no revision 'v9'"]),
        ("org/gated-moe", None, False, ["org/gated-moe is gated", "HF_TOKEN"]),
        (REPO, "hf_wrong", False, ["refused the token", "HTTP 401", "HF_TOKEN"]),
        (REPO, None, True, [f"{REPO} is not in the Hugging Face cache", "HF_HUB_OFFLINE"]),
    ],
)
def test_a_repo_that_cannot_be_had_is_one_line(
    hf, monkeypatch, tmp_path, model, token, offline, needles
):
    from huggingface_hub import constants

    if token:
        monkeypatch.setenv("HF_TOKEN", token)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    r = cli_in_process("plan", "--model", model, "--nodes", "2")
    assert_one_line_error(r, *needles)
    if offline:  # the cache's folder of the repo is named
        assert str(tmp_path / "hf" / "models--org--demo-moe") in r.stderr
    assert not [line for s in SHARDS for line in _touched(hf, s)]


def test_gated_with_a_good_token_and_no_hub_at_all(hf, monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_TOKEN", GOOD_TOKEN)
    assert cli_in_process("plan", "--model", "org/gated-moe", "--nodes", "2").returncode == 0
    # a hub that does not answer: the cache answers alone; here it has nothing
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(
        constants,
        "HUGGINGFACE_CO_URL_TEMPLATE",
        "http://127.0.0.1:9/{repo_id}/resolve/{revision}/{filename}",
    )
    r = cli_in_process("plan", "--model", "org/other-moe", "--nodes", "2")
    assert_one_line_error(r, "org/other-moe is not in the Hugging Face cache", "cannot be reached")
    r = cli_in_process("plan", "--model", "org/gated-moe", "--nodes", "2")  # cached above
    assert r.returncode == 0, r.stderr


def test_a_checkpoint_the_disk_cannot_hold_is_refused_before_fetching(hf):
    hf.faults.claimed_size[SHARDS[0]] = 10**16  # 10 PB
    r = cli_in_process("run", "--model", "org/huge-moe", "--prompt", "hi")
    assert_one_line_error(r, "org/huge-moe needs", "more in the Hugging Face cache")
    assert hf.gets("org/huge-moe") == []


def test_a_dense_model_is_refused_by_plan_before_its_weights(hf):
    r = cli_in_process("plan", "--model", "org/dense", "--nodes", "2")
    assert r.returncode == 2 and "no routed experts" in r.stderr, r.stderr
    assert hf.gets() == ["config.json"]


def test_ctrl_c_stops_a_download_in_one_line_and_the_next_run_resumes(hf, tmp_path):
    """Ctrl-C while a shard arrives (slowly): one line, the files that finished kept; the next
    run fetches the rest alone. The first in a process of its own, for the signal."""
    import os
    import signal
    import subprocess
    import sys
    import time

    hf.faults.slow.add(SHARDS[1])
    env = dict(os.environ, HF_ENDPOINT=hf.url, HF_HUB_CACHE=str(tmp_path / "hf"))
    env.pop("HF_TOKEN", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "moe_cluster.coordinator.cli", "run", "--model", REPO]
        + ["--prompt", "hi"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        # Ctrl-C as in a terminal: a runner started in the background ignores SIGINT, which its
        # children would inherit (Python then installs no KeyboardInterrupt handler)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    snapshot = tmp_path / "hf/models--org--demo-moe/snapshots" / hf.repos[REPO].commit

    def finished() -> set[str]:
        return {p.name for p in snapshot.iterdir()} if snapshot.is_dir() else set()

    # the slow shard on its way and another file already in: the stop comes between the two
    deadline = time.monotonic() + 60
    while (SHARDS[1] not in hf.gets() or not finished()) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 1, err
    last = err.strip().splitlines()[-1]
    assert f"downloading {REPO} interrupted after" in last and "run again to resume" in last, err
    kept = finished()
    assert SHARDS[1] not in kept and kept, kept
    hf.reset()
    r = cli_in_process("run", "--model", REPO, "--prompt", "hi", "--max-tokens", "2")
    assert r.returncode == 0, r.stderr
    assert sorted(hf.gets()) == sorted(NEEDED - kept)  # what was kept is not fetched again
