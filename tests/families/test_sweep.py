"""Every MoE family the installed mlx-lm ships, through the cluster's arithmetic at N = 2 and 3:
stock mlx-lm's greedy tokens, |Δlogit| <= 1e-4 in float32; one quantization mode per family; each
layer's preferred decode route, and at N = 2 the host route too (test_routes.py has the others).

The families come from mlx-lm itself (tiny.families()), so a release with a new family is tested
without a line written here. Families whose stock model cannot run on this backend are skipped
with the reason.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import sweep
import tiny

pytestmark = pytest.mark.integration

FAMILIES = tiny.families()


def _runnable(family: str) -> None:
    if tiny.needs_metal(family):
        pytest.skip(
            f"{family} calls mlx-lm's Metal-only kernels; stock mlx-lm cannot run it on this backend"
        )


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_exact_at_2_and_3_nodes(family, tmp_path):
    _runnable(family)
    path = sweep.checkpoint(family, tmp_path)
    ref = tiny.stock_tokens(path, sweep.PROMPT, sweep.STEPS)
    for nodes, keepalive, route in (
        (2, "lru", "preferred"),
        (3, "lru", "preferred"),
        (2, "none", "preferred"),  # none: decode routed on the device
        (2, "lru", "host"),  # every layer's routing read on the host (node/moe/route.py)
    ):
        got = sweep.check(path, nodes, ref, keepalive, route=route)
        assert len(got["tokens"]) == sweep.STEPS
        assert got["tokens_match"], (family, nodes, keepalive, route, got)
        assert got["max_abs_logit_diff"] <= sweep.TOLERANCE, (
            family,
            nodes,
            keepalive,
            route,
            got["max_abs_logit_diff"],
        )
    if family in BY_STREAM_REFUSED:
        return
    # attention by stream: two streams, each its own owner's, gathered at every MoE layer
    for stream, got in sweep.check_by_stream(path, 2).items():
        assert got["tokens"] == got["reference_tokens"], (family, stream, got)
        assert got["max_abs_logit_diff"] <= sweep.TOLERANCE, (family, stream, got)


# families whose decoder layer routes and hands the experts their indices (a routed call): by
# stream refuses them in one line (node/batch.py), as their router's outputs are not gathered
BY_STREAM_REFUSED = {"gemma4", "gemma4_text"}


def test_by_stream_refuses_routed_calls_by_name(tmp_path):
    """A family whose MoE block takes its routing from outside is refused by stream, naming the
    layers and what to use instead, when the node's batch starts."""
    from moe_cluster.node.batch import BatchLimits, RunningBatch
    from moe_cluster.node.moe.load import load_shard
    from moe_cluster.node.collective.base import LocalCollective
    from moe_cluster.proto.errors import UserError

    class Two(LocalCollective):
        world_size = 2

    path = sweep.checkpoint("gemma4_text", tmp_path)
    sharded = load_shard(str(path), None, 0, collective=Two(), route="preferred")
    with pytest.raises(UserError, match=r"MoE layers \[.*\] take their routing from outside"):
        RunningBatch(sharded, BatchLimits(attention="by-stream"))


def _quantized_reference(path):
    """Stock mlx-lm's tokens and logits for a quantized checkpoint. On a GPU, the checkpoint is
    skipped, with the reason, where stock itself gives no reference to hold the cluster to: it
    cannot run the checkpoint there, or its own GPU logits part from its CPU logits beyond the
    bound (MLX's CUDA quantized matmul garbles a small 8-bit group-64 router: its GPU logits move
    from run to run).
    On the CPU both are the same kernels, so nothing is skipped."""
    on_gpu = mx.default_device().type == mx.DeviceType.gpu
    try:
        ref = tiny.stock_tokens(path, sweep.PROMPT, sweep.STEPS)
    except Exception as e:  # noqa: BLE001 - e.g. CUDA's "[quantized_matmul] No implementation for problem shape"
        if on_gpu:
            pytest.skip(
                f"stock mlx-lm cannot run this checkpoint on this GPU: {type(e).__name__}: {e}"
            )
        raise
    if on_gpu:
        with mx.stream(mx.cpu):
            _, cpu_logits = tiny.stock_tokens(path, sweep.PROMPT, sweep.STEPS)
        drift = float(np.nan_to_num(np.max(np.abs(ref[1] - cpu_logits)), nan=np.inf))
        if drift > sweep.QUANT_TOLERANCE:
            pytest.skip(
                f"stock mlx-lm's own logits on this GPU and on the CPU differ by {drift:.3g} "
                f"(bound {sweep.QUANT_TOLERANCE}): no stable reference"
            )
    return ref


