"""A random 4-bit checkpoint of a large MoE shape at any depth, built from one layer of each kind.

`moe-cluster demo-model` builds the whole model in memory (in bf16 before it quantizes: ~5 GB per
layer of the Qwen3 shape, ~22.5 GB per MoE layer of the DeepSeek-V3 one), which no host holds at
full depth. Here demo-model builds one layer of each kind the shape has, then L layers are written
from them, one safetensors file each: every MoE layer has the same expert and attention weights
and its own router (the first MoE layer's rows, and its score-correction bias, permuted by a
seeded permutation), so each layer routes differently while every byte has the real shape. The
embeddings and head are the demo tokenizer's small vocabulary (state it with any figure).

Shapes (--shape):
- qwen3-235b (default): Qwen3-235B-A22B; hidden 4096, 128 experts of width 1536, top-8, 64 heads
  of 128 with 4 KV heads as in the released config; every layer MoE.
- deepseek-v3: DeepSeek-V3; hidden 7168, 128 heads of multi-head latent attention (q_lora_rank
  1536, kv_lora_rank 512, qk_nope/rope 128/64, v_head_dim 128), 256 routed experts of width 2048,
  top-8 in 8 groups of which the best 4 are kept, sigmoid scores with the noaux_tc bias, scaling
  2.5, one shared expert; the first 3 layers dense (intermediate 18432). Built as one dense and
  one MoE layer, the dense one written 3 times.
Both 4-bit affine, group 64 (as mlx-community's 4-bit conversions), bfloat16.

Usage: python3 scripts/gpu/race_ckpt.py OUT --layers L [--shape deepseek-v3] [--test-shape]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

COMMON = ["--quantize", "4", "--dtype", "bfloat16"]

# name -> (demo-model arguments, config overrides, the same at a small size to try on a CPU,
#          dense layers before the first MoE one)
SHAPES = {
    "qwen3-235b": (
        ["--arch", "qwen3_moe", "--hidden", "4096", "--heads", "64", "--kv-heads", "4"]
        + ["--ffn", "1536", "--experts", "128", "--top-k", "8"],
        {},
        ["--arch", "qwen3_moe", "--hidden", "256", "--heads", "4", "--kv-heads", "2"]
        + ["--ffn", "128", "--experts", "16", "--top-k", "4"],
        {},
        0,
    ),
    "deepseek-v3": (
        ["--arch", "deepseek_v3", "--hidden", "7168", "--heads", "128"]
        + ["--ffn", "2048", "--experts", "256", "--top-k", "8"],
        {
            "q_lora_rank": 1536,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "intermediate_size": 18432,
            "n_group": 8,
            "topk_group": 4,
        },
        ["--arch", "deepseek_v3", "--hidden", "256", "--heads", "4"]
        + ["--ffn", "128", "--experts", "16", "--top-k", "4"],
        {
            "q_lora_rank": 128,
            "kv_lora_rank": 64,
            "qk_nope_head_dim": 64,
            "qk_rope_head_dim": 32,
            "v_head_dim": 64,
            "intermediate_size": 512,
            "n_group": 8,
            "topk_group": 4,
        },
        3,
    ),
}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-235b")
    p.add_argument(
        "--test-shape", action="store_true", help="a small shape, to try the script on a CPU"
    )
    args = p.parse_args()
    full, full_over, small, small_over, dense = SHAPES[args.shape]
    shape, overrides = (small, small_over) if args.test_shape else (full, full_over)
    if args.layers <= dense:
        p.error(f"{args.shape} has {dense} dense layers first: --layers must be more than that")
    import mlx.core as mx
    import numpy as np

    out = Path(args.out)
    if (out / "model.safetensors.index.json").exists():
        config = json.loads((out / "config.json").read_text())
        if config.get("num_hidden_layers") == args.layers:
            print(f"{out}: already built with {args.layers} layers")
            return 0
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # one layer of each kind: layer 0 dense (where the shape has dense layers), the last MoE
    kinds = 2 if dense else 1
    if dense:
        overrides = {**overrides, "first_k_dense_replace": 1}
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        one = Path(tmp) / "one"
        subprocess.run(
            [sys.executable, "-m", "moe_cluster.coordinator.cli", "demo-model", *shape, *COMMON]
            + ["--layers", str(kinds), "--out", str(one)]
            + (["--config", json.dumps(overrides)] if overrides else []),
            check=True,
        )
        config = json.loads((one / "config.json").read_text())
        weights = {}
        for f in sorted(one.glob("*.safetensors")):
            weights.update(mx.load(str(f)))
        if args.shape == "qwen3-235b" and config.get("head_dim") != 128:
            # the released config: 64 query heads of 128 (the demo divides hidden by heads)
            config["head_dim"] = 128
            _resize_attention(weights, config)
        built = [
            {k.split(f"layers.{j}.", 1)[1]: v for k, v in weights.items() if f".layers.{j}." in k}
            for j in range(kinds)
        ]
        rest = {k: v for k, v in weights.items() if ".layers." not in k}
        del weights
        # which built layer each written layer copies: the dense one first, then the MoE one
        source = [0 if i < dense else kinds - 1 for i in range(args.layers)]
        out.mkdir(parents=True, exist_ok=True)
        index = {}
        name = "model-base.safetensors"
        mx.save_safetensors(str(out / name), rest, metadata={"format": "mlx"})
        index.update({k: name for k in rest})
        rng = np.random.default_rng(0)
        for i in range(args.layers):
            moe = i >= dense
            perm = mx.array(rng.permutation(_experts(config))) if moe else None
            tensors = {}
            for k, v in built[source[i]].items():
                # the router (mlp.gate.*: its rows, its bias) permuted: another routing per layer
                permute = moe and i > dense and k.startswith("mlp.gate.")
                tensors[f"model.layers.{i}.{k}"] = v[perm] if permute else v
            name = f"model-layer-{i:03d}.safetensors"
            mx.save_safetensors(str(out / name), tensors, metadata={"format": "mlx"})
            index.update({k: name for k in tensors})
            print(f"layer {i + 1}/{args.layers}", flush=True)
        config["num_hidden_layers"] = args.layers
        if dense:
            config["first_k_dense_replace"] = dense
        for key in ("quantization", "quantization_config"):  # per-module bits, per written layer
            q = config.get(key) or {}
            for path, v in [(p, v) for p, v in q.items() if ".layers." in p]:
                j = int(path.split(".layers.", 1)[1].split(".", 1)[0])
                for i in (i for i in range(args.layers) if source[i] == j):
                    q[path.replace(f".layers.{j}.", f".layers.{i}.")] = v
        (out / "config.json").write_text(json.dumps(config, indent=2))
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": index})
        )
        for f in one.iterdir():
            if f.suffix != ".safetensors" and f.name not in (
                "config.json",
                "model.safetensors.index.json",
            ):
                shutil.copy(f, out / f.name)
    return 0


def _experts(config: dict) -> int:
    return config.get("num_experts") or config["n_routed_experts"]


def _resize_attention(weights: dict, config: dict) -> None:
    """q, k, v and o projections of layer 0 rebuilt at head_dim 128 (random, 4-bit like the rest)."""
    import mlx.core as mx

    hidden, heads, kv = (
        config["hidden_size"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
    )
    q = config.get("quantization", {})
    bits, group = q.get("bits", 4), q.get("group_size", 64)
    shapes = {
        "q_proj": (heads * 128, hidden),
        "k_proj": (kv * 128, hidden),
        "v_proj": (kv * 128, hidden),
        "o_proj": (hidden, heads * 128),
    }
    for seed, (name, shape) in enumerate(shapes.items()):
        prefix = f"model.layers.0.self_attn.{name}"
        w = (mx.random.normal(shape, key=mx.random.key(seed)) * shape[1] ** -0.5).astype(
            mx.bfloat16
        )
        wq, scales, biases = mx.quantize(w, group_size=group, bits=bits)
        weights[f"{prefix}.weight"], weights[f"{prefix}.scales"], weights[f"{prefix}.biases"] = (
            wq,
            scales,
            biases,
        )
    for norm in ("q_norm", "k_norm"):
        weights[f"model.layers.0.self_attn.{norm}.weight"] = mx.ones((128,), dtype=mx.bfloat16)


if __name__ == "__main__":
    sys.exit(main())
