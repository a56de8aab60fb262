"""The model's own multi-token-prediction (MTP) layer as the speculative draft
(`serving.speculative: mtp`).

DeepSeek-V3/R1, GLM-4.5/4.6 and MiMo checkpoints hold `num_nextn_predict_layers` extra layers after
the decoder's, `model.layers.{num_hidden_layers + i}.*`, which mlx-lm's `sanitize` drops. Each is,
in DeepSeek-V3's form, a decoder block of the family fed with the model's last hidden state h_i
and the embedding of the token after it:

    h'_i = block(eh_proj(concat(enorm(embed(t_{i+1})), hnorm(h_i))))
    logits = lm_head(shared_head.norm(h'_i))          # a guess of t_{i+2}

The block is built from mlx-lm's own decoder-layer class of the family, the embedding and the
head are the model's. Its KV cache rides as the last entry of every sequence's cache list (the
model ignores it), so merging, extracting, trimming and rolling back a batch's rows keep it
aligned with the model's: position i of the MTP cache holds the pair (h_i, t_{i+1}).

A checkpoint whose MTP weights are not in its safetensors may carry them in `mtp.safetensors`
beside them (the embedded demo's: stock mlx-lm reads `model*.safetensors` and so still loads the
demo as it was).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..proto.errors import UserError

SIDE_FILE = "mtp.safetensors"
# families whose mlx-lm decoder layer an MTP block is built from, (args, layer index) -> block
FAMILIES = ("deepseek_v3", "glm4_moe", "qwen3_moe")


def has_mtp(config: dict, path: Path | None = None) -> bool:
    """Whether speculation should draft with the checkpoint's own MTP layers: it declares some
    (`num_nextn_predict_layers`), its family's block can be built here, and their weights are
    present (in its safetensors, or `mtp.safetensors` beside them). What `auto` asks."""
    if not int(config.get("num_nextn_predict_layers") or 0):
        return False
    if config.get("model_type") not in FAMILIES:
        return False
    return path is None or bool(_weight_source(Path(path), config))


def _weight_source(path: Path, config: dict) -> dict:
    """{key: TensorInfo} of the first MTP layer's tensors, from the checkpoint or its side file."""
    from .checkpoint import Checkpoint, read_header

    prefix = f"model.layers.{int(config['num_hidden_layers'])}."
    found = {
        k: v
        for k, v in Checkpoint.open(path, download=False).tensors.items()
        if k.startswith(prefix)
    }
    side = path / SIDE_FILE
    if not found and side.exists():
        found = {k: v for k, v in read_header(side).items() if k.startswith(prefix)}
    return found


