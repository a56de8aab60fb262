"""Tiny float32 checkpoints for every mlx-lm model family that has routed experts.

The families are found in the installed mlx-lm itself: every `mlx_lm.models.<name>` module with a
`Model` and a `ModelArgs` is instantiated from a tiny config built out of its own `ModelArgs`
fields, and kept when the instantiated model holds an expert bank. A family mlx-lm adds later is
picked up without anyone writing lines for it, as long as the generic naming rules below fit its
config; the override table at the bottom is for the few whose config they cannot guess.

Import as `from tiny import ...` (tests/ is not a package; pytest puts this folder on sys.path).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import json
import pkgutil
import re
import shutil
import sys
import types
import typing
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

# Sizes of every tiny model. Small enough that a family builds and decodes in well under a second.
VOCAB = (
    300  # not a multiple of any hidden width: the tied-head check looks for a (VOCAB, ...) Linear
)
HIDDEN = 64
LAYERS = 4
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
FFN = 128  # dense MLP
EXPERT_FFN = 32  # one routed expert / shared expert
EXPERTS = 8
TOP_K = 2
DENSE_LAYERS = 1  # where a family has a notion of leading dense layers, keep one: useful coverage

# Names of fields -> value. A field of ModelArgs whose name is here gets the value whether or not
# it has a default: defaults are real-model sizes (hidden 4096, 128 experts, ...).
_RULES: dict[str, typing.Any] = {}


def _rule(value, *names: str) -> None:
    for n in names:
        _RULES[n] = value


_rule(VOCAB, "vocab_size", "num_vocab", "vocab_size_per_layer_input")
_rule(HIDDEN, "hidden_size", "d_model", "model_dim", "n_embd", "dim")
_rule(LAYERS, "num_hidden_layers", "n_layers", "num_layers", "n_layer")
_rule(FFN, "intermediate_size", "ffn_hidden_size", "ffn_dim")
_rule(
    EXPERT_FFN,
    "moe_intermediate_size",
    "expert_ffn_hidden_size",
    "shared_expert_intermediate_size",
    "shared_intermediate_size",
    "moe_shared_expert_intermediate_size",
    "share_expert_dim",
    "expert_intermediate_size",
    "moe_latent_size",
)
_rule(
    HEADS,
    "num_attention_heads",
    "n_heads",
    "num_heads",
    "n_head",
    "swa_num_attention_heads",
    "index_n_heads",
)
_rule(
    KV_HEADS,
    "num_key_value_heads",
    "num_attention_groups",
    "n_kv_heads",
    "num_kv_heads",
    "swa_num_key_value_heads",
    "num_global_key_value_heads",
)
_rule(
    HEAD_DIM,
    "head_dim",
    "v_head_dim",
    "qk_nope_head_dim",
    "swa_head_dim",
    "swa_v_head_dim",
    "index_head_dim",
    "global_head_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "mamba_head_dim",
    "mamba_d_head",
)
_rule(8, "qk_rope_head_dim", "rotary_dim")
_rule(32, "kv_lora_rank", "q_lora_rank", "o_lora_rank")
_rule(EXPERTS, "num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_rule(
    TOP_K,
    "num_experts_per_tok",
    "moe_topk",
    "moe_k",
    "top_k_experts",
    "moe_top_k",
    "num_experts_per_token",
)
_rule(1, "n_shared_experts", "num_shared_experts", "num_shared_expert", "moe_num_shared_experts")
_rule(1, "n_group", "num_expert_group", "topk_group")
_rule(DENSE_LAYERS, "first_k_dense_replace", "num_dense_layers", "moe_layer_start_index")
_rule(1, "moe_layer_freq", "decoder_sparse_step", "moe_layer_interval", "expert_layer_period")
_rule(0, "expert_layer_offset")
_rule(1e-5, "rms_norm_eps", "norm_eps", "layer_norm_epsilon", "layernorm_epsilon", "layer_norm_eps")
_rule(10000.0, "rope_theta", "swa_rope_theta")
_rule(512, "max_position_embeddings", "model_max_length", "original_max_position_embeddings")
_rule(32, "sliding_window", "sliding_window_size")
_rule(None, "rope_scaling")
_rule(64, "index_topk")
_rule(
    4,
    "linear_num_value_heads",
    "linear_num_key_heads",
    "linear_conv_kernel_dim",
    "mamba_d_conv",
    "conv_kernel",
    "mamba_n_heads",
    "mamba_num_heads",
)
_rule(16, "mamba_d_state", "ssm_state_size")
_rule(2, "mamba_expand")
_rule(1, "mamba_n_groups", "n_groups")
_rule(True, "norm_topk_prob")
_rule(0.0, "router_jitter_noise")  # jitter is training-time noise; keep decoding deterministic
_rule(2, "layer_group_size")
_rule(16, "group_norm_size")
_rule([0], "mlp_only_layers")  # the one dense layer of Qwen-style configs
_rule(1, "dense_layers_count")
_rule(EXPERT_FFN, "moe_hidden_size", "routed_expert_hidden_size")
_rule(
    1.0,
    "output_multiplier",
    "embedding_multiplier",
    "residual_multiplier",
    "attention_multiplier",
    "logits_scaling",
)
# Both spellings of rope_parameters at once: flat ({"rope_theta": ...}) and per layer type.
_ROPE = {
    "rope_theta": 10000.0,
    "rope_type": "default",
    "llama_4_scaling_beta": 0.1,
    "original_max_position_embeddings": 512,
}
_rule({**_ROPE, "full_attention": dict(_ROPE), "sliding_attention": dict(_ROPE)}, "rope_parameters")

# Fields that hold one entry per layer: layer 0 dense / sliding, the rest MoE, full attention last.
_PER_LAYER: dict[str, typing.Callable[[int], typing.Any]] = {
    "layer_types": lambda i: "full_attention" if i % 2 else "sliding_attention",
    "moe_layer_freq": lambda i: int(i >= DENSE_LAYERS),
    "is_moe_layer": lambda i: i >= DENSE_LAYERS,
    "mlp_layer_types": lambda i: "sparse" if i >= DENSE_LAYERS else "dense",
    "hybrid_layer_pattern": lambda i: i % 2,  # mimo: 1 = sliding window, 0 = global
    "layer_rope_theta": lambda i: 10000.0,
    "sparse_attention_freq": lambda i: 0,
}

# Values for fields a family requires but others default: only used when the field is required.
_REQUIRED = {
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "score_function": "sigmoid",
    "tie_word_embeddings": False,
    "partial_rotary_factor": 0.5,
    "routed_scaling_factor": 1.0,
    "zero_expert_type": "identity",
    "zero_expert_num": 1,
    "conv_L_cache": 3,
    "use_qk_norm": True,
    "mla_scale_q_lora": True,
    "mla_scale_kv_lora": True,
}

# Fallbacks for required fields the rules do not name, by annotated type.
_BY_TYPE = {int: 1, float: 1.0, bool: False, str: "", dict: {}, list: [], tuple: ()}


def _is_args_class(obj) -> bool:
    from mlx_lm.models.base import BaseModelArgs

    return (
        inspect.isclass(obj)
        and dataclasses.is_dataclass(obj)
        and issubclass(obj, BaseModelArgs)
        and obj is not BaseModelArgs
    )


def _module(model_type: str) -> types.ModuleType:
    return importlib.import_module(f"mlx_lm.models.{model_type}")


def _fields(cls) -> list[dataclasses.Field]:
    return list(dataclasses.fields(cls))


def _type_default(f: dataclasses.Field, hints: dict):
    t = hints.get(f.name, f.type)
    origin = typing.get_origin(t)
    if origin is typing.Union or origin is types.UnionType:  # Optional[int], int | None
        args = [a for a in typing.get_args(t) if a is not type(None)]
        t = args[0] if args else t
        origin = typing.get_origin(t)
    t = origin or t
    for base in (bool, int, float, str, dict, list, tuple):  # bool before int: bool is an int
        if isinstance(t, type) and issubclass(t, base):
            return _BY_TYPE[base]
    return None


def _is_list(t) -> bool:
    for a in (t, *typing.get_args(t)):
        if a in (list, tuple, typing.List) or typing.get_origin(a) in (list, tuple):
            return True
    return "List[" in str(t) or "list[" in str(t)


def _fill(cls, model_type: str, top: bool = True) -> dict:
    """A config for the ModelArgs-like dataclass `cls` from the generic rules."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # forward references mlx-lm does not resolve: fall back to raw annotations
        hints = {}
    cfg: dict = {}
    for f in _fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if f.name == "model_type":
            cfg["model_type"] = model_type if top or required or not f.default else f.default
        elif f.name in _PER_LAYER and _is_list(hints.get(f.name, f.type)):
            cfg[f.name] = [_PER_LAYER[f.name](i) for i in range(LAYERS)]
        elif f.name in _RULES:
            cfg[f.name] = _RULES[f.name]
        elif required and f.name in _REQUIRED:
            cfg[f.name] = _REQUIRED[f.name]
        elif required:
            cfg[f.name] = _type_default(f, hints)
    return cfg


