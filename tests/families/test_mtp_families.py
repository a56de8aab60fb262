"""`speculative: mtp` on a second family: GLM-4.5's layout (glm4_moe, whose mlx-lm sanitize drops
`model.layers.{num_hidden_layers}.*`), a tiny checkpoint with one MTP layer in its safetensors,
in two and three real node processes over the envoy: stock mlx-lm's tokens and float32 logits."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

import tiny
from conftest import cli


@pytest.mark.parametrize("nodes", [2, 3])
def test_mtp_drafts_on_glm4_moe_give_stock_tokens_and_logits(tmp_path, nodes):
    from moe_cluster.node.demo.make import mtp_weights

    out = tiny.make_checkpoint("glm4_moe", tmp_path / "glm", tokenizer=True)
    model, cfg = tiny.build_model("glm4_moe", 0, None)
    config = json.loads((out / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    weights = dict(mx.load(str(out / "model.safetensors")))
    weights.update(mtp_weights(model, config, 1))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config))
    r = cli(
        "simulate", "--model", str(out), "--nodes", str(nodes), "--transport", "envoy",
        "--prompt", "To be, or not to be", "--max-tokens", "12", "--check",
        "--speculative", "mtp", "--draft-tokens", "2", "--json",
        timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout)
    assert got["tokens_match"] and got["compared_steps"] == 12, got
    assert got["max_abs_logit_diff"] <= 1e-4, got["max_abs_logit_diff"]
    spec = got["speculative"]
    assert spec["mode"] == "mtp, 2 drafts, MTP experts whole" and spec["drafted"] > 0, spec
