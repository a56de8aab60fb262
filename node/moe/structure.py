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

The block is the module that owns the bank, unless that module is called with the routing from
outside, `(x, indices, weights)` (gemma4, deepseek_v41 keep an `Experts` wrapper): then the block
is its parent when the parent is called with `x` alone (the bank sits one level down), or else
the wrapper itself, probed with indices and weights of its own and top-k read from the sibling
that returns them (the router).

What the rule cannot place is an error naming the module path.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from ...proto.errors import UserError
from ..device import ieee_float32
from . import families
from .bank import Bank

_PROBE_TOKENS = 8
# A term only some routings add (LongCat-Flash's identity "zero experts": a token routed to one adds
# itself, scaled) shows on the probe only if some probe token is routed there. Eight tokens missed
# it at 16 experts top-2; 2048 miss one expert of 65 at top-1 with probability (64/65)^2048 ~ 1e-14.
# Only the residual's silent run takes them (router and inline terms; the bank answers zeros).
_RESIDUAL_TOKENS = 2048
# The probe's comparisons add and subtract whole block outputs computed in float32. Each output
# carries the rounding of the block's own sums (top-k routed terms, shared experts, gates: a few
# dozen additions of terms no larger than the largest output), so an identity that holds exactly
# holds in float32 to within a few dozen ulps of the largest operand, for every element: also one
# that came out near zero from a cancellation of large terms, which an element-wise relative bound
# would refuse. The bound is that, with a margin: `_ULPS` float32 epsilons per operand, times the
# largest |value| of any operand of the comparison. A structural mismatch (a term counted twice, a
# norm or a square after the routed sum) is of the order of the values themselves, 10^4 times more.
_EPS32 = 2.0**-23
_ULPS = 64


class StructureError(UserError):
    """A MoE block whose output the cluster cannot split exactly, naming the module path."""


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
    routed_call: bool = False  # the block is called as block(x, indices, weights)
    width: int = 0  # of the block's input (the bank's may be a latent projection of it)

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
            return Bank(
                attr,
                child,
                "glu",
                child.activation,
                p.num_experts,
                p.input_dims,
                child.down_proj.output_dims,
                "stacked",
            )
        if isinstance(child, SwitchMLP):
            p = child.fc1
            return Bank(
                attr,
                child,
                "mlp",
                child.activation,
                p.num_experts,
                p.input_dims,
                child.fc2.output_dims,
                "stacked",
            )
    return None


def get_bank(block: nn.Module, attr: str):
    for part in attr.split("."):
        block = getattr(block, part)
    return block


def set_bank(block: nn.Module, attr: str, module) -> None:
    head, _, last = attr.rpartition(".")
    setattr(get_bank(block, head) if head else block, last, module)


def _arity(module: nn.Module) -> int:
    """Required positional arguments of the module's call, besides the module."""
    params = list(inspect.signature(type(module).__call__).parameters.values())[1:]
    return sum(
        1
        for p in params
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    )


def find_moe_blocks(model: nn.Module) -> list[MoEBlock]:
    """Every MoE block of `model`, in layer order, each described from its structure.

    Blocks of one class with the same children are probed once (the probe evaluates the block's
    own parameters, so probing every layer of a large model would cost memory for nothing).
    """
    layer_paths = {}
    layer_of = {id(layer): i for i, layer in enumerate(model.layers)}
    modules = dict(model.named_modules())
    for path, m in modules.items():
        if id(m) in layer_of:
            layer_paths[path] = layer_of[id(m)]
    found: list[tuple[int, str, nn.Module, Bank, bool]] = []
    for path, m in modules.items():
        bank = find_bank(model, path, m)
        if bank is None:
            continue
        layer = max(
            (i for p, i in layer_paths.items() if path == p or path.startswith(p + ".")),
            default=None,
        )
        if layer is None:
            raise StructureError(f"MoE block {path} is not inside any of the model's layers")
        routed_call = families.forward(m) is None and _arity(m) > 1
        if routed_call:
            parent_path, _, name = path.rpartition(".")
            parent = modules.get(parent_path)
            if parent is not None and parent_path not in layer_paths and _arity(parent) == 1:
                bank.attr = f"{name}.{bank.attr}"
                path, m, routed_call = parent_path, parent, False
        found.append((layer, path, m, bank, routed_call))
    found.sort(key=lambda t: t[0])
    probed: dict[tuple, tuple] = {}
    blocks = []
    for layer, path, m, bank, routed_call in found:
        key = (
            type(m),
            bank.attr,
            bank.num_experts,
            tuple(
                sorted(
                    (n, type(c).__name__)
                    for n, c in m.children().items()
                    if isinstance(c, nn.Module)
                )
            ),
        )
        if key not in probed:
            top_k = _sibling_top_k(modules, path, bank) if routed_call else None
            with ieee_float32():  # TF32's rounding (~1e-3 relative) would fail the linearity check
                probed[key] = probe_block(path, m, bank, top_k)
        top_k, routers, dense, residual, forward, width = probed[key]
        blocks.append(
            MoEBlock(
                layer, path, m, bank, top_k, routers, dense, residual, forward, routed_call, width
            )
        )
    return blocks


