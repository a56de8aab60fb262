"""All-reduce among processes of one machine through shared memory (simulate, tests)."""

from __future__ import annotations

from multiprocessing import shared_memory
from typing import Callable

import mlx.core as mx
import numpy as np

from .base import CollectiveError, HostCollective, from_wire, to_wire
from .reduce import DTYPES, Reducer

_HDR = 16  # per slot: int64 sequence number, int64 payload bytes


def unlink_segment(shm: shared_memory.SharedMemory) -> None:
    """Remove a segment's name; one already removed (by another process) is no error."""
    try:
        shm.unlink()
    except FileNotFoundError:
        pass


class ShmCollective(HostCollective):
    """All-reduce among processes of one machine through shared memory.

    Each rank writes its partial into its own slot (two per rank, alternating by step, so a fast
    rank never overwrites what a slow one still reads), then posts one semaphore per peer; a rank
    reads all slots once every peer has posted to it. Nothing is pickled per layer.
    """

    @staticmethod
    def create(world_size: int, slot_bytes: int, ctx, timeout_s: float = 30.0):
        """-> (ShmSpec for every rank, the segment, which the caller closes and unlinks)."""
        from .specs import ShmSpec

        size = world_size * 2 * (_HDR + slot_bytes)
        shm = shared_memory.SharedMemory(create=True, size=size)
        shm.buf[:size] = bytes(size)
        sems = tuple(
            tuple(None if s == d else ctx.Semaphore(0) for d in range(world_size))
            for s in range(world_size)
        )
        return ShmSpec(shm.name, world_size, slot_bytes, sems, timeout_s), shm

    def __init__(self, spec, rank: int):
        super().__init__(rank, spec.world_size, Reducer())
        self._spec = spec
        # Simulated nodes are spawned children sharing the creator's resource tracker. Rank 0
        # drops the segment's name after the first all-reduce, so a creator killed together with
        # its tracker leaves nothing in /dev/shm.
        self._shm = shared_memory.SharedMemory(name=spec.name)
        self._named = rank == 0  # the name is still to drop, by this rank
        self._seq = 0
        self.request_id = ""

    def _slot(self, rank: int, parity: int) -> tuple[memoryview, memoryview]:
        off = (rank * 2 + parity) * (_HDR + self._spec.slot_bytes)
        return self._shm.buf[off : off + _HDR], self._shm.buf[
            off + _HDR : off + _HDR + self._spec.slot_bytes
        ]

    def begin(self, request_id: str) -> None:
        self.request_id = request_id
        self._rider.clear()

    def watch(self, what: str | None, cold: bool = False) -> None:
        pass  # every all-reduce times out by itself

    def start(self, partial: mx.array, layer: int) -> Callable[[], mx.array]:
        """all_reduce in two halves (node/overlap.py): post `partial` now; the returned call
        waits for the peers' and sums. Call it before the next start or all_reduce."""
        payload, extra = self._rider.attach(partial, layer)
        raw, dtype = to_wire(payload)
        seq = self._post(raw)
        return lambda: self._finish(seq, raw, dtype, extra, partial, layer)

    def _post(self, raw: np.ndarray) -> int:
        """Write this rank's payload into its slot and tell every peer; the exchange's number."""
        data = raw.tobytes()
        if len(data) > self._spec.slot_bytes:
            raise CollectiveError(
                f"partial of {len(data)} bytes exceeds the shared slot ({self._spec.slot_bytes} bytes)"
            )
        self._seq += 1
        seq = self._seq
        hdr, body = self._slot(self.rank, seq & 1)
        body[: len(data)] = data
        np.frombuffer(hdr, dtype=np.int64)[:] = (seq, len(data))
        for dst in range(self.world_size):
            if dst != self.rank:
                self._spec.sems[self.rank][dst].release()
        return seq

    def _exchange(self, raw: np.ndarray, dtype: str, shape, layer: int) -> list[np.ndarray]:
        """Every rank's raw payload of one exchange (HostCollective): copies, in rank order."""
        seq = self._post(raw)
        return [p.copy() for p in self._collect(seq, raw, dtype, layer)]

    def _finish(self, seq, raw, dtype, extra, partial, layer) -> mx.array:
        parts = self._collect(seq, raw, dtype, layer)
        out = from_wire(
            self._rider.detach(self._reduce(parts, dtype), dtype, extra), dtype, partial.shape
        )
        return out

    def _collect(self, seq: int, raw: np.ndarray, dtype: str, layer: int) -> list[np.ndarray]:
        """Every rank's payload of exchange `seq` (views of the slots), once every peer posted."""
        parts = []
        for src in range(self.world_size):
            if src == self.rank:
                parts.append(raw.reshape(-1))
                continue
            if not self._spec.sems[src][self.rank].acquire(timeout=self._spec.timeout_s):
                raise CollectiveError(
                    f"rank {src} did not answer layer {layer} within {self._spec.timeout_s:.0f} s (dead or stalled)"
                )
            shdr, sbody = self._slot(src, seq & 1)
            got, nbytes = np.frombuffer(shdr, dtype=np.int64)
            if got != seq or nbytes != raw.nbytes:
                raise CollectiveError(
                    f"rank {src} is out of step at layer {layer} (step {got}, expected {seq})"
                )
            parts.append(np.frombuffer(sbody[:nbytes], dtype=DTYPES[dtype]))
        if self._named:  # every rank has the segment mapped (each wrote its slot): its name can go,
            self._named = False  # the memory stays until the last rank unmaps it
            unlink_segment(self._shm)
        return parts

    def failure(self) -> str | None:
        return None  # no child process to lose: a peer's loss fails the step itself

    def abort(self, request_id: str) -> None:
        pass  # a step waits out its own timeout

    def close(self) -> None:
        try:
            self._shm.close()
        except BufferError:
            pass
