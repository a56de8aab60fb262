"""N node processes (shared-memory collective) against stock mlx-lm, for every MoE family.

float32: greedy tokens equal and max |Δlogit| <= 1e-4, both layouts, N = 1..4.
bfloat16 / 4-bit: tokens equal, or the first difference is a near-tie (tolerances below).
"""

from __future__ import annotations

import pytest

from conftest import ARCHS
from moe_cluster.coordinator.dev.simulate import compare, run_nodes
from moe_cluster.proto.records import Sampling
from moe_cluster.node.sim import SimTask

PROMPT = (345, 12, 88, 501, 7, 260, 19, 944, 3, 71)
TOKENS = 32
FLOAT32_TOL = 1e-4
# bfloat16 keeps 8 bits of mantissa: relative error ~2^-9 per rounding, a few dozen roundings
# deep, on logits of magnitude ~5. A first difference counts as a near-tie when the reference's
# top two logits were closer than this.
BF16_NEAR_TIE = 0.25
# 4-bit: weights are identical on both sides; only the order of float32 additions differs.
Q4_NEAR_TIE = 1e-3


def _task(path, record=True):
    return SimTask(str(path), PROMPT, Sampling(max_tokens=TOKENS), record_logits=record)


@pytest.fixture(scope="module")
def float32_models(make_ckpt):
    return [(arch, layout, make_ckpt(arch, layout)) for arch in ARCHS for layout in ("mlx", "hf")]


@pytest.mark.parametrize("nodes", [1, 2, 3, pytest.param(4, marks=pytest.mark.slow)])  # 4 nodes: 18 s
def test_float32_every_family_both_layouts(nodes, float32_models, reference):
    reports = run_nodes([_task(p) for _, _, p in float32_models], nodes)
    for (arch, layout, path), per_rank in zip(float32_models, reports):
        ref_tokens, ref_logits = reference(path, PROMPT, TOKENS)
        got = per_rank[0]
        assert all(r["tokens"] == got["tokens"] for r in per_rank), f"{arch}/{layout}: nodes disagree"
        cmp = compare(got["tokens"], got["logits"], ref_tokens, ref_logits)
        assert cmp["tokens_match"], (arch, layout, nodes, cmp)
        assert len(got["tokens"]) == TOKENS
        assert cmp["max_abs_logit_diff"] <= FLOAT32_TOL, (arch, layout, nodes, cmp["max_abs_logit_diff"])


def _near_tie_or_equal(cmp: dict, tol: float, what: str) -> None:
    if cmp["tokens_match"]:
        return
    first = cmp["first_difference"]
    assert first["reference_top2_gap"] <= tol, (what, first)


@pytest.mark.parametrize("nodes", [2, pytest.param(3, marks=pytest.mark.slow)])  # 3 nodes: 23 s
def test_bfloat16(nodes, make_ckpt, reference):
    models = [(a, make_ckpt(a, "mlx", "bfloat16")) for a in ("mixtral", "qwen3_moe", "deepseek_v3", "dbrx", "gpt_oss")]
    models.append(("qwen2_moe-hf", make_ckpt("qwen2_moe", "hf", "bfloat16")))
    reports = run_nodes([_task(p) for _, p in models], nodes)
    for (name, path), per_rank in zip(models, reports):
        # Stock mlx-lm on MLX's CPU backend has no bfloat16 gather_mm: its reference runs the same
        # checkpoint upcast to float32 (exactly representable), i.e. the bf16 model's exact output.
        ref_tokens, ref_logits = reference(path, PROMPT, TOKENS)
        cmp = compare(per_rank[0]["tokens"], per_rank[0]["logits"], ref_tokens, ref_logits)
        _near_tie_or_equal(cmp, BF16_NEAR_TIE, f"{name} bf16 N={nodes}")


@pytest.mark.slow  # 22 s to 24 s each
@pytest.mark.parametrize("nodes", [2, 3])
def test_4bit(nodes, make_ckpt, reference):
    models = [(a, make_ckpt(a, "mlx", "float32", 4)) for a in ARCHS]
    models += [(f"{a}-hf", make_ckpt(a, "hf", "float32", 4)) for a in ("mixtral", "olmoe", "deepseek_v3")]
    models.append(("mixtral-mixed-bits", make_ckpt("mixtral", "mlx", "float32", 4, mixed_bits=True)))
    reports = run_nodes([_task(p) for _, p in models], nodes)
    for (name, path), per_rank in zip(models, reports):
        ref_tokens, ref_logits = reference(path, PROMPT, TOKENS)
        cmp = compare(per_rank[0]["tokens"], per_rank[0]["logits"], ref_tokens, ref_logits)
        _near_tie_or_equal(cmp, Q4_NEAR_TIE, f"{name} 4-bit N={nodes}")
        assert cmp["max_abs_logit_diff"] <= FLOAT32_TOL or not cmp["tokens_match"], (name, cmp["max_abs_logit_diff"])
