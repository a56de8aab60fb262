"""`speculative: mtp` in real node processes: the checkpoint's own multi-token-prediction layer
drafts (node/mtp.py) and every node verifies, with the tokens and float32 logits of decoding one
token per step. On a DeepSeek-V3-shaped checkpoint in Hugging Face's layout whose safetensors hold
an MTP layer (`model.layers.61.*`, dropped by mlx-lm's sanitize) at N = 2 and 3, greedy and seeded,
its routed experts whole on every node and sharded (`mtp_experts`), alone (against stock mlx-lm)
and in a batch of prompts of different lengths (against the same batch without speculation); and
on the demo with its trained MTP head, whose drafts hold."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import cli
from moe_cluster.coordinator.dev.simulate import run_nodes
from moe_cluster.node.demo import MODEL_DIR
from moe_cluster.node.sim import SimTask
from moe_cluster.proto.records import Sampling

SEEDED = ("--temperature", "1", "--seed", "3")


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """61 decoder layers (mlx-lm's DeepSeek-V3 sanitize drops `model.layers.61.*`, the released
    model's MTP layer), the last three MoE, and one MTP layer with its own routed experts."""
    out = tmp_path_factory.mktemp("dsv3-mtp")
    config = {"num_nextn_predict_layers": 1, "first_k_dense_replace": 58}
    r = cli(
        "demo-model", "--arch", "deepseek_v3", "--out", str(out), "--layout", "hf",
        "--layers", "61", "--experts", "8", "--top-k", "2", "--hidden", "64",
        "--config", json.dumps(config),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    return out


def _simulate(model, nodes: int, *extra: str) -> dict:
    r = cli(
        "simulate", "--model", str(model), "--nodes", str(nodes), "--transport", "envoy",
        "--prompt", "To be, or not to be", "--max-tokens", "16", "--check",
        "--speculative", "mtp", "--draft-tokens", "2", "--json", *extra,
        timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


def _held(out: dict, holding: str, mtp_layer: int) -> None:
    """Every node says where the MTP layer's routed experts are, and made no MoE call (each an
    all-reduce) for it where they are whole; one or more per decode step where they are sharded."""
    assert out["speculative"]["mode"] == f"mtp, 2 drafts, MTP experts {holding}", out
    for node in out["nodes"]:
        calls = node["moe_calls"]
        if holding == "whole":
            assert str(mtp_layer) not in calls, calls
        else:
            model = max(v for k, v in calls.items() if k != str(mtp_layer))
            assert calls[str(mtp_layer)] >= model > 0, calls  # a feed each step, at least


@pytest.mark.parametrize(
    "nodes,sampling,holding",
    [(2, (), "whole"), (2, SEEDED, "sharded"), (3, (), "sharded"), (3, SEEDED, "whole")],
    ids=["2-greedy-whole", "2-seeded-sharded", "3-greedy-sharded", "3-seeded-whole"],
)
def test_mtp_drafts_on_a_deepseek_v3_checkpoint_give_stock_tokens_and_logits(
    deepseek, nodes, sampling, holding
):
    out = _simulate(deepseek, nodes, *sampling, "--mtp-experts", holding)
    assert out["tokens_match"] and out["compared_steps"] == 16, out
    assert out["max_abs_logit_diff"] <= 1e-4, out["max_abs_logit_diff"]
    assert out["speculative"]["drafted"] > 0, out["speculative"]
    _held(out, holding, 61)


@pytest.mark.parametrize("nodes,sampling", [(2, ()), (3, SEEDED)], ids=["2-greedy", "3-seeded"])
def test_auto_draws_on_the_mtp_layer_with_stock_tokens_and_logits(deepseek, nodes, sampling):
    """`auto`, the default, where the checkpoint has an MTP layer: every node loads it and drafts
    with it where prompt lookup has no guess. This head is random: its guesses fail, `adapt` rests
    them, and the plain steps between still feed the layer (Speculator.plain) for the probes
    after them; every token and logit is stock's either way."""
    out = _simulate(deepseek, nodes, *sampling, "--speculative", "auto")
    assert out["speculative"]["mode"] == "auto, 2 drafts, MTP experts whole", out["speculative"]
    assert out["tokens_match"] and out["compared_steps"] == 16, out
    assert out["max_abs_logit_diff"] <= 1e-4, out["max_abs_logit_diff"]
    assert out["speculative"]["drafted"] > 0, out["speculative"]


def test_the_demos_trained_mtp_head_drafts_what_the_model_says():
    out = _simulate("demo", 2)  # auto: its 2 MB bank stays whole
    assert out["tokens_match"] and out["max_abs_logit_diff"] <= 1e-4, out
    spec = out["speculative"]
    assert spec["accepted"] >= 0.4 * spec["drafted"] > 0, spec  # a random head holds ~0
    assert spec["steps"] < 16, spec
    _held(out, "whole", 4)


TEXTS = (
    "To be, or not to be, that is the question:",
    "Now is the winter",
    "O",
    "Friends, Romans, countrymen, lend me your ears; I come to bury Caesar, not to praise him.",
    "All the world's a stage,",
)


@pytest.mark.parametrize(
    "model,nodes,sampling,holding,disagree,mode",
    [
        ("deepseek", 3, Sampling(max_tokens=12, temperature=1.0, seed=5), "sharded", False, "mtp"),
        ("demo", 2, None, "whole", False, "mtp"),
        ("demo", 3, None, "whole", True, "mtp"),
        ("demo", 2, None, "whole", False, "auto"),
    ],
    ids=[
        "deepseek-3-seeded-sharded",
        "demo-2-greedy-whole",
        "demo-3-greedy-whole-disagree",
        "demo-2-greedy-auto",
    ],
)
def test_mtp_in_a_batch_of_prompts_of_different_lengths_keeps_each_streams_output(
    deepseek, model, nodes, sampling, holding, disagree, mode
):
    """The MTP layer's cache rides with each sequence's (merged, rolled back, extracted when a
    row leaves: a one-token prompt's is fed first at its first decode step). `disagree`: the last
    node feeds guesses of its own at every other step, as a node that rounds differently would:
    only the guesses every node fed are verified, and every token still holds. With `auto` the
    batch's 5 rows share 8 drafts a step: each guesses one, from the prompt or the MTP layer."""
    from mlx_lm.tokenizer_utils import load

    path = str(deepseek if model == "deepseek" else MODEL_DIR)
    tok = load(MODEL_DIR)
    prompts = tuple(tuple(tok.encode(t, add_special_tokens=False)) for t in TEXTS)
    assert len(prompts[2]) == 1
    sampling = sampling or Sampling(max_tokens=12)
    drafts = 8 if mode == "auto" else 3
    tasks = [
        SimTask(
            path,
            prompts[0],
            sampling,
            keepalive="none",
            streams=prompts,
            speculative=m,
            draft_tokens=drafts,
            record_logits=True,
            mtp_experts=holding if m != "off" else "auto",
            disagree=disagree and m != "off",
        )
        for m in ("off", mode)
    ]
    off, on = (ranks[0] for ranks in run_nodes(tasks, nodes, transport="envoy", timeout_s=240))
    assert on["speculative"] == f"{mode}, {drafts} drafts, MTP experts {holding}", on["speculative"]
    assert on["drafted"] > 0
    if model == "demo":  # rows accept different numbers of drafts: each rolls back its own tail
        assert on["accepted"] > 0, on["accepted"]
    assert on["tokens"] == off["tokens"] and all(len(t) == 12 for t in on["tokens"])
    for a, b in zip(on["logits"], off["logits"]):
        assert len(a) == len(b) == 12
        assert max(float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in zip(a, b)) <= 1e-4


def test_a_checkpoint_without_mtp_layers_is_refused_in_one_line(tmp_path):
    r = cli(
        "demo-model", "--arch", "qwen3_moe", "--out", str(tmp_path), "--hidden", "64",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    r = cli(
        "simulate", "--model", str(tmp_path), "--nodes", "1", "--prompt", "hi",
        "--max-tokens", "2", "--speculative", "mtp",
    )  # fmt: skip
    assert r.returncode != 0
    lines = [line for line in r.stderr.splitlines() if "MTP" in line]
    assert lines and "needs a checkpoint with MTP layers" in lines[-1], r.stderr
    assert "Traceback" not in r.stderr, r.stderr
