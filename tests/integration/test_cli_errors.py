"""How the real CLI ends: a UserError is one line and exit 2; a bug is one internal-error line and exit 1."""

from __future__ import annotations

import pytest

from conftest import assert_one_line_error, cli
from moe_cluster.coordinator import cli as cli_module


def test_a_missing_prompts_file_is_a_user_error(tmp_path):
    r = cli(
        "profile",
        "--model",
        "demo",
        "--prompts",
        str(tmp_path / "none.txt"),
        "--out",
        str(tmp_path / "p.json"),
    )
    assert_one_line_error(r, "moe-cluster profile: error: cannot read prompts file", "none.txt")


def test_a_bad_option_value_in_command_code_is_a_user_error():
    r = cli("bench", "decode", "--model", "demo", "--nodes", "1,two")
    assert_one_line_error(r, "moe-cluster bench: error: --nodes", "1,two")


def test_a_soak_that_would_kill_nothing_is_a_user_error():
    r = cli("bench", "soak", "--minutes", "0.5", "--kill-every", "60")
    assert_one_line_error(r, "moe-cluster bench: error: --kill-every 60 s is longer than the soak")


def test_bench_link_on_nodes_it_would_start_itself_is_a_user_error():
    """bench link measures running node agents: the README's local demo cluster.yaml has none."""
    from pathlib import Path

    demo = Path(__file__).resolve().parents[2] / "cluster.yaml"
    r = cli("bench", "link", str(demo))
    assert_one_line_error(r, "moe-cluster bench: error:", "needs launch: remote")


def test_no_running_cluster_is_a_user_error(tmp_path):
    import os

    r = cli("status", env={**os.environ, "XDG_RUNTIME_DIR": str(tmp_path), "HOME": str(tmp_path)})
    assert_one_line_error(r, "no running cluster found", "--url")


def _bug(args):
    return {}["missing"]  # a KeyError no input can explain


@pytest.fixture
def buggy_run(monkeypatch):
    """`moe-cluster run` with a handler that has a bug (the real parser, the real error handling)."""
    import moe_cluster.coordinator.dev.run_local as run_local

    monkeypatch.setattr(run_local, "main", _bug)


def test_a_bug_is_one_internal_error_line_and_exit_1(buggy_run, capsys):
    assert cli_module.main(["run", "--model", "demo", "--prompt", "hi"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "moe-cluster run: internal error: KeyError: 'missing' (run with -v for the traceback)"
    ]


def test_a_bug_with_v_shows_the_traceback(buggy_run, capsys):
    assert cli_module.main(["-v", "run", "--model", "demo", "--prompt", "hi"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "_bug" in err
    assert err.strip().splitlines()[-1].startswith("moe-cluster run: internal error: KeyError")


def test_a_plain_value_error_is_a_bug_not_a_usage_error(monkeypatch, capsys):
    import moe_cluster.coordinator.dev.run_local as run_local

    def broken(args):
        raise ValueError("an internal invariant broke")

    monkeypatch.setattr(run_local, "main", broken)
    assert cli_module.main(["run", "--model", "demo", "--prompt", "hi"]) == 1
    assert "internal error: ValueError: an internal invariant broke" in capsys.readouterr().err


def test_a_failed_cluster_is_one_error_line_and_exit_1(monkeypatch, capsys):
    import moe_cluster.coordinator.serve.remote as remote
    from moe_cluster.coordinator.serve.client import ClusterError

    def down(args):
        raise ClusterError("cannot reach http://127.0.0.1:9: connection refused")

    monkeypatch.setattr(remote, "status", down)
    assert cli_module.main(["status", "--url", "http://127.0.0.1:9"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "moe-cluster status: error: cannot reach http://127.0.0.1:9: connection refused"
    ]