def rebind(blocks: Sequence[MoEBlock], model: nn.Module) -> list[MoEBlock]:
    """`blocks`, found on another instance of `model`'s class and config, moved onto `model`: the
    same description (top-k, routers, dense terms, forward), its own modules, no probe run."""
    modules = dict(model.named_modules())
    out = []
    for b in blocks:
        block = modules[b.path]
        owner = f"{b.path}.{b.bank.attr}".rpartition(".")[0]
        bank = find_bank(model, owner, modules[owner])
        if bank is None:
            raise StructureError(f"{type(model).__name__} has no expert bank under {owner}")
        bank.attr = b.bank.attr
        out.append(dataclasses.replace(b, block=block, bank=bank))
    return out


def _sibling_top_k(modules: dict, path: str, bank: Bank) -> int:
    """Top-k of a block called with the routing from outside: the width of the indices its sibling
    router returns (a child of the same parent answering `(indices, weights)` for `x`)."""
    parent_path, _, name = path.rpartition(".")
    parent = modules[parent_path]
    x = mx.random.normal((1, _PROBE_TOKENS, bank.in_dims), key=mx.random.key(0))
    for sibling, child in parent.children().items():
        if sibling == name or not isinstance(child, nn.Module) or not _has_parameters(child):
            continue
        try:
            out = child(x)
        except Exception:  # noqa: BLE001 - not a module of x alone: not the router
            continue
        if (
            isinstance(out, tuple)
            and len(out) == 2
            and isinstance(out[0], mx.array)
            and mx.issubdtype(out[0].dtype, mx.integer)
        ):
            return int(out[0].shape[-1])
    raise StructureError(
        f"MoE block {path} is called with its routing from outside, and no sibling of it "
        f"under {parent_path} returns (indices, weights)"
    )


# ---------------------------------------------------------------------------------------------
# The probe


class _ProbeBank(nn.Module):
    """Stands in for the bank: expert e answers `table[e] * (x . u)` for its token (times `scale`),
    and the call is recorded. Its answer depends on its input, so a child that feeds the bank (a
    latent projection) is never mistaken for a dense term."""

    def __init__(
        self, table: mx.array, u: mx.array, keep: mx.array | None = None, scale: float = 1.0
    ):
        super().__init__()
        self._table, self._u, self._keep, self._scale = table, u, keep, scale
        self.calls: list[mx.array] = []

    def __call__(self, x, inds, *args, **kwargs):
        # A child zeroed by the probe may hand us indices past the bank (a router answering zeros of
        # the wrong width); gathering them would read out of bounds.
        if bool(mx.any((inds < 0) | (inds >= self._table.shape[0]))):
            raise IndexError(f"expert indices outside 0..{self._table.shape[0] - 1}")
        self.calls.append(inds)
        per_token = (x.astype(mx.float32) @ self._u).reshape(inds.shape[:-1])
        out = self._table[inds] * (self._scale * per_token)[..., None, None]  # inds.shape + (D,)
        if self._keep is not None:
            out = out * self._keep[inds][..., None]
        return out.astype(x.dtype)


class Zero(nn.Module):
    """A child removed from the computation: answers zeros shaped like its input."""

    def __call__(self, x, *args, **kwargs):
        return mx.zeros_like(x)


def _has_parameters(module: nn.Module) -> bool:
    return bool(tree_flatten(module.parameters()))


def _children(block: nn.Module, bank_attr: str) -> list[str]:
    """Direct children holding parameters, other than the bank's: routers and dense terms."""
    out = []
    for name, child in block.children().items():
        if name == bank_attr.split(".")[0] or not isinstance(child, nn.Module):
            continue
        if _has_parameters(child):
            out.append(name)
    return out


