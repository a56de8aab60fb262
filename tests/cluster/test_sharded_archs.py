"""N node processes (shared-memory collective) against stock mlx-lm, for every MoE family.

float32: greedy tokens equal and max |Δlogit| <= 1e-4, both layouts, N = 1..4.
bfloat16 / 4-bit: TOKENS tokens, equal to stock's or first differing at a near-tie (tolerances
below), and every step up to that one within a logit bound of the dtype (conftest.BF16_ULPS for
bfloat16; float32's 1e-4 for 4-bit, whose arithmetic is float32).
"""

from __future__ import annotations

import pytest

from conftest import ARCHS, bf16_logit_bound
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


@pytest.fixture(scope="module")
def bfloat16_models(make_ckpt):
    models = [
        (a, make_ckpt(a, "mlx", "bfloat16"))
        for a in ("mixtral", "qwen3_moe", "deepseek_v3", "dbrx", "gpt_oss")
    ]
    models.append(("qwen2_moe-hf", make_ckpt("qwen2_moe", "hf", "bfloat16")))
    return models


@pytest.fixture(scope="module")
def q4_models(make_ckpt):
    models = [(a, make_ckpt(a, "mlx", "float32", 4)) for a in ARCHS]
    models += [
        (f"{a}-hf", make_ckpt(a, "hf", "float32", 4)) for a in ("mixtral", "olmoe", "deepseek_v3")
    ]
    models.append(
        ("mixtral-mixed-bits", make_ckpt("mixtral", "mlx", "float32", 4, mixed_bits=True))
    )
    return models


@pytest.fixture(scope="module")
def reports_at(request):
    """reports_at(suite, nodes) -> reports[model][rank] of `run_nodes` for that suite's models.

    One spawn of N node processes serves every suite selected at that N (float32, bfloat16, 4-bit:
    each node loads each model in turn), not one spawn per test: at N = 2 and 3 that is one spawn
    of the processes instead of three (~10 s on 2 vCPUs). Each test still checks its own models."""
    tests = {
        "test_float32_every_family_both_layouts": "float32_models",
        "test_bfloat16": "bfloat16_models",
        "test_4bit": "q4_models",
    }
    wanted: dict[int, list[str]] = {}  # nodes -> the suites selected at that N, in test order
    for item in request.session.items:
        if item.module is request.module and item.originalname in tests:
            suites = wanted.setdefault(item.callspec.params["nodes"], [])
            if tests[item.originalname] not in suites:
                suites.append(tests[item.originalname])
    cache: dict[int, dict[str, list]] = {}

    def get(suite: str, nodes: int) -> list:
        if nodes not in cache:
            suites = wanted.get(nodes, [suite])
            models = {s: request.getfixturevalue(s) for s in suites}
            paths = [m[-1] for s in suites for m in models[s]]
            reports = run_nodes([_task(p) for p in paths], nodes)
            cache[nodes], at = {}, 0
            for s in suites:
                cache[nodes][s], at = reports[at : at + len(models[s])], at + len(models[s])
        return cache[nodes][suite]

    return get


# 4 nodes: tests/cluster/test_transports.py (the suite's time budget took this one's 10 s)
# 3 nodes: the drawn configs' simulate (tests/families/test_drawn.py) and test_up (the suite's time
# budget took this one's 23 s); 4 nodes: tests/cluster/test_transports.py
@pytest.mark.parametrize("nodes", [2])  # 1 node: the in-process batch and sweep tests
def test_float32_every_family_both_layouts(nodes, float32_models, reports_at, reference):
    reports = reports_at("float32_models", nodes)
    for (arch, layout, path), per_rank in zip(float32_models, reports, strict=True):
        ref_tokens, ref_logits = reference(path, PROMPT, TOKENS)
        got = per_rank[0]
        assert all(r["tokens"] == got["tokens"] for r in per_rank), (
            f"{arch}/{layout}: nodes disagree"
        )
        cmp = compare(got["tokens"], got["logits"], ref_tokens, ref_logits)
        assert cmp["tokens_match"], (arch, layout, nodes, cmp)
        assert len(got["tokens"]) == TOKENS
        assert len(got["logits"]) == TOKENS and cmp["compared_steps"] == TOKENS, (
            arch,
            len(got["logits"]),
        )
        assert cmp["max_abs_logit_diff"] <= FLOAT32_TOL, (
            arch,
            layout,
            nodes,
            cmp["max_abs_logit_diff"],
        )


def _near_tie_or_equal(cmp: dict, tokens: list[int], tol: float, what: str) -> None:
    """TOKENS tokens, stock's or first differing at a near-tie; the logits compared at every step
    of the shared prefix and at the step that differs (the same context on both sides)."""
    assert len(tokens) == TOKENS, (what, len(tokens))
    if cmp["tokens_match"]:
        assert cmp["compared_steps"] == TOKENS, (what, cmp["compared_steps"])
        return
    first = cmp["first_difference"]
    assert cmp["compared_steps"] == first["step"] + 1, (what, cmp["compared_steps"], first)
    assert first["reference_top2_gap"] <= tol, (what, first)


@pytest.mark.parametrize("nodes", [2])  # 3 nodes: 23 s, outside the suite's time budget
def test_bfloat16(nodes, bfloat16_models, reports_at, reference):
    reports = reports_at("bfloat16_models", nodes)
    for (name, path), per_rank in zip(bfloat16_models, reports, strict=True):
        # Stock mlx-lm on MLX's CPU backend has no bfloat16 gather_mm: its reference runs the same
        # checkpoint upcast to float32 (exactly representable), i.e. the bf16 model's exact output.
        ref_tokens, ref_logits = reference(path, PROMPT, TOKENS)
        cmp = compare(per_rank[0]["tokens"], per_rank[0]["logits"], ref_tokens, ref_logits)
        _near_tie_or_equal(cmp, per_rank[0]["tokens"], BF16_NEAR_TIE, f"{name} bf16 N={nodes}")
        bound = bf16_logit_bound(ref_logits)
        assert cmp["max_abs_logit_diff"] <= bound, (name, nodes, cmp["max_abs_logit_diff"], bound)


@pytest.mark.slow  # 22 s to 24 s each
@pytest.mark.parametrize("nodes", [2])  # 3 nodes: outside the suite's time budget
def test_4bit(nodes, q4_models, reports_at, reference):
    reports = reports_at("q4_models", nodes)
    for (name, path), per_rank in zip(q4_models, reports, strict=True):
        ref_tokens, ref_logits = reference(path, PROMPT, TOKENS)
        cmp = compare(per_rank[0]["tokens"], per_rank[0]["logits"], ref_tokens, ref_logits)
        _near_tie_or_equal(cmp, per_rank[0]["tokens"], Q4_NEAR_TIE, f"{name} 4-bit N={nodes}")
        assert cmp["max_abs_logit_diff"] <= FLOAT32_TOL, (name, nodes, cmp["max_abs_logit_diff"])
