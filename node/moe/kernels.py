"""How a shard's local experts compute, chosen once at load: the matmul of each projection
(gather_mm, gather_qmm or one matmul per expert), and the kernel of a routed call (every position
through a slot, a skip kernel, or rows grouped by slot, on the host or, counted, on the device).

A kernel takes the input and what the shard's slot plan (plan.py) made of the routing indices,
`kernel(x, plan(inds))`, and returns the shard's output, (..., k, out), zeros at the positions
another node computes.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from . import qskip, skip_gemv
from .plan import Counted, Hosted, Routed

# How the local experts are multiplied: one gather_mm for all rows, or one matmul per expert
# where MLX has no gather_mm for the dtype (its CPU backend, bfloat16/float16: _gather_mm_ok).
# Rows are always grouped by expert, but gather_mm is told so only from this many rows on, as
# mlx-lm's SwitchGLU does: on MLX's CUDA backend the sorted kernel is ~6x slower for decode-sized
# batches (DBRX experts on an H200: 1.07 ms vs 0.17 ms per call; `bench expert-step`'s `sorted`
# column times it).
SORTED_FROM = 64
# A projection stored in slices of its input dimension (ShardLinear.slice_inputs) multiplies calls
# below this many rows as one gather_mm over every (row, slice), unsorted, and wider ones (a prompt)
# slice by slice, each told its rows are sorted, as a prompt's thousands of rows need: on a 2-vCPU
# EPYC with OpenBLAS the one call beat the slice-by-slice form in a node's MoE layer by 6% at 64
# rows and 3% at 256.
SLICED_AS_ONE_BELOW = 256

Groups = Sequence[tuple[int, int, int]]  # [(slot, start, end)]: runs of equal slot in sorted rows


def _gather_mm_ok(dtype: mx.Dtype) -> bool:
    return dtype == mx.float32 or mx.default_device().type != mx.DeviceType.cpu


def _per_expert(dtype: mx.Dtype, quantized: bool) -> bool:
    return not quantized and not _gather_mm_ok(dtype)


class ShardLinear(nn.Module):
    """One projection of the local experts: weight (E_local, out, in), maybe quantized, maybe
    biased."""

    def __init__(
        self, weight: mx.array, *, scales=None, biases=None, bias=None, quant: Mapping | None = None
    ):
        super().__init__()
        self.weight = weight
        if scales is not None:
            self.scales = scales
        if biases is not None:
            self.biases = biases
        if bias is not None:
            self.bias = bias
        self.quant = dict(quant) if quant else None  # {"group_size", "bits", "mode"}
        self.slices = 1  # the weight's input dimension is stored in this many slices
        # chosen once: this runs three times per MoE layer per token, on the step's critical path
        self.per_expert = _per_expert(weight.dtype, quant is not None)
        self._biased = bias is not None
        self._matmul = (
            self._by_expert
            if self.per_expert
            else self._gather_qmm
            if self.quant is not None
            else self._gather_mm
        )

    @property
    def biased(self) -> bool:
        return self._biased

    def __call__(self, x: mx.array, slots: mx.array, groups: Groups | None) -> mx.array:
        """x (M, 1, in) rows sorted by slot; slots (M,); groups [(slot, start, end)] -> (M, 1,
        out)."""
        y = self._matmul(x, slots, groups)
        if self._biased:
            y = y + mx.expand_dims(self["bias"][slots], -2)
        return y

    def _by_expert(self, x: mx.array, slots: mx.array, groups: Groups) -> mx.array:
        return mx.concatenate([self._one(x[a:b], s) for s, a, b in groups], axis=0)

    def gather(self, x: mx.array, slots: mx.array, sorted_indices: bool) -> mx.array:
        """x (M, 1, in) rows through expert slots[i] each in one gather_mm / gather_qmm, told
        whether the rows come grouped by slot (a node's calls tell it from SORTED_FROM rows on;
        `bench expert-step` times both ways). -> (M, 1, out), without the bias."""
        gather = self._gather_qmm if self.quant is not None else self._gather_mm
        return gather(x, slots, None, sorted_indices)

    def _gather_qmm(self, x: mx.array, slots: mx.array, groups, sorted_indices=None) -> mx.array:
        return mx.gather_qmm(
            x,
            self["weight"],
            self["scales"],
            self.get("biases"),
            rhs_indices=slots,
            transpose=True,
            group_size=self.quant["group_size"],
            bits=self.quant["bits"],
            mode=self.quant["mode"],
            sorted_indices=x.shape[0] >= SORTED_FROM if sorted_indices is None else sorted_indices,
        )

    def _gather_mm(self, x: mx.array, slots: mx.array, groups, sorted_indices=None) -> mx.array:
        sort = x.shape[0] >= SORTED_FROM if sorted_indices is None else sorted_indices
        if self.slices > 1:
            return self._sliced(x, slots, sort)
        return mx.gather_mm(
            x, self["weight"].swapaxes(-1, -2), rhs_indices=slots, sorted_indices=sort
        )

    def can_slice(self, slices: int) -> bool:
        """Whether the weight can be stored in `slices` slices of its input dimension: a plain
        (unquantized) weight multiplied by gather_mm, its input dimension divisible."""
        w = self["weight"]
        return (
            self.quant is None
            and not self.per_expert
            and w.ndim == 3
            and w.shape[0] > 0
            and (w.shape[-1] * self.slices) % slices == 0
        )

    def slice_inputs(self, slices: int) -> None:
        """Store the weight (E, out, in) as `slices` slices of its input dimension, (E * slices,
        out, in / slices), slice j of expert e at e * slices + j (1: whole again). A call then sums
        the slices' products (same values, float32 sums in another order). Why: route.py
        choose_slices, which keeps this only where a node's decode call measured faster."""
        if slices == self.slices:
            return
        w = self["weight"]
        e, out, k = w.shape[0] // self.slices, w.shape[1], w.shape[2]
        whole = w.reshape(e, self.slices, out, k).transpose(0, 2, 1, 3).reshape(e, out, -1)
        inner = whole.shape[-1]
        w = whole.reshape(e, out, slices, inner // slices).transpose(0, 2, 1, 3)
        self.weight = mx.contiguous(w.reshape(e * slices, out, inner // slices))
        mx.eval(self.weight)
        self.slices = slices

    def _sliced(self, x: mx.array, slots: mx.array, sort: bool) -> mx.array:
        """x through the sliced weight: the slices' products summed, slice 0 first."""
        p, w = self.slices, self["weight"]
        k = w.shape[-1]
        rows = x.shape[0]
        if x.ndim == 3 and slots.shape == (rows,) and rows < SLICED_AS_ONE_BELOW:
            # every (row, slice) as a row of its own, slice j of a row next to slice j + 1
            at = (slots[:, None] * p + mx.arange(p, dtype=slots.dtype)).reshape(-1)
            y = mx.gather_mm(x.reshape(rows * p, 1, k), w.swapaxes(-1, -2), rhs_indices=at)
            return y.reshape(rows, p, -1).sum(axis=1, keepdims=True)
        by_slice = w.reshape(-1, p, *w.shape[1:])
        y = None
        for j in range(p):
            part = mx.gather_mm(
                x[..., j * k : (j + 1) * k],
                by_slice[:, j].swapaxes(-1, -2),
                rhs_indices=slots,
                sorted_indices=sort,
            )
            y = part if y is None else y + part
        return y

    def _one(self, x: mx.array, slot: int) -> mx.array:
        """Rows of one expert through its (maybe quantized) matrix."""
        if self.quant is None:
            return x @ self["weight"][slot].T
        biases = self.get("biases")
        return mx.quantized_matmul(
            x,
            self["weight"][slot],
            self["scales"][slot],
            biases[slot] if biases is not None else None,
            transpose=True,
            group_size=self.quant["group_size"],
            bits=self.quant["bits"],
            mode=self.quant["mode"],
        )


class ExpertMLP:
    """The local experts' MLP over rows: gate/up/down (glu) or fc1/fc2 (mlp), each projection a
    ShardLinear. Called through the modules, so the shard's parameters are read at call time."""

    def __init__(self, projections: Sequence[ShardLinear], kind: str, activation: Callable):
        self.projections = tuple(projections)  # gate, up, down (glu) or fc1, fc2 (mlp)
        self.kind = kind
        self.activation = activation
        self.gathered = not self.projections[-1].per_expert  # one gather_mm for all rows
        self._mlp = self._glu if kind == "glu" else self._two

    def __call__(self, x: mx.array, slots: mx.array, groups: Groups | None) -> mx.array:
        return self._mlp(x, slots, groups)

    def _glu(self, x, slots, groups):
        gate, up, down = self.projections
        return down(self.activation(up(x, slots, groups), gate(x, slots, groups)), slots, groups)

    def _two(self, x, slots, groups):
        fc1, fc2 = self.projections
        return fc2(self.activation(fc1(x, slots, groups)), slots, groups)

    @property
    def last(self) -> ShardLinear:
        return self.projections[-1]


class Gather:
    """The device-routed call: every (token, j) position through a local slot, one gather_mm (or
    gather_qmm) per projection; positions another node computes read a filler slot and are
    zeroed."""

    name = "device"

    def __init__(self, mlp: ExpertMLP):
        self.mlp = mlp

    def __call__(self, x: mx.array, r: Routed) -> mx.array:
        if r.alone:  # every position is ours, in stock's order
            # (..., 1, 1, D): every slot of a token reads its row, as SwitchGLU
            rows = mx.expand_dims(x, (-2, -3))
            if r.inds.size >= SORTED_FROM:
                return self._sorted(rows, r.slots)
            return self.mlp(rows, r.slots, None).squeeze(-2)
        rows = _rows(x, 2)  # the same, laid out plainly
        mine, safe = r.mine, r.safe  # uint32, as gather_mm takes it: no cast
        # keepalive none: another node's positions repeat a slot read anyway (the highest selected
        # here, safe's 0 at theirs; slot 0 where none is): a repeated expert's weights come from
        # cache, not memory (a layer of 16 local 12.6 MB experts ran 0.87x the time it took with
        # slot 0 as the filler on a 2-vCPU CPU), though a CPU still computes the row
        other = r.fill if r.fill is not None else safe.max()
        slots = mx.where(mine, safe, other)
        y = self.mlp(rows, slots, None).squeeze(-2)  # (..., k, out)
        return mx.where(mine[..., None], y, 0.0)  # a scalar zero: no array of zeros to fill

    def _sorted(self, rows: mx.array, slots: mx.array) -> mx.array:
        """Many rows (a prompt, a wide batch) alone: mlx-lm's SwitchGLU sorted path op for op (rows
        grouped by expert, gather_mm told so, then put back), so a lone node's prefill is stock's to
        the bit in every dtype (a GPU's sorted kernel rounds differently from its unsorted one)."""
        flat = slots.flatten()
        order = mx.argsort(flat)
        back = mx.argsort(order)
        y = self.mlp(rows.flatten(0, -3)[order // slots.shape[-1]], flat[order], None)
        return mx.unflatten(y[back], 0, slots.shape).squeeze(-2)


class Skip:
    """The device-routed call at N > 1 through the skip kernels (skip_gemv for bfloat16/float16
    weights, qskip for quantized ones): nothing is read for a position another node computes.
    Inputs of another dtype than the one checked at load take `fallback` (Gather)."""

    name = "skip"

    def __init__(self, mlp: ExpertMLP, dtype: mx.Dtype, fallback: Gather):
        self.mlp = mlp
        self.dtype = dtype
        self.fallback = fallback

    def __call__(self, x: mx.array, r: Routed) -> mx.array:
        if x.dtype != self.dtype:
            return self.fallback(x, r)
        if r.fill is None:  # nothing read for the positions another node computes
            return self._skipped(x, r.inds, r.slots)
        y = self._skipped(x, r.inds, mx.where(r.mine, r.slots, r.fill))  # fillers read, then zeroed
        return mx.where(r.mine[..., None], y, 0.0)

    def _skipped(self, x: mx.array, inds: mx.array, slots: mx.array) -> mx.array:
        """The MLP through the skip kernels: `slots` (..., k) local slot per position, -1 where none
        is read; (..., k, out)."""
        m = self.mlp
        k, x2, s = inds.shape[-1], x.reshape(-1, x.shape[-1]), slots.reshape(-1).astype(mx.int32)
        if m.kind == "glu":
            gate, up, down = m.projections
            h = m.activation(skip_proj(up, x2, s, k), skip_proj(gate, x2, s, k))
            y = skip_proj(down, h, s, 1)
        else:
            fc1, fc2 = m.projections
            y = skip_proj(fc2, m.activation(skip_proj(fc1, x2, s, k)), s, 1)
        return y.reshape(*inds.shape, y.shape[-1])


def skip_proj(p: ShardLinear, x: mx.array, slots: mx.array, per_x: int) -> mx.array:
    """One projection of the skipping decode step, by the kernel for its weight format."""
    if p.quant is None:
        return skip_gemv.skip_gemv(x, p.weight, slots, per_x)
    return qskip.qskip(x, qskip.QMatrix.of(p), slots, per_x)


def skip_fits(mlp: ExpertMLP) -> tuple[str | None, mx.Dtype | None]:
    """(why not, None) where a skip kernel cannot compute these projections, else (None, dtype):
    unbiased weights of a format a kernel takes, one bfloat16/float16 activation dtype, and the
    kernel's check at the weight's shape passed (on CUDA)."""
    projs = mlp.projections
    for p in projs:
        fits = qskip.fits(qskip.QMatrix.of(p)) if p.quant is not None else skip_gemv.fits(p.weight)
        if p.biased or not fits:
            return "biased, float32, odd-sized or unsupported quantized expert weights", None
    dtypes = {act_dtype(p) for p in projs}
    # float32 keeps gather_mm/gather_qmm: summed in the kernel's order, longcat_flash's float32
    # model was 3.2e-4 from stock at N = 2 (bound 1e-4), within it with gather_mm (skip_gemv.py)
    if len(dtypes) != 1 or not dtypes <= {mx.bfloat16, mx.float16}:
        return "expert projections of different dtypes", None
    for p in projs:
        why = qskip.check(qskip.QMatrix.of(p)) if p.quant is not None else skip_gemv.check(p.weight)
        if why:
            return why, None
    return None, dtypes.pop()


class HostRows:
    """The host-read call: the rows of the positions (and fillers) this node computes, grouped by
    slot, through the MLP round by round as the plan's expert cache fills its slots; every other
    position takes a zero row."""

    name = "host"

    def __init__(self, mlp: ExpertMLP):
        self.mlp = mlp

    def __call__(self, x: mx.array, h: Hosted) -> mx.array:
        out_shape = tuple(h.inds.shape) + (x.shape[-1],)
        if h.empty:
            return mx.zeros(out_shape, dtype=x.dtype)
        xf = x.reshape(-1, x.shape[-1])
        ys, src, base = [], np.full(h.positions_total, -1, dtype=np.int64), 0
        for rows in h.rounds():
            tokens = _rows(xf[mx.array(rows.tokens.astype(np.int32))], 1)
            slots = mx.array(rows.slots.astype(np.uint32))
            y = self.mlp(tokens, slots, groups(rows.slots))[:, 0, :]
            h.reading(y)  # evaluated before the next miss overwrites a slot it reads
            # started now, MLX computes the experts while Python builds the rest of the layer and
            # the next one's attention up to its host read, instead of after (one rank by stream,
            # 16 streams of 1,024 positions on the CPU: 55.8 -> 54.2 ms a step; docs/race.md)
            mx.async_eval(y)
            src[rows.positions] = base + rows.order
            base += len(rows.slots)
            ys.append(y)
        # Every position takes its row, or the appended zero row if another node computes it.
        # Filler rows are computed with the rest (one primitive) and then left out.
        src[src < 0] = base
        y = mx.concatenate(ys + [mx.zeros((1, ys[0].shape[-1]), dtype=ys[0].dtype)], axis=0)
        return y[mx.array(src.astype(np.int32))].reshape(out_shape)


class CountedRows:
    """The counted call (plan.CountedPlan): this node's positions and keepalive's fillers, sorted by
    slot on the device, as rows through the MLP, HostRows's rows in HostRows's order; every other
    position takes a zero row. The host knows only how many rows there are."""

    name = "host"

    def __init__(self, mlp: ExpertMLP):
        self.mlp = mlp

    def __call__(self, x: mx.array, c: Counted) -> mx.array:
        out_shape = tuple(c.inds.shape) + (x.shape[-1],)
        if c.n == 0:
            return mx.zeros(out_shape, dtype=x.dtype)
        computed = c.order[: c.n]  # the positions with a row: this node's and its fillers
        xf = x.reshape(-1, x.shape[-1])
        rows = _rows(xf[computed // c.inds.shape[-1]], 1)
        y = self.mlp(rows, c.slots[computed].astype(mx.uint32), None)[:, 0, :]
        mx.async_eval(y)  # as HostRows: the experts run while Python builds what follows
        # each position's row among the sorted ones; the zero row after them where the output is
        # another node's (fillers' rows included)
        place = mx.where(c.mine, mx.argsort(c.order), c.n)
        y = mx.concatenate([y, mx.zeros((1, y.shape[-1]), dtype=y.dtype)], axis=0)
        return y[place].reshape(out_shape)


def _rows(x: mx.array, axes: int) -> mx.array:
    """Rows (..., D) as gather_mm takes them, `axes` axes of 1 before D, by reshape: MLX's CPU
    backend multiplies a `[:, None, :]` or expand_dims view of the same rows through a BLAS call
    about half as fast (OpenBLAS, 8 MoE layers of 64 rows through 512 x 192 experts: 68 ms against
    34; with the reference BLAS both forms run alike; docs/race.md)."""
    return x.reshape(*x.shape[:-1], *(1,) * axes, x.shape[-1])


def groups(slots: np.ndarray) -> list[tuple[int, int, int]]:
    """Runs of equal slot in sorted rows: [(slot, start, end)]."""
    if len(slots) == 0:
        return []
    edges = np.flatnonzero(np.diff(slots)) + 1
    starts = np.concatenate([[0], edges])
    ends = np.concatenate([edges, [len(slots)]])
    return [(int(slots[a]), int(a), int(b)) for a, b in zip(starts, ends)]


def out_dim(lin: ShardLinear) -> int:
    return lin.weight.shape[1]


def act_dtype(lin: ShardLinear) -> mx.Dtype:
    if lin.quant is not None:
        floating = (mx.float32, mx.float16, mx.bfloat16)
        return lin.scales.dtype if lin.scales.dtype in floating else mx.float32
    return lin.weight.dtype
