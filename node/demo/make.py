"""`moe-cluster demo-model`: write a random-weight mlx-lm checkpoint of a chosen MoE family."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..checkpoint import DEFAULT_SHARD_BYTES, CheckpointError, model_classes, write_checkpoint
from . import tokenizer
from .archs import ARCHS, Shape

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


@dataclass(frozen=True)
class DemoSpec:
    arch: str
    layers: int = 2
    experts: int = 8
    top_k: int = 2
    hidden: int = 64
    heads: int | None = None
    kv_heads: int | None = None
    expert_ffn: int | None = None
    dtype: str = "float32"
    quantize: int | None = None  # bits
    layout: str = "mlx"  # "mlx" | "hf"
    seed: int = 0
    shard_bytes: int = DEFAULT_SHARD_BYTES
    # With --quantize: the first MoE layer's experts get 8 bits, recorded as a per-layer override.
    mixed_bits: bool = False
    # Config keys set over the family's (e.g. a released model's MLA ranks), as JSON values.
    overrides: dict = field(default_factory=dict, hash=False)

    def check(self) -> None:
        if self.arch not in ARCHS:
            raise CheckpointError(
                f"unknown architecture {self.arch!r}; choose from {', '.join(ARCHS)}"
            )
        arch = ARCHS[self.arch]
        if self.layers < arch.min_layers:
            raise CheckpointError(
                f"{self.arch} needs --layers >= {arch.min_layers} (got {self.layers})"
            )
        if self.experts < 2:
            raise CheckpointError(f"--experts must be at least 2 (got {self.experts})")
        if self.experts % arch.experts_multiple:
            raise CheckpointError(
                f"{self.arch} needs --experts divisible by {arch.experts_multiple} (got {self.experts})"
            )
        if not 1 <= self.top_k <= self.experts:
            raise CheckpointError(
                f"--top-k must be between 1 and --experts ({self.experts}); got {self.top_k}"
            )
        if self.hidden < 32 or self.hidden % 32:
            raise CheckpointError(f"--hidden must be a positive multiple of 32 (got {self.hidden})")
        heads = self.heads or 4
        if self.hidden % heads or (self.hidden // heads) % 8:
            raise CheckpointError(
                f"--heads ({heads}) must divide --hidden ({self.hidden}) into heads of a multiple of 8"
            )
        if self.kv_heads is not None and (self.kv_heads < 1 or heads % self.kv_heads):
            raise CheckpointError(f"--kv-heads ({self.kv_heads}) must divide --heads ({heads})")
        if self.expert_ffn is not None and (self.expert_ffn < 32 or self.expert_ffn % 32):
            raise CheckpointError(
                f"--ffn must be a positive multiple of 32 (got {self.expert_ffn})"
            )
        if self.dtype not in DTYPES:
            raise CheckpointError(f"--dtype must be one of {', '.join(DTYPES)} (got {self.dtype})")
        if self.quantize not in (None, 4, 8):
            raise CheckpointError(f"--quantize must be 4 or 8 (got {self.quantize})")
        if self.layout not in ("mlx", "hf"):
            raise CheckpointError(f"--layout must be mlx or hf (got {self.layout})")
        if self.layout == "hf" and self.quantize and not arch.hf_quantized:
            raise CheckpointError(
                f"{self.arch}: stock mlx-lm cannot read quantized experts in its Hugging Face layout; "
                "use --layout mlx with --quantize"
            )
        if self.mixed_bits and not self.quantize:
            raise CheckpointError("--mixed-bits needs --quantize")
        if not isinstance(self.overrides, dict):
            raise CheckpointError(
                f"--config must be a JSON object of config keys (got {self.overrides!r})"
            )


def build_model(spec: DemoSpec, vocab: int) -> tuple[nn.Module, dict]:
    """A randomly initialised model of the spec and its config (mlx layout, unquantized)."""
    arch = ARCHS[spec.arch]
    config = arch.make_config(
        Shape(
            vocab,
            spec.layers,
            spec.experts,
            spec.top_k,
            spec.hidden,
            spec.heads,
            spec.kv_heads,
            spec.expert_ffn,
        )
    )
    config.update(spec.overrides)
    model_cls, args_cls = model_classes(config)
    mx.random.seed(spec.seed)
    try:
        model = model_cls(args_cls.from_dict(config))
    except (TypeError, ValueError, KeyError, AssertionError) as exc:
        raise CheckpointError(f"{spec.arch}: mlx-lm cannot build this config: {exc}") from exc
    _scale_init(model)
    model.set_dtype(DTYPES[spec.dtype])
    # One tensor at a time: a float32 initialisation never waits in memory beside the others
    # (one MoE layer of a large model is tens of GB before it is cast and quantized).
    for _, p in tree_flatten(model.parameters()):
        mx.eval(p)
    return model, config


def mtp_weights(model: nn.Module, config: dict, n: int) -> dict:
    """`n` random MTP layers (node/mtp.py) as a released checkpoint stores them after the decoder's,
    `model.layers.{num_hidden_layers + i}.*`, with their copies of the embedding and the head."""
    from ..mtp import MTP

    out: dict = {}
    if not n:
        return out
    first = int(config["num_hidden_layers"])
    for i in range(n):
        layer = first + i
        mtp = MTP(type(model.model.layers[-1])(model.args, layer), config["hidden_size"], 1e-6)
        _scale_init(mtp)
        mtp.set_dtype(model.model.embed_tokens.weight.dtype)
        for k, v in tree_flatten(mtp.parameters()):
            out[f"model.layers.{layer}.{k.removeprefix('block.')}"] = v
        out[f"model.layers.{layer}.embed_tokens.weight"] = model.model.embed_tokens.weight
        head = getattr(model, "lm_head", None) or model.model.embed_tokens
        out[f"model.layers.{layer}.shared_head.head.weight"] = head.weight
    return out


def _scale_init(model: nn.Module) -> None:
    """Give embeddings a unit-ish scale so random models have spread-out logits (no near-ties).

    mlx-lm initialises a score-corrected router (DeepSeek-V3's and GLM-4's gate) to zeros: every
    expert would tie and every token pick the same ones. Those get random rows, and a correction
    bias small beside the sigmoid scores, as a trained router has."""
    for path, m in model.named_modules():
        if isinstance(m, nn.Embedding):
            m.weight = m.weight * (m.weight.shape[-1] ** -0.5) * 4
        if "e_score_correction_bias" in m and "weight" in m:
            w, b = m["weight"], m["e_score_correction_bias"]
            m.weight = mx.random.normal(w.shape) * w.shape[-1] ** -0.5
            m.e_score_correction_bias = mx.random.normal(b.shape) * 0.02


def quantize(model: nn.Module, config: dict, bits: int, mixed_bits: bool) -> dict:
    from mlx_lm.utils import quantize_model

    family = getattr(model, "quant_predicate", None)
    first_bank: list[str] = []

    def predicate(path: str, module: nn.Module):
        if (
            mixed_bits
            and hasattr(module, "num_experts")
            and (not first_bank or path.startswith(first_bank[0]))
        ):
            bank = path.rsplit(".", 1)[0]
            if not first_bank:
                first_bank.append(bank)
            return {"group_size": 64, "bits": 8, "mode": "affine"}
        return family(path, module) if family else True

    # quantize_model reports bits per weight on stdout; keep our output clean.
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        _, config = quantize_model(
            model, config, group_size=64, bits=bits, quant_predicate=predicate
        )
    return config


def make_checkpoint(spec: DemoSpec, out: Path) -> dict:
    """Write the checkpoint; returns a summary (files, bytes, parameters)."""
    spec.check()
    vocab = tokenizer.vocab_size()
    model, config = build_model(spec, vocab)
    if spec.quantize:
        config = quantize(model, config, spec.quantize, spec.mixed_bits)
    weights = dict(tree_flatten(model.parameters()))
    weights.update(mtp_weights(model, config, int(config.get("num_nextn_predict_layers") or 0)))
    if spec.layout == "hf":
        weights = ARCHS[spec.arch].to_hf(weights, config)
        if spec.arch == "gpt_oss":
            config["quantization_config"] = {"quant_method": "mxfp4"}
    mx.eval(weights)
    files = write_checkpoint(
        out,
        weights,
        config,
        max_shard_bytes=spec.shard_bytes,
        metadata={"moe_cluster_layout": spec.layout},
    )
    tokenizer.copy_tokenizer(out)
    return {
        "path": str(out),
        "arch": spec.arch,
        "layout": spec.layout,
        "files": [f.name for f in files],
        "bytes": sum(v.nbytes for v in weights.values()),
        "tensors": len(weights),
    }
