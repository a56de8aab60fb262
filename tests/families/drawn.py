"""Configs drawn at random from what each family's ModelArgs allows: the randomized family sweep.

tiny.py gives every family one config (8 experts, top-2, hidden 64, ...). A structure rule tuned on
that one config can still refuse or mis-split another: the same family with 48 experts, top-6, a
routed scaling factor and group-limited routing. `draw(family, seed)` picks such a config from a
seeded generator over

- expert count (4-64) and top-k (1-8, at most the experts; llama4 routes exactly one),
- hidden width (64 or 128) and expert and shared-expert widths (32-96): multiples of 32, so every
  quantization mode's group size divides them,
- shared experts (0-2, where the family counts them), a routed scaling factor and normalised or raw
  top-k weights (where the family reads them), group-limited routing (where it has groups),
- 3 or 4 layers with 0 or 1 leading dense layers, and float32 or one quantization mode,

and `config(family, d)` writes it over the family's tiny config by the field names tiny.py's rules
use, at every level (text_config, dbrx's ffn_config). Families whose layer layout is spelled out
per layer in tiny.py's overrides keep their depth.

    python tests/families/drawn.py [--seeds N] [family ...]   # more seeds by hand

`FAMILY_SEEDS` (environment) sets how many seeds the pytest sweep draws per family (default 1;
`drawn.py --seeds 10` passed 10 of 10 on every family, docs/families.md).
"""

from __future__ import annotations

import dataclasses
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tiny  # noqa: E402

EXPERT_COUNTS = (4, 6, 8, 12, 16, 24, 32, 48, 64)
WIDTHS = (
    64,
    128,
)  # hidden: multiples of 64, the group size some families quantize their router with
EXPERT_WIDTHS = (32, 64, 96)
QUANTIZE = (None, None, "4bit", "8bit", "mxfp4", "mxfp8")  # float32 half the time

# Field names by what they mean, as tiny.py's rules name them.
KEYS = {
    "hidden": ("hidden_size", "d_model", "model_dim", "n_embd", "dim"),
    "layers": ("num_hidden_layers", "n_layers", "num_layers", "n_layer"),
    "experts": ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"),
    "top_k": (
        "num_experts_per_tok",
        "moe_topk",
        "moe_k",
        "top_k_experts",
        "moe_top_k",
        "num_experts_per_token",
    ),
    "expert_ffn": (
        "moe_intermediate_size",
        "expert_ffn_hidden_size",
        "expert_intermediate_size",
        "moe_hidden_size",
        "routed_expert_hidden_size",
    ),
    "shared_ffn": (
        "shared_expert_intermediate_size",
        "shared_intermediate_size",
        "moe_shared_expert_intermediate_size",
        "share_expert_dim",
    ),
    "shared": (
        "n_shared_experts",
        "num_shared_experts",
        "num_shared_expert",
        "moe_num_shared_experts",
    ),
    "dense_layers": ("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index"),
    "n_group": ("n_group", "num_expert_group"),
    "topk_group": ("topk_group",),
    "routed_scaling": ("routed_scaling_factor",),
    "norm_topk": ("norm_topk_prob",),
}
# Where a family gives a generic name another meaning (llama4's `intermediate_size` is its expert
# width, its dense MLP's is `intermediate_size_mlp`; dbrx's `ffn_config.ffn_hidden_size` is too).
_FAMILY_KEYS = {
    "llama4": {"intermediate_size": "expert_ffn"},
    "dbrx": {"ffn_hidden_size": "expert_ffn"},
}
# Families whose layer layout is written out per layer in tiny.py's overrides (1-based KDA layer
# lists, hybrid patterns), or needs a full-attention layer every 4th (qwen3_next, qwen3_5 and llama4
# index the cache of layer 3): their depth stays tiny.LAYERS.
_FIXED_DEPTH = {
    "kimi_linear",
    "kimi_k3",
    "lfm2_moe",
    "nemotron_h",
    "granitemoehybrid",
    "jamba",
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_moe",
    "llama4",
}
# Families that accept only some values: llama4 asserts top-1; muse_spark rejects shared experts;
_FIXED = {"llama4": {"top_k": 1}, "muse_spark": {"shared": 0}}
# Lower bounds: stock mlx-lm (0.32) dies of a segmentation fault decoding a top-1 bailing_moe;
# hunyuan's mixed MLP+MoE layer (its real shape, tiny.py), Klear and bailing_moe_v3 always have a
# shared expert (0 builds a 0-wide MLP).
_MIN = {
    "bailing_moe": {"top_k": 2},
    "hunyuan": {"shared": 1},
    "Klear": {"shared": 1},
    "bailing_moe_v3": {"shared": 1},
}
# So does the deepseek lineage, which counts them in `n_shared_experts`: mlx-lm builds a 0-wide MLP
# from 0 (it tests `is not None`), and transformers' configs, read with the tokenizer, refuse null.
_ALWAYS_SHARED = "n_shared_experts"