class _Run:
    """Runs the block on the probe with a chosen bank stand-in and chosen children zeroed."""

    def __init__(
        self,
        path: str,
        block: nn.Module,
        bank: Bank,
        forward: Callable,
        in_dims: int,
        top_k: int | None,
        tokens: int = _PROBE_TOKENS,
    ):
        self.path, self.block, self.bank, self.forward = path, block, bank, forward
        kx, kt, ki, kw = mx.random.split(mx.random.key(0), 4)
        self.x = mx.random.normal((1, tokens, in_dims), key=kx)
        self.table = mx.random.normal((bank.num_experts, bank.out_dims), key=kt)
        self.u = mx.random.normal((bank.in_dims,), key=mx.random.key(1))
        half = mx.arange(bank.num_experts) % 2
        self.keep_a, self.keep_b = half.astype(mx.float32), (1 - half).astype(mx.float32)
        self.args: tuple = ()
        if top_k is not None:  # called as block(x, indices, weights): distinct experts per token
            order = mx.argsort(
                mx.random.uniform(shape=(1, tokens, bank.num_experts), key=ki), axis=-1
            )
            self.args = (order[..., :top_k], mx.random.uniform(shape=(1, tokens, top_k), key=kw))

    def __call__(
        self, *, table: bool = True, keep=None, scale: float = 1.0, zero: Sequence[str] = ()
    ):
        stand_in = _ProbeBank(
            self.table if table else mx.zeros_like(self.table), self.u, keep, scale
        )
        saved = {name: getattr(self.block, name) for name in zero}
        original = get_bank(self.block, self.bank.attr)
        set_bank(self.block, self.bank.attr, stand_in)
        for name in zero:
            setattr(self.block, name, Zero())
        try:
            y = self.forward(self.block, self.x, *self.args)
            if not isinstance(y, mx.array):
                raise StructureError(
                    f"MoE block {self.path} returns {type(y).__name__}, not one array: "
                    "its output cannot be all-reduced"
                )
            mx.eval(y, stand_in.calls)
        finally:
            set_bank(self.block, self.bank.attr, original)
            for name, child in saved.items():
                setattr(self.block, name, child)
        if not stand_in.calls:
            raise StructureError(
                f"MoE block {self.path} never calls its expert bank {self.bank.attr!r}"
            )
        return y.astype(mx.float32), stand_in.calls


@dataclass(frozen=True)
class Mismatch:
    """How far an identity the probe checks is from holding, against what float32 rounding allows."""

    what: str  # the identity, e.g. "half_a + half_b - silent == full"
    error: float  # max |lhs - rhs|
    bound: float  # what rounding allows: _ULPS eps32 per operand, times the largest |operand|
    scale: float  # the largest |operand|
    operands: int

    @property
    def holds(self) -> bool:
        return self.error <= self.bound

    def __str__(self) -> str:
        return (
            f"{self.what}: max |difference| {self.error:.3g} against a float32 rounding bound of "
            f"{self.bound:.3g} ({_ULPS} ulps x {self.operands} operands of magnitude up to "
            f"{self.scale:.3g})"
        )


def compare(
    what: str, lhs: Sequence[tuple[float, mx.array]], rhs: Sequence[tuple[float, mx.array]]
) -> Mismatch:
    """Check sum(c * a for c, a in lhs) == sum(c * b for c, b in rhs) up to float32 rounding.

    Operands are whole block outputs; each weighs in with _ULPS epsilons of the largest |operand|.
    """
    terms = [*lhs, *rhs]
    shapes = {tuple(a.shape) for _, a in terms}
    if len(shapes) != 1:
        return Mismatch(f"{what} (shapes {sorted(shapes)})", float("inf"), 0.0, 0.0, len(terms))
    left = sum(c * a for c, a in lhs)
    right = sum(c * b for c, b in rhs)
    scale = max(float(mx.max(mx.abs(c * a))) for c, a in terms)
    error = float(mx.max(mx.abs(left - right)))
    if error != error:  # NaN: no bound holds
        error = float("inf")
    return Mismatch(what, error, _ULPS * _EPS32 * scale * len(terms), scale, len(terms))


def _same_routed(
    with_t: mx.array, without_t: mx.array, full: mx.array, silent: mx.array, zeroed: str
) -> Mismatch:
    """Whether zeroing a child leaves the routed part of the output (full - silent) as it was."""
    return compare(
        f"the routed part with {zeroed} zeroed == the routed part",
        [(1, with_t), (-1, without_t)],
        [(1, full), (-1, silent)],
    )


def _same_routing(a: list[mx.array], b: list[mx.array]) -> bool:
    return len(a) == len(b) and all(
        x.shape == y.shape and bool(mx.array_equal(x, y)) for x, y in zip(a, b)
    )


