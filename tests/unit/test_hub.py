"""Models by name, without a hub: what is a repo id, what cluster.yaml makes of one, and the one
line each failure of the client (or of the disk under its cache) becomes."""

from __future__ import annotations

import errno

import pytest

from moe_cluster.coordinator.serve.config import ConfigError, parse_config
from moe_cluster.node.hub import (
    DownloadStopped,
    HubError,
    RepoId,
    Transfer,
    explain,
    parse_repo_id,
)

NODES = "nodes:\n  - name: a\n"


@pytest.mark.parametrize(
    "spec, repo",
    [
        ("mlx-community/Qwen3-30B-A3B-4bit", RepoId("mlx-community/Qwen3-30B-A3B-4bit")),
        ("org/name@v1.0", RepoId("org/name", "v1.0")),
        ("org/name@refs/pr/3", RepoId("org/name", "refs/pr/3")),
        ("demo", None),
        ("/abs/path", None),
        ("./rel/path", None),
        ("~/models/x", None),
        ("a/b/c", None),
        ("org/../x", None),
        ("org/na--me", None),
    ],
)
def test_what_is_a_repo_id(spec, repo):
    assert parse_repo_id(spec) == repo


def test_a_repo_id_is_shipped_by_default_and_a_folder_is_not(tmp_path):
    c = parse_config(NODES + "model: org/some-moe\n")
    assert c.model == "org/some-moe" and c.checkpoint == "coordinator"
    assert parse_config(NODES + "model: demo\n").checkpoint == "every-node"
    explicit = parse_config(NODES + "model: org/some-moe\ncheckpoint: every-node\n")
    assert explicit.checkpoint == "every-node"  # local nodes read this machine's cache
    # up --model takes the file's place, and its default with it
    assert parse_config(NODES + "model: demo\n", model="org/x@main").checkpoint == "coordinator"
    # a folder that exists wins over a repo of the same name
    (tmp_path / "org" / "x").mkdir(parents=True)
    c = parse_config(NODES + f"model: {tmp_path}/org/x\n")
    assert c.checkpoint == "every-node"


@pytest.mark.parametrize(
    "text, where, needles",
    [
        (
            NODES + "model: org/x\nlaunch: remote\ncheckpoint: every-node\n",
            "cluster.yaml:5: checkpoint",
            ["only this machine downloads", "checkpoint: coordinator"],
        ),
        (NODES + "model: no/such/folder\n", "cluster.yaml:3: model", ["does not exist"]),
    ],
)
def test_what_a_repo_id_cannot_be(text, where, needles):
    with pytest.raises(ConfigError) as e:
        parse_config(text)
    assert str(e.value).startswith(where) and all(n in str(e.value) for n in needles), e.value


def test_a_full_disk_and_a_failure_midway_are_told_as_one_line():
    repo = RepoId("org/x")
    full = explain(OSError(errno.ENOSPC, "No space left on device"), repo)
    assert isinstance(full, HubError) and "is full while downloading org/x" in str(full)
    assert "run again to resume" in str(full)
    other = explain(ConnectionResetError("reset by peer"), repo)
    assert isinstance(other, DownloadStopped) and "ConnectionResetError: reset by peer" in str(
        other
    )
    for e in (full, other):
        assert "\n" not in str(e)


def test_progress_line():
    t = Transfer("org/x", None, 3, 4_000_000_000, 1_000_000_000, 10.0)
    assert t.line() == "downloading org/x: 1.00 GB of 4.00 GB (25%), 100.00 MB/s, ETA 30 s"
    assert (
        Transfer("org/x", None, 3, 10, 10, 1.0).line() == "downloading org/x: 10 B of 10 B (100%)"
    )


def test_no_progress_line_follows_the_line_that_ends_a_stopped_download(monkeypatch, tmp_path):
    """A worker of the hub client that finishes its chunk after the download was stopped (hf's
    thread pool outlives the snapshot's thread) reports nothing more: the interrupted line stays
    the last one."""
    import threading
    import time
    from types import SimpleNamespace

    from moe_cluster.node import hub

    cancel, late = threading.Event(), threading.Event()

    def snapshot(*, on_bytes=None, cancel=None, **kw):
        on_bytes(10)  # a first chunk

        def straggler():  # passed its stop check before the stop, reports after the raise
            cancel.wait(5)
            time.sleep(0.3)
            on_bytes(90)
            late.set()

        threading.Thread(target=straggler, daemon=True).start()
        cancel.wait(5)
        raise hub._Stop()

    monkeypatch.setattr(hub, "_snapshot", snapshot)
    monkeypatch.setattr(hub, "cache_dir", lambda: tmp_path)
    seen = []

    def report(t):
        seen.append(t.done_bytes)
        if t.done_bytes:  # after the first chunk, the user presses Ctrl-C
            cancel.set()

    todo = [SimpleNamespace(local_path=str(tmp_path / "shard.safetensors"), file_size=100)]
    with pytest.raises(hub.DownloadInterrupted, match="10 B of 100 B"):
        hub._download(RepoId("org/x"), {}, "abc", todo, 100, report, cancel)
    assert late.wait(5)
    assert seen == [0, 10]  # nothing after the stop
