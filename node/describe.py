"""One description of a model, read once: what the node, the shard cache, the shipper, the
planner and the load check know about a checkpoint (or a bare config.json).

`describe(checkpoint)` builds the config's model with mlx-lm (parameters stay lazy), finds its MoE
blocks by the structure rule (`node/moe/structure.py`, which runs each kind of block once on a
probe), and reads from the safetensors headers which tensors hold each block's routed experts and
how (stacked `(E, ...)` or one tensor per expert), their bytes, the weights' dtype and the config's
quantization. Nothing here reads a weight. Who needs a model to load weights into asks the
description for a fresh one (`new_model`): its blocks come rebound, not probed again.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

from .checkpoint import _DTYPES, Checkpoint, CheckpointError, model_args, model_classes
from .moe.structure import MoEBlock, StructureError, find_moe_blocks, rebind
from .vocab import embedding_rows

logger = logging.getLogger(__name__)

# Names Hugging Face checkpoints use for the projections of one expert.
PROJ_ALIASES = {"w1": "gate_proj", "v1": "up_proj", "w3": "up_proj", "w2": "down_proj"}
PARAMS = ("weight", "scales", "biases", "bias")
# quantization_config methods that mlx-lm turns into a quantization of its own (mlx_lm.utils
# load_model); the others it dequantizes in a family's sanitize, or handles with code of its own.
_METHODS = {
    "mxfp4": {"group_size": 32, "bits": 4, "mode": "mxfp4"},
    "mxfp8": {"group_size": 32, "bits": 8, "mode": "mxfp8"},
}
_FLOATS = {"F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16}
_CONFIG_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


class DescribeError(CheckpointError):
    """A model that cannot be described for sharding, with the reason."""


# ---------------------------------------------------------------------------------------------
# Quantization


@dataclass(frozen=True)
class Quantization:
    """A checkpoint's quantization as mlx-lm's loader reads its config: `quantization` (mlx), or a
    `quantization_config` whose method mlx-lm maps to one. `mode` is empty for a method mlx-lm
    handles otherwise (nothing here applies it)."""

    method: str  # "mlx", or quantization_config's quant_method
    mode: str = ""  # affine, mxfp4, mxfp8, ...
    bits: int = 0
    group_size: int = 0
    overrides: Mapping[str, Any] = field(default_factory=dict)  # module path -> params or bool

    @property
    def applied(self) -> bool:
        return bool(self.mode)

    def label(self) -> str:
        return f"{self.bits}-bit {self.mode} g{self.group_size}"

    def require_applied(self) -> None:
        if not self.applied:
            raise DescribeError(
                f"quantization method {self.method!r} is not supported for sharded loading "
                "(convert the checkpoint with mlx_lm.convert first)"
            )


def quantization(config: Mapping, where: Path | str = "config.json") -> Quantization | None:
    """The quantization of a config, the one reading of it (None: not quantized)."""
    q = config.get("quantization")
    if q is not None:
        try:
            return Quantization(
                "mlx",
                str(q.get("mode", "affine")),
                int(q["bits"]),
                int(q["group_size"]),
                {k: v for k, v in q.items() if isinstance(v, (dict, bool))},
            )
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(
                f"{where}: malformed quantization {q!r} ({type(exc).__name__}: {exc})"
            ) from None
    qc = config.get("quantization_config")
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method is None:
        return None
    known = _METHODS.get(method)
    if known is None:
        return Quantization(str(method))
    return Quantization(method, known["mode"], known["bits"], known["group_size"])


def expert_quant(quant: Quantization | None, m, proj: str, params: Mapping) -> dict | None:
    """Quantization of one projection of MoE layer `m`'s experts ({"weight", "scales", ...} as
    read): its own entry in the config, else mode and group size from the config and the bits
    from the shapes. None: not quantized."""
    if "scales" not in params:
        return None
    if quant is not None:
        quant.require_applied()
    overrides = quant.overrides if quant else {}
    for path in (f"{m.bank_path}.{proj}", f"{m.path}.experts.{proj}"):
        if isinstance(overrides.get(path), dict):
            return {"mode": "affine", **overrides[path]}
    w, s = params["weight"], params["scales"]
    mode = quant.mode if quant else "affine"
    group = quant.group_size if quant else 64
    bits = w.shape[-1] * 32 // (s.shape[-1] * group)
    if bits not in (2, 3, 4, 5, 6, 8):
        raise DescribeError(
            f"layer {m.layer} {proj}: cannot infer quantization bits from shapes "
            f"weight {w.shape}, scales {s.shape}"
        )
    return {"group_size": group, "bits": bits, "mode": mode}


# ---------------------------------------------------------------------------------------------
# Expert tensors


@dataclass(frozen=True)
class Group:
    """One expert tensor of a MoE layer: stacked (`key` holds every expert, `per` leading rows each)
    or one tensor per expert (`key` has `{e}` where the expert index goes)."""

    key: str
    dtype: str
    shape: tuple[int, ...]  # the checkpoint tensor's shape (per expert when not stacked)
    stacked: bool
    per: int = 1  # leading rows per expert, when stacked

    def blob(self, e: int) -> str:
        return f"{self.key}[{e}]" if self.stacked else self.key.format(e=e)

    def expert_nbytes(self) -> int:
        n = math.prod(self.shape) * _DTYPES[self.dtype][2]
        return n // (self.shape[0] // self.per) if self.stacked else n

    def expert_shape(self) -> tuple[int, ...]:
        return (self.per,) + self.shape[1:] if self.stacked else (1,) + self.shape


@dataclass(frozen=True)
class MoELayer:
    """One MoE block and the checkpoint tensors of its routed experts."""

    layer: int  # decoder layer index
    path: str  # the block, e.g. "model.layers.3.mlp"
    bank_path: str  # its expert bank
    num_experts: int
    top_k: int
    dense: tuple[str, ...]  # paths of its dense terms (shared experts and their gates)
    routed_call: bool  # called as block(x, indices, weights): cannot be probed alone
    keys: frozenset[str] = frozenset()  # checkpoint tensors of its routed experts
    expert_bytes: int = 0  # one routed expert, from the headers
    groups: tuple[Group, ...] = ()  # what a shard cache stores per expert
    layout_error: str = ""  # why `groups` cannot split this layer per expert ("" when it can)
    # (projection, param) -> the stacked tensor, or the per-expert name with `{e}` (generic layouts)
    tensors: Mapping[tuple[str, str], str] = field(default_factory=dict)

    def local_bytes(self, local, tensors: Mapping) -> int:
        """Bytes of experts `local` on disk: stacked (or fused) rows, or their own tensors."""
        head = self.path + ".experts."
        total = 0
        for key in self.keys:
            rest = key[len(head) :] if key.startswith(head) else ""
            e = rest.split(".", 1)[0]
            if e.isdigit():
                total += tensors[key].nbytes if int(e) in local else 0
            elif tensors[key].shape:
                total += tensors[key].nbytes * len(local) // self.num_experts
        return total


def _expert_layer(b: MoEBlock, tensors: Mapping) -> MoELayer:
    prefixes = (b.bank_path + ".", b.path + ".experts.")
    keys = frozenset(k for k in tensors if k.startswith(prefixes))
    n = b.num_experts
    groups: list[Group] = []
    seen: set[str] = set()
    error = ""
    per_expert = re.compile(
        re.escape(b.path) + r"\.experts\.(\d+)\.(\w+)\.(weight|scales|biases|bias)$"
    )
    by_param: dict[tuple[str, str], str] = {}
    head = b.path + ".experts."
    for key in sorted(keys):
        info = tensors[key]
        m = per_expert.match(key)
        if m:
            by_param[(PROJ_ALIASES.get(m[2], m[2]), m[3])] = f"{head}{{e}}.{m[2]}.{m[3]}"
        rest = key[len(head) :].split(".", 1) if key.startswith(head) else [""]
        if rest[0].isdigit() and len(rest) == 2:  # one tensor per expert
            template = f"{head}{{e}}.{rest[1]}"
            if template in seen:
                continue
            seen.add(template)
            missing = [e for e in range(n) if f"{head}{e}.{rest[1]}" not in tensors]
            if missing and not error:
                error = f"layer {b.layer}: no tensor {template} for experts {missing[:5]}"
            groups.append(Group(template, info.dtype, info.shape, stacked=False))
        elif info.shape and info.shape[0] % n == 0:
            groups.append(Group(key, info.dtype, info.shape, stacked=True, per=info.shape[0] // n))
        elif not error:
            error = (
                f"{key}: leading dimension {info.shape[:1]} is not a multiple of the {n} experts; "
                "it cannot be split per expert"
            )
    stacked = {
        (proj, param): f"{b.bank_path}.{proj}.{param}"
        for proj in b.projections
        for param in PARAMS
        if f"{b.bank_path}.{proj}.{param}" in tensors
    }
    return MoELayer(
        layer=b.layer,
        path=b.path,
        bank_path=b.bank_path,
        num_experts=n,
        top_k=b.top_k,
        dense=b.dense_paths(),
        routed_call=b.routed_call,
        keys=keys,
        expert_bytes=sum(tensors[k].nbytes for k in keys) // n,
        groups=tuple(groups),
        layout_error=error,
        tensors={**by_param, **stacked},  # a stacked tensor wins, as the loader reads it
    )


# ---------------------------------------------------------------------------------------------
# The description


@dataclass(frozen=True)
class ExpertBytes:
    """What a checkpoint's headers say a node will hold: the bytes it reads."""

    replicated: int  # everything but the routed experts (shared experts included)
    per_expert: dict[int, int]  # MoE layer -> bytes of one routed expert
    num_experts: dict[int, int]  # MoE layer -> routed experts
    top_k: dict[int, int] = field(default_factory=dict)  # MoE layer -> experts each token selects


