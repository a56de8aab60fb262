"""Bookkeeping of a node's all-reduce steps: which partials arrived, which are early, which are old.

Pure logic, no I/O. Nodes run in lock-step, so a peer is at most one step ahead of this node (it
cannot finish a step without this node's partial): frames for the step this node has not submitted
yet, or for a request it has not begun yet, are kept until it does. Frames of a request that ended
here (finished or aborted) are dropped. A frame twice for the same step, or one whose layer, dtype
or shape disagrees with this node's, fails the request: nothing is silently lost, duplicated or
reordered.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ...proto.errors import ErrorKind, MoeClusterError
from ...proto.frame import Frame
from .reduce import DTYPES


class StepError(MoeClusterError):
    """A step that cannot complete; the message names the step and the offending rank."""

    kind = ErrorKind.UNAVAILABLE


@dataclass
class Pending:
    """The step this node submitted and waits on."""

    request_id: str
    step: int
    layer: int
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    started: float  # time.monotonic() at submit
    parts: list = field(default_factory=list)  # raw payload per rank, None until it arrives
    arrived: int = 1  # parts in (this node's own counts)

    def missing(self) -> list[int]:
        return [r for r, p in enumerate(self.parts) if p is None]


class Complete(NamedTuple):
    """A step with every rank's partial, ready to reduce in rank order (a tuple: made once per
    all-reduce, where a frozen dataclass's checked init costs more)."""

    step: int
    dtype: str
    nbytes: int
    parts: list  # raw 1-D payloads in rank order


class StepTable:
    def __init__(
        self, rank: int, world_size: int, *, history: int = 1024, max_early: int | None = None
    ):
        self.rank = rank
        self.world_size = world_size
        self.current: str | None = None
        self.next_step = 0
        self.pending: Pending | None = None
        self.failed: str | None = None  # why the current request failed
        self.dropped = 0  # frames of ended requests, dropped
        self.evicted = (
            0  # early frames pushed out by newer ones (a peer ran a request we never began)
        )
        self._history = history
        self._max_early = max_early if max_early is not None else 4 * world_size
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._early: OrderedDict[tuple[str, int], dict[int, Frame]] = OrderedDict()

    def begin(self, request_id: str) -> None:
        """Start `request_id`: the previous request ends here; its frames are dropped from now on."""
        if self.current is not None and self.current != request_id:
            self._ended[self.current] = None
            while len(self._ended) > self._history:
                self._ended.popitem(last=False)
        self._ended.pop(request_id, None)  # an id may be reused once its request has ended
        for key in [k for k in self._early if k[0] != request_id]:
            if key[0] in self._ended:
                self.dropped += len(self._early.pop(key))
        self.current = request_id
        self.next_step = 0
        self.pending = None
        self.failed = None

    def fail(self, reason: str) -> None:
        """The current request failed here; later steps of it fail at once with `reason`."""
        self.failed = reason
        self.pending = None

    def submit(
        self, step: int, layer: int, dtype: str, shape: tuple[int, ...], payload: np.ndarray
    ) -> Complete | None:
        """This node's partial for `step`; returns the complete step if every peer's frame is in."""
        self.admit(step)
        parts = [None] * self.world_size
        parts[self.rank] = payload
        self.pending = Pending(
            self.current, step, layer, dtype, tuple(shape), payload.nbytes, time.monotonic(), parts
        )
        for frame in self._early.pop((self.current, step), {}).values():
            self._accept(frame)
        return self._complete()

    def admit(self, step: int) -> None:
        """StepError unless this node may submit `step` now (it sends its frame before it
        submits)."""
        if self.current is None:
            raise StepError("no request begun: an all-reduce needs begin(request_id) first")
        if self.failed is not None:
            raise StepError(f"request {self.current} already failed: {self.failed}")
        if self.pending is not None:
            raise StepError(
                f"step {step} submitted while step {self.pending.step} of request {self.current} is pending"
            )
        if step != self.next_step:
            raise StepError(
                f"node submitted step {step} of request {self.current}, expected step {self.next_step}"
            )

    def receive(self, frame: Frame) -> Complete | None:
        """A peer's frame; returns the complete step if it was the last one missing."""
        if not 0 <= frame.rank < self.world_size or frame.rank == self.rank:
            raise StepError(
                f"frame claims rank {frame.rank} (world size {self.world_size}, this is rank {self.rank})"
            )
        if frame.request_id in self._ended or (
            frame.request_id == self.current and self.failed is not None
        ):
            self.dropped += 1
            return None
        p = self.pending
        if frame.request_id == self.current:
            at = self.next_step if p is None else p.step  # the step this node is on
            if frame.step < at:
                raise StepError(
                    f"rank {frame.rank} sent step {frame.step} of request {frame.request_id} "
                    f"again (this node is at step {at})"
                )
            if p is not None and frame.step == p.step:
                self._accept(frame)
                return self._complete()
            # a peer may have finished the pending step already (it has this node's frame), not more
            if frame.step > at + (p is not None):
                raise StepError(
                    f"rank {frame.rank} is ahead: it sent step {frame.step} of request "
                    f"{frame.request_id} while this node is at step {at}"
                )
        self._keep_early(frame)
        return None

    def take(self, rank: int, part: np.ndarray) -> Complete | None:
        """`rank`'s partial for the pending step, from a frame its caller matched byte for byte
        against this node's own header for it (request, step, layer, dtype, shape); returns the
        complete step if it was the last one missing."""
        p = self.pending
        if p.parts[rank] is not None:
            raise StepError(f"rank {rank} sent step {p.step} of request {p.request_id} twice")
        p.parts[rank] = part
        p.arrived += 1
        return self._complete()

    def _keep_early(self, frame: Frame) -> None:
        slot = self._early.setdefault((frame.request_id, frame.step), {})
        if frame.rank in slot:
            raise StepError(
                f"rank {frame.rank} sent step {frame.step} of request {frame.request_id} twice"
            )
        slot[frame.rank] = frame
        while sum(len(v) for v in self._early.values()) > self._max_early:
            _, gone = self._early.popitem(last=False)
            self.evicted += len(gone)

    def _accept(self, frame: Frame) -> None:
        p = self.pending
        assert p is not None and frame.request_id == p.request_id and frame.step == p.step
        if p.parts[frame.rank] is not None:
            raise StepError(f"rank {frame.rank} sent step {p.step} of request {p.request_id} twice")
        if frame.layer != p.layer or frame.dtype != p.dtype or tuple(frame.shape) != p.shape:
            raise StepError(
                f"rank {frame.rank} is out of step at step {p.step} of request {p.request_id}: it sent layer "
                f"{frame.layer} {frame.dtype}{list(frame.shape)}, this node has layer {p.layer} {p.dtype}{list(p.shape)}"
            )
        if len(frame.payload) != p.nbytes:
            raise StepError(
                f"rank {frame.rank} sent {len(frame.payload)} bytes for step {p.step} of request "
                f"{p.request_id}, this node has {p.nbytes}"
            )
        p.parts[frame.rank] = np.frombuffer(frame.payload, dtype=DTYPES[p.dtype])
        p.arrived += 1

    def _complete(self) -> Complete | None:
        p = self.pending
        if p is None or p.arrived < self.world_size:
            return None
        self.pending = None
        self.next_step = p.step + 1
        return Complete(p.step, p.dtype, p.nbytes, p.parts)
