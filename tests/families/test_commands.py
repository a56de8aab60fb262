"""The families the old name rules got wrong or refused, through the commands people run:
`simulate` (real node processes over shared memory, checked against stock mlx-lm) and `plan`
(the planner's description: top-k and shared-expert bytes come from the same structure rule)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import sweep
import tiny

pytestmark = pytest.mark.integration

WRONG, REFUSED = tiny.WRONG, tiny.REFUSED
PROMPT = "To be, or not to be"
# families whose caches hold a recurrent state (ArraysCache): no speculation (node/speculate.py);
# the rotating (gemma4_text, step3p5) and chunked (llama4) windows speculate while the prompt and
# its output are still in them, as here
NO_ROLLBACK = {"kimi_linear", "kimi_k3", "qwen3_5_moe", "longcat_flash_ngram"}


def moe_cluster(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moe_cluster.coordinator.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {f: tiny.make_checkpoint(f, root / f, tokenizer=True) for f in WRONG + REFUSED}


@pytest.mark.parametrize("family", WRONG + REFUSED)
def test_simulate_two_node_processes_equal_stock(family, checkpoints, capsys):
    """`simulate` through the command's own entry point, in this process (its two node processes are
    real, spawned as from the CLI): a subprocess each only added an interpreter and MLX import.
    With speculation on (`auto`, the default): its steps verify drafts, so the check also covers
    rolling them back."""
    from moe_cluster.coordinator.cli import main

    code = main(
        [
            "simulate",
            "--model",
            str(checkpoints[family]),
            "--nodes",
            "2",
            "--prompt",
            PROMPT,
            "--max-tokens",
            "8",
            "--check",
            "--json",
            "--speculative",
            "auto",
        ]
    )
    r = capsys.readouterr()
    assert code == 0, r.err
    out = json.loads(r.out)  # stdout is the JSON alone
    assert len(out["tokens"]) == 8
    assert out["tokens_match"], out
    assert out["compared_steps"] == 8, out  # every step's logits were recorded and compared
    assert out["max_abs_logit_diff"] <= sweep.TOLERANCE, out["max_abs_logit_diff"]
    # speculating (drafts from the prompt's n-grams, most rejected and rolled back) where the
    # family's caches can drop positions; one token a step, saying why, where they cannot
    spec = out["speculative"]
    if family in NO_ROLLBACK:
        assert spec["mode"].startswith("off: its caches (") and spec["drafted"] == 0, spec
    else:
        assert spec["mode"] == "auto, 4 drafts" and spec["drafted"] > 0, spec


@pytest.mark.parametrize("family", [f for f in tiny.families() if tiny.needs_metal(f)])
def test_a_metal_only_family_is_refused_in_one_line(family, tmp_path):
    path = tiny.make_checkpoint(family, tmp_path / family, tokenizer=True)
    for args in (
        ["simulate", "--model", str(path), "--nodes", "2", "--prompt", PROMPT],
        ["run", "--model", str(path), "--prompt", PROMPT],
    ):
        r = moe_cluster(*args)
        assert r.returncode == 2, r.stderr
        lines = r.stderr.strip().splitlines()
        assert (
            len(lines) == 1
            and f"model_type={family!r} calls mlx-lm's Metal-only kernels" in lines[0]
        ), r.stderr


@pytest.mark.parametrize("family", tiny.families())
def test_plan_describes_every_family(family, tmp_path, capsys):
    """`plan --model` on every family, in this process (the command's own entry point): top-k and
    shared-expert bytes come from the same structure rule, so issue 13's families (WRONG, REFUSED)
    are checked here with the rest rather than by a subprocess each (17 of them cost ~30 s)."""
    from moe_cluster.coordinator.cli import main

    path = tiny.make_checkpoint(family, tmp_path / family)
    code = main(
        ["plan", "--model", str(path), "--hardware", "m2-ultra-192", "--nodes", "2", "--json"]
    )
    out = capsys.readouterr()
    if tiny.needs_metal(family):  # describing runs each MoE block once: not possible off Metal
        assert code == 2 and "Metal-only kernels" in out.err, out.err
        return
    assert code == 0, out.err
    model = json.loads(out.out)["model"]
    assert model["num_experts"] == 8, model
    assert model["top_k"] == (1 if family == "llama4" else 2), (
        model
    )  # tiny.py: top-2, llama4 asserts top-1
    assert model["moe_layers"] >= 1 and model["expert_bytes"] > 0, model
    if family in ("hunyuan", "step3p5"):  # shared experts counted whatever their name
        assert model["shared_expert_bytes"] > 0, model


def test_a_family_never_checked_against_stock_is_refused_in_one_line(tmp_path):
    """prism_hadamard_qwen35's packed checkpoint cannot be built here, so no run was ever compared
    with stock mlx-lm: `plan` (which reads config.json alone) refuses it, saying why."""
    import json as _json

    from moe_cluster.node.checkpoint import UNVERIFIED

    for family in UNVERIFIED:
        (tmp_path / family).mkdir()
        (tmp_path / family / "config.json").write_text(_json.dumps(tiny.tiny_config(family)))
        r = moe_cluster(
            "plan", "--model", str(tmp_path / family), "--hardware", "m2-ultra-192", "--nodes", "2"
        )
        assert r.returncode == 2, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and f"model_type={family!r} is not supported" in lines[0], r.stderr