@dataclasses.dataclass(frozen=True)
class Draw:
    family: str
    seed: int
    hidden: int
    layers: int
    experts: int
    top_k: int
    expert_ffn: int
    shared_ffn: int
    shared: int
    dense_layers: int
    n_group: int
    topk_group: int
    routed_scaling: float
    norm_topk: bool
    quantize: str | None

    def label(self) -> str:
        group = f" groups {self.topk_group}/{self.n_group}" if self.n_group > 1 else ""
        return (
            f"{self.family}#{self.seed}: {self.experts} experts top-{self.top_k} hidden {self.hidden} "
            f"ffn {self.expert_ffn} shared {self.shared}x{self.shared_ffn} layers {self.layers} "
            f"(dense {self.dense_layers}) scale {self.routed_scaling} norm {self.norm_topk}{group} "
            f"{self.quantize or 'float32'}"
        )


def draw(family: str, seed: int) -> Draw:
    """The config of `family` drawn by `seed`: the same pair always gives the same config."""
    rng = random.Random(f"{family}:{seed}")
    fixed = _FIXED.get(family, {})
    experts = rng.choice(EXPERT_COUNTS)
    least = dict(_MIN.get(family, {}))
    if _ALWAYS_SHARED in json.dumps(tiny.tiny_config(family)):
        least.setdefault("shared", 1)
    top_k = fixed.get("top_k", rng.randint(least.get("top_k", 1), min(8, experts)))
    # group-limited routing: groups divide the experts, each group holds at least two (deepseek
    # scores a group by its top two), the chosen groups hold at least top-k experts, and some group
    # is dropped (mlx-lm masks n_group - topk_group groups; none is an empty mask it cannot take)
    per = lambda g: experts // g  # noqa: E731
    groups = [
        g for g in (2, 4, 8) if experts % g == 0 and per(g) >= 2 and (g - 1) * per(g) >= top_k
    ]
    n_group = rng.choice([1] + groups)
    topk_group = rng.choice([t for t in range(1, n_group) if t * per(n_group) >= top_k] or [1])
    layers = tiny.LAYERS if family in _FIXED_DEPTH else rng.choice((3, 4))
    return Draw(
        family=family,
        seed=seed,
        hidden=rng.choice(WIDTHS),
        layers=layers,
        experts=experts,
        top_k=top_k,
        expert_ffn=rng.choice(EXPERT_WIDTHS),
        shared_ffn=rng.choice(EXPERT_WIDTHS),
        shared=fixed.get("shared", rng.randint(least.get("shared", 0), 2)),
        dense_layers=rng.randint(0, 1),
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling=rng.choice((1.0, 1.5, 2.5)),
        norm_topk=rng.random() < 0.5,
        quantize=rng.choice(QUANTIZE),
    )


def _per_layer(name: str, old: list, d: Draw) -> list:
    """A per-layer list for the drawn depth and dense layers. Lists tiny.py's overrides spell out
    (hybrid layouts) keep their entries where the depth is theirs."""
    moe = lambda i: i >= d.dense_layers  # noqa: E731
    by_dense = {
        "moe_layer_freq": lambda i: int(moe(i)),
        "is_moe_layer": moe,
        "mlp_layer_types": lambda i: "sparse" if moe(i) else "dense",
    }
    if name in by_dense:
        return [by_dense[name](i) for i in range(d.layers)]
    if len(old) == d.layers:
        return old
    return [tiny._PER_LAYER[name](i) for i in range(d.layers)]