@dataclass(frozen=True)
class ModelDescription:
    """A model as its config and safetensors headers describe it (no weight read)."""

    where: str  # its config.json, for messages
    config: Mapping[str, Any]
    checkpoint: Checkpoint | None  # None: described from a bare config.json
    model_type: str
    layers: int  # decoder layers
    moe: tuple[MoELayer, ...]  # in layer order
    quant: Quantization | None
    dtype: mx.Dtype  # of the weights: the floating dtype holding most bytes, else the config's
    hidden: int  # width of the hidden states (the widest token embedding)
    vocab: int  # rows of the first token embedding: token ids must be below this
    blocks: tuple[MoEBlock, ...] = field(repr=False, default=())  # as probed, on a model of its own

    @property
    def path(self) -> Path:
        return Path(self.where).parent

    def moe_layers(self) -> dict[int, int]:
        """{MoE layer: routed experts}."""
        return {m.layer: m.num_experts for m in self.moe}

    def require_moe(self) -> None:
        if not self.moe:
            raise DescribeError(
                f"{self.path} has no MoE layers (model_type {self.model_type!r}); "
                "there are no experts to spread"
            )

    def layer(self, layer: int) -> MoELayer:
        return next(m for m in self.moe if m.layer == layer)

    def expert_keys(self) -> dict[str, MoELayer]:
        """Checkpoint keys that hold routed-expert weights, mapped to their layer."""
        return {k: m for m in self.moe for k in m.keys}

    def sizes(self, total_bytes: int | None = None) -> ExpertBytes:
        """Routed-expert and replicated bytes from the safetensors headers. Described from a bare
        config (a repo whose weights are not here yet): from its model's parameters, quantized as
        the config says (the planner's figures), scaled to the checkpoint's `total_bytes` where
        they are known (a safetensors index states them; a config may not say the dtype)."""
        self.require_moe()
        if self.checkpoint is None:
            model, _ = self.new_model()
            model.set_dtype(self.dtype)
            quantize_lazily(model, self.quant, self.moe)
            per_expert, total = {}, 0
            for path, v in tree_flatten(model.parameters()):
                total += v.nbytes
                bank = next((m for m in self.moe if path.startswith(m.bank_path + ".")), None)
                if bank is not None:
                    per_expert[bank.layer] = per_expert.get(bank.layer, 0) + v.nbytes
            scale = total_bytes / total if total_bytes and total else 1.0
            per_expert = {
                m.layer: int(scale * per_expert.get(m.layer, 0)) // m.num_experts for m in self.moe
            }
            total_bytes = int(scale * total)
        else:
            per_expert = {m.layer: m.expert_bytes for m in self.moe}
            total_bytes = self.checkpoint.total_bytes()
        experts = sum(per_expert[m.layer] * m.num_experts for m in self.moe)
        return ExpertBytes(
            replicated=total_bytes - experts,
            per_expert=per_expert,
            num_experts=self.moe_layers(),
            top_k={m.layer: m.top_k for m in self.moe},
        )

    def new_model(self) -> tuple[nn.Module, list[MoEBlock]]:
        """A fresh model of this config (lazy parameters) and its MoE blocks, not probed again."""
        model_cls, _ = model_classes(dict(self.config), self.where)
        model = model_cls(model_args(dict(self.config), self.where))
        return model, rebind(list(self.blocks), model)


