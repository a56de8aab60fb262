"""The collective interface nodes use once per MoE layer, and its in-machine implementations.

`all_reduce(partial, layer) -> total` is all a node needs: every rank passes its partial MoE
output and gets back the sum of all ranks' partials, added in rank order in float32 so every node
holds the same bytes. The envoy (gRPC) and `mx.distributed` transports implement the same
interface in their own modules.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Protocol

import mlx.core as mx
import numpy as np

from ..envoy.reduce import DTYPES, reduce_sum

# The layer id of the per-step agreement on the next token and on cancellation.
TOKEN_LAYER = -1

_MX_WIRE = {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16"}


class CollectiveError(RuntimeError):
    """An all-reduce that could not complete (a peer died, stalled or sent something wrong)."""


class Cancelled(Exception):
    """The cluster agreed to stop the current generation."""


class Collective(Protocol):
    rank: int
    world_size: int

    def begin(self, request_id: str) -> None:
        """Start a request: frames of any earlier request are dropped from here on."""

    def all_reduce(self, partial: mx.array, layer: int) -> mx.array:
        """Sum `partial` over all ranks (rank order, float32) and return it in its dtype."""

    def close(self) -> None: ...


def to_wire(x: mx.array) -> tuple[np.ndarray, str]:
    """An mx array -> (raw numpy payload, wire dtype name)."""
    dtype = _MX_WIRE.get(x.dtype)
    if dtype is None:
        raise CollectiveError(f"cannot all-reduce dtype {x.dtype}")
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

    def begin(self, request_id: str) -> None:
        pass

    def all_reduce(self, partial: mx.array, layer: int) -> mx.array:
        return partial

    def close(self) -> None:
        pass


def agree(collective: Collective, token: int, cancel: bool) -> tuple[int, bool]:
    """Every node takes rank 0's token; any node's cancel stops all of them at the same step."""
    mine = mx.array([float(token) if collective.rank == 0 else 0.0, 1.0 if cancel else 0.0], dtype=mx.float32)
    total = collective.all_reduce(mine, TOKEN_LAYER).tolist()
    return int(total[0]), total[1] > 0


# ---------------------------------------------------------------------------------------------
# Shared memory between processes of one machine (simulate, tests)


@dataclass(frozen=True)
class ShmSpec:
    """What a process needs to join a ShmCollective (picklable; semaphores from the spawn context)."""

    name: str
    world_size: int
    slot_bytes: int
    # sems[src][dst]: posted by src once per all-reduce for dst; None on the diagonal.
    sems: tuple
    timeout_s: float = 30.0


_HDR = 16  # per slot: int64 sequence number, int64 payload bytes


class ShmCollective:
    """All-reduce among processes of one machine through shared memory.

    Each rank writes its partial into its own slot (two per rank, alternating by step, so a fast
    rank never overwrites what a slow one still reads), then posts one semaphore per peer; a rank
    reads all slots once every peer has posted to it. Nothing is pickled per layer.
    """

    @staticmethod
    def create(world_size: int, slot_bytes: int, ctx, timeout_s: float = 30.0) -> tuple[ShmSpec, shared_memory.SharedMemory]:
        size = world_size * 2 * (_HDR + slot_bytes)
        shm = shared_memory.SharedMemory(create=True, size=size)
        shm.buf[:size] = bytes(size)
        sems = tuple(
            tuple(None if s == d else ctx.Semaphore(0) for d in range(world_size)) for s in range(world_size)
        )
        return ShmSpec(shm.name, world_size, slot_bytes, sems, timeout_s), shm

    def __init__(self, spec: ShmSpec, rank: int):
        self.rank = rank
        self.world_size = spec.world_size
        self._spec = spec
        # Simulated nodes are spawned children: they share the creator's resource tracker,
        # which unlinks the segment once the creator does.
        self._shm = shared_memory.SharedMemory(name=spec.name)
        self._seq = 0
        self.request_id = ""

    def _slot(self, rank: int, parity: int) -> tuple[memoryview, memoryview]:
        off = (rank * 2 + parity) * (_HDR + self._spec.slot_bytes)
        return self._shm.buf[off : off + _HDR], self._shm.buf[off + _HDR : off + _HDR + self._spec.slot_bytes]

    def begin(self, request_id: str) -> None:
        self.request_id = request_id

    def all_reduce(self, partial: mx.array, layer: int) -> mx.array:
        raw, dtype = to_wire(partial)
        data = raw.tobytes()
        if len(data) > self._spec.slot_bytes:
            raise CollectiveError(f"partial of {len(data)} bytes exceeds the shared slot ({self._spec.slot_bytes} bytes)")
        self._seq += 1
        parity = self._seq & 1
        hdr, body = self._slot(self.rank, parity)
        body[: len(data)] = data
        np.frombuffer(hdr, dtype=np.int64)[:] = (self._seq, len(data))
        for dst in range(self.world_size):
            if dst != self.rank:
                self._spec.sems[self.rank][dst].release()
        parts = []
        for src in range(self.world_size):
            if src == self.rank:
                parts.append(raw.reshape(-1))
                continue
            if not self._spec.sems[src][self.rank].acquire(timeout=self._spec.timeout_s):
                raise CollectiveError(
                    f"rank {src} did not answer layer {layer} within {self._spec.timeout_s:.0f} s (dead or stalled)"
                )
            shdr, sbody = self._slot(src, parity)
            seq, nbytes = np.frombuffer(shdr, dtype=np.int64)
            if seq != self._seq or nbytes != len(data):
                raise CollectiveError(f"rank {src} is out of step at layer {layer} (step {seq}, expected {self._seq})")
            parts.append(np.frombuffer(sbody[:nbytes], dtype=DTYPES[dtype]))
        return from_wire(reduce_sum(parts, dtype), dtype, partial.shape)

    def close(self) -> None:
        try:
            self._shm.close()
        except BufferError:
            pass


def _attach(name: str) -> shared_memory.SharedMemory:
    """Attach to a segment another process owns, without this process's resource tracker
    unlinking it at exit (Python < 3.13 registers attachments too)."""
    shm = shared_memory.SharedMemory(name=name)
    try:
        from multiprocessing import resource_tracker

        resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001
    except (ImportError, AttributeError, KeyError):
        pass
    return shm


class TimedCollective:
    """Wraps a collective and accumulates the seconds spent waiting in it."""

    def __init__(self, inner: Collective):
        self.inner = inner
        self.rank = inner.rank
        self.world_size = inner.world_size
        self.seconds = 0.0
        self.calls = 0

    def begin(self, request_id: str) -> None:
        self.inner.begin(request_id)

    def all_reduce(self, partial: mx.array, layer: int) -> mx.array:
        t = time.perf_counter()
        out = self.inner.all_reduce(partial, layer)
        self.seconds += time.perf_counter() - t
        self.calls += 1
        return out

    def close(self) -> None:
        self.inner.close()
