"""Configs of small checkpoints for each supported mlx-lm MoE family, and their Hugging Face layouts.

mlx-lm saves a model in its own ("mlx") layout: experts stacked `(E, ...)` under the bank's name.
Hugging Face checkpoints store the experts the way each family was released; mlx-lm's `sanitize`
turns that into the mlx layout at load. `to_hf` here is the inverse of `sanitize` for each family,
so a checkpoint written with `--layout hf` goes through the same conversion a real one would.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx


@dataclass(frozen=True)
class Shape:
    """The sizes a user picks on the command line."""

    vocab: int
    layers: int
    experts: int
    top_k: int
    hidden: int
    attention_heads: int | None = None  # default 4
    kv_heads: int | None = None  # default: the family's small-model choice (2 for most)
    expert_ffn: int | None = (
        None  # width of one routed expert; default: the family's ratio to hidden
    )

    @property
    def heads(self) -> int:
        return self.attention_heads or 4

    def kv(self, default: int = 2) -> int:
        return self.kv_heads or default

    def ffn(self, default: int) -> int:
        return self.expert_ffn or default

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


Weights = dict[str, mx.array]


@dataclass(frozen=True)
class Arch:
    name: str
    make_config: Callable[[Shape], dict]
    to_hf: Callable[[Weights, dict], Weights]
    min_layers: int = 1
    # Whether stock mlx-lm reads this family's HF layout with quantized experts.
    hf_quantized: bool = True
    # Expert count must be a multiple of this (grouped routing).
    experts_multiple: int = 1
    note: str = ""


_BANK = re.compile(
    r"^(?P<prefix>.+)\.(?P<bank>switch_mlp|experts)\.(?P<proj>\w+)\.(?P<param>weight|scales|biases|bias)$"
)


def unstack_experts(
    weights: Weights, names: dict[str, str] | None = None, bank: str = "switch_mlp"
) -> Weights:
    """`<p>.switch_mlp.<proj>.<param>` (E, ...) -> `<p>.experts.<e>.<name>.<param>` per expert."""
    names = names or {}
    out: Weights = {}
    for k, v in weights.items():
        m = _BANK.match(k)
        if not m or m["bank"] != bank:
            out[k] = v
            continue
        name = names.get(m["proj"], m["proj"])
        for e in range(v.shape[0]):
            out[f"{m['prefix']}.experts.{e}.{name}.{m['param']}"] = v[e]
    return out


def _common(s: Shape) -> dict:
    return {
        "vocab_size": s.vocab,
        "hidden_size": s.hidden,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv(),
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "eos_token_id": 0,
    }


def _mixtral(s: Shape) -> dict:
    return {
        **_common(s),
        "model_type": "mixtral",
        "architectures": ["MixtralForCausalLM"],
        "intermediate_size": s.ffn(2 * s.hidden),
        "num_local_experts": s.experts,
        "num_experts_per_tok": s.top_k,
    }


def _qwen2_moe(s: Shape) -> dict:
    return {
        **_common(s),
        "model_type": "qwen2_moe",
        "architectures": ["Qwen2MoeForCausalLM"],
        "intermediate_size": 2 * s.hidden,
        "moe_intermediate_size": s.ffn(s.hidden),
        "shared_expert_intermediate_size": 2 * s.hidden,
        "num_experts": s.experts,
        "num_experts_per_tok": s.top_k,
    }


def _qwen3_moe(s: Shape) -> dict:
    return {
        **_common(s),
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "intermediate_size": 2 * s.hidden,
        "moe_intermediate_size": s.ffn(s.hidden),
        "num_experts": s.experts,
        "num_experts_per_tok": s.top_k,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "head_dim": s.head_dim,
        "norm_topk_prob": True,
    }


def _olmoe(s: Shape) -> dict:
    return {
        **_common(s),
        "model_type": "olmoe",
        "architectures": ["OlmoeForCausalLM"],
        "intermediate_size": s.ffn(s.hidden),
        "num_experts": s.experts,
        "num_experts_per_tok": s.top_k,
        "norm_topk_prob": False,
    }


def _deepseek_v3(s: Shape) -> dict:
    return {
        **_common(s),
        "model_type": "deepseek_v3",
        "architectures": ["DeepseekV3ForCausalLM"],
        "intermediate_size": 2 * s.hidden,
        "moe_intermediate_size": s.ffn(s.hidden),
        "num_key_value_heads": s.kv(s.heads),
        "n_routed_experts": s.experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": s.top_k,
        "routed_scaling_factor": 2.5,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        # Grouped routing: 4 groups, the best 2 kept.
        "n_group": 4,
        "topk_group": 2,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "q_lora_rank": s.hidden // 2,
        "kv_lora_rank": s.hidden // 4,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 8,
        "attention_bias": False,
    }


def _dbrx(s: Shape) -> dict:
    return {
        "model_type": "dbrx",
        "architectures": ["DbrxForCausalLM"],
        "vocab_size": s.vocab,
        "d_model": s.hidden,
        "n_heads": s.heads,
        "n_layers": s.layers,
        "max_seq_len": 4096,
        "attn_config": {"kv_n_heads": s.kv(), "clip_qkv": 8.0, "rope_theta": 500000.0},
        "ffn_config": {
            "ffn_hidden_size": s.ffn(2 * s.hidden),
            "moe_num_experts": s.experts,
            "moe_top_k": s.top_k,
        },
        "eos_token_id": 0,
    }


def _gpt_oss(s: Shape) -> dict:
    return {
        **_common(s),
        "model_type": "gpt_oss",
        "architectures": ["GptOssForCausalLM"],
        "intermediate_size": s.ffn(s.hidden),
        "head_dim": s.head_dim,
        "num_local_experts": s.experts,
        "num_experts_per_tok": s.top_k,
        "sliding_window": 128,
        "rope_theta": 150000,
        "layer_types": [("sliding_attention", "full_attention")[i % 2] for i in range(s.layers)],
    }


def _qwen3_next(s: Shape) -> dict:
    return {
        **_qwen3_moe(s),  # Qwen3-Next is Qwen3-MoE with a shared expert and mostly linear attention
        "model_type": "qwen3_next",
        "architectures": ["Qwen3NextForCausalLM"],
        "shared_expert_intermediate_size": s.hidden,
        "partial_rotary_factor": 0.25,
        # Gated DeltaNet (linear attention) on 3 layers of every 4, full attention on the 4th.
        "full_attention_interval": 4,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": s.head_dim,
        "linear_value_head_dim": s.head_dim,
        "linear_conv_kernel_dim": 4,
    }


def _generic_hf(names: dict[str, str] | None = None) -> Callable[[Weights, dict], Weights]:
    def convert(weights: Weights, config: dict) -> Weights:
        return unstack_experts(weights, names)

    return convert


def _deepseek_hf(weights: Weights, config: dict) -> Weights:
    out = unstack_experts(weights)
    # Multi-head latent attention: mlx-lm splits `kv_b_proj` into embed_q / unembed_out.
    nope = config["qk_nope_head_dim"]
    for k in [k for k in out if k.endswith(".self_attn.embed_q.weight")]:
        prefix = k[: -len(".embed_q.weight")]
        wk = out.pop(f"{prefix}.embed_q.weight")  # (H, kv_lora, nope)
        wv = out.pop(f"{prefix}.unembed_out.weight")  # (H, v_head, kv_lora)
        v = mx.concatenate([wk.swapaxes(-1, -2), wv], axis=1)  # (H, nope + v_head, kv_lora)
        assert v.shape[1] == nope + config["v_head_dim"]
        out[f"{prefix}.kv_b_proj.weight"] = v.reshape(-1, v.shape[-1])
    return out


def _qwen3_next_hf(weights: Weights, config: dict) -> Weights:
    out = unstack_experts(weights)
    norm_suffixes = (
        ".input_layernorm.weight",
        ".post_attention_layernorm.weight",
        "model.norm.weight",
        ".q_norm.weight",
        ".k_norm.weight",
    )
    for k, v in list(out.items()):
        if "conv1d.weight" in k and v.shape[-1] == 1 and v.shape[1] != 1:
            out[k] = v.swapaxes(1, 2)  # mlx (C, K, 1) -> HF (C, 1, K)
        if k.endswith(norm_suffixes) and v.ndim == 1:
            out[k] = v - 1.0  # HF stores these norms zero-centred
    return out


def _dbrx_hf(weights: Weights, config: dict) -> Weights:
    """DBRX releases fuse each layer's experts: `ffn.experts.mlp.{w1,v1,w2}` of shape (E*F, D)."""
    E = config["ffn_config"]["moe_num_experts"]
    out: Weights = {}
    fused: dict[str, list] = {}
    pat = re.compile(r"^(?P<p>.+\.ffn\.experts)\.(?P<e>\d+)\.(?P<w>w1|v1|w2)\.weight$")
    for k, v in weights.items():
        m = pat.match(k)
        if not m:
            out[k] = v
            continue
        key = f"{m['p']}.mlp.{m['w']}"
        fused.setdefault(key, [None] * E)[int(m["e"])] = v.T if m["w"] == "w2" else v
    for key, parts in fused.items():
        out[key] = mx.concatenate(parts, axis=0)
    return out