def _text_args_class(mod: types.ModuleType):
    """The dataclass of a family's nested `text_config`, found in the module the way its Model uses it."""
    seen = set()
    todo = [mod] + [
        sys.modules[c.__module__]
        for c in mod.Model.__mro__[1:]
        if c.__module__.startswith("mlx_lm.")
    ]
    for m in todo:
        if m.__name__ in seen:
            continue
        seen.add(m.__name__)
        own = [
            (k, v)
            for k, v in vars(m).items()
            if _is_args_class(v)
            and v is not m.ModelArgs
            and "vision" not in k.lower()
            and "audio" not in k.lower()
        ]
        text = [v for k, v in own if "text" in k.lower() or "text" in v.__name__.lower()]
        if text:
            return text[0]
        if len(own) == 1:
            return own[0][1]
    subs = [
        v
        for v in vars(mod).values()
        if isinstance(v, types.ModuleType)
        and v.__name__.startswith("mlx_lm.models.")
        and hasattr(v, "ModelArgs")
    ]
    if len(subs) == 1:
        return subs[0].ModelArgs
    raise LookupError(f"{mod.__name__}: cannot tell which dataclass its text_config is")


def _has_text_config(cls) -> bool:
    return any(f.name == "text_config" for f in _fields(cls))


def tiny_config(model_type: str) -> dict:
    """config.json of a tiny model of the family, built from the family's own ModelArgs fields."""
    mod = _module(model_type)
    over = _OVERRIDES.get(model_type, {})
    if _has_text_config(mod.ModelArgs):
        text_cls = over.get("text_class", _text_args_class)(mod)
        text = _fill(text_cls, over.get("text_model_type", model_type), top=False)
        text.update(over.get("text", {}))
        cfg = {k: v for k, v in _fill(mod.ModelArgs, model_type).items() if k != "text_config"}
        cfg["text_config"] = text
    else:
        cfg = _fill(mod.ModelArgs, model_type)
    # families that share a model_type with another and are told apart by `architectures`
    from mlx_lm.utils import MODEL_ARCHITECTURE_REMAPPING

    for (mt, arch), target in MODEL_ARCHITECTURE_REMAPPING.items():
        if target == model_type:
            cfg["model_type"], cfg["architectures"] = mt, [arch]
    cfg.update(over.get("top", {}))
    return json.loads(json.dumps(cfg))  # a plain JSON dict, as read from config.json


