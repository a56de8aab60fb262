"""Build a node's shard of a MoE checkpoint and patch the model for expert parallelism.

The model is built by mlx-lm (its config, `sanitize` and quantization) with every non-expert weight;
each expert bank is replaced by an `ExpertShard` holding only this node's experts, read by byte
range from the safetensors files. Every MoE block then all-reduces its output once, and the shared
expert of a layer counts on one node only (owner = layer index mod N).
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from . import families as adapters
from ..checkpoint import Checkpoint, CheckpointError, TensorInfo, model_args, model_classes, read_tensor
from ..collective.base import Collective, LocalCollective
from .experts import ExpertShard, ShardLinear, ShardState
from ...proto.placement import Placement

logger = logging.getLogger(__name__)

GLU_PROJ = ("gate_proj", "up_proj", "down_proj")
MLP_PROJ = ("fc1", "fc2")
# Names Hugging Face checkpoints use for the projections of one expert.
PROJ_ALIASES = {"w1": "gate_proj", "v1": "up_proj", "w3": "up_proj", "w2": "down_proj"}
PARAMS = ("weight", "scales", "biases", "bias")


class ShardError(CheckpointError):
    """A checkpoint or placement that cannot be sharded, with the reason."""


@dataclass
class MoEBlock:
    """One MoE block of the model: where it is, its expert bank and what kind of experts."""

    layer: int  # decoder layer index
    path: str  # e.g. "model.layers.3.mlp"
    block: nn.Module
    bank_attr: str  # attribute of the block holding the bank, e.g. "switch_mlp"
    bank: object
    kind: str  # "glu" (gate/up/down) or "mlp" (fc1/fc2)
    activation: Callable
    num_experts: int

    @property
    def bank_path(self) -> str:
        return f"{self.path}.{self.bank_attr}"

    @property
    def projections(self) -> tuple[str, ...]:
        return GLU_PROJ if self.kind == "glu" else MLP_PROJ


def find_moe_blocks(model: nn.Module) -> list[MoEBlock]:
    """Every MoE block: a module owning an expert bank (`SwitchGLU`/`SwitchMLP`, or an adapter's)."""
    from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

    layer_of = {id(layer): i for i, layer in enumerate(model.layers)}
    layer_paths = {}
    for path, m in model.named_modules():
        if id(m) in layer_of:
            layer_paths[path] = layer_of[id(m)]
    blocks = []
    for path, m in model.named_modules():
        found = adapters.find_bank(model, path, m)
        if found is None:
            for attr, child in m.children().items():
                if isinstance(child, SwitchGLU):
                    found = (attr, child, "glu", child.activation, child.gate_proj.num_experts)
                elif isinstance(child, SwitchMLP):
                    found = (attr, child, "mlp", child.activation, child.fc1.num_experts)
                if found:
                    break
        if found is None:
            continue
        layer = max((i for p, i in layer_paths.items() if path == p or path.startswith(p + ".")), default=None)
        if layer is None:
            raise ShardError(f"MoE block {path} is not inside any of the model's layers")
        attr, bank, kind, activation, n = found
        blocks.append(MoEBlock(layer, path, m, attr, bank, kind, activation, n))
    return blocks


@dataclass(frozen=True)
class ShardInfo:
    """What a node holds after loading, measured."""

    rank: int
    experts_per_layer: dict[int, int]
    resident_weight_bytes: int  # sum of the arrays the model now holds
    active_memory_bytes: int  # MLX allocator's live bytes after the load (measured)
    replicated_bytes: int
    expert_bytes: int
    load_seconds: float
    peak_memory_bytes: int  # MLX allocator peak during the load


@dataclass
class ShardedModel:
    model: nn.Module
    config: dict
    blocks: list[MoEBlock]
    placement: Placement
    state: ShardState
    info: ShardInfo
    collective: Collective = field(default_factory=LocalCollective)

    def moe_layers(self) -> dict[int, int]:
        return {b.layer: b.num_experts for b in self.blocks}


def moe_layers_of(ckpt: Checkpoint) -> dict[int, int]:
    """{decoder layer: number of routed experts} of a checkpoint, without loading weights."""
    model_cls, _ = model_classes(ckpt.config, ckpt.path / "config.json")
    model = model_cls(model_args(ckpt.config, ckpt.path / "config.json"))
    blocks = find_moe_blocks(model)
    if not blocks:
        raise ShardError(f"{ckpt.path} has no MoE layers (model_type {ckpt.config.get('model_type')!r}); "
                         "there are no experts to spread")
    return {b.layer: b.num_experts for b in blocks}


# ---------------------------------------------------------------------------------------------
# Expert tensors in the checkpoint


def _expert_keys(ckpt: Checkpoint, blocks: Sequence[MoEBlock]) -> dict[str, MoEBlock]:
    """Checkpoint keys that hold routed-expert weights, mapped to their block."""
    out = {}
    for b in blocks:
        prefixes = (b.bank_path + ".", b.path + ".experts.")
        for key in ckpt.tensors:
            if key.startswith(prefixes):
                out[key] = b
    return out


def _local_expert_bytes(ckpt: Checkpoint, blocks: Sequence[MoEBlock], placement: Placement, rank: int) -> int:
    """Bytes this rank reads for its experts (from the headers: stacked rows or per-expert tensors)."""
    total = 0
    for b in blocks:
        local = placement.layers[b.layer][rank]
        for key, info in ckpt.tensors.items():
            if key.startswith(b.bank_path + ".") or key.startswith(b.path + ".experts."):
                rest = key[len(b.path) + len(".experts."):] if key.startswith(b.path + ".experts.") else ""
                head = rest.split(".", 1)[0]
                if head.isdigit():  # one tensor per expert
                    total += info.nbytes if int(head) in local else 0
                elif info.shape:  # stacked or fused: rows of the local experts
                    total += info.nbytes * len(local) // b.num_experts
    return total


def _read_local(ckpt: Checkpoint, b: MoEBlock, local: Sequence[int]) -> dict[str, dict[str, mx.array]]:
    """{projection: {param: (E_local, ...)}} for the local experts of block `b`, by byte range."""
    special = adapters.read_experts(ckpt, b, local)
    if special is not None:
        return special
    t = ckpt.tensors
    out: dict[str, dict[str, mx.array]] = {}
    per_expert = re.compile(re.escape(b.path) + r"\.experts\.(\d+)\.(\w+)\.(weight|scales|biases|bias)$")
    by_expert: dict[tuple[str, str], dict[int, TensorInfo]] = {}
    for key, info in t.items():
        m = per_expert.match(key)
        if m:
            proj = PROJ_ALIASES.get(m[2], m[2])
            by_expert.setdefault((proj, m[3]), {})[int(m[1])] = info
    for proj in b.projections:
        for param in PARAMS:
            stacked = t.get(f"{b.bank_path}.{proj}.{param}")
            if stacked is not None:
                if stacked.shape[0] != b.num_experts:
                    raise ShardError(f"{stacked.key}: leading dimension {stacked.shape[0]} is not the expert "
                                     f"count {b.num_experts}")
                out.setdefault(proj, {})[param] = read_tensor(stacked, local) if local else None
                continue
            parts = by_expert.get((proj, param))
            if parts is None:
                continue
            missing = [e for e in local if e not in parts]
            if missing:
                raise ShardError(f"layer {b.layer}: no tensor for experts {missing} of {proj}.{param} "
                                 f"under {b.path}.experts.*")
            stacked = mx.stack([read_tensor(parts[e]) for e in local]) if local else None
            if stacked is not None:
                mx.eval(stacked)  # frees the per-expert reads now, not at the end of the layer
            out.setdefault(proj, {})[param] = stacked
        if "weight" not in out.get(proj, {}):
            raise ShardError(f"layer {b.layer}: cannot find the expert weights of {proj} in {ckpt.path} "
                             f"(looked for {b.bank_path}.{proj}.weight and {b.path}.experts.<e>.{proj}.weight)")
    return out


# ---------------------------------------------------------------------------------------------
# Quantization, as mlx-lm's load_model does it


def _quant_config(config: dict) -> dict | None:
    q = config.get("quantization")
    if q is not None:
        return q
    qc = config.get("quantization_config")
    if isinstance(qc, dict):
        method = qc.get("quant_method")
        if method == "mxfp4":
            return {"group_size": 32, "bits": 4, "mode": "mxfp4"}
        if method is not None:
            raise ShardError(f"quantization method {method!r} is not supported for sharded loading "
                             "(convert the checkpoint with mlx_lm.convert first)")
    return None


def _quantize_replicated(model: nn.Module, config: dict, weights: dict, shard_prefixes: tuple[str, ...]) -> None:
    q = _quant_config(config)
    if q is None:
        return
    from mlx_lm.utils import infer_quant_config

    def predicate(path, m):
        if path.startswith(shard_prefixes):
            return False
        if path in q:
            return q[path]
        if not hasattr(m, "to_quantized") or f"{path}.scales" not in weights:
            return False
        return infer_quant_config(path, m, weights)

    nn.quantize(model, group_size=q["group_size"], bits=q["bits"], mode=q.get("mode", "affine"),
                class_predicate=predicate)


def _shard_quant(config: dict, b: MoEBlock, proj: str, params: dict) -> dict | None:
    """Quantization parameters of one bank projection: per-layer override, else inferred."""
    if "scales" not in params:
        return None
    q = _quant_config(config) or {}
    for path in (f"{b.bank_path}.{proj}", f"{b.path}.experts.{proj}"):
        if isinstance(q.get(path), dict):
            return {"mode": "affine", **q[path]}
    w, s = params["weight"], params["scales"]
    mode = q.get("mode", "affine")
    group = q.get("group_size", 64)
    in_dims = s.shape[-1] * group
    bits = w.shape[-1] * 32 // in_dims
    if bits not in (2, 3, 4, 5, 6, 8):
        raise ShardError(f"layer {b.layer} {proj}: cannot infer quantization bits from shapes "
                         f"weight {w.shape}, scales {s.shape}")
    return {"group_size": group, "bits": bits, "mode": mode}


# ---------------------------------------------------------------------------------------------
# Patching: shared experts once per cluster, one all-reduce per MoE block


class _Zero(nn.Module):
    """Stands in for a shared expert on nodes that do not own it this layer."""

    def __call__(self, x, *args, **kwargs):
        return mx.zeros_like(x)


_REDUCING: dict[type, type] = {}


def _reducing_class(cls: type) -> type:
    """A subclass of a MoE block class whose output is all-reduced across the cluster."""
    if cls not in _REDUCING:

        def __call__(self, x, *args, **kwargs):
            y = cls.__call__(self, x, *args, **kwargs)
            state: ShardState = self._moe_state
            t0 = time.perf_counter()
            mx.eval(y)
            t1 = time.perf_counter()
            y = self._moe_collective.all_reduce(y, self._moe_layer)
            t2 = time.perf_counter()
            state.timers.experts += t1 - t0
            state.timers.collective += t2 - t1
            state.record_allreduce(t2 - t1)
            return y

        _REDUCING[cls] = type(f"AllReduced{cls.__name__}", (cls,), {"__call__": __call__})
    return _REDUCING[cls]


def shared_experts_elsewhere(b: MoEBlock, state: ShardState) -> list[str]:
    """Names of the block's shared experts when another node owns them this layer.

    A shared expert runs on every token, so it counts once in the cluster: on the node whose rank
    is the layer index mod N (the owner rotates so the extra work spreads evenly).
    """
    if state.world_size == 1 or b.layer % state.world_size == state.rank:
        return []
    return [name for name in b.block.children() if "shared_expert" in name and not name.endswith("_gate")]


def patch_block(b: MoEBlock, shard: ExpertShard, collective: Collective, state: ShardState) -> None:
    setattr(b.block, b.bank_attr, shard)
    adapters.patch_forward(b)
    for name in shared_experts_elsewhere(b, state):
        setattr(b.block, name, _Zero())
    b.block._moe_layer = b.layer
    b.block._moe_collective = collective
    b.block._moe_state = state
    b.block.__class__ = _reducing_class(type(b.block))


def set_collective(sm: ShardedModel, collective: Collective) -> None:
    sm.collective = collective
    for b in sm.blocks:
        b.block._moe_collective = collective


# ---------------------------------------------------------------------------------------------


def load_shard(
    model_spec: str,
    placement: Placement | None,
    rank: int,
    *,
    keepalive: str = "lru",
    collective: Collective | None = None,
    warm_up: bool = True,
    progress: Callable[[int, int, str], None] | None = None,
) -> ShardedModel:
    """Load this rank's shard. `placement=None` means an even split over `collective.world_size`.

    Args:
        progress: called as progress(bytes_loaded, bytes_total, phase) while reading.
    """
    collective = collective or LocalCollective()
    t_start = time.perf_counter()
    mx.reset_peak_memory()
    ckpt = Checkpoint.open(model_spec)
    config = ckpt.config
    where = ckpt.path / "config.json"
    model_cls, _ = model_classes(config, where)
    model = model_cls(model_args(config, where))  # parameters are lazy: nothing is allocated yet
    blocks = find_moe_blocks(model)
    if not blocks:
        raise ShardError(f"{ckpt.path} has no MoE layers (model_type {config.get('model_type')!r}); "
                         "there are no experts to spread")
    moe_layers = {b.layer: b.num_experts for b in blocks}
    world = collective.world_size
    placement = placement or Placement.even(moe_layers, world)
    if placement.world_size != world:
        raise ShardError(f"placement is for {placement.world_size} nodes but the cluster has {world}")
    placement.check(moe_layers)
    if not 0 <= rank < world:
        raise ShardError(f"rank {rank} is out of range 0..{world - 1}")
    state = ShardState(rank, world, keepalive)

    # 1. Replicated weights, through the family's own sanitize. Expert tensors (and shared experts
    #    another node owns) enter it as lazy placeholders, never evaluated, never read from disk,
    #    so sanitize sees the checkpoint it expects.
    bank_prefixes = tuple(b.bank_path + "." for b in blocks)
    skipped = bank_prefixes + tuple(f"{b.path}.{n}." for b in blocks for n in shared_experts_elsewhere(b, state))
    expert_keys = _expert_keys(ckpt, blocks)
    to_read = {k for k in ckpt.tensors if k not in expert_keys and not k.startswith(skipped)}
    total = sum(ckpt.tensors[k].nbytes for k in to_read) + _local_expert_bytes(ckpt, blocks, placement, rank)
    report = progress or (lambda done, total, phase: None)
    done = 0
    weights = {}
    for key, info in ckpt.tensors.items():
        if key in to_read:
            weights[key] = read_tensor(info)
            done += info.nbytes
            report(done, total, "replicated")
        else:
            weights[key] = mx.zeros(info.shape, info.mx_dtype)
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    weights = {k: v for k, v in weights.items() if not k.startswith(skipped)}
    replicated_bytes = sum(v.nbytes for v in weights.values())

    # 2. Expert shards, by byte range.
    expert_bytes = 0
    for b in blocks:
        local = placement.layers[b.layer][rank]
        params = _read_local(ckpt, b, local)
        projections = {}
        for proj in b.projections:
            p = {k: v for k, v in params[proj].items() if v is not None}
            if not local:
                projections[proj] = ShardLinear(mx.zeros((0, 1, 1)))
                continue
            quant = _shard_quant(config, b, proj, p)
            projections[proj] = ShardLinear(p["weight"], scales=p.get("scales"), biases=p.get("biases"),
                                            bias=p.get("bias"), quant=quant)
            expert_bytes += sum(v.nbytes for v in p.values())
        report(min(done + expert_bytes, total), total, "experts")
        shard = ExpertShard(b.layer, local, placement.holders(b.layer, b.num_experts), projections, b.kind,
                            b.activation, state)
        mx.eval(shard.parameters())
        patch_block(b, shard, collective, state)

    # 3. Quantize and load the replicated part, then check that nothing is missing or left over.
    _quantize_replicated(model, config, weights, bank_prefixes)
    model.eval()
    params = dict(tree_flatten(model.parameters()))
    shard_params = {k: v for k, v in params.items() if k.startswith(bank_prefixes)}
    missing = sorted(set(params) - set(shard_params) - set(weights))
    extra = sorted(set(weights) - set(params))
    if missing or extra:
        raise ShardError(f"{ckpt.path}: weights do not match the model: missing {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''}, unexpected {extra[:5]}{' ...' if len(extra) > 5 else ''}")
    model.load_weights(list(weights.items()) + list(shard_params.items()), strict=True)
    del weights
    mx.eval(model.parameters())

    resident = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    if warm_up and _on_metal():
        # Metal's driver pages out buffers that sit idle; touch every local expert once, then wire
        # the resident set (paper §3.2, Algorithm 2's warm-up)
        report(total, total, "warmup")
        for b in blocks:
            getattr(b.block, b.bank_attr).warm_up()
    elif warm_up:
        logger.info("expert warm-up: not on Metal, nothing to do")
    _wire(resident)
    info = ShardInfo(
        rank=rank,
        experts_per_layer=placement.experts_per_layer(rank),
        resident_weight_bytes=resident,
        active_memory_bytes=int(mx.get_active_memory()),
        replicated_bytes=replicated_bytes,
        expert_bytes=expert_bytes,
        load_seconds=time.perf_counter() - t_start,
        peak_memory_bytes=int(mx.get_peak_memory()),
    )
    logger.info("rank %d loaded %d MoE layers, %.1f MB resident (%.1f MB experts) in %.1fs", rank, len(blocks),
                resident / 1e6, expert_bytes / 1e6, info.load_seconds)
    return ShardedModel(model, config, blocks, placement, state, info, collective)


def load_unsharded(model_spec: str) -> ShardedModel:
    """One node alone: stock mlx-lm's model, nothing patched (the single-node fallback runs at
    mlx-lm's own speed, with the same serving stack)."""
    from mlx_lm.utils import load_model

    t0 = time.perf_counter()
    mx.reset_peak_memory()
    ckpt = Checkpoint.open(model_spec)
    model_args(ckpt.config, ckpt.path / "config.json")
    model, config = load_model(ckpt.path)
    blocks = find_moe_blocks(model)
    moe_layers = {b.layer: b.num_experts for b in blocks}
    resident = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    _wire(resident)
    experts = sum(v.nbytes for b in blocks for _, v in tree_flatten(getattr(b.block, b.bank_attr).parameters())
                  if hasattr(getattr(b.block, b.bank_attr), "parameters"))
    info = ShardInfo(rank=0, experts_per_layer=dict(moe_layers), resident_weight_bytes=resident,
                     active_memory_bytes=int(mx.get_active_memory()), replicated_bytes=resident - experts,
                     expert_bytes=experts, load_seconds=time.perf_counter() - t0,
                     peak_memory_bytes=int(mx.get_peak_memory()))
    return ShardedModel(model, config, blocks, Placement.even(moe_layers, 1), ShardState(0, 1, "none"), info,
                        LocalCollective())


def _on_metal() -> bool:
    metal = getattr(mx, "metal", None)
    return metal is not None and metal.is_available()


def _wire(resident_bytes: int) -> None:
    """On Metal, wire the resident set so the driver does not page idle experts out (paper §3.2)."""
    if not _on_metal() or not hasattr(mx, "set_wired_limit"):
        logger.info("wired memory limit: not on Metal, nothing to do (%d bytes resident)", resident_bytes)
        return
    limit = mx.metal.device_info().get("max_recommended_working_set_size", 0)
    if limit and resident_bytes > limit:
        logger.warning("resident weights (%.1f GB) exceed the recommended working set (%.1f GB); "
                       "the GPU may page experts out", resident_bytes / 1e9, limit / 1e9)
    mx.set_wired_limit(min(resident_bytes, limit) if limit else resident_bytes)
