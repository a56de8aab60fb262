"""A checkpoint's quantization is read by one function (node.describe.quantization), and the
planner and the loader agree on what it means: the planner quantizes a bank from it, and the
loader (node.describe.expert_quant) infers the same mode, bits and group size from the weights
that quantization produced."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.nn as nn
import pytest
from mlx_lm.models.switch_layers import SwitchGLU

from moe_cluster.node.describe import (
    DescribeError,
    MoELayer,
    Quantization,
    expert_quant,
    quantization,
    quantize_lazily,
)

GATE = "block.switch_mlp.gate_proj"

CASES = {
    "affine": (
        {"quantization": {"group_size": 64, "bits": 4}},
        Quantization("mlx", "affine", 4, 64),
    ),
    "affine, one bank at 8 bits": (
        {"quantization": {"group_size": 32, "bits": 4, GATE: {"group_size": 32, "bits": 8}}},
        Quantization("mlx", "affine", 4, 32, {GATE: {"group_size": 32, "bits": 8}}),
    ),
    "mlx mxfp8": (
        {"quantization": {"group_size": 32, "bits": 8, "mode": "mxfp8"}},
        Quantization("mlx", "mxfp8", 8, 32),
    ),
    "legacy mxfp4": (
        {"quantization_config": {"quant_method": "mxfp4"}},
        Quantization("mxfp4", "mxfp4", 4, 32),
    ),
    "legacy mxfp8": (
        {"quantization_config": {"quant_method": "mxfp8"}},
        Quantization("mxfp8", "mxfp8", 8, 32),
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_one_reading_of_the_quantization_config(case):
    config, want = CASES[case]
    assert quantization(config) == want


def test_unquantized_and_unapplied_methods():
    assert quantization({}) is None
    assert quantization({"quantization_config": {"quant_method": None}}) is None
    awq = quantization({"quantization_config": {"quant_method": "awq"}})
    assert awq == Quantization("awq") and not awq.applied
    with pytest.raises(DescribeError, match="'awq' is not supported for sharded loading"):
        expert_quant(awq, SimpleNamespace(), "gate_proj", {"weight": None, "scales": None})
    with pytest.raises(Exception, match="malformed quantization"):
        quantization({"quantization": {"bits": 4}})  # no group size


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.switch_mlp = SwitchGLU(128, 64, 4)  # widths every group size divides


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = _Block()


@pytest.mark.parametrize("case", CASES)
def test_the_planner_and_the_loader_agree(case):
    """The loader's reading of the bank the planner quantized from the same config: the mode, bits
    and group size each projection was quantized with. The loader used to refuse mxfp8."""
    config, _ = CASES[case]
    q = quantization(config)
    model = _Model()
    bank = MoELayer(0, "block", "block.switch_mlp", 4, 2, (), False)
    assert quantize_lazily(model, q, (bank,))
    b = SimpleNamespace(layer=0, path="block", bank_path="block.switch_mlp")
    for proj in ("gate_proj", "up_proj", "down_proj"):
        m = getattr(model.block.switch_mlp, proj)
        planned = {"mode": m.mode, "bits": m.bits, "group_size": m.group_size}
        loaded = expert_quant(q, b, proj, {"weight": m.weight, "scales": m.scales})
        assert loaded == planned, (case, proj)


def test_the_description_keeps_none_of_the_probes_weights():
    """The probe evaluates a block's own weights in float32 (here a 6 MB shared expert); `up`
    keeps its description while it serves, so it must not keep them (before: 6.3 MB held)."""
    import gc

    import mlx.core as mx

    from moe_cluster.node.describe import describe

    hidden, shared = 256, 2048
    config = {
        "model_type": "qwen2_moe",
        "hidden_size": hidden,
        "num_hidden_layers": 1,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": shared,
        "vocab_size": 128,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    }
    gc.collect()
    before = mx.get_active_memory()
    desc = describe(config)
    gc.collect()
    assert desc.moe_layers() == {0: 4} and desc.moe[0].dense  # the shared expert was probed
    held = mx.get_active_memory() - before
    assert held < 3 * hidden * shared * 4 // 10, held  # a tenth of the shared expert's bytes