# ---------------------------------------------------------------------------------------- banks


def _bank_kind(module: nn.Module) -> str | None:
    from mlx_lm.models import switch_layers as sl

    if isinstance(module, sl.SwitchGLU):
        return "SwitchGLU"
    if isinstance(module, sl.SwitchMLP):
        return "SwitchMLP"
    return None


_FFN_NAME = re.compile(r"expert|moe|mlp|ffn", re.I)
_ATTN_NAME = re.compile(r"attn|attention", re.I)


def _ffn_like(path: str, m: nn.Module) -> bool:
    """A custom bank must sit where a feed-forward does: grouped projections inside attention
    (deepseek_v41's o_proj groups use SwitchLinear) are not routed experts."""
    where = f"{path} {type(m).__name__}"
    return bool(_FFN_NAME.search(where)) and not _ATTN_NAME.search(where)


def banks(model: nn.Module) -> list[tuple[str, str]]:
    """(path, kind) of every routed-expert bank in the model, outermost only.

    kind: "SwitchGLU" / "SwitchMLP" (mlx-lm's banks, quantized or not), "per-expert list"
    (`self.experts = [MLP() for _ in range(n)]`), "other: SwitchLinear" (a family's own bank class
    built from SwitchLinear layers), "other: stacked" (a module holding (num_experts, ...) arrays).
    """
    from mlx_lm.models import switch_layers as sl

    found: list[tuple[str, str]] = []
    switch_linear = (sl.SwitchLinear, sl.QuantizedSwitchLinear)
    for path, m in model.named_modules():
        kind = _bank_kind(m)
        if kind is None and not isinstance(m, switch_linear) and _ffn_like(path, m):
            kids = m.children()
            if any(isinstance(c, switch_linear) for c in kids.values()):
                kind = "other: SwitchLinear"
            elif any(
                isinstance(v, mx.array) and v.ndim == 3 and v.shape[0] == EXPERTS
                for k, v in kids.items()
                if not k.startswith("_")
            ):
                kind = "other: stacked"
            for name, child in kids.items():
                if (
                    isinstance(child, list)
                    and len(child) >= 4
                    and "expert" in name.lower()
                    and all(isinstance(c, nn.Module) and type(c) is type(child[0]) for c in child)
                ):
                    found.append((f"{path}.{name}" if path else name, "per-expert list"))
        if kind is not None:
            found.append((path, kind))
    # keep only the outermost bank of a nest (a SwitchGLU's SwitchLinear projections are its parts)
    found.sort(key=lambda pk: pk[0].count("."))
    outer: list[tuple[str, str]] = []
    for p, k in found:
        if not any(p.startswith(q + ".") for q, _ in outer):
            outer.append((p, k))
    return sorted(outer)


