"""The collective interface nodes use once per MoE layer, and the trivial one-node case.

`all_reduce(partial, layer) -> total` is all a node needs: every rank passes its partial MoE
output and gets back the sum of all ranks' partials, added in rank order in float32 so every node
holds the same bytes. The transports (shared memory, envoy, `mx.distributed`) implement the same
interface in node/collective/.

The token agreement rides on that all-reduce too: after sampling, a node hands its (lazy) token
and its cancel flag to `ride`, the next MoE all-reduce carries them beside the partial, and
`settle` then says what every rank sampled (`Agreement`). No separate round trip per token.
"""

from __future__ import annotations

from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

import ml_dtypes
import mlx.core as mx
import numpy as np

from ...proto.errors import ErrorKind, MoeClusterError
from .reduce import DTYPES, Reducer, to_float32


# The layer id of the per-step agreement on the next token and on cancellation.
TOKEN_LAYER = -1

_MX_WIRE = {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16"}
_NP_RAW = {
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": np.uint16,
}  # numpy dtype of the raw bytes


class CollectiveError(MoeClusterError):
    """An all-reduce that could not complete (a peer died, stalled or sent something wrong)."""

    kind = ErrorKind.UNAVAILABLE


class TokenMismatch(CollectiveError):
    """Two nodes sampled different tokens at the same step: their logits differ (mixed hardware
    rounding replicated attention differently, or a bug). Stopping beats silent drift."""

    kind = ErrorKind.INTERNAL


@dataclass(frozen=True)
class Agreement:
    """What every rank put on one agreement (index = rank): a vector of small non-negative ints
    (a running batch rides its queue, cancel flags and tokens: node/batch.py)."""

    values: tuple[tuple[int, ...], ...]

    def any_set(self, index: int) -> bool:
        """Whether any rank's value at `index` is non-zero (a flag one rank may raise alone)."""
        return any(v[index] for v in self.values)

    def token(self, index: int, what: str, offset: int = 0) -> int:
        """The token every rank put at `index` (less `offset`); TokenMismatch naming `what` and both
        tokens where a rank's is not rank 0's: stopping beats silent drift."""
        column = [v[index] - offset for v in self.values]
        for rank, token in enumerate(column):
            if token != column[0]:
                raise TokenMismatch(
                    f"{what}: rank {rank} sampled token {token}, rank 0 sampled "
                    f"{column[0]} (the nodes' logits differ)"
                )
        return column[0]


# On a summing transport each value travels as three base-256 digits (exact in bfloat16, whose
# 8-bit significand holds integers up to 256). Each rank fills only its own slots, so the sum holds
# every rank's values.
RIDE_DIGITS = 3
RIDE_MAX_TOKEN = 1 << 24  # values from here on do not fit three digits


def ride_slots(rank: int, world_size: int, values: mx.array, dtype) -> mx.array:
    """This rank's (world_size * n * RIDE_DIGITS,) contribution to a summed agreement of n values."""
    v = values.reshape(-1).astype(mx.int32)
    mine = mx.stack([v % 256, (v // 256) % 256, v // 65536], axis=1).reshape(-1)
    before = mx.zeros((rank * mine.size,), mx.int32)
    after = mx.zeros(((world_size - rank - 1) * mine.size,), mx.int32)
    return mx.concatenate([before, mine, after]).astype(dtype)


def read_slots(summed, world_size: int) -> Agreement:
    """The Agreement in the sum of every rank's `ride_slots` (any float or int sequence)."""
    d = [int(x) for x in summed]
    per_rank = len(d) // world_size
    values = []
    for r in range(world_size):
        mine = d[r * per_rank : (r + 1) * per_rank]
        values.append(
            tuple(
                mine[i] + 256 * mine[i + 1] + 65536 * mine[i + 2]
                for i in range(0, per_rank, RIDE_DIGITS)
            )
        )
    return Agreement(tuple(values))


_BF16 = np.dtype(ml_dtypes.bfloat16)


class Rider:
    """A node's values (an int vector, lazy) waiting for the next MoE all-reduce, and what came back.

    The transports own one each: `take` hands the pending ride to the all-reduce of a MoE layer
    (never to the explicit agreement of TOKEN_LAYER), which `carried` a way to read the Agreement.
    Summing transports append `ride_slots` to the partial (`attach`) and read them back (`detach`).
    """

    def __init__(self, rank: int, world_size: int) -> None:
        self._rank = rank
        self._world_size = world_size
        self._pending: mx.array | None = None
        self._carried: deque[Callable[[], Agreement]] = deque()

    def ride(self, values: mx.array) -> None:
        self._pending = values

    def take(self, layer: int) -> mx.array | None:
        if layer < 0:
            return None
        pending, self._pending = self._pending, None
        return pending

    def carried(self, read: Callable[[], Agreement]) -> None:
        self._carried.append(read)

    def attach(self, partial: mx.array, layer: int) -> tuple[mx.array, int]:
        """(what a summing transport sends, how many ride values follow the partial in it)."""
        ride = self.take(layer)
        if ride is None:
            return partial, 0
        extra = ride_slots(self._rank, self._world_size, ride, partial.dtype)
        return mx.concatenate([partial.reshape(-1), extra]), extra.size

    def detach(self, total: np.ndarray, dtype: str, extra: int) -> np.ndarray:
        """The partial's part of a summed raw payload; the Agreement in the rest is kept (copied)."""
        if not extra:
            return total
        total = total.reshape(-1)
        agreement = read_slots(to_float32(total[-extra:], dtype), self._world_size)
        self._carried.append(lambda: agreement)
        return total[:-extra]

    def settle(self) -> Agreement | None:
        """The oldest carried Agreement (waits for it), or None where no all-reduce carried one."""
        if not self._carried:
            self._pending = None
            return None
        return self._carried.popleft()()

    def clear(self) -> None:
        self._pending = None
        self._carried.clear()


@dataclass(frozen=True)
class Capabilities:
    """What a transport's all-reduce is, declared once by its class: the MoE layer's hand-over
    (node/moe/combine.py) is chosen from it when the node loads, never probed per call."""

    # all_reduce is itself a graph operation (one node; mx.distributed): the layer hands it the
    # lazy partial and the step stays one graph. Otherwise the partial is evaluated and handed over.
    in_graph: bool
    # start(partial, layer) hands the partial over and returns the wait for its sum: the two halves
    # apart, so another micro-batch computes while it travels (node/overlap.py)
    halves: bool = False


class Epochs:
    """A collective's numbering of the running batch's epochs (from idle to idle): numbered per
    collective, not per batch, since one transport may serve the batches of several models in turn
    (simulate), and an epoch id it has seen before is not a new epoch."""

    epoch = 0

    def begin_epoch(self) -> str:
        """Begin the next epoch (`begin` with its id) and return its id, the same on every rank."""
        self.epoch += 1
        self.begin(self.epoch_id)
        return self.epoch_id

    @property
    def epoch_id(self) -> str:
        return f"batch-{self.epoch}"


class Collective(Protocol):
    rank: int
    world_size: int
    caps: Capabilities

    def begin(self, request_id: str) -> None:
        """Start a request: frames of any earlier request are dropped from here on."""

    def begin_epoch(self) -> str:
        """Begin the running batch's next epoch (Epochs); its id."""

    epoch_id: str

    def all_reduce(self, partial: mx.array, layer: int) -> mx.array:
        """Sum `partial` over all ranks (rank order, float32) and return it in its dtype."""

    def all_gather(self, rows: mx.array, counts: tuple[int, ...], layer: int) -> mx.array:
        """Every rank's rows in rank order, (sum(counts), D): rank r brings counts[r] (attention
        by stream: each node's own streams' rows, gathered for the experts)."""

    def reduce_scatter(self, partial: mx.array, counts: tuple[int, ...], layer: int) -> mx.array:
        """The ranks' partials (sum(counts), D) summed over this rank's rows: (counts[rank], D)."""

    def ride(self, values: mx.array) -> None:
        """Carry this node's values (int32 vector, lazy; the same length on every rank) on the next
        MoE all-reduce."""

    def settle(self) -> Agreement | None:
        """What the oldest ride came back with; None where no all-reduce carried it."""

    def watch(self, what: str | None, cold: bool = False) -> None:
        """Arm (a description of the wait) or disarm (None) the stall guard while the node waits on
        a result that needs the peers; arming again restarts the clock. `cold`: the wait may build
        kernels (a step of a shape this node has not run yet), so it gets the longer bound. A no-op
        where the transport times out by itself."""

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
    """A raw payload -> a new mx array (a copy), evaluated: bfloat16 bits go in as ml_dtypes'
    bfloat16, which MLX copies as they are (a `view` op would cost an evaluation of its own)."""
    if dtype == "bfloat16":
        raw = raw.view(_BF16)
    return mx.array(raw.reshape(shape))


class LocalCollective(Epochs):
    """One node alone: the sum of one partial is itself."""

    rank = 0
    world_size = 1
    caps = Capabilities(in_graph=True)  # nothing to evaluate before the "sum"

    def begin(self, request_id: str) -> None:
        pass

    def all_reduce(self, partial: mx.array, layer: int) -> mx.array:
        return partial

    def all_gather(self, rows: mx.array, counts: tuple[int, ...], layer: int) -> mx.array:
        return rows

    def reduce_scatter(self, partial: mx.array, counts: tuple[int, ...], layer: int) -> mx.array:
        return partial

    def ride(self, values: mx.array) -> None:
        pass  # alone there is nobody to agree with

    def settle(self) -> Agreement | None:
        return None

    def watch(self, what: str | None, cold: bool = False) -> None:
        pass

    def failure(self) -> str | None:
        return None

    def abort(self, request_id: str) -> None:
        pass  # nothing to wait for

    def close(self) -> None:
        pass


class HostCollective(Epochs):
    """What the transports whose exchange runs on the host (shared memory, the envoy) share: the
    all-reduce in two halves (`start`, theirs) and whole, the agreement riding on a MoE
    all-reduce (`Rider`), and `all_gather` and `reduce_scatter` of rows (attention by stream),
    each one exchange of every rank's raw payload (`_exchange`, theirs) through `_parts`.

    Every rank's rows are padded to the largest count, so every payload of one exchange has one
    size (what the transports check)."""

    caps = Capabilities(in_graph=False, halves=True)

    def __init__(self, rank: int, world_size: int, reduce: Reducer) -> None:
        self.rank = rank
        self.world_size = world_size
        self._reduce = reduce  # the rank-order sum on the host
        self._rider = Rider(rank, world_size)

    def all_reduce(self, partial: mx.array, layer: int) -> mx.array:
        return self.start(partial, layer)()

    def ride(self, values: mx.array) -> None:
        self._rider.ride(values)

    def settle(self) -> Agreement | None:
        return self._rider.settle()

    def all_gather(self, rows: mx.array, counts: tuple[int, ...], layer: int) -> mx.array:
        """Every rank's rows, in rank order: (sum(counts), D), this rank's (counts[rank], D)."""
        width = rows.shape[-1]
        most = max(counts)
        padded = rows if rows.shape[0] == most else _pad_rows(rows, most)
        parts, dtype = self._parts(padded, layer)
        out = np.concatenate([p[: n * width] for p, n in zip(parts, counts)])
        return from_wire(out, dtype, (sum(counts), width))

    def reduce_scatter(self, partial: mx.array, counts: tuple[int, ...], layer: int) -> mx.array:
        """The rank-order float32 sum of every rank's `partial` (sum(counts), D) over this rank's
        rows: (counts[rank], D)."""
        width = partial.shape[-1]
        start = sum(counts[: self.rank]) * width
        stop = start + counts[self.rank] * width
        parts, dtype = self._parts(partial, layer)
        out = self._reduce(
            [p[start:stop] for p in parts], dtype, np.empty(stop - start, DTYPES[dtype])
        )
        return from_wire(out, dtype, (counts[self.rank], width))

    def _parts(self, payload: mx.array, layer: int) -> tuple[list[np.ndarray], str]:
        """Every rank's raw payload of one exchange (the ride read off their tails)."""
        payload, extra = self._rider.attach(payload, layer)
        raw, dtype = to_wire(payload)
        parts = self._exchange(raw.reshape(-1), dtype, tuple(payload.shape), layer)
        if extra:
            tails = [p[-extra:] for p in parts]
            summed = self._reduce.sum_float32(tails, dtype, np.empty(extra, np.float32))
            self._rider.detach(summed, "float32", extra)
            parts = [p[:-extra] for p in parts]
        return parts, dtype


def _pad_rows(rows: mx.array, n: int) -> mx.array:
    """`rows` (m, D) with zero rows after them up to n."""
    return mx.concatenate([rows, mx.zeros((n - rows.shape[0], rows.shape[-1]), rows.dtype)])


def rank_order_sum(parts: list[mx.array]) -> mx.array:
    """Partials added in rank order in float32, cast back: in-graph, the same bytes as
    `reduce.Reducer` (which rounds as MLX casts), so every transport gives the same logits."""
    total = parts[0].astype(mx.float32)
    for p in parts[1:]:
        total = total + p.astype(mx.float32)
    return total.astype(parts[0].dtype)


def rank_order_sum_rows(parts: mx.array) -> mx.array:
    """`rank_order_sum` of the rows of `parts` (N, ...), rank r's partial in row r (an all-gather's
    output): the same bytes, cast to float32 once and split into views, where indexing each row and
    casting it would launch 2N kernels; (1, ...)."""
    rows = mx.split(parts.astype(mx.float32), parts.shape[0])
    return rank_order_sum(rows).astype(parts.dtype)  # float32 rows: its casts are no-ops


@contextmanager
def waiting(collective: Collective, what: str, cold: bool = False) -> Iterator[None]:
    """The stall guard armed while the node waits on a result that needs the peers (`cold`: one
    that may build kernels, Collective.watch)."""
    collective.watch(what, cold)
    try:
        yield
    finally:
        collective.watch(None)


def agree(collective: Collective, values) -> Agreement:
    """One explicit round trip: every rank's values (where no MoE all-reduce carried the ride).
    The caller watches the wait (`waiting`)."""
    values = values if isinstance(values, mx.array) else mx.array(values, dtype=mx.int32)
    mine = ride_slots(collective.rank, collective.world_size, values, mx.float32)
    return read_slots(collective.all_reduce(mine, TOKEN_LAYER).tolist(), collective.world_size)