class MTP(nn.Module):
    """One MTP layer (DeepSeek-V3's form) over a model's embedding and head."""

    def __init__(self, block: nn.Module, hidden: int, eps: float):
        super().__init__()
        self.enorm = nn.RMSNorm(hidden, eps=eps)
        self.hnorm = nn.RMSNorm(hidden, eps=eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.block = block
        self.shared_head = _Head(hidden, eps)

    def __call__(self, embedded: mx.array, hidden: mx.array, cache) -> mx.array:
        """The block's output h' for (B, L) positions: `embedded` the next tokens' embeddings,
        `hidden` the model's hidden states there; `cache` this layer's KV cache."""
        from mlx_lm.models.base import create_attention_mask

        x = self.eh_proj(mx.concatenate([self.enorm(embedded), self.hnorm(hidden)], axis=-1))
        mask = create_attention_mask(x, cache, return_array=True)
        return self.block(x, mask, cache)


class _Head(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.norm = nn.RMSNorm(hidden, eps=eps)


def head(model: nn.Module):
    """The model's logits from its last hidden states (`model.model`'s output), as its __call__
    computes them."""
    args = getattr(model, "args", None)
    if getattr(args, "tie_word_embeddings", False) or not hasattr(model, "lm_head"):
        return model.model.embed_tokens.as_linear
    return model.lm_head


class Drafter:
    """A loaded model's MTP layer, drafting greedily (drafts only change speed, never output)."""

    def __init__(self, model: nn.Module, mtp: MTP):
        self.model, self.mtp = model, mtp
        self.head = head(model)

    def feed(self, tokens: mx.array, hidden: mx.array, cache) -> mx.array:
        """Feed (B, L) pairs (the model's hidden state at position i, token i + 1) into the MTP
        cache; the block's outputs h' (B, L, hidden)."""
        return self.mtp(self.model.model.embed_tokens(tokens), hidden, cache)

    def guess(self, h: mx.array) -> mx.array:
        """(B,) greedy guesses from block outputs h' (B, hidden)."""
        return mx.argmax(self.head(self.mtp.shared_head.norm(h)), axis=-1)

    def chain(self, first: mx.array, h: mx.array, k: int, cache) -> list[mx.array]:
        """`k` guesses per row: `first` (B,) and its block output h (B, hidden), then each next one
        fed back with the block's own output as its hidden state (one MTP layer drafting past its
        depth, as vLLM and SGLang do); the cache is trimmed back to where it was."""
        out = [first]
        for _ in range(k - 1):
            h = self.feed(out[-1][:, None], h[:, None], cache)[:, -1]
            out.append(self.guess(h))
        if k > 1:
            cache.trim(k - 1)
        return out


def load(model: nn.Module, config: dict, path: Path) -> Drafter:
    """The checkpoint's first MTP layer over `model` (mlx-lm's, loaded), its routed experts whole
    on this node; refused in one line where the checkpoint has none or its family is not built."""
    from mlx.utils import tree_flatten

    from .checkpoint import read_tensor

    n = int(config.get("num_nextn_predict_layers") or 0)
    family = config.get("model_type")
    if not n:
        raise UserError(
            f"speculative: mtp needs a checkpoint with MTP layers; {path} has none "
            "(config num_nextn_predict_layers)"
        )
    if family not in FAMILIES:
        raise UserError(
            f"speculative: mtp is not built for {family} (MTP drafts run for {', '.join(FAMILIES)})"
        )
    layer = int(config["num_hidden_layers"])
    tensors = _weight_source(Path(path), config)
    if not tensors:
        raise UserError(
            f"speculative: mtp: {path} declares {n} MTP layer(s) but holds no weights "
            f"model.layers.{layer}.* (in its safetensors or {SIDE_FILE})"
        )
    prefix = f"model.layers.{layer}."
    # the block's weights go through the family's sanitize as a layer 0 of the model would (it
    # stacks per-expert tensors, dequantizes fp8); the MTP's embedding and head are the model's
    own = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")
    skip = ("embed_tokens.", "shared_head.head.")
    block, rest = {}, {}
    for key, info in tensors.items():
        name = key[len(prefix) :]
        if name.startswith(skip):
            continue
        (rest if name.startswith(own) else block)[name] = read_tensor(info)
    if hasattr(model, "sanitize"):
        block = model.sanitize({f"model.layers.0.{k}": v for k, v in block.items()})
        block = {k.removeprefix("model.layers.0."): v for k, v in block.items()}
    cls = type(model.model.layers[-1])
    args = model.args
    mtp = MTP(cls(args, layer), int(config["hidden_size"]), float(config.get("rms_norm_eps", 1e-6)))
    weights = {**{f"block.{k}": v for k, v in block.items()}, **rest}
    q = config.get("quantization")
    if q:
        nn.quantize(
            mtp,
            group_size=q["group_size"],
            bits=q["bits"],
            class_predicate=lambda p, m: hasattr(m, "to_quantized") and f"{p}.scales" in weights,
        )
    params = dict(tree_flatten(mtp.parameters()))
    missing, extra = sorted(set(params) - set(weights)), sorted(set(weights) - set(params))
    if missing or extra:
        raise UserError(
            f"speculative: mtp: {path}'s MTP layer does not match {cls.__name__}: "
            f"missing {missing[:4]}, unexpected {extra[:4]}"
        )
    mtp.load_weights(list(weights.items()), strict=True)
    mtp.eval()
    mx.eval(mtp.parameters())
    return Drafter(model, mtp)


def carry_cache(model: nn.Module) -> None:
    """Every cache made for `model` (mlx-lm's make_prompt_cache) gets the MTP layer's KV cache as
    its last entry; the model's layers zip with theirs and leave it alone."""
    from mlx_lm.models.cache import KVCache

    if getattr(model, "_carries_mtp_cache", False):  # a model loaded once, run again
        return
    own = getattr(model, "make_cache", None)
    n = len(model.layers)
    model.make_cache = lambda: (own() if own else [KVCache() for _ in range(n)]) + [KVCache()]
    model._carries_mtp_cache = True


class _Layers(nn.Module):
    """The MTP block as the one layer of a model, for the structure rule (moe/structure.py)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.layers = [block]


# `auto` keeps the MTP layer's routed experts whole on every node where they add little to what
# the node holds: at most a quarter of its own routed experts' bytes (DeepSeek-V3's MTP layer
# beside a node's share of its 58 MoE layers: N / 58, whole up to N = 14), or a bank this small
# outright, below any machine's margin (the demo's: 2 MB)
WHOLE_SHARE = 0.25
SMALL_BANK = 64 << 20  # bytes


def holding(asked: str, bank_bytes: int, node_bytes: int) -> str:
    """Where the MTP layer's routed experts live at N > 1, "whole" or "sharded", for
    `serving.mtp_experts` `asked` (proto/records.py MTP_EXPERTS): `bank_bytes` the layer's whole
    routed bank, `node_bytes` this node's routed experts of the model's layers.

    Whole, each node drafts alone: the MTP layer's feed and each chained draft cost no all-reduce
    (with 2 drafts, two a step: on the demo's 4 MoE layers a step pays 4, not 6), for (1 - 1/N)
    of one layer's bank more on every node. Sharded, no node holds more than its share."""
    if asked != "auto":
        return asked
    return "whole" if bank_bytes <= max(WHOLE_SHARE * node_bytes, SMALL_BANK) else "sharded"


def shard_experts(drafter: Drafter, sharded, layer: int, asked: str = "auto") -> tuple[str, str]:
    """Give the MTP block's routed experts the holding `asked` (`holding`): kept whole, the block
    drafts on each node alone; sharded, it gets the cluster's treatment of any MoE layer: this
    node keeps its even share, the block becomes a `ClusterMoE` whose output is all-reduced once
    per call (one more all-reduce per draft, every rank alike). One node, or a quantized bank,
    keeps every expert. -> ("whole" or "sharded", what was done, for the log)."""
    import dataclasses

    from mlx.utils import tree_flatten, tree_unflatten

    from ..proto.placement import Placement
    from .moe.experts import ExpertShard, ShardLinear
    from .moe.layer import ClusterMoE, install, owns_dense_terms
    from .moe.structure import find_moe_blocks, get_bank

    c = sharded.collective
    if c.world_size == 1 or not sharded.layers:
        return "whole", "every expert on this node"
    holder = _Layers(drafter.mtp.block)
    loaded = tree_flatten(holder.parameters())
    (b,) = find_moe_blocks(holder)
    holder.update(tree_unflatten(loaded))  # the structure probe drew its own weights
    bank = get_bank(b.block, b.bank.attr)
    projs = {p: getattr(bank, p) for p in b.projections}
    size = sum(v.nbytes for m in projs.values() for _, v in tree_flatten(m.parameters()))
    mine = sharded.info.expert_bytes
    chosen = holding(asked, size, mine)
    if chosen == "whole":
        return "whole", (
            f"every expert on this node ({size / 2**20:.1f} MiB beside this node's "
            f"{mine / 2**20:.1f} MiB of experts, mtp_experts: {asked}): no all-reduce"
        )
    if any("scales" in m for m in projs.values()):
        return "whole", "every expert on this node (a quantized MTP bank is not sharded)"
    b = dataclasses.replace(b, layer=layer)
    placement = Placement.even({layer: b.num_experts}, c.world_size)
    local = list(placement.layers[layer][c.rank])
    idx = mx.array(local)
    shard = ExpertShard(
        layer,
        local,
        placement.holders(layer, b.num_experts),
        {
            p: ShardLinear(m.weight[idx], bias=m["bias"][idx] if "bias" in m else None)
            for p, m in projs.items()
        },
        b.kind,
        b.activation,
        sharded.state,
    )
    mx.eval(shard.parameters())
    cluster = ClusterMoE(
        b, shard, sharded.layers[0].combine, owns_dense_terms(layer, c.rank, c.world_size)
    )
    install(drafter.mtp.block, b.path.removeprefix("layers.0."), cluster)
    return "sharded", (
        f"{len(local)} of its {b.num_experts} experts on this node, all-reduced "
        f"(mtp_experts: {asked})"
    )
