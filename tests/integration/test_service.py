"""`moe-cluster service` as a user runs it: the file it prints, what it refuses, and install, status
and uninstall of a launchd agent against a stand-in `launchctl` (no launchd here; systemd has no
PID 1 in this container, so its unit is checked as printed)."""

from __future__ import annotations

import os
import plistlib
import stat
import sys
from pathlib import Path

import pytest

from moe_cluster.coordinator.service import units

SECRET = "hunter2-cluster-secret"


class Run:
    def __init__(self, returncode: int, stdout: str, stderr: str):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.fixture
def cli(capfd, monkeypatch):
    """`moe-cluster service ARGS` through the command line's own entry point, in this process (the
    platform tool it calls is a process of its own); `env` is set for the call."""
    from moe_cluster.coordinator.cli import main

    def run(*args: str, env: dict | None = None) -> Run:
        for k, v in (env or {}).items():
            monkeypatch.setenv(k, v)
        capfd.readouterr()
        code = main(["service", *args])
        out, err = capfd.readouterr()
        return Run(code, out, err)

    return run


def test_print_install_status_uninstall(tmp_path, cli):
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    yaml = tmp_path / "cluster.yaml"
    yaml.write_text(
        "name: lab\nmodel: demo\nlaunch: remote\nnodes:\n  - name: m1\n    address: 10.0.0.2\n"
    )
    # a remote cluster's coordinator needs its secret in a file: refused, naming the key
    r = cli("install", "coordinator", "--file", str(yaml), "--print", "--platform", "systemd")
    assert r.returncode == 2 and "secret.file" in r.stderr, r.stderr
    yaml.write_text(yaml.read_text() + f"secret:\n  file: {secret}\n")
    r = cli("install", "coordinator", "--file", str(yaml), "--print", "--platform", "systemd")
    assert r.returncode == 0, r.stderr
    u = units.parse_unit(r.stdout)
    argv = units.exec_argv(u["Service"]["ExecStart"][0])
    assert argv[0] == sys.executable and argv[-2:] == ["supervise", str(yaml)]
    assert u["Service"]["Restart"] == ["on-failure"] and SECRET not in r.stdout
    # a node: its secret from a file, never in the service
    r = cli("install", "node", "--print", "--platform", "launchd", "--name", "m1")
    assert r.returncode == 2 and "--secret-file" in r.stderr, r.stderr

    home = tmp_path / "home"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    fake = bin_dir / "launchctl"  # records its arguments; `print` says how a loaded job looks
    fake.write_text(
        f'#!/bin/sh\necho "$@" >> {calls}\n[ "$1" = print ] && echo "state = running"\nexit 0\n'
    )
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    env = {"HOME": str(home), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    args = ("node", "--platform", "launchd")
    r = cli("install", *args, "--secret-file", str(secret), "--name", "m1", env=env)
    assert r.returncode == 0, r.stderr
    plist = home / "Library" / "LaunchAgents" / "org.moe-cluster.node.plist"
    d = plistlib.loads(plist.read_bytes())
    assert d["ProgramArguments"][-4:] == ["--secret-file", str(secret), "--name", "m1"]
    assert Path(d["StandardOutPath"]).parent.is_dir()  # ~/Library/Logs/moe-cluster
    assert SECRET not in plist.read_text()
    uid = os.getuid()
    assert f"bootstrap gui/{uid} {plist}" in calls.read_text()
    r = cli("status", *args, env=env)
    assert r.returncode == 0 and "state = running" in r.stdout, r.stdout
    r = cli("uninstall", *args, env=env)
    assert r.returncode == 0 and not plist.exists()
    assert f"bootout gui/{uid}/org.moe-cluster.node" in calls.read_text()
    r = cli("status", *args, env=env)
    assert r.returncode == 3 and "not installed" in r.stdout
