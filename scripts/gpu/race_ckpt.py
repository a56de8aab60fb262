"""A Qwen3-235B-A22B-shaped random 4-bit checkpoint of any depth, one layer in memory at a time.

`moe-cluster demo-model` builds the whole model in memory (in bf16 before it quantizes: ~5 GB per
layer of this shape), which no host holds at 94 layers. Here it builds one layer (hidden 4096,
128 experts of width 1536, top-8, 64 heads of 128 with 4 KV heads as in the released config;
4-bit affine, group 64), then writes L layers from it, one safetensors file each: every layer has
the same expert and attention weights and its own router (layer 0's rows permuted by a seeded
permutation), so each layer routes differently while every byte has the real shape. The
embeddings and head are the demo tokenizer's small vocabulary (state it with any figure).

Usage: python3 scripts/gpu/race_ckpt.py OUT --layers L
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SHAPE = [
    "--arch",
    "qwen3_moe",
    "--hidden",
    "4096",
    "--heads",
    "64",
    "--kv-heads",
    "4",
    "--ffn",
    "1536",
    "--experts",
    "128",
    "--top-k",
    "8",
    "--quantize",
    "4",
    "--dtype",
    "bfloat16",
]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--layers", type=int, required=True)
    p.add_argument(
        "--test-shape", action="store_true", help="a small shape, to try the script on a CPU"
    )
    args = p.parse_args()
    shape = (
        SHAPE
        if not args.test_shape
        else [
            *SHAPE[:2],
            "--hidden",
            "256",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--ffn",
            "64",
            "--experts",
            "16",
            "--top-k",
            "4",
            *SHAPE[14:],
        ]
    )
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
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        one = Path(tmp) / "one"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "moe_cluster.coordinator.cli",
                "demo-model",
                *shape,
                "--layers",
                "1",
                "--out",
                str(one),
            ],
            check=True,
        )
        config = json.loads((one / "config.json").read_text())
        # the released config: 64 query heads of 128 (the demo divides hidden by heads)
        weights = {}
        for f in sorted(one.glob("*.safetensors")):
            weights.update(mx.load(str(f)))
        if config.get("head_dim") != 128:
            config["head_dim"] = 128
            _resize_attention(weights, config)
        layer = {k.split("layers.0.", 1)[1]: v for k, v in weights.items() if ".layers.0." in k}
        rest = {k: v for k, v in weights.items() if ".layers.0." not in k}
        out.mkdir(parents=True, exist_ok=True)
        index = {}
        name = "model-base.safetensors"
        mx.save_safetensors(str(out / name), rest, metadata={"format": "mlx"})
        index.update({k: name for k in rest})
        rng = np.random.default_rng(0)
        for i in range(args.layers):
            perm = mx.array(rng.permutation(config["num_experts"]))
            tensors = {}
            for k, v in layer.items():
                key = f"model.layers.{i}.{k}"
                # the router (mlp.gate.*) gets its rows permuted: another routing per layer
                tensors[key] = v[perm] if k.startswith("mlp.gate.") and i else v
            name = f"model-layer-{i:03d}.safetensors"
            mx.save_safetensors(str(out / name), tensors, metadata={"format": "mlx"})
            index.update({k: name for k in tensors})
            print(f"layer {i + 1}/{args.layers}", flush=True)
        config["num_hidden_layers"] = args.layers
        for key in (
            "quantization",
            "quantization_config",
        ):  # per-module bits (the router's 8) per layer
            q = config.get(key) or {}
            for path, v in [(p, v) for p, v in q.items() if ".layers.0." in p]:
                for i in range(1, args.layers):
                    q[path.replace(".layers.0.", f".layers.{i}.")] = v
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
