"""Describe an mlx-lm MoE checkpoint for the performance model, from its config.json alone.

The model is instantiated with mlx-lm from the config (parameters stay lazy: nothing is
materialised, nothing is evaluated), the config's quantization is applied as mlx-lm's loader
would, and `.nbytes` is summed per module. A routed-expert bank is a `SwitchGLU`/`SwitchMLP`
(weights `(E, out, in)`), any other parent of `SwitchLinear`s, or a list of expert modules
(`ffn.experts` in DBRX), found with the node's own rule (`node.moe.structure`), which also gives
top-k and the block's dense terms. Everything else is replicated; dense terms (shared experts and
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

from ...node.checkpoint import Checkpoint, check_runnable, model_args, model_classes, read_config
from .perfmodel import CacheSpec, ModelSpec, PlanError

logger = logging.getLogger(__name__)

_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
_ST_DTYPES = {"F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16}
_PROBE_TOKENS = (256, 512)  # multiples of KVCache.step, so cache buffers are exactly this long
_LEGACY_QUANT = {
    "mxfp4": {"group_size": 32, "bits": 4, "mode": "mxfp4"},
    "mxfp8": {"group_size": 32, "bits": 8, "mode": "mxfp8"},
}


class NotMoEError(PlanError):
    """The config describes a model without routed experts."""


@dataclass
class _Bank:
    path: str
    block: str  # the MoE block holding the bank (its parent)
    layer: int  # decoder layer index
    num_experts: int
    top_k: int
    dense: tuple[str, ...]  # paths of the block's dense terms (shared experts and their gates)


@dataclass
class _Tally:
    replicated: int = 0
    embedding: dict[str, int] = field(default_factory=dict)  # embedding module -> its parameters
    expert: dict[int, int] = field(default_factory=dict)  # layer -> all experts of the bank
    shared: dict[int, int] = field(default_factory=dict)  # layer -> shared experts


def _layer_index(path: str) -> int | None:
    for part in path.split("."):
        if part.isdigit():
            return int(part)
    return None


def _find_banks(model: nn.Module) -> list[_Bank]:
    """The routed-expert banks, found by the same rule the node shards them by."""
    from ...node.moe.structure import StructureError, find_moe_blocks

    try:
        blocks = find_moe_blocks(model)
    except StructureError as exc:
        raise PlanError(str(exc)) from None
    return [
        _Bank(b.bank_path, b.path, b.layer, b.num_experts, b.top_k, b.dense_paths()) for b in blocks
    ]


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


def _tally(model: nn.Module, banks: list[_Bank], embeddings: dict[str, int], measure) -> _Tally:
    t = _Tally()
    for path, arr in tree_flatten(model.parameters()):
        value = measure(arr)
        bank = next((b for b in banks if path.startswith(b.path + ".")), None)
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


def _dtype(config: dict, checkpoint: Checkpoint | None) -> mx.Dtype:
    if checkpoint is not None:
        sizes: dict[str, int] = {}
        for t in checkpoint.tensors.values():
            if t.dtype in _ST_DTYPES:
                sizes[t.dtype] = sizes.get(t.dtype, 0) + t.nbytes
        if sizes:
            return _ST_DTYPES[max(sizes, key=sizes.get)]
    name = config.get("torch_dtype") or config.get("dtype")
    if isinstance(name, str) and name in _DTYPES:
        return _DTYPES[name]
    logger.info("config names no dtype and no weights are present; assuming bfloat16")
    return mx.bfloat16


def _quantize(
    model: nn.Module, config: dict, banks: list[_Bank], bits: int | None, group_size: int
) -> str:
    """Apply the config's quantization (or `bits`) lazily, as mlx-lm's loader would; returns a label."""
    quant = config.get("quantization")
    legacy = (config.get("quantization_config") or {}).get("quant_method")
    if quant is not None and bits is not None:
        raise PlanError(
            f"the checkpoint is already quantized ({quant.get('bits')} bits); drop --bits"
        )
    family = getattr(model, "quant_predicate", None)
    if quant is not None:
        gs = quant["group_size"]

        def predicate(path, m):
            if path in quant:
                v = quant[path]
                return dict(v) if isinstance(v, dict) else bool(v)
            if not hasattr(m, "to_quantized") or m.weight.shape[-1] % gs:
                return False
            return family(path, m) if family else True

        nn.quantize(
            model,
            group_size=gs,
            bits=quant["bits"],
            mode=quant.get("mode", "affine"),
            class_predicate=predicate,
        )
        return f"{quant['bits']}-bit {quant.get('mode', 'affine')} g{gs}"
    if legacy in _LEGACY_QUANT:
        q = _LEGACY_QUANT[legacy]
        # mlx-lm quantizes what the checkpoint stores quantized: the released experts only.
        nn.quantize(
            model,
            class_predicate=lambda p, m: (
                any(p.startswith(b.path + ".") for b in banks) and hasattr(m, "to_quantized")
            ),
            **q,
        )
        return f"experts {legacy}"
    if legacy:
        logger.warning(
            "quantization_config quant_method=%r is not applied (mlx-lm dequantizes it at load)",
            legacy,
        )
    if bits is not None:

        def predicate(path, m):
            if not hasattr(m, "to_quantized") or m.weight.shape[-1] % group_size:
                return False
            return family(path, m) if family else True

        nn.quantize(model, group_size=group_size, bits=bits, class_predicate=predicate)
        return f"{bits}-bit affine g{group_size}"
    return ""


def _probe_caches(model_cls, args, banks: list[_Bank], dtype: mx.Dtype) -> tuple[CacheSpec, ...]:
    """Cache bytes per token from a lazy forward pass (graph only: shapes, never evaluated).

    The MoE blocks are replaced by zeros first: some families evaluate the routing on the host
    (DBRX calls `.tolist()`), which would materialise weights.
    """
    from mlx_lm.models.cache import make_prompt_cache

    from ...node.moe.layer import install
    from ...node.moe.structure import Zero

    sizes = []
    for tokens in _PROBE_TOKENS:
        model = model_cls(args)
        model.set_dtype(dtype)
        for b in banks:
            install(model, b.block, Zero())
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
    config: dict,
    name: str,
    *,
    checkpoint: Checkpoint | None = None,
    bits: int | None = None,
    group_size: int = 64,
    where: str = "config.json",
) -> ModelSpec:
    """A `ModelSpec` from an mlx-lm config (and, when present, the checkpoint's headers for the
    dtype and a cross-check of the total size)."""
    check_runnable(config, where)  # describing runs each MoE block once (node.moe.structure)
    model_cls, _ = model_classes(config, where)
    args = model_args(config, where)
    dtype = _dtype(config, checkpoint)
    model = model_cls(args)
    banks = _find_banks(model)  # probes the blocks in float32, before the dtype is set
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
            f"{where}: more than one expert bank in a decoder layer ({[b.path for b in banks]})"
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
        _quantize(model, config, banks, bits, group_size)
        or {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bf16"}[dtype]
    )
    nbytes = _tally(model, banks, embeddings, lambda a: a.nbytes)

    moe_ids = tuple(sorted(nbytes.expert))
    emb_bytes = sum(nbytes.embedding.values())
    # One row of each table per token; a tied head reads (and multiplies by) the whole table.
    emb_read = sum(b // embeddings[p] for p, b in nbytes.embedding.items()) if head else emb_bytes
    emb_flops = 0.0 if head else 2.0 * sum(elements.embedding.values())
    layers = (
        len(model.layers)
        if hasattr(model, "layers")
        else max((_layer_index(p) or 0) for p, _ in tree_flatten(model.parameters())) + 1
    )
    try:
        caches = _probe_caches(model_cls, args, banks, dtype)
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
    spec: str, *, bits: int | None = None, group_size: int = 64
) -> tuple[ModelSpec, int | None]:
    """Describe a checkpoint folder or a bare config.json; returns (model, checkpoint bytes or None)."""
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".json":
        directory, cfg_file = path.parent, path
    else:
        directory, cfg_file = path, path / "config.json"
    config = read_config(directory) if cfg_file.name == "config.json" else _read_json(cfg_file)
    checkpoint = Checkpoint(directory) if any(directory.glob("model*.safetensors")) else None
    name = re.sub(r"\s+", "-", directory.name or str(directory))
    model = describe_config(
        config, name, checkpoint=checkpoint, bits=bits, group_size=group_size, where=str(cfg_file)
    )
    return model, (checkpoint.total_bytes() if checkpoint else None)


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
