"""The README's two set-up commands: CI runs exactly the test command, the main job is `up`."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return [b.strip() for b in re.findall(r"```\n(.*?)```", quick, flags=re.S)]


def test_exactly_two_setup_commands():
    main, tests = _blocks()
    assert "\n" not in main and "\n" not in tests
    assert main.endswith("moe-cluster up cluster.yaml") and "python3 -m venv" in main
    assert "pytest" in tests and "python3 -m venv" in tests


def test_ci_runs_the_readme_test_command():
    """Each step of it as a line of its own, in order (tests/integration/test_ci_run.py: why)."""
    _, tests = _blocks()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    steps = tests.split(" && ")
    assert all(step in ci for step in steps), (steps, ci)
    assert sorted(steps, key=ci.index) == steps


def test_root_cluster_yaml_is_a_valid_two_node_demo():
    from moe_cluster.coordinator.serve.config import load_config

    c = load_config(ROOT / "cluster.yaml")
    assert c.model == "demo" and c.launch == "local" and len(c.nodes) == 2


def test_the_two_mac_cluster_yaml_is_valid():
    """The README's cluster of two Macs validates as it stands (docs/configuration.md's annotated
    example is checked by test_config_docs.py)."""
    from moe_cluster.coordinator.serve.config import parse_config

    text = (ROOT / "README.md").read_text()
    block = re.search(r"```yaml\n(.*?)```", text, flags=re.S).group(1)
    c = parse_config(block, "README.md")
    assert c.launch == "remote" and c.checkpoint == "coordinator"
    assert [n.name for n in c.nodes] == ["studio-1", "studio-2"]


def test_readme_stays_short():
    """The README serves a new user; evidence and internals go to docs/."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200
