"""What a MoE block is made of, found from its structure: the one description node and planner share.

A MoE block is a module that owns an expert bank (`SwitchGLU`/`SwitchMLP`, or a family adapter's).
Everything else about it is measured by running the block once on a small probe, with the bank
replaced by a stand-in whose output we control — never read from attribute names:

- **top-k** is the last dimension of the indices the block hands its bank;
- a **router** is a child whose removal changes those indices or the routed part of the output
  (it stays on every node);
- a **dense term** is a child whose removal leaves the routed part untouched: a shared expert and
  its gate, under whatever name (`shared_expert`, `shared_mlp`, `share_expert`, ...). It must count
  once in the cluster, so it runs on one node per layer (the owner) and is zeroed elsewhere;
- a **residual** is what the block adds with the bank silenced and every dense term zeroed: a term
  written inline in the block's forward (LongCat-Flash's identity "zero experts"). Non-owners
  subtract it, so it too counts once;
- the block's output must be **linear** in the bank's output (the cluster sums partial bank
  outputs): checked on the probe by splitting the experts in two and by scaling, else refused.

What the rule cannot place is an error naming the module path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn

from . import families

GLU_PROJ = ("gate_proj", "up_proj", "down_proj")
MLP_PROJ = ("fc1", "fc2")

_PROBE_TOKENS = 8
# float32 probe: sums of a few hundred terms of magnitude ~1 agree to ~1e-6; a real mismatch (a
# term counted twice, a norm after the sum) is of order 1.
_RTOL, _ATOL = 1e-4, 1e-5


class StructureError(ValueError):
    """A MoE block whose output the cluster cannot split exactly, naming the module path."""


@dataclass
class Bank:
    """An expert bank as found in the module tree."""

    attr: str  # attribute of the block that holds it, e.g. "switch_mlp"
    module: object
    kind: str  # "glu" (gate/up/down) or "mlp" (fc1/fc2)
    activation: Callable
    num_experts: int
    in_dims: int
    out_dims: int
    layout: str  # "stacked" (one (E, ...) tensor per projection) or "list" (one module per expert)

    @property
    def projections(self) -> tuple[str, ...]:
        return GLU_PROJ if self.kind == "glu" else MLP_PROJ


@dataclass
class MoEBlock:
    """One MoE block of a model, described from its structure."""

    layer: int  # decoder layer index
    path: str  # e.g. "model.layers.3.mlp"
    block: nn.Module
    bank: Bank
    top_k: int
    routers: tuple[str, ...]  # children that decide the routing (replicated everywhere)
    dense: tuple[str, ...]  # children that add a dense term: run by the layer's owner only
    residual: bool  # an inline non-routed term: non-owners subtract it
    forward: Callable  # forward(block, x, *args, **kwargs): the class's, or a family adapter's

    @property
    def num_experts(self) -> int:
        return self.bank.num_experts

    @property
    def bank_attr(self) -> str:
        return self.bank.attr

    @property
    def bank_path(self) -> str:
        return f"{self.path}.{self.bank.attr}"

    @property
    def kind(self) -> str:
        return self.bank.kind

    @property
    def activation(self) -> Callable:
        return self.bank.activation

    @property
    def projections(self) -> tuple[str, ...]:
        return self.bank.projections

    def dense_paths(self) -> tuple[str, ...]:
        return tuple(f"{self.path}.{name}" for name in self.dense)


def find_bank(model: nn.Module, path: str, module: nn.Module) -> Bank | None:
    """The expert bank `module` owns directly, if any."""
    from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

    found = families.find_bank(model, path, module)
    if found is not None:
        return found
    for attr, child in module.children().items():
        if isinstance(child, SwitchGLU):
            p = child.gate_proj
            return Bank(attr, child, "glu", child.activation, p.num_experts, p.input_dims, child.down_proj.output_dims,
                        "stacked")
        if isinstance(child, SwitchMLP):
            p = child.fc1
            return Bank(attr, child, "mlp", child.activation, p.num_experts, p.input_dims, child.fc2.output_dims,
                        "stacked")
    return None


def find_moe_blocks(model: nn.Module) -> list[MoEBlock]:
    """Every MoE block of `model`, in layer order, each described from its structure.

    Blocks of one class with the same children are probed once (the probe evaluates the block's
    own parameters, so probing every layer of a large model would cost memory for nothing).
    """
    layer_paths = {}
    layer_of = {id(layer): i for i, layer in enumerate(model.layers)}
    for path, m in model.named_modules():
        if id(m) in layer_of:
            layer_paths[path] = layer_of[id(m)]
    found: list[tuple[int, str, nn.Module, Bank]] = []
    for path, m in model.named_modules():
        bank = find_bank(model, path, m)
        if bank is None:
            continue
        layer = max((i for p, i in layer_paths.items() if path == p or path.startswith(p + ".")), default=None)
        if layer is None:
            raise StructureError(f"MoE block {path} is not inside any of the model's layers")
        found.append((layer, path, m, bank))
    found.sort(key=lambda t: t[0])
    probed: dict[tuple, tuple] = {}
    blocks = []
    for layer, path, m, bank in found:
        key = (type(m), bank.attr, bank.num_experts,
               tuple(sorted((n, type(c).__name__) for n, c in m.children().items() if isinstance(c, nn.Module))))
        if key not in probed:
            probed[key] = probe_block(path, m, bank)
        top_k, routers, dense, residual, forward = probed[key]
        blocks.append(MoEBlock(layer, path, m, bank, top_k, routers, dense, residual, forward))
    return blocks


# ---------------------------------------------------------------------------------------------
# The probe


class _ProbeBank(nn.Module):
    """Stands in for the bank: expert e answers `table[e]` (times `scale`), and the call is recorded."""

    def __init__(self, table: mx.array, keep: mx.array | None = None, scale: float = 1.0):
        super().__init__()
        self._table, self._keep, self._scale = table, keep, scale
        self.calls: list[mx.array] = []

    def __call__(self, x, inds, *args, **kwargs):
        self.calls.append(inds)
        out = self._table[inds] * self._scale  # inds.shape + (D,)
        if self._keep is not None:
            out = out * self._keep[inds][..., None]
        return out.astype(x.dtype)


class Zero(nn.Module):
    """A child removed from the computation: answers zeros shaped like its input."""

    def __call__(self, x, *args, **kwargs):
        return mx.zeros_like(x)


def _children(block: nn.Module, bank_attr: str) -> list[str]:
    """Direct children holding parameters, other than the bank: routers and dense terms."""
    out = []
    for name, child in block.children().items():
        if name == bank_attr or not isinstance(child, nn.Module):
            continue
        if any(True for _ in _leaves(child.parameters())):
            out.append(name)
    return out


def _leaves(tree):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _leaves(v)
    elif isinstance(tree, mx.array):
        yield tree


class _Run:
    """Runs the block on the probe with a chosen bank stand-in and chosen children zeroed."""

    def __init__(self, path: str, block: nn.Module, bank: Bank, forward: Callable):
        self.path, self.block, self.bank, self.forward = path, block, bank, forward
        key = mx.random.key(0)
        kx, kt = mx.random.split(key)
        self.x = mx.random.normal((1, _PROBE_TOKENS, bank.in_dims), key=kx)
        self.table = mx.random.normal((bank.num_experts, bank.out_dims), key=kt)
        half = mx.arange(bank.num_experts) % 2
        self.keep_a, self.keep_b = half.astype(mx.float32), (1 - half).astype(mx.float32)

    def __call__(self, *, table: bool = True, keep=None, scale: float = 1.0, zero: Sequence[str] = ()):
        stand_in = _ProbeBank(self.table if table else mx.zeros_like(self.table), keep, scale)
        saved = {name: getattr(self.block, name) for name in zero}
        original = getattr(self.block, self.bank.attr)
        setattr(self.block, self.bank.attr, stand_in)
        for name in zero:
            setattr(self.block, name, Zero())
        try:
            y = self.forward(self.block, self.x)
            if not isinstance(y, mx.array):
                raise StructureError(f"MoE block {self.path} returns {type(y).__name__}, not one array: "
                                     "its output cannot be all-reduced")
            mx.eval(y, stand_in.calls)
        finally:
            setattr(self.block, self.bank.attr, original)
            for name, child in saved.items():
                setattr(self.block, name, child)
        if not stand_in.calls:
            raise StructureError(f"MoE block {self.path} never calls its expert bank {self.bank.attr!r}")
        return y.astype(mx.float32), stand_in.calls


def _close(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and bool(mx.allclose(a, b, rtol=_RTOL, atol=_ATOL))


def _same_routing(a: list[mx.array], b: list[mx.array]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and bool(mx.array_equal(x, y)) for x, y in zip(a, b))


def probe_block(path: str, block: nn.Module, bank: Bank):
    """(top_k, routers, dense, residual, forward) of one block, measured on a float32 probe."""
    forward = families.forward(block) or type(block).__call__
    run = _Run(path, block, bank, forward)
    full, calls = run()
    silent, _ = run(table=False)
    routed = full - silent
    top_k = int(calls[0].shape[-1])

    half_a, _ = run(keep=run.keep_a)
    half_b, _ = run(keep=run.keep_b)
    double, _ = run(scale=2.0)
    if not _close(half_a + half_b - silent, full) or not _close(double - silent, 2 * routed):
        raise StructureError(f"the output of MoE block {path} ({type(block).__name__}) is not linear in its "
                             "routed experts' outputs, so it cannot be summed across nodes")

    routers, dense = [], []
    for name in _children(block, bank.attr):
        try:
            with_t, zc = run(zero=[name])
            without_t, _ = run(table=False, zero=[name])
        except Exception:  # a child whose output is not a tensor like its input (a router's tuple)
            routers.append(name)
            continue
        if _same_routing(zc, calls) and _close(with_t - without_t, routed):
            dense.append(name)
        else:
            routers.append(name)
    residual = False
    if dense:
        with_t, _ = run(zero=dense)
        without_t, _ = run(table=False, zero=dense)
        if not _close(with_t - without_t, routed):
            raise StructureError(f"MoE block {path}: zeroing its dense children {dense} together changes the "
                                 "routed part of its output")
        residual = bool(mx.any(without_t != 0))
    else:
        residual = bool(mx.any(silent != 0))
    return top_k, tuple(routers), tuple(dense), residual, forward
