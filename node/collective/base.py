"""The collective interface nodes use once per MoE layer, and the trivial one-node case.

`all_reduce(partial, layer) -> total` is all a node needs: every rank passes its partial MoE
output and gets back the sum of all ranks' partials, added in rank order in float32 so every node
holds the same bytes. The transports (shared memory, envoy, `mx.distributed`) implement the same
interface in node/transports/.
"""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx
import numpy as np

from ...proto.errors import ErrorKind, MoeClusterError


# The layer id of the per-step agreement on the next token and on cancellation.
TOKEN_LAYER = -1

_MX_WIRE = {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16"}
_NP_RAW = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}  # numpy dtype of the raw bytes


class CollectiveError(MoeClusterError):
    """An all-reduce that could not complete (a peer died, stalled or sent something wrong)."""

    kind = ErrorKind.UNAVAILABLE


class Cancelled(MoeClusterError):
    """The cluster agreed to stop the current generation."""

    kind = ErrorKind.CANCELLED


class Collective(Protocol):
    rank: int
    world_size: int
    # True where all_reduce is itself a graph operation (one node; mx.distributed): the MoE layer
    # then hands it the lazy partial. Otherwise the partial is evaluated first and handed over.
    in_graph: bool

    def begin(self, request_id: str) -> None:
        """Start a request: frames of any earlier request are dropped from here on."""

    def all_reduce(self, partial: mx.array, layer: int) -> mx.array:
        """Sum `partial` over all ranks (rank order, float32) and return it in its dtype."""

    def close(self) -> None: ...

    def abort(self, request_id: str) -> None:
        """Request `request_id` failed elsewhere: its waiting and later steps fail at once. Called
        from another thread than the one in all_reduce; a no-op where the transport cannot."""

    def failure(self) -> str | None:
        """Why this collective can no longer run (its process exited), or None while it can."""
        ...


def to_wire(x: mx.array) -> tuple[np.ndarray, str]:
    """An mx array -> (raw numpy payload, wire dtype name)."""
    dtype = _MX_WIRE.get(x.dtype)
    if dtype is None:
        raise CollectiveError(f"cannot all-reduce dtype {x.dtype}")
    buf = memoryview(x)  # evaluates x; bfloat16 exports as itself, which numpy reads as raw uint16
    if buf.c_contiguous:  # zero-copy: skips the eval of a `view` op (~20 us per call)
        return np.frombuffer(buf, dtype=_NP_RAW[dtype]).reshape(x.shape), dtype
    if dtype == "bfloat16":
        x = x.view(mx.uint16)
    return np.asarray(x), dtype


def from_wire(raw: np.ndarray, dtype: str, shape) -> mx.array:
    out = mx.array(raw.reshape(shape))
    return out.view(mx.bfloat16) if dtype == "bfloat16" else out


class LocalCollective:
    """One node alone: the sum of one partial is itself."""

    rank = 0
    world_size = 1
    in_graph = True  # all_reduce is a graph operation: nothing to evaluate before it

    def begin(self, request_id: str) -> None:
        pass

    def all_reduce(self, partial: mx.array, layer: int) -> mx.array:
        return partial

    def failure(self) -> str | None:
        return None

    def abort(self, request_id: str) -> None:
        pass  # nothing to wait for

    def close(self) -> None:
        pass


def agree(collective: Collective, token: int, cancel: bool) -> tuple[int, bool]:
    """Every node takes rank 0's token; any node's cancel stops all of them at the same step."""
    mine = mx.array([float(token) if collective.rank == 0 else 0.0, 1.0 if cancel else 0.0], dtype=mx.float32)
    total = collective.all_reduce(mine, TOKEN_LAYER).tolist()
    return int(total[0]), total[1] > 0
