"""Describe an mlx-lm MoE checkpoint for the performance model, from its config.json alone.

The model's description (`node.describe`: the one the nodes load by) gives its MoE blocks, found
with the node's own rule (`node.moe.structure`: a `SwitchGLU`/`SwitchMLP`, any other parent of
`SwitchLinear`s, or a list of expert modules as in DBRX, with top-k and the block's dense terms),
the weights' dtype and the quantization. A fresh model of the config (parameters stay lazy:
nothing is materialised, nothing is evaluated) is quantized as mlx-lm's loader would, and
`.nbytes` is summed per module. Everything else is replicated; dense terms (shared experts and
their gates, whatever their names) are replicated but computed by one owner per layer. Per decoded token
the embedding table is read one row, a separate head in full (a tied head reads the whole table).
The KV cache per token comes from a lazy forward pass with the MoE blocks stubbed out, reading
the shapes of the caches mlx-lm makes.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ...node.checkpoint import Checkpoint, check_runnable, index_bytes, read_config
from ...node.describe import ModelDescription, MoELayer, describe, quantize_lazily
from .perfmodel import CacheSpec, ModelSpec, PlanError

logger = logging.getLogger(__name__)

_PROBE_TOKENS = (256, 512)  # multiples of KVCache.step, so cache buffers are exactly this long


class NotMoEError(PlanError):
    """The config describes a model without routed experts."""


@dataclass
class _Tally:
    replicated: int = 0
    embedding: dict[str, int] = field(default_factory=dict)  # embedding module -> its parameters
    expert: dict[int, int] = field(default_factory=dict)  # layer -> all experts of the bank
    shared: dict[int, int] = field(default_factory=dict)  # layer -> shared experts


def _embeddings(model: nn.Module) -> dict[str, int]:
    """Embedding module paths -> rows (vocabulary)."""
    return {
        p: m.weight.shape[0]
        for p, m in model.named_modules()
        if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding))
    }


def _has_head(model: nn.Module, vocab: set[int]) -> bool:
    return any(
        isinstance(m, (nn.Linear, nn.QuantizedLinear)) and m.weight.shape[0] in vocab
        for _, m in model.named_modules()
    )


def _tally(
    model: nn.Module, banks: tuple[MoELayer, ...], embeddings: dict[str, int], measure
) -> _Tally:
    t = _Tally()
    for path, arr in tree_flatten(model.parameters()):
        value = measure(arr)
        bank = next((b for b in banks if path.startswith(b.bank_path + ".")), None)
        if bank is not None:
            t.expert[bank.layer] = t.expert.get(bank.layer, 0) + value
            continue
        block = next((b for b in banks if any(path.startswith(d + ".") for d in b.dense)), None)
        if block is not None:
            t.shared[block.layer] = t.shared.get(block.layer, 0) + value
            continue
        owner = path.rsplit(".", 1)[0]
        if owner in embeddings:
            t.embedding[owner] = t.embedding.get(owner, 0) + value
            continue
        t.replicated += value
    return t


def _logical_elements(arr: mx.array) -> int:
    return arr.size


def _probe_caches(desc: ModelDescription, dtype: mx.Dtype) -> tuple[CacheSpec, ...]:
    """Cache bytes per token from a lazy forward pass (graph only: shapes, never evaluated).

    The MoE blocks are replaced by zeros first: some families evaluate the routing on the host
    (DBRX calls `.tolist()`), which would materialise weights.
    """
    from mlx_lm.models.cache import make_prompt_cache

    from ...node.moe.layer import install
    from ...node.moe.structure import Zero

    sizes = []
    for tokens in _PROBE_TOKENS:
        model, _ = desc.new_model()
        model.set_dtype(dtype)
        for b in desc.moe:
            install(model, b.path, Zero())
        cache = make_prompt_cache(model)
        model(mx.zeros((1, tokens), dtype=mx.int32), cache=cache)
        sizes.append([(c.nbytes, getattr(c, "max_size", None)) for c in cache])
    (t1, t2), out = _PROBE_TOKENS, []
    for (b1, cap), (b2, _) in zip(*sizes):
        per_token = (b2 - b1) // (t2 - t1)
        out.append(
            CacheSpec(
                per_token_bytes=per_token,
                fixed_bytes=b1 - per_token * t1,
                max_tokens=cap if isinstance(cap, int) else None,
            )
        )
    return tuple(out)


def describe_config(
    desc: ModelDescription, name: str, *, bits: int | None = None, group_size: int = 64
) -> ModelSpec:
    """A `ModelSpec` from a model's description (node.describe: its config and, when present, the
    checkpoint's headers for the dtype and a cross-check of the total size)."""
    config, where, checkpoint, dtype = desc.config, desc.where, desc.checkpoint, desc.dtype
    model, _ = desc.new_model()  # the blocks were probed in float32 by `describe`
    banks = desc.moe
    model.set_dtype(dtype)
    if not banks:
        raise NotMoEError(
            f"{where}: model_type={config.get('model_type')!r} has no routed experts "
            "(no SwitchGLU/SwitchMLP or expert list); `plan` is for MoE models"
        )
    counts = {b.num_experts for b in banks}
    if len(counts) != 1:
        raise PlanError(f"{where}: expert banks differ in size ({sorted(counts)}); not supported")
    num_experts = counts.pop()
    if len({b.layer for b in banks}) != len(banks):
        raise PlanError(
            f"{where}: more than one expert bank in a decoder layer "
            f"({[b.bank_path for b in banks]})"
        )
    top_ks = {b.top_k for b in banks}
    if len(top_ks) != 1:
        raise PlanError(
            f"{where}: MoE blocks route different numbers of experts per token ({sorted(top_ks)})"
        )
    top_k = top_ks.pop()
    embeddings = _embeddings(model)
    if not embeddings:
        raise PlanError(f"{where}: no token embedding found")
    modules = dict(model.named_modules())
    hidden = modules[next(iter(embeddings))].weight.shape[1]
    elements = _tally(model, banks, embeddings, _logical_elements)
    head = _has_head(model, set(embeddings.values()))

    weights = (
        quantize_lazily(model, desc.quant, banks, bits, group_size)
        or {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bf16"}[dtype]
    )
    nbytes = _tally(model, banks, embeddings, lambda a: a.nbytes)

    moe_ids = tuple(sorted(nbytes.expert))
    emb_bytes = sum(nbytes.embedding.values())
    # One row of each table per token; a tied head reads (and multiplies by) the whole table.
    emb_read = sum(b // embeddings[p] for p, b in nbytes.embedding.items()) if head else emb_bytes
    emb_flops = 0.0 if head else 2.0 * sum(elements.embedding.values())
    layers = desc.layers
    try:
        caches = _probe_caches(desc, dtype)
    except Exception as exc:  # noqa: BLE001 - a family the probe cannot run: plan without the KV cache
        logger.warning(
            "%s: could not size the KV cache (%s: %s); --context is not counted",
            where,
            type(exc).__name__,
            exc,
        )
        caches = ()
    spec = ModelSpec(
        name=name,
        num_experts=num_experts,
        top_k=top_k,
        layers=layers,
        moe_layer_ids=moe_ids,
        hidden=hidden,
        act_bytes=mx.zeros((), dtype=dtype).itemsize,
        replicated_bytes=nbytes.replicated + emb_bytes + sum(nbytes.shared.values()),
        replicated_read_bytes=nbytes.replicated + emb_read,
        replicated_flops=2.0 * elements.replicated + emb_flops,
        expert_layer_bytes=tuple(nbytes.expert[l] // num_experts for l in moe_ids),
        expert_layer_flops=tuple(2.0 * elements.expert[l] / num_experts for l in moe_ids),
        shared_layer_bytes=tuple(nbytes.shared.get(l, 0) for l in moe_ids) if nbytes.shared else (),
        shared_layer_flops=tuple(2.0 * elements.shared.get(l, 0) for l in moe_ids)
        if nbytes.shared
        else (),
        caches=caches,
        weights=weights,
        source=where,
    )
    if checkpoint is not None:
        on_disk = checkpoint.total_bytes()
        if abs(on_disk - spec.total_bytes) > 0.01 * on_disk:
            logger.warning(
                "%s: described %d bytes, the checkpoint holds %d (a layout mlx-lm converts at load?)",
                where,
                spec.total_bytes,
                on_disk,
            )
    return spec


def describe_path(
    spec: str, *, bits: int | None = None, group_size: int = 64, name: str | None = None
) -> tuple[ModelSpec, int | None]:
    """Describe a checkpoint folder or a bare config.json; returns (model, checkpoint bytes or None:
    a folder without weights, such as a repo's config fetched alone, has them from its index)."""
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".json":
        directory, cfg_file = path.parent, path
    else:
        directory, cfg_file = path, path / "config.json"
    checkpoint = (
        Checkpoint(directory)
        if cfg_file.name == "config.json" and any(directory.glob("model*.safetensors"))
        else None
    )
    if checkpoint is not None:
        config = checkpoint.config
    else:
        config = read_config(directory) if cfg_file.name == "config.json" else _read_json(cfg_file)
    check_runnable(config, cfg_file)  # describing runs each MoE block once (node.moe.structure)
    desc = describe(checkpoint or config, cfg_file)
    name = name or re.sub(r"\s+", "-", directory.name or str(directory))
    model = describe_config(desc, name, bits=bits, group_size=group_size)
    if checkpoint is not None:
        return model, checkpoint.total_bytes()
    indexed = index_bytes(directory) if cfg_file.name == "config.json" else None
    if indexed and abs(indexed - model.total_bytes) > 0.01 * indexed:
        logger.warning(
            "%s: described %d bytes, its index states %d (a dtype the config does not name?)",
            cfg_file,
            model.total_bytes,
            indexed,
        )
    return model, indexed


def _read_json(file: Path) -> dict:
    import json

    from ...node.checkpoint import CheckpointError

    try:
        config = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file} is not a readable JSON config: {exc}") from exc
    if not isinstance(config, dict) or "model_type" not in config:
        raise CheckpointError(f"{file} is malformed: expected a JSON object with model_type")
    return config