def moe_layers(bank_paths) -> int:
    """How many distinct decoder layers hold a bank (paths like `...layers.3.mlp.experts`, `...blocks.3.ffn`)."""
    idx = set()
    for p, _ in bank_paths:
        m = re.search(r"(?:layers|blocks|h)\.(\d+)\.", p + ".")
        idx.add(m.group(1) if m else p)
    return len(idx)


def expert_count(cfg: dict) -> int:
    """The routed experts a config declares (at any level: text_config, dbrx's ffn_config)."""
    names = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
    for k, v in cfg.items():
        if k in names and isinstance(v, int):
            return v
    for v in cfg.values():
        if isinstance(v, dict) and (n := expert_count(v)):
            return n
    return 0


def build_model(model_type: str, seed: int = 0, cfg: dict | None = None) -> tuple[nn.Module, dict]:
    """Instantiate the tiny model and re-initialise every parameter deterministically."""
    from mlx_lm.utils import _get_classes

    cfg = cfg if cfg is not None else tiny_config(model_type)
    model_cls, args_cls = _get_classes(cfg)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(json.loads(json.dumps(cfg))))
    reinit(model, seed, expert_count(cfg) or EXPERTS)
    return model, cfg


def reinit(model: nn.Module, seed: int = 0, experts: int = EXPERTS) -> None:
    """Deterministic random values everywhere, scaled so every block matters and routing is non-degenerate.

    mlx-lm's own init leaves some families with zero gates, zero e_score_correction_bias or zero
    norms. Here: embeddings normal(0, 1) (0.1 where tied to the output head); matrices normal / sqrt(fan_in) (unit-variance outputs, so
    each attention / expert block adds O(1) to the residual stream and the experts really move the
    logits: with a flat 0.02 the embedding dominated and most families decoded alike); 1-D weights
    (norm scales) 1 + normal*0.02; other vectors (biases, A_log, correction biases) normal*0.02.
    Integer buffers are left alone.
    """
    params = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(seed), max(2, len(params)))
    embeddings = {
        p for p, m in model.named_modules() if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding))
    }
    # With tied embeddings the residual stream holds the input token's own row, whose logit is its
    # squared norm: at std 1 that echo beats every block and the model repeats its last token.
    tied = not any(
        isinstance(m, nn.Linear) and m.weight.shape[0] == VOCAB for _, m in model.named_modules()
    )
    embed_std = 0.1 if tied else 1.0
    new = []
    for i, (name, v) in enumerate(params):
        if not mx.issubdtype(v.dtype, mx.floating):
            continue
        z = mx.random.normal(v.shape, dtype=mx.float32, key=keys[i])
        owner, leaf = name.rsplit(".", 1) if "." in name else ("", name)
        if owner in embeddings and leaf == "weight":
            w = z * embed_std
        elif v.ndim >= 2:
            fan_in = (
                v.shape[-1] if v.ndim == 2 or v.shape[0] == experts else int(np.prod(v.shape[1:]))
            )
            w = z * fan_in**-0.5
        elif leaf in ("weight", "scale", "g", "gamma"):
            w = 1.0 + z * 0.02
        else:
            w = z * 0.02
        new.append((name, w.astype(v.dtype)))
    model.update(tree_unflatten(new))
    mx.eval(model.parameters())