def quantize_lazily(
    model: nn.Module,
    quant: Quantization | None,
    banks: tuple[MoELayer, ...],
    bits: int | None = None,
    group_size: int = 64,
) -> str:
    """Apply the checkpoint's quantization (or `bits`) to a lazy model, as mlx-lm's loader would;
    returns a label. Sizing a model from its config alone needs it: the planner, and `up` before
    a repo's weights are downloaded."""
    ours = quant is not None and quant.method == "mlx"
    if ours and bits is not None:
        raise DescribeError(f"the checkpoint is already quantized ({quant.bits} bits); drop --bits")
    family = getattr(model, "quant_predicate", None)
    if ours:
        gs = quant.group_size

        def predicate(path, m):
            if path in quant.overrides:
                v = quant.overrides[path]
                return dict(v) if isinstance(v, dict) else bool(v)
            if not hasattr(m, "to_quantized") or m.weight.shape[-1] % gs:
                return False
            return family(path, m) if family else True

        nn.quantize(
            model, group_size=gs, bits=quant.bits, mode=quant.mode, class_predicate=predicate
        )
        return quant.label()
    if quant is not None and quant.applied:
        # mlx-lm quantizes what the checkpoint stores quantized: the released experts only.
        nn.quantize(
            model,
            group_size=quant.group_size,
            bits=quant.bits,
            mode=quant.mode,
            class_predicate=lambda p, m: (
                any(p.startswith(b.bank_path + ".") for b in banks) and hasattr(m, "to_quantized")
            ),
        )
        return f"experts {quant.method}"
    if quant is not None:
        logger.warning(
            "quantization_config quant_method=%r is not applied (mlx-lm dequantizes it at load)",
            quant.method,
        )
    if bits is not None:

        def predicate(path, m):
            if not hasattr(m, "to_quantized") or m.weight.shape[-1] % group_size:
                return False
            return family(path, m) if family else True

        nn.quantize(model, group_size=group_size, bits=bits, class_predicate=predicate)
        return f"{bits}-bit affine g{group_size}"
    return ""


