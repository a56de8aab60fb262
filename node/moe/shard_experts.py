"""A node's expert bank from the checkpoint: its experts' tensors read by byte range (or stacked as
stored), the replicated weights quantized as mlx-lm's load_model does, and the `ExpertShard` made
of them (with its expert cache where only part is resident)."""

from __future__ import annotations

import logging
import zlib
from typing import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..checkpoint import (
    Checkpoint,
    CheckpointError,
    TensorInfo,
    _physical_rows,
    read_tensor,
)
from ..describe import PARAMS, ModelDescription, MoELayer, Quantization, expert_quant
from . import families
from .expert_cache import (
    CacheStats,
    LayerCache,
    Part,
    Staging,
    choose_resident,
    read_parts,
    read_pool,
)
from .experts import ExpertShard, ShardLinear, ShardState
from .structure import MoEBlock

logger = logging.getLogger(__name__)


class ShardError(CheckpointError):
    """A checkpoint or placement that cannot be sharded, with the reason."""


# ---------------------------------------------------------------------------------------------
# Expert tensors in the checkpoint


def _expert_tensors(
    ckpt: Checkpoint, b: MoEBlock, m: MoELayer
) -> dict[str, dict[str, TensorInfo | dict[int, TensorInfo]]]:
    """{projection: {param: the stacked (E, ...) tensor, or {expert: its own tensor}}} of block `b`
    (the generic layouts, as the description names them; a family that stores its experts
    otherwise reads them itself)."""
    t = ckpt.tensors
    out: dict[str, dict] = {}
    for proj in b.projections:
        for param in PARAMS:
            name = m.tensors.get((proj, param))
            if name is None:
                continue
            if "{e}" not in name:
                stacked = t[name]
                if stacked.shape[0] != b.num_experts:
                    raise ShardError(
                        f"{stacked.key}: leading dimension {stacked.shape[0]} is not the expert "
                        f"count {b.num_experts}"
                    )
                out.setdefault(proj, {})[param] = stacked
                continue
            found = {e: t[name.format(e=e)] for e in range(b.num_experts) if name.format(e=e) in t}
            out.setdefault(proj, {})[param] = found
        if "weight" not in out.get(proj, {}):
            raise ShardError(
                f"layer {b.layer}: cannot find the expert weights of {proj} in {ckpt.path} "
                f"(looked for {b.bank_path}.{proj}.weight and {b.path}.experts.<e>.{proj}.weight)"
            )
    return out


def _read_local(
    ckpt: Checkpoint, b: MoEBlock, m: MoELayer, local: Sequence[int]
) -> dict[str, dict[str, mx.array]]:
    """{projection: {param: (E_local, ...)}} for the local experts of block `b`, by byte range."""
    special = families.read_experts(ckpt, b, local)
    if special is not None:
        return special
    out: dict[str, dict[str, mx.array]] = {}
    for proj, params in _expert_tensors(ckpt, b, m).items():
        for param, src in params.items():
            if isinstance(src, TensorInfo):
                out.setdefault(proj, {})[param] = read_tensor(src, local) if local else None
                continue
            missing = [e for e in local if e not in src]
            if missing:
                raise ShardError(
                    f"layer {b.layer}: no tensor for experts {missing} of {proj}.{param} "
                    f"under {b.path}.experts.*"
                )
            stacked = mx.stack([read_tensor(src[e]) for e in local]) if local else None
            if stacked is not None:
                mx.eval(stacked)  # frees the per-expert reads now, not at the end of the layer
            out.setdefault(proj, {})[param] = stacked
    return out


def _expert_parts(
    ckpt: Checkpoint, b: MoEBlock, m: MoELayer, shard: ExpertShard
) -> Callable[[int], list[Part]]:
    """local index -> the byte ranges of that expert, one per tensor of the shard's slots (in
    `_slot_tensors` order): what an expert cache reads on a miss."""
    if families.read_experts(ckpt, b, []) is not None:
        raise ShardError(
            f"layer {b.layer}: the expert cache reads experts by byte range, and this checkpoint "
            f"stores them fused ({ckpt.path}); convert it with mlx_lm.convert or set expert_cache: off"
        )
    tensors = _expert_tensors(ckpt, b, m)
    order = [tensors[proj][param] for proj, param in _slot_keys(shard)]
    ids = shard.global_ids

    def parts(i: int) -> list[Part]:
        e, out = ids[i], []
        for src in order:
            if isinstance(src, TensorInfo):
                (row,) = _physical_rows(src, [e])
                rb = src.row_bytes()
                out.append(Part(str(src.file), src.start + row * rb, rb))
            else:
                out.append(Part(str(src[e].file), src[e].start, src[e].nbytes))
        return out

    return parts