def _keyed_parameters(block: nn.Module, bank_attr: str) -> None:
    """Give the block's own parameters values drawn from a fixed key before it is probed.

    A freshly built model's parameters are lazy draws from MLX's global random state, which must
    not be evaluated off the main thread (the node loads in a gRPC worker thread: it aborts). The
    values do not matter (the checkpoint's replace them at load), only that they are not degenerate.
    """
    own = [
        (k, v)
        for k, v in tree_flatten(block.parameters())
        if k.split(".")[0] != bank_attr.split(".")[0]
    ]
    if not own:
        return
    keys = mx.random.split(mx.random.key(2), len(own))
    block.update(
        tree_unflatten([(k, _keyed(k, v, keys[i]).astype(v.dtype)) for i, (k, v) in enumerate(own)])
    )


def _keyed(name: str, v: mx.array, key: mx.array) -> mx.array:
    """Matrices 0.5 * normal; vectors as a model's: scales near 1, biases near 0. A router's score
    bias drawn as large as its weights (DeepSeek's and LongCat's `e_score_correction_bias`) would
    pick the same experts for every token, and a term only some experts add (LongCat's identity
    experts) would never show on the probe."""
    z = mx.random.normal(v.shape, key=key)
    if v.ndim >= 2:
        return 0.5 * z
    if name.rsplit(".", 1)[-1] in ("weight", "scale", "g", "gamma"):
        return 1.0 + 0.02 * z
    return 0.02 * z


def _input_dims(block: nn.Module, bank: Bank) -> list[int]:
    """Widths the block's input may have: the bank's, then those of its linear children (a block may
    project into a latent space before its experts, as nemotron_h does)."""
    dims = [bank.in_dims]
    for _, m in block.named_modules():
        if isinstance(m, nn.Linear) and m.weight.shape[-1] not in dims:
            dims.append(m.weight.shape[-1])
    return dims


def probe_block(path: str, block: nn.Module, bank: Bank, top_k: int | None = None):
    """(top_k, routers, dense, residual, forward, input width) of one block, measured on a float32 probe.

    `top_k` is given for a block called with the routing from outside (`block(x, indices, weights)`).
    """
    forward = families.forward(block) or type(block).__call__
    _keyed_parameters(block, bank.attr)
    errors = []
    for dims in _input_dims(block, bank):
        run = _Run(path, block, bank, forward, dims, top_k)
        try:
            full, calls = run()
            break
        except StructureError:
            raise
        except Exception as exc:  # noqa: BLE001 - the wrong input width: try the next
            errors.append(f"{dims}: {type(exc).__name__}: {exc}")
    else:
        raise StructureError(
            f"MoE block {path} ({type(block).__name__}) cannot be run on a probe: "
            + "; ".join(errors)
        )
    silent, _ = run(table=False)
    top_k = int(calls[0].shape[-1])

    half_a, _ = run(keep=run.keep_a)
    half_b, _ = run(keep=run.keep_b)
    double, _ = run(scale=2.0)
    for check in (
        compare(
            "half_a + half_b - silent == full (the experts split in two halves)",
            [(1, half_a), (1, half_b), (-1, silent)],
            [(1, full)],
        ),
        compare(
            "double - silent == 2 (full - silent) (every expert's output doubled)",
            [(1, double), (-1, silent)],
            [(2, full), (-2, silent)],
        ),
    ):
        if not check.holds:
            raise StructureError(
                f"the output of MoE block {path} ({type(block).__name__}) is not linear in its "
                f"routed experts' outputs, so it cannot be summed across nodes: {check}"
            )

    routers, dense = [], []
    for name in _children(block, bank.attr):
        try:
            with_t, zc = run(zero=[name])
            without_t, _ = run(table=False, zero=[name])
        except Exception:  # a child whose output is not a tensor like its input (a router's tuple)
            routers.append(name)
            continue
        if _same_routing(zc, calls) and _same_routed(with_t, without_t, full, silent, name).holds:
            dense.append(name)
        else:
            routers.append(name)
    if dense:
        with_t, _ = run(zero=dense)
        without_t, _ = run(table=False, zero=dense)
        check = _same_routed(with_t, without_t, full, silent, " and ".join(dense))
        if not check.holds:
            raise StructureError(
                f"MoE block {path}: zeroing its dense children {dense} together changes the "
                f"routed part of its output: {check}"
            )
    many = _Run(
        path, block, bank, forward, dims, top_k if run.args else None, tokens=_RESIDUAL_TOKENS
    )
    residual = bool(mx.any(many(table=False, zero=dense)[0] != 0))
    return top_k, tuple(routers), tuple(dense), residual, forward, dims