@functools.lru_cache(maxsize=None)
def _survey() -> dict[str, tuple[str, int, str]]:
    """model_type -> (bank kind, MoE layers, '') for families with banks; errors as ('error', 0, why)."""
    import mlx_lm.models as mm

    out: dict[str, tuple[str, int, str]] = {}
    for info in sorted(pkgutil.iter_modules(mm.__path__), key=lambda i: i.name):
        name = info.name
        try:
            mod = _module(name)
        except BaseException:  # some families need optional packages (olmo exits on import)
            continue
        if not (hasattr(mod, "Model") and hasattr(mod, "ModelArgs")):
            continue
        try:
            model, _ = _instantiate(name)
        except Exception as exc:
            if not _mentions_experts(mod):
                continue  # a dense family our generic config does not fit: not an expert family
            out[name] = ("error", 0, f"{type(exc).__name__}: {exc}".splitlines()[0][:160])
            continue
        b = banks(model)
        if b:
            kinds = sorted({k for _, k in b})
            out[name] = ("/".join(kinds), moe_layers(b), "")
    return out


def _mentions_experts(mod: types.ModuleType) -> bool:
    """Whether the family's source, or that of the mlx-lm modules it builds on, speaks of experts."""
    mods = {mod}
    for v in vars(mod).values():
        m = (
            v
            if isinstance(v, types.ModuleType)
            else sys.modules.get(getattr(v, "__module__", "") or "")
        )
        if (
            m is not None
            and m.__name__.startswith("mlx_lm.models.")
            and not m.__name__.endswith((".switch_layers", ".base"))
        ):
            mods.add(m)
    for m in mods:
        try:
            if "expert" in inspect.getsource(m).lower():
                return True
        except (OSError, TypeError):
            pass
    return False