def _weights_dtype(config: Mapping, ckpt: Checkpoint | None) -> mx.Dtype:
    sizes: dict[str, int] = {}
    for t in ckpt.tensors.values() if ckpt is not None else ():
        if t.dtype in _FLOATS:
            sizes[t.dtype] = sizes.get(t.dtype, 0) + t.nbytes
    if sizes:
        return _FLOATS[max(sizes, key=sizes.get)]
    name = config.get("torch_dtype") or config.get("dtype")
    return _CONFIG_DTYPES.get(name, mx.bfloat16) if isinstance(name, str) else mx.bfloat16


def describe(source: Checkpoint | Mapping, where: Path | str | None = None) -> ModelDescription:
    """Describe an open checkpoint, or a bare config (`where`: the file it came from).

    The MoE blocks are probed in float32 here, once; a model with none is described with none
    (who needs experts says so: `require_moe`).
    """
    ckpt = source if isinstance(source, Checkpoint) else None
    config = ckpt.config if ckpt is not None else dict(source)
    where = str(ckpt.path / "config.json") if ckpt is not None else str(where or "config.json")
    quant = quantization(config, where)
    model_cls, _ = model_classes(config, where)
    model = model_cls(model_args(config, where))  # parameters are lazy: nothing is allocated
    embeddings = [
        m.weight.shape
        for _, m in model.named_modules()
        if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding))
    ]
    try:
        blocks = find_moe_blocks(model)
    except StructureError as exc:
        raise DescribeError(f"{where} (model_type {config.get('model_type')!r}): {exc}") from None
    # The probe evaluated the probed blocks' own weights (float32: a shared expert of a large
    # model is hundreds of MB). The description keeps their structure, never those values, and
    # lives as long as `up` serves: lazy zeros in their place allocate nothing.
    model.update(tree_map(lambda v: mx.zeros(v.shape, v.dtype), model.parameters()))
    tensors = ckpt.tensors if ckpt is not None else {}
    return ModelDescription(
        where=where,
        config=config,
        checkpoint=ckpt,
        model_type=str(config.get("model_type")),
        layers=len(model.layers) if hasattr(model, "layers") else 0,
        moe=tuple(_expert_layer(b, tensors) for b in blocks),
        quant=quant,
        dtype=_weights_dtype(config, ckpt),
        hidden=max((s[1] for s in embeddings), default=0),
        vocab=embedding_rows(model) if embeddings else 0,
        blocks=tuple(blocks),
    )