def _gpt_oss_hf(weights: Weights, config: dict) -> Weights:
    """gpt-oss releases store experts in mxfp4 with gate and up rows interleaved:
    `mlp.experts.gate_up_proj_blocks` (E, 2F, D/32, 16) uint8, `..._scales`, `..._bias`."""
    out: Weights = {}
    banks = sorted({k.rsplit(".", 2)[0] for k in weights if ".mlp.experts." in k})
    for k, v in weights.items():
        if ".mlp.experts." not in k:
            out[k] = v
    for bank in banks:
        g, u, d = (weights[f"{bank}.{p}.weight"] for p in ("gate_proj", "up_proj", "down_proj"))
        E, F, D = g.shape
        gate_up = mx.stack([g, u], axis=2).reshape(E, 2 * F, D)  # rows g0, u0, g1, u1, ...
        for name, w in (("gate_up_proj", gate_up), ("down_proj", d)):
            wq, scales = mx.quantize(w.astype(mx.float32), group_size=32, bits=4, mode="mxfp4")
            out[f"{bank}.{name}_blocks"] = wq.view(mx.uint8).reshape(*w.shape[:-1], -1, 16)
            out[f"{bank}.{name}_scales"] = scales
        gb, ub = weights[f"{bank}.gate_proj.bias"], weights[f"{bank}.up_proj.bias"]
        out[f"{bank}.gate_up_proj_bias"] = mx.stack([gb, ub], axis=2).reshape(E, 2 * F)
        out[f"{bank}.down_proj_bias"] = weights[f"{bank}.down_proj.bias"]
    return out


ARCHS: dict[str, Arch] = {
    a.name: a
    for a in [
        Arch(
            "mixtral",
            _mixtral,
            _generic_hf({"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}),
        ),
        Arch("qwen2_moe", _qwen2_moe, _generic_hf()),
        Arch("qwen3_moe", _qwen3_moe, _generic_hf(), hf_quantized=False),
        Arch("olmoe", _olmoe, _generic_hf()),
        Arch(
            "deepseek_v3",
            _deepseek_v3,
            _deepseek_hf,
            min_layers=2,
            experts_multiple=4,
            note="layer 0 is dense (first_k_dense_replace=1)",
        ),
        Arch("dbrx", _dbrx, _dbrx_hf, hf_quantized=False),
        Arch(
            "gpt_oss",
            _gpt_oss,
            _gpt_oss_hf,
            min_layers=2,
            hf_quantized=False,
            note="the HF layout stores experts in mxfp4, as the release does",
        ),
        Arch(
            "qwen3_next",
            _qwen3_next,
            _qwen3_next_hf,
            min_layers=4,
            hf_quantized=False,
            note="layers 4k+3 use full attention, the others Gated DeltaNet; needs 4 layers or more",
        ),
    ]
}