def _slot_keys(shard: ExpertShard) -> list[tuple[str, str]]:
    """(projection, param) of every tensor an expert slot spans, in a fixed order."""
    return [
        (proj, param)
        for proj in sorted(shard.children())
        if isinstance(shard[proj], ShardLinear)
        for param in PARAMS
        if param in shard[proj]
    ]


def _attach_cache(
    ckpt: Checkpoint,
    b: MoEBlock,
    m: MoELayer,
    shard: ExpertShard,
    resident: Sequence[int],
    pinned: Sequence[int],
    staging: Staging,
) -> LayerCache:
    """Give `shard` (whose projections hold the experts `resident`, by local index) its cache; take
    every local expert's checksum on the way (each is read once, then dropped)."""
    parts_of = _expert_parts(ckpt, b, m, shard)
    views = []
    for proj, param in _slot_keys(shard):
        arr = shard[proj][param]
        views.append(
            np.frombuffer(memoryview(arr).cast("B"), dtype=np.uint8).reshape(arr.shape[0], -1)
        )
    n_local = len(shard.global_ids)
    sizes = [p.nbytes for p in parts_of(0)]
    if sizes != [v.shape[1] for v in views]:
        raise ShardError(
            f"layer {b.layer}: an expert's bytes on disk {sizes} do not match its slots "
            f"{[v.shape[1] for v in views]}; the expert cache cannot read it by byte range"
        )
    cache = LayerCache(
        b.layer, n_local, views, parts_of, resident, pinned, CacheStats(), read_pool(), staging
    )
    cache.fingerprint(
        dict(
            enumerate(
                read_pool().map(lambda i: zlib.crc32(read_parts(parts_of(i))), range(n_local))
            )
        )
    )
    shard.attach_cache(cache, ahead=b.top_k)
    return cache


# ---------------------------------------------------------------------------------------------
# Quantization, as mlx-lm's load_model does it


def quantize_replicated(
    model: nn.Module, quant: Quantization | None, weights: dict, shard_prefixes: tuple[str, ...]
) -> None:
    if quant is None:
        return
    quant.require_applied()
    from mlx_lm.utils import infer_quant_config

    def predicate(path, m):
        if path.startswith(shard_prefixes) or not hasattr(m, "to_quantized"):
            return False  # a bank, or a dense term another node runs (a Zero)
        if path in quant.overrides:
            return quant.overrides[path]
        if f"{path}.scales" not in weights:
            return False
        return infer_quant_config(path, m, weights)

    nn.quantize(
        model,
        group_size=quant.group_size,
        bits=quant.bits,
        mode=quant.mode,
        class_predicate=predicate,
    )


def make_shard(
    desc: ModelDescription,
    b: MoEBlock,
    local: Sequence[int],
    holders,
    state: ShardState,
    capacity: int | None = None,
    heat: tuple[Sequence[float], int] | None = None,
) -> ExpertShard:
    """The ExpertShard of block `b` holding experts `local`, read by byte range and evaluated; with
    `capacity` below len(local), only that many resident (the hottest by `heat`, the profile's
    (selections per expert, tokens)), the rest read on a miss."""
    ckpt, m = desc.checkpoint, desc.layer(b.layer)
    cached = capacity is not None and capacity < len(local)
    if cached:
        local_heat = np.array([heat[0][e] for e in local], dtype=np.float64) if heat else None
        resident, pinned = choose_resident(capacity, local_heat, heat[1] if heat else 0)
        params = _read_local(ckpt, b, m, [local[i] for i in resident])
    else:
        params = _read_local(ckpt, b, m, local)
    projections = {}
    for proj in b.projections:
        p = {k: v for k, v in params[proj].items() if v is not None}
        if not local:
            projections[proj] = ShardLinear(mx.zeros((0, 1, 1)))
            continue
        projections[proj] = ShardLinear(
            p["weight"],
            scales=p.get("scales"),
            biases=p.get("biases"),
            bias=p.get("bias"),
            quant=expert_quant(desc.quant, m, proj, p),
        )
    shard = ExpertShard(b.layer, local, holders, projections, b.kind, b.activation, state)
    mx.eval(shard.parameters())
    if cached:
        _attach_cache(ckpt, b, m, shard, resident, pinned, state.staging)
    return shard