@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_at_2_nodes(family, tmp_path):
    _runnable(family)
    path = sweep.checkpoint(family, tmp_path, sweep.quant_mode(family))
    ref = _quantized_reference(path)
    for route in ("preferred", "host"):
        got = sweep.check(path, 2, ref, route=route)
        assert got["tokens_match"], (family, sweep.quant_mode(family), route, got)
        assert got["max_abs_logit_diff"] <= sweep.QUANT_TOLERANCE, (
            family,
            route,
            got["max_abs_logit_diff"],
        )


def test_a_wrong_rule_is_caught(tmp_path, monkeypatch):
    """The sweep can fail: a node that keeps its shared expert on every rank (the old name rule
    missed hunyuan's `shared_mlp`) counts it N times, and the check sees it."""
    from moe_cluster.node.moe import load

    monkeypatch.setattr(load, "owns_dense_terms", lambda layer_index, rank, world: True)
    path = sweep.checkpoint("hunyuan", tmp_path)
    got = sweep.check(path, 2)
    assert got["max_abs_logit_diff"] > sweep.TOLERANCE


def test_a_legacy_mxfp8_config_loads_as_stock_does(tmp_path):
    """A config that names only `quantization_config: {quant_method: mxfp8}` (a Hugging Face
    release): stock mlx-lm quantizes it as mxfp8 in groups of 32, and so do the loader and the
    planner, which read it with one function (node.describe.quantization). The loader used to
    refuse it while the planner described it."""
    import json

    from moe_cluster.coordinator.plan.describe import describe_path

    path = sweep.checkpoint("qwen3_moe", tmp_path, "mxfp8")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg.pop("quantization")["mode"] == "mxfp8"
    cfg["quantization_config"] = {"quant_method": "mxfp8"}
    (path / "config.json").write_text(json.dumps(cfg))
    got = sweep.check(path, 2, _quantized_reference(path))
    assert got["tokens_match"], got
    assert got["max_abs_logit_diff"] <= sweep.QUANT_TOLERANCE, got["max_abs_logit_diff"]
    model, _ = describe_path(str(path))
    assert model.weights == "experts mxfp8"


# families whose caches cannot drop a rejected draft: a recurrent state (ArraysCache), or
# deepseek_v41's own LayerCache; auto is off for them, saying why
NO_ROLLBACK = {
    "bailing_hybrid",
    "bailing_moe_linear",
    "bailing_moe_v3",
    "deepseek_v41",
    "granitemoehybrid",
    "jamba",
    "kimi_k3",
    "kimi_linear",
    "lfm2_moe",
    "longcat_flash_ngram",
    "nemotron_h",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_next",
}


@pytest.mark.parametrize("family", FAMILIES)
def test_auto_speculation_gives_one_token_steps_or_says_why_not(family, tmp_path):
    """`speculative: auto` in the running batch: where the family's caches can drop positions
    (plain, rotating and chunked windows), drafts are verified and rolled back and every token and
    logit is that of one token per step; elsewhere it is off, naming the cache."""
    _runnable(family)
    got = sweep.check_speculative(sweep.checkpoint(family, tmp_path))
    assert got["tokens_match"], (family, got)
    assert got["max_abs_logit_diff"] <= sweep.TOLERANCE, (family, got)
    if family in NO_ROLLBACK:
        assert got["mode"].startswith("off: its caches (") and got["drafted"] == 0, (family, got)
    else:
        assert got["mode"] == "auto, 4 drafts" and got["drafted"] > 0, (family, got)
