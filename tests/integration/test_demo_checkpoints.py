"""`moe-cluster demo-model`: every family, both layouts, float32/bfloat16/4-bit, loads with stock
mlx-lm; the Hugging Face layout goes through mlx-lm's real conversion to the same weights."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from conftest import ARCHS, assert_one_line_error, cli
from moe_cluster.node.checkpoint import Checkpoint
from moe_cluster.node.demo import tokenizer


def _stock_load(path):
    from mlx_lm import load

    return load(str(path))


@pytest.mark.parametrize("arch", ARCHS)
def test_float32_both_layouts_load_to_the_same_weights(arch, make_ckpt):
    mlx_model, tok = _stock_load(make_ckpt(arch, "mlx"))
    hf_path = make_ckpt(arch, "hf")
    hf_model, _ = _stock_load(hf_path)
    ck = Checkpoint(hf_path)
    assert any(".experts." in k for k in ck.tensors), "the HF layout keeps experts apart"
    assert (hf_path / "model.safetensors.index.json").exists()  # split past 300 KB
    a, b = dict(tree_flatten(mlx_model.parameters())), dict(tree_flatten(hf_model.parameters()))
    if arch == "gpt_oss":  # its HF layout stores experts in mxfp4, as the release does
        a = {k: v for k, v in a.items() if ".experts." not in k}
        b = {k: v for k, v in b.items() if ".experts." not in k}
    assert a.keys() == b.keys()
    for k in a:
        assert mx.array_equal(a[k], b[k]), k
    logits = mlx_model(mx.array([tok.encode("To be, or not to be")]))
    assert logits.shape[-1] == tokenizer.vocab_size() and bool(mx.isfinite(logits).all())


@pytest.mark.parametrize("arch", ARCHS)
def test_bfloat16_and_4bit_load_with_stock_mlx_lm(arch, make_ckpt):
    for layout in ("mlx", "hf"):
        model, _ = _stock_load(make_ckpt(arch, layout, "bfloat16"))
        dtypes = {
            v.dtype
            for _, v in tree_flatten(model.parameters())
            if v.dtype in (mx.float32, mx.bfloat16)
        }
        assert dtypes == {mx.bfloat16}, (layout, dtypes)
    path = make_ckpt(arch, "mlx", "float32", 4)
    config = json.loads((path / "config.json").read_text())
    assert config["quantization"]["bits"] == 4
    model, tok = _stock_load(path)
    assert any(".scales" in k for k, _ in tree_flatten(model.parameters()))
    mx.eval(model(mx.array([tok.encode("hello")])))


def test_per_layer_override_and_quantized_hf_layout(make_ckpt):
    path = make_ckpt("mixtral", "hf", "float32", 4, mixed_bits=True)
    config = json.loads((path / "config.json").read_text())
    overrides = {k: v for k, v in config["quantization"].items() if isinstance(v, dict)}
    assert overrides and all(v["bits"] == 8 and "layers.0." in k for k, v in overrides.items())
    model, tok = _stock_load(path)
    mx.eval(model(mx.array([tok.encode("hello")])))


def test_tokenizer_round_trips_text():
    from transformers import AutoTokenizer

    from moe_cluster.node.demo import MODEL_DIR

    tok = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    samples = [t[:4000] for t in tokenizer.corpus_texts()[:3]] + [
        "naïve café — 日本語 🙂\n\ttabs  and  spaces"
    ]
    for s in samples:
        assert tok.decode(tok.encode(s)) == s


def test_cli_writes_a_checkpoint(tmp_path):
    out = tmp_path / "olmoe"
    r = cli(
        "demo-model",
        "--arch",
        "olmoe",
        "--out",
        str(out),
        "--layout",
        "hf",
        "--dtype",
        "bfloat16",
        "--experts",
        "16",
        "--top-k",
        "4",
        "--hidden",
        "96",
        "--layers",
        "3",
        "--shard-size",
        "100KB",
        "--seed",
        "7",
    )
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert len(info["files"]) > 1 and info["arch"] == "olmoe"
    config = json.loads((out / "config.json").read_text())
    assert (
        config["num_experts"],
        config["num_experts_per_tok"],
        config["hidden_size"],
        config["num_hidden_layers"],
    ) == (16, 4, 96, 3)
    assert all((out / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--arch", "llama"], "unknown architecture 'llama'"),
        (["--arch", "qwen3_next", "--layers", "2"], "needs --layers >= 4"),
        (["--arch", "mixtral", "--top-k", "9"], "--top-k"),
        (["--arch", "mixtral", "--dtype", "float64"], "--dtype"),
        (
            ["--arch", "qwen3_moe", "--layout", "hf", "--quantize", "4"],
            "cannot read quantized experts",
        ),
        (["--arch", "mixtral", "--shard-size", "lots"], "size 'lots'"),
    ],
)
def test_cli_errors(args, needle, tmp_path):
    assert_one_line_error(cli("demo-model", "--out", str(tmp_path / "x"), *args), needle)


def test_config_overrides_and_a_routing_deepseek_gate(tmp_path):
    """--config sets a released model's keys (MLA ranks, grouped routing) over the family's, and
    the score-corrected gate mlx-lm leaves at zero routes tokens to different experts."""
    out = tmp_path / "dsv3"
    over = {"q_lora_rank": 64, "kv_lora_rank": 64, "qk_nope_head_dim": 64, "n_group": 8}
    r = cli(
        "demo-model",
        "--arch",
        "deepseek_v3",
        "--out",
        str(out),
        "--experts",
        "16",
        "--top-k",
        "4",
        "--hidden",
        "128",
        "--config",
        json.dumps(over | {"topk_group": 4}),
    )
    assert r.returncode == 0, r.stderr
    config = json.loads((out / "config.json").read_text())
    assert {k: config[k] for k in over} == over and config["topk_group"] == 4
    model, _ = _stock_load(out)
    attn, moe = model.model.layers[1].self_attn, model.model.layers[1].mlp
    assert attn.embed_q.weight.shape == (4, 64, 64)  # (heads, kv_lora_rank, qk_nope_head_dim)
    assert float(mx.abs(moe.gate.e_score_correction_bias).max()) > 0
    inds, _ = moe.gate(mx.random.normal((16, 128), key=mx.random.key(1)))
    assert len({tuple(sorted(row)) for row in inds.tolist()}) > 1, "every token took one set"


@pytest.mark.parametrize(
    "config, needle",
    [
        ("{kv_lora_rank: 4}", "--config is not valid JSON"),
        ("[1, 2]", "--config must be a JSON object"),
    ],
)
def test_config_errors(config, needle, tmp_path):
    args = ["--arch", "deepseek_v3", "--config", config]
    assert_one_line_error(cli("demo-model", "--out", str(tmp_path / "x"), *args), needle)
