"""Profile-guided placement with replication lowers the measured per-node expert load."""

from __future__ import annotations

import json

from conftest import cli


def test_profile_guided_placement_beats_the_even_split():
    r = cli(
        "bench",
        "placement",
        "--model",
        "demo",
        "--nodes",
        "2",
        "--spare-experts",
        "4",
        "--max-tokens",
        "24",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    even = out["placements"]["even"]["measured_expected_experts"]
    guided = out["placements"]["profile"]["measured_expected_experts"]
    assert guided < even, out
    assert out["same_tokens"]  # placement never changes what the model says
    assert (
        out["placements"]["profile"]["experts_per_node"]
        > out["placements"]["even"]["experts_per_node"]
    )