def _instantiate(model_type: str):
    from mlx_lm.utils import _get_classes

    cfg = tiny_config(model_type)
    model_cls, args_cls = _get_classes(cfg)
    return model_cls(args_cls.from_dict(json.loads(json.dumps(cfg)))), cfg


# Issue 13's families: silently wrong before (shared experts or an inline term counted N times)...
WRONG = ["hunyuan", "step3p5", "longcat_flash", "longcat_flash_ngram"]
# ...and refused before: config nested under text_config, `model_dim`, or a top-k key the planner did not know
REFUSED = [
    "qwen3_5_moe",
    "qwen3_vl_moe",
    "kimi_k25",
    "kimi_vl",
    "kimi_k3",
    "minimax_m3_vl",
    "llama4",
    "phixtral",
    "ernie4_5_moe",
    "kimi_linear",
    "gemma4_text",
]


def families() -> list[str]:
    """Every mlx-lm family whose tiny model holds a routed-expert bank."""
    return sorted(n for n, (kind, _, _) in _survey().items() if kind != "error")


def bank_kind(model_type: str) -> str:
    return _survey()[model_type][0]


def per_expert_list_families() -> list[str]:
    """Families whose experts are a Python list of per-expert modules rather than a stacked bank."""
    return sorted(n for n, (kind, _, _) in _survey().items() if "per-expert list" in kind)


def survey_errors() -> dict[str, str]:
    """Families whose tiny config could not even be instantiated (so could not be classified)."""
    return {n: why for n, (kind, _, why) in _survey().items() if kind == "error"}


def needs_metal(model_type: str) -> bool:
    """The family calls mlx-lm's hand-written Metal kernels (mlx_lm.kernels) and this is not Metal:
    the product refuses it here (node.checkpoint.check_runnable)."""
    from moe_cluster.node.checkpoint import CheckpointError, check_runnable

    try:
        check_runnable(tiny_config(model_type))
    except CheckpointError:
        return True
    return False


# ----------------------------------------------------------------------------------- checkpoints

QUANT_MODES = {
    "4bit": dict(bits=4, group_size=32, mode="affine"),
    "8bit": dict(bits=8, group_size=32, mode="affine"),
    "mxfp4": dict(bits=4, group_size=32, mode="mxfp4"),
    "mxfp8": dict(bits=8, group_size=32, mode="mxfp8"),
    # 4-bit affine with the first MoE layer's experts at 8 bits: a per-layer override in the config
    "4bit+8bit-layer": dict(bits=4, group_size=32, mode="affine", first_bank_bits=8),
}


def _override_first_bank(model: nn.Module, q: dict):
    """A quant_predicate giving the first bank `first_bank_bits`, else the family's own choice."""
    own = getattr(model, "quant_predicate", None)
    if "first_bank_bits" not in q:
        return own
    first = banks(model)[0][0]

    def predicate(path, module):
        if path == first or path.startswith(first + "."):
            return {"group_size": q["group_size"], "bits": q["first_bank_bits"], "mode": q["mode"]}
        return own(path, module) if own is not None else True

    return predicate


@functools.lru_cache(maxsize=1)
def _tokenizer_dir() -> Path:
    """A byte-level BPE of exactly VOCAB tokens, trained once per process on the demo corpus."""
    import tempfile

    from moe_cluster.node.demo.tokenizer import train_tokenizer, vocab_size

    out = Path(tempfile.mkdtemp(prefix="tiny-tokenizer-"))
    train_tokenizer(out, vocab_size=VOCAB)
    assert vocab_size(out) == VOCAB, vocab_size(out)
    return out


