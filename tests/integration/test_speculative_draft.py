"""`speculative: draft` in three real node processes over the envoy (`simulate --check`): rank 0's
draft model guesses, the others read its guesses from one agreement per step, and every node
verifies them: stock mlx-lm's tokens and float32 logits, with every guess of a draft that is the
model itself accepted (four tokens a step)."""

from __future__ import annotations

import json

from conftest import cli


def test_a_draft_on_rank_0_guesses_for_three_envoy_nodes_with_stock_tokens():
    r = cli(
        "simulate",
        "--model",
        "demo",
        "--nodes",
        "3",
        "--transport",
        "envoy",
        "--prompt",
        "To be, or not to be",
        "--max-tokens",
        "24",
        "--check",
        "--speculative",
        "draft",
        "--draft-model",
        "demo",
        "--draft-tokens",
        "3",
        "--json",
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["tokens_match"] and out["compared_steps"] == 24, out
    assert out["max_abs_logit_diff"] <= 1e-4, out["max_abs_logit_diff"]
    spec = out["speculative"]
    assert spec["mode"] == "draft, 3 drafts" and spec["accepted"] == spec["drafted"] >= 18, spec
    assert spec["steps"] <= 7, spec  # 24 tokens at 4 a step (and the first with the prompt)
