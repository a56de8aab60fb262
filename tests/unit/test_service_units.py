"""The services' files: a launchd agent that plutil would pass (a plist round trip and the keys
launchd needs), a systemd unit systemd would parse, each restarting on failure, started at login
or boot, logging where the platform keeps logs, and never holding the secret."""

from __future__ import annotations

import plistlib

import pytest

from moe_cluster.coordinator.service import units
from moe_cluster.coordinator.service.supervise import RESTART_MAX_S, RESTART_S, next_delay

ARGV = ("/opt/py/bin/python3", "-m", "moe_cluster.coordinator.cli", "node", "--secret-file",
        "/Users/me/.config/moe-cluster/secret", "--name", "m1 (desk)", "--cluster", "lab%1$x")  # fmt: skip
NODE = units.Service("node", ARGV, "/Users/me", "/Users/me/Library/Logs/moe-cluster/node.log")


def test_plist_round_trips_with_the_keys_launchd_needs():
    data = units.plist(NODE)
    d = plistlib.loads(data)
    assert plistlib.loads(plistlib.dumps(d)) == d
    assert data.startswith(b"<?xml") and b"<!DOCTYPE plist" in data
    assert d["Label"] == "org.moe-cluster.node"
    assert d["ProgramArguments"] == list(ARGV)  # no shell: each word as it is
    assert d["RunAtLoad"] is True  # at login
    assert d["KeepAlive"] == {"SuccessfulExit": False}  # again after a failure, not after a stop
    assert d["StandardOutPath"] == d["StandardErrorPath"] == NODE.log
    assert isinstance(d["ThrottleInterval"], int) and d["ThrottleInterval"] > 0
    for key, value in d.items():  # launchd's types
        assert isinstance(value, (str, bool, int, list, dict)), key
    assert all(isinstance(v, str) for v in d["EnvironmentVariables"].values())


def test_unit_parses_restarts_on_failure_and_starts_at_login_or_boot():
    text = units.unit(NODE)
    u = units.parse_unit(text)
    assert set(u) == {"Unit", "Service", "Install"}
    s = u["Service"]
    assert s["Restart"] == ["on-failure"] and int(s["RestartSec"][0]) > 0
    assert units.exec_argv(s["ExecStart"][0]) == list(ARGV)
    assert "%%" in s["ExecStart"][0] and "$$" in s["ExecStart"][0]  # systemd's specifiers
    assert u["Install"]["WantedBy"] == ["default.target"]  # a user's: at login
    system = units.unit(units.Service("node", ARGV, "/root", system=True))
    assert units.parse_unit(system)["Install"]["WantedBy"] == ["multi-user.target"]  # at boot
    assert "StandardOutput" not in s  # the journal keeps it


def test_a_unit_that_is_not_one_is_refused():
    with pytest.raises(ValueError, match="line 2"):
        units.parse_unit("[Service]\nExecStart /bin/true\n")


def test_the_secret_is_never_in_either_file():
    secret = "hunter2-cluster-secret"
    for text in (units.plist(NODE).decode(), units.unit(NODE)):
        assert secret not in text and "MOE_CLUSTER_SECRET" not in text
        assert "--secret-file" in text


def test_supervise_backs_off_while_up_fails_fast():
    delays, d = [], 0.0
    for _ in range(10):
        d = next_delay(d, ran_s=1.0)
        delays.append(d)
    assert delays[0] == RESTART_S and delays == sorted(delays) and delays[-1] == RESTART_MAX_S
    assert next_delay(RESTART_MAX_S, ran_s=3600) == RESTART_S  # a long run: at once again