def make_checkpoint(
    model_type: str,
    out_dir,
    seed: int = 0,
    quantize: str | None = None,
    tokenizer: bool = False,
    cfg: dict | None = None,
) -> Path:
    """Write config.json + model.safetensors of the tiny model, loadable by mlx_lm.utils.load_model;
    with `tokenizer`, also tokenizer files of VOCAB tokens, so the commands that read text run on it.
    `cfg` replaces the family's tiny config (drawn.py's configs)."""
    import contextlib
    import io

    from mlx_lm.utils import quantize_model, save_config

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model, cfg = build_model(model_type, seed, cfg)
    if quantize is not None:
        q = QUANT_MODES[quantize]
        # group size 32 divides every tiny width (hidden 64, expert 32); quantize_model skips others
        with contextlib.redirect_stdout(io.StringIO()):  # it prints bits per weight
            model, cfg = quantize_model(
                model,
                cfg,
                group_size=q["group_size"],
                bits=q["bits"],
                mode=q["mode"],
                quant_predicate=_override_first_bank(model, q),
            )
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    for old in out.glob("model*.safetensors*"):
        old.unlink()
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    save_config(dict(cfg), out / "config.json")
    if tokenizer:
        for f in _tokenizer_dir().iterdir():
            shutil.copy(f, out / f.name)
    return out


def stock_tokens(path, prompt_ids, n: int) -> tuple[list[int], np.ndarray]:
    """Greedy decode n tokens with stock mlx-lm: (token ids, float32 logits of each step, (n, vocab))."""
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(path))
    return decode(model, prompt_ids, n)


