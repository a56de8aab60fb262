"""The reduction every transport shares: sum partials in rank order in float32, cast back.

Summing in a fixed order in float32 gives every node the same bytes whichever node does it.
Only numpy (and ml_dtypes' bfloat16 casts) here, and for bfloat16, the common activation dtype,
_sum.c where the install could build it: the same bytes, 8x faster at a decode step's 6,144 values
on 2 vCPUs (docs/envoy.md).
"""

from __future__ import annotations

from typing import Sequence

import ml_dtypes
import numpy as np

try:
    from . import _sum as BUILT  # _sum.c: built by `pip install` where there is a C compiler
except ImportError:
    BUILT = None

# Wire dtype names -> numpy dtype holding the raw bytes. bfloat16 travels as uint16 bit patterns.
DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(np.uint16),
}

_BF16 = np.dtype(ml_dtypes.bfloat16)
_BF16_NAN = 0x7FC0  # what MLX writes for any NaN cast to bfloat16
_F16_NAN = 0x7D00  # what MLX writes for a NaN cast to float16, with the NaN's sign bit added


def unbuilt_note() -> str | None:
    """One line for a node to print where the install could not build node/collective/_sum.c
    (pip hides the build's warning), else None."""
    if BUILT is not None:
        return None
    return (
        "node/collective/_sum.c was not built (no C compiler at install?): bfloat16 all-reduces "
        "are summed in numpy, 1.4-2x slower on small machines; install again with one "
        "(docs/CONTRIBUTING.md)"
    )


def _fix_f16_nans(acc: np.ndarray, out: np.ndarray) -> None:
    """numpy keeps a NaN's payload bits when casting to float16; MLX writes 0x7D00 | sign."""
    nan = np.isnan(acc)
    if nan.any():
        sign = ((acc[nan].view(np.uint32) >> 16) & 0x8000).astype(np.uint16)
        out.view(np.uint16)[nan] = sign | _F16_NAN


def to_float32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Raw payload (as stored for `dtype`) -> float32 values."""
    if dtype == "bfloat16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32, copy=False)


def from_float32(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values -> raw payload of `dtype` (round to nearest even, as MLX casts)."""
    if dtype == "bfloat16":
        u = x.view(np.uint32)
        out = ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
        nan = np.isnan(x)
        if nan.any():
            out[nan] = _BF16_NAN
        return out
    out = x.astype(DTYPES[dtype], copy=False)
    if dtype == "float16" and out is not x:
        _fix_f16_nans(x, out)
    return out


class Reducer:
    """`reduce_sum` with scratch buffers kept between calls (one instance per thread).

    A decode step reduces a few thousand values, where numpy's per-call overhead dominates, so
    this does the fewest ufunc calls that give the same bytes as `to_float32`/`from_float32`:
    every call writes into a preallocated buffer, and the NaN fix-up of the bfloat16 cast runs
    only when a cheap check (a float sum, which any NaN or infinity turns non-finite) says so.

    Args:
        native: sum bfloat16 in _sum.c where it was built (False: numpy's path, the same bytes,
            as an install without a C compiler sums; to compare the two).
    """

    def __init__(self, native: bool = True) -> None:
        self.native = BUILT if native else None
        self._size = 0
        self._acc = np.empty(0, np.float32)

    def native_sums(self, dtype: str) -> bool:
        """Whether this reducer sums `dtype`'s partials in _sum.c (else in numpy)."""
        return dtype == "bfloat16" and self.native is not None

    def _scratch(self, n: int) -> np.ndarray:
        if n > self._size:
            self._size = n
            self._acc = np.empty(n, np.float32)
        return self._acc[:n]

    def __call__(
        self, partials: Sequence[np.ndarray], dtype: str, out: np.ndarray | None = None
    ) -> np.ndarray:
        """Sum raw payloads in the given (rank) order in float32; returns the raw payload of the sum.

        Args:
            partials: 1-D raw payloads of equal length, numpy dtype `DTYPES[dtype]`, in rank order.
            dtype: wire dtype name ("float32", "float16" or "bfloat16").
            out: optional 1-D buffer of `DTYPES[dtype]` to write the sum into (returned).
        """
        n = _check(partials, dtype)
        if out is None:
            out = np.empty(n, DTYPES[dtype])
        if dtype == "bfloat16" and self.native is not None:
            self.native.bfloat16(out, partials)
            return out
        if dtype == "float32":
            return self._sum(partials, dtype, out)
        acc = self._sum(partials, dtype, self._scratch(n))
        if dtype == "float16":
            np.copyto(out, acc, casting="unsafe")
            if not np.isfinite(np.add.reduce(acc)):
                _fix_f16_nans(acc, out)
            return out
        # bfloat16: ml_dtypes' cast rounds to nearest even, as MLX does, in one pass (the shifts and
        # adds of the same rule in plain numpy took six)
        # only NaNs need fixing after the rounding (infinities round to themselves; MLX writes every
        # NaN as 0x7FC0, ml_dtypes keeps its sign), and maximum propagates NaN: one cheap pass
        peak = np.maximum.reduce(acc)
        has_nan = peak != peak  # a scalar's own compare: np.isnan on it costs a ufunc call
        np.copyto(out.view(_BF16), acc, casting="unsafe")
        if has_nan:
            out[np.isnan(acc)] = _BF16_NAN
        return out

    def sum_float32(
        self, partials: Sequence[np.ndarray], dtype: str, out: np.ndarray
    ) -> np.ndarray:
        """The rank-order float32 sum of raw `dtype` payloads into `out` (float32, `n` values), not
        rounded back (the ride's slots: node/collective/envoy.py)."""
        _check(partials, dtype)
        return self._sum(partials, dtype, out)

    def _sum(self, partials: Sequence[np.ndarray], dtype: str, out: np.ndarray) -> np.ndarray:
        if len(partials) == 1:
            np.copyto(
                out,
                partials[0].view(_BF16) if dtype == "bfloat16" else partials[0],
                casting="unsafe",
            )
            return out
        if dtype == "float32":
            np.add(partials[0], partials[1], out=out)
            for p in partials[2:]:
                np.add(out, p, out=out)
            return out
        if dtype == "float16":
            np.copyto(out, partials[0])
            for p in partials[1:]:
                np.add(out, p, out=out, dtype=np.float32)
            return out
        # bfloat16: ml_dtypes' casts widen exactly, inside the float32 add's own buffered loop (no
        # pass of its own per partial: a 32-token sum of two went from 70 to 57 us on this VM)
        np.add(partials[0].view(_BF16), partials[1].view(_BF16), out=out, dtype=np.float32)
        for p in partials[2:]:
            np.add(out, p.view(_BF16), out=out, dtype=np.float32)
        return out


def _check(partials: Sequence[np.ndarray], dtype: str) -> int:
    """The values per partial; ValueError for an unknown dtype or partials of unequal length."""
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r} (expected one of {', '.join(DTYPES)})")
    n = partials[0].size
    for i, p in enumerate(partials):
        if p.size != n:
            raise ValueError(f"partial {i} has {p.size} values, partial 0 has {n}")
    return n


_default = Reducer()


def reduce_sum(
    partials: Sequence[np.ndarray], dtype: str, out: np.ndarray | None = None
) -> np.ndarray:
    """Sum raw payloads in the given (rank) order in float32; returns the raw payload of the sum.

    Not thread-safe (it shares one Reducer's scratch buffers); threads make their own `Reducer`.
    """
    return _default(partials, dtype, out)
