"""The family sweep on configs drawn at random (drawn.py): other expert counts, top-k, widths, shared
experts, routed scaling, group routing, depth and quantization than tiny.py's one config.

Each drawn config: every rank's shard summed in rank order at N = 2 and 3 against stock mlx-lm
(greedy tokens, float32 |Δlogit| <= 1e-4; 1e-3 on quantized weights, as the fixed sweep), and
`plan` describing it with the drawn expert count and top-k. `FAMILY_SEEDS=N` draws N configs per
family (CI: 1); `python tests/families/drawn.py --seeds N` prints a row per family by hand.
"""

from __future__ import annotations

import json

import pytest

import drawn
import sweep
import tiny

pytestmark = pytest.mark.integration

CASES = [(f, s) for f in tiny.families() if not tiny.needs_metal(f) for s in drawn.seeds()]


@pytest.mark.parametrize("family,seed", CASES, ids=[f"{f}-{s}" for f, s in CASES])
def test_drawn_config_is_exact_at_2_and_3_nodes_and_planned(family, seed, tmp_path, capsys):
    got = drawn.check(family, seed, tmp_path)
    d = got["draw"]
    bound = sweep.QUANT_TOLERANCE if d.quantize else sweep.TOLERANCE
    for n, r in got["nodes"].items():
        assert len(r["tokens"]) == len(r["reference_tokens"]) == sweep.STEPS, (d.label(), n, r)
        assert r["tokens_match"], (d.label(), n, r)
        assert r["max_abs_logit_diff"] <= bound, (d.label(), n, r["max_abs_logit_diff"])

    from moe_cluster.coordinator.cli import main

    code = main(
        [
            "plan",
            "--model",
            str(got["path"]),
            "--hardware",
            "m2-ultra-192",
            "--nodes",
            "3",
            "--json",
        ]
    )
    out = capsys.readouterr()
    assert code == 0, (d.label(), out.err)
    model = json.loads(out.out)["model"]
    assert (model["num_experts"], model["top_k"]) == (d.experts, d.top_k), (d.label(), model)


def test_a_non_linear_block_is_refused_with_its_mismatch():
    """The probe still refuses what is not linear in its routed experts: a block that squares its
    routed sum, and one that normalises it. The message names the block, the identity that failed,
    and the mismatch against its rounding bound."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import SwitchGLU

    from moe_cluster.node.moe.structure import StructureError, find_moe_blocks

    class Block(nn.Module):
        def __init__(self, post):
            super().__init__()
            self.gate = nn.Linear(16, 4, bias=False)
            self.switch_mlp = SwitchGLU(16, 8, 4)
            self.post = post

        def __call__(self, x):
            inds = mx.argpartition(-self.gate(x), kth=1, axis=-1)[..., :2]
            y = self.switch_mlp(x, inds).sum(axis=-2)
            return self.post(y)

    class Model(nn.Module):
        def __init__(self, post):
            super().__init__()
            self.layers = [Block(post)]

    def normalise(y):
        return y / mx.sqrt(mx.mean(y * y, axis=-1, keepdims=True) + 1e-6)

    for name, post in (("square", lambda y: y * y), ("normalise", normalise)):
        with pytest.raises(StructureError) as err:
            find_moe_blocks(Model(post))
        msg = str(err.value)
        assert "layers.0" in msg and "not linear" in msg, (name, msg)
        assert "max |difference|" in msg and "rounding bound" in msg, (name, msg)
    assert find_moe_blocks(Model(lambda y: 1.5 * y))  # a linear post-scale is accepted


def test_cancellation_near_zero_is_rounding_not_structure():
    """An identity that holds exactly, checked on outputs where large terms cancel to ~0, passes the
    bound (the old element-wise atol refused it); a real mismatch of 1e-3 of the scale does not."""
    import mlx.core as mx

    from moe_cluster.node.moe.structure import compare

    big = mx.array([65.0, -65.0, 1e-3], dtype=mx.float32)
    eps = mx.array([3.05e-5, 0.0, -3.05e-5], dtype=mx.float32)  # float32 rounding at magnitude 65
    ok = compare("a + b == c", [(1, big), (1, -big + eps)], [(1, mx.zeros(3))])
    assert ok.holds and ok.error > 1e-5, ok  # the element-wise atol of 1e-5 would refuse it
    bad = compare("a + b == c", [(1, big), (1, -big + 0.065)], [(1, mx.zeros(3))])
    assert not bad.holds and "max |difference| 0.065" in str(bad), bad


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek"])
def test_simulate_three_node_processes_on_a_drawn_config(family, tmp_path, capsys):
    """`simulate --check` (three real node processes over shared memory) on a family the probe
    refused on such configs: stock's tokens, |Δlogit| within the bound."""
    from moe_cluster.coordinator.cli import main

    d = drawn.draw(family, 0)
    path = tiny.make_checkpoint(
        family, tmp_path / family, tokenizer=True, quantize=d.quantize, cfg=drawn.config(family, d)
    )
    code = main(
        [
            "simulate",
            "--model",
            str(path),
            "--nodes",
            "3",
            "--prompt",
            "To be, or not to be",
            "--max-tokens",
            "8",
            "--check",
            "--json",
        ]
    )
    r = capsys.readouterr()
    assert code == 0, (d.label(), r.err)
    out = json.loads(r.out)
    assert len(out["tokens"]) == 8 and out["tokens_match"], (d.label(), out)
    assert out["max_abs_logit_diff"] <= (
        sweep.QUANT_TOLERANCE if d.quantize else sweep.TOLERANCE
    ), (d.label(), out)