def _apply(cfg: dict, d: Draw, meaning: dict[str, str], defaults: dict) -> None:
    """Write the draw over one level of a config: keys it holds, and optional fields of its
    dataclass (`defaults`: field name -> default) that select behaviour (scaling, groups)."""
    values = dataclasses.asdict(d)
    for key in list(cfg):
        what = meaning.get(key)
        if what is not None:
            cfg[key] = values[what]
        elif isinstance(cfg[key], dict):
            _apply(cfg[key], d, meaning, {})
        elif key in tiny._PER_LAYER and isinstance(cfg[key], list):
            cfg[key] = _per_layer(key, cfg[key], d)
        elif key == "mlp_only_layers":
            cfg[key] = list(range(d.dense_layers))
    for what in ("routed_scaling", "norm_topk", "n_group", "topk_group"):
        for key in KEYS[what]:
            if key in defaults:
                cfg[key] = values[what]
    if "topk_method" in defaults and d.n_group > 1:
        cfg.setdefault("topk_method", "noaux_tc")  # deepseek_v2 groups only under a group method


def _defaults(cls) -> dict:
    return {
        f.name: None if f.default is dataclasses.MISSING else f.default
        for f in dataclasses.fields(cls)
    }


def config(family: str, d: Draw) -> dict:
    """The family's tiny config with the draw written over it."""
    cfg = tiny.tiny_config(family)
    meaning = {k: what for what, keys in KEYS.items() for k in keys}
    meaning.update(_FAMILY_KEYS.get(family, {}))
    mod = tiny._module(family)
    if "text_config" in cfg:
        text_cls = tiny._OVERRIDES.get(family, {}).get("text_class", tiny._text_args_class)(mod)
        _apply(cfg["text_config"], d, meaning, _defaults(text_cls))
        _apply(cfg, d, meaning, {})
    else:
        _apply(cfg, d, meaning, _defaults(mod.ModelArgs))
    return cfg


def seeds() -> list[int]:
    import os

    return list(range(int(os.environ.get("FAMILY_SEEDS", "1"))))


def check(family: str, seed: int, tmp: Path) -> dict:
    """One drawn config at N = 2 and 3 against stock: {"draw", "path", "nodes": {n: sweep.check},
    "exact": bool} (tokens equal, |Δlogit| within the sweep's bound for its dtype)."""
    import sweep

    d = draw(family, seed)
    path = tiny.make_checkpoint(
        family, Path(tmp) / f"{family}-{seed}", quantize=d.quantize, cfg=config(family, d)
    )
    ref = tiny.stock_tokens(path, sweep.PROMPT, sweep.STEPS)
    nodes = {n: sweep.check(path, n, ref) for n in (2, 3)}
    bound = sweep.QUANT_TOLERANCE if d.quantize else sweep.TOLERANCE
    exact = all(
        len(r["tokens"]) == sweep.STEPS and r["tokens_match"] and r["max_abs_logit_diff"] <= bound
        for r in nodes.values()
    )
    return {"draw": d, "path": path, "nodes": nodes, "exact": exact}


def passed(family: str, n_seeds: int, tmp: Path) -> tuple[int, list[str]]:
    """(configs exact of the first n_seeds, a line for each that is not)."""
    failures = []
    for seed in range(n_seeds):
        try:
            got = check(family, seed, tmp)
        except Exception as exc:  # noqa: BLE001 - a refusal or a crash is a finding to print
            failures.append(
                f"{draw(family, seed).label()}: {type(exc).__name__}: {exc}".splitlines()[0]
            )
            continue
        if not got["exact"]:
            diffs = {
                n: (r["tokens_match"], f"{r['max_abs_logit_diff']:.2g}")
                for n, r in got["nodes"].items()
            }
            failures.append(f"{got['draw'].label()}: (tokens equal, |Δlogit|) by N {diffs}")
    return n_seeds - len(failures), failures


def main(argv: list[str] | None = None) -> int:
    import argparse
    import contextlib
    import io
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=8, help="configs drawn per family (default 8)")
    ap.add_argument("families", nargs="*", help="default: every family that runs here")
    args = ap.parse_args(argv)
    with contextlib.redirect_stdout(io.StringIO()):  # some mlx-lm modules print on import
        families = args.families or [f for f in tiny.families() if not tiny.needs_metal(f)]
    bad = 0
    for family in families:
        with tempfile.TemporaryDirectory() as tmp:
            ok, failures = passed(family, args.seeds, Path(tmp))
        print(f"{family}: {ok}/{args.seeds} drawn configs exact at N = 2 and 3", flush=True)
        for line in failures:
            print(f"  {line}", flush=True)
        bad += bool(failures)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