def decode(model: nn.Module, prompt_ids, n: int) -> tuple[list[int], np.ndarray]:
    """Greedy decoding with a KV cache from make_prompt_cache, as mlx-lm's generate_step does."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    x = mx.array([list(prompt_ids)], dtype=mx.int32)
    tokens: list[int] = []
    logits_all = []
    for _ in range(n):
        logits = model(x, cache=cache)[:, -1, :].astype(mx.float32)
        tok = int(mx.argmax(logits, axis=-1).item())
        tokens.append(tok)
        logits_all.append(np.array(logits[0]))
        x = mx.array([[tok]], dtype=mx.int32)
    return tokens, np.stack(logits_all) if logits_all else np.zeros((0, 0), np.float32)


@contextlib.contextmanager
def record_routing(model: nn.Module):
    """Within the block, {bank path: set of expert ids the bank ran} for the model's stacked banks.

    Every stacked bank (SwitchGLU, SwitchMLP, a family's own) runs its experts through
    SwitchLinear / QuantizedSwitchLinear with the routed indices; those calls are recorded.
    Per-expert-list banks are not (their routing is a Python loop).
    """
    from mlx_lm.models import switch_layers as sl

    owner: dict[int, str] = {}
    for path, kind in banks(model):
        bank = model
        for part in path.split("."):
            bank = bank[int(part)] if isinstance(bank, list) else bank[part]
        if isinstance(bank, nn.Module):
            for _, m in bank.named_modules():
                if isinstance(m, (sl.SwitchLinear, sl.QuantizedSwitchLinear)):
                    owner[id(m)] = path
    seen: dict[str, set[int]] = {p: set() for p in set(owner.values())}
    originals = {cls: cls.__call__ for cls in (sl.SwitchLinear, sl.QuantizedSwitchLinear)}

    def wrap(orig):
        def call(self, x, indices, *a, **kw):
            if id(self) in owner:
                seen[owner[id(self)]].update(np.array(indices).reshape(-1).tolist())
            return orig(self, x, indices, *a, **kw)

        return call

    for cls, orig in originals.items():
        cls.__call__ = wrap(orig)
    try:
        yield seen
    finally:
        for cls, orig in originals.items():
            cls.__call__ = orig


# -------------------------------------------------------------------------------------- overrides
# Only where the generic rules cannot work; each entry says why. Keys:
#   top: merged into the top-level config; text: merged into text_config;
#   text_class: fn(module) -> the text dataclass; text_model_type: text_config's model_type.

_OVERRIDES: dict[str, dict] = {}

_KDA = {
    "kda_layers": [1, 3],
    "full_attn_layers": [2, 4],
    "num_heads": HEADS,
    "head_dim": HEAD_DIM,
    "short_conv_kernel_size": 4,
}
_OVERRIDES.update(
    {
        # dbrx nests its sizes in two dicts the generic rules cannot see into
        "dbrx": {
            "top": {
                "ffn_config": {
                    "ffn_hidden_size": EXPERT_FFN,
                    "moe_num_experts": EXPERTS,
                    "moe_top_k": TOP_K,
                },
                "attn_config": {"kv_n_heads": KV_HEADS, "clip_qkv": 8.0, "rope_theta": 10000.0},
            }
        },
        # MLA attention reads rope_scaling's yarn fields unconditionally
        "deepseek_v2": {
            "top": {
                "rope_scaling": {
                    "type": "yarn",
                    "factor": 1.0,
                    "mscale": 1.0,
                    "mscale_all_dim": 1.0,
                    "original_max_position_embeddings": 512,
                }
            }
        },
        # hunyuan: cross-layer attention sharing needs a factor; mixed MLP+MoE is its real shape
        "hunyuan": {
            "top": {
                "use_cla": True,
                "cla_share_factor": 2,
                "use_mixed_mlp_moe": True,
                "rope_scaling": {"alpha": 1.0, "factor": 1.0, "type": "dynamic"},
            }
        },
        # jamba: one attention layer in the period of 2, MoE every other layer as released
        "jamba": {
            "top": {
                "attn_layer_offset": 1,
                "attn_layer_period": 2,
                "expert_layer_offset": 1,
                "expert_layer_period": 2,
            }
        },
        # linear-attention layout is a nested dict (1-based layer numbers)
        "kimi_linear": {"top": {"linear_attn_config": _KDA}},
        "kimi_k3": {"text": {"linear_attn_config": _KDA, "model_type": "kimi_linear"}},
        # lfm2: short-conv and attention layers by name
        "lfm2_moe": {"top": {"layer_types": ["conv", "full_attention", "conv", "full_attention"]}},
        # llama4 routes exactly one expert per token (asserted) and interleaves MoE every other layer
        "llama4": {
            "text": {
                "num_experts_per_tok": 1,
                "interleave_moe_layer_step": 2,
                "attention_chunk_size": 32,
                "intermediate_size_mlp": FFN,
                "intermediate_size": EXPERT_FFN,
            }
        },
        # muse_spark rejects dense or shared-expert layers
        "muse_spark": {"text": {"num_shared_experts": 0, "mlp_layer_types": None}},
        # nemotron_h describes its stack as a pattern of mamba / attention / MoE blocks
        # (its routed_scaling_factor defaults to None, which the router multiplies by); layer_types in
        # transformers' names, which its config (read when the tokenizer is loaded) checks; mlx-lm reads
        # the pattern
        "nemotron_h": {
            "top": {
                "hybrid_override_pattern": ["M", "E", "*", "E"],
                "routed_scaling_factor": 1.0,
                "layer_types": ["linear_attention", "moe", "full_attention", "moe"],
            }
        },
        # granitemoehybrid: mamba / attention layers by name; transformers' config wants the mamba heads to
        # span mamba_expand (2) x hidden
        "granitemoehybrid": {
            "top": {"layer_types": ["mamba", "attention", "mamba", "attention"], "mamba_d_head": 32}
        },
        # mistral3 wraps a text model picked by text_config.model_type; mistral4 is its MoE one
        "mistral3": {
            "text_class": lambda m: m.mistral4.ModelArgs,
            "text_model_type": "mistral4",
            "text": {"model_type": "mistral4"},
        },
        # gemma4: experts only with enable_moe_block; no KV-sharing layers at this depth
        "gemma4_text": {"top": {"enable_moe_block": True, "num_kv_shared_layers": 0}},
        "gemma4": {
            "text_class": lambda m: m.gemma4_text.ModelArgs,
            "text": {
                "enable_moe_block": True,
                "num_kv_shared_layers": 0,
                "model_type": "gemma4_text",
            },
        },
    }
)
