"""The reduction every transport shares: sum partials in rank order in float32, cast back.

Summing in a fixed order in float32 gives every node the same bytes whichever node does it.
Only numpy here, so the envoy process stays light.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

# Wire dtype names -> numpy dtype holding the raw bytes. bfloat16 travels as uint16 bit patterns.
DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(np.uint16),
}


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
            out[nan] = 0x7FC0
        return out
    return x.astype(DTYPES[dtype], copy=False)


def reduce_sum(partials: Sequence[np.ndarray], dtype: str) -> np.ndarray:
    """Sum raw payloads in the given (rank) order in float32; returns the raw payload of the sum."""
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r} (expected one of {', '.join(DTYPES)})")
    acc = to_float32(partials[0], dtype).copy()
    for p in partials[1:]:
        acc += to_float32(p, dtype)
    return from_float32(acc, dtype)
