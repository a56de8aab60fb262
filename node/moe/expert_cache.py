"""A layer's expert cache: C of the node's E_local experts resident in stacked slots, misses read by
byte range from the node's shard file (or the checkpoint) into a slot, exactly.

The slots are the `ExpertShard`'s own (C, ...) parameters; a miss is written into a slot's bytes in
place (no (C, ...) copy per miss). The lazy graph must not see that write: the layer remembers the
last output computed from its slots (`reading`) and evaluates it before overwriting any slot, so a
result never depends on when MLX evaluates it (a call that needs more experts than slots runs in
rounds, each evaluated before the next one's reads land).

What stays (seed 000): experts pinned by the routing profile, then a recency/frequency score
(frequency × 0.25^(age/128) steps), the lowest evicted first.

Hiding the disk: a read runs in the node's read pool from the moment it is known to be wanted and
lands in a staging buffer (its bytes, checked), which `ensure` copies into a slot when the expert is
needed; one no pool thread has taken up by then is read on the caller's thread instead. A call's
misses start as soon as its routing is on the host (a later round's first few while an earlier
round computes); with a routing profile, `prefetch` starts the next layer's likeliest non-resident
experts when a layer begins. Prefetching never changes what is computed: a staged expert enters a
slot only when the routing selects it, and one not selected is dropped after that layer's call.
"""

from __future__ import annotations

import os
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import mlx.core as mx
import numpy as np

from ...proto.errors import UnavailableError

# Parallel reads in flight per node: NVMe SSDs reach their bandwidth at queue depths of 8-32.
READ_THREADS = 8  # expert reads in flight at once (an SSD serves several queues in parallel)
_DECAY, _HALF = 0.25, 128.0  # score = freq * _DECAY ** (age / _HALF) (seed 000's LCP)


class ExpertReadError(UnavailableError):
    """An expert's bytes could not be read back (file gone, short read, changed bytes): the
    request fails, naming the file, instead of computing with a wrong expert."""


@dataclass
class CacheStats:
    """Sums per MoE layer: selections found resident, read from disk, bytes and seconds reading."""

    capacity: int = 0  # resident slots
    local: int = 0  # experts this node holds for the layer
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0  # bytes of the misses (what entered a slot)
    read_seconds: float = 0.0  # the step waiting on misses: reads not done yet, and slot writes
    rounds: int = 0  # calls whose experts did not fit the slots at once
    prefetched: int = (
        0  # reads started ahead of the layer's routing (profile's hottest non-resident)
    )
    prefetch_hits: int = 0  # misses whose bytes a prefetch had already staged
    prefetch_bytes: int = 0  # bytes read by prefetches, used or not

    def reset(self) -> None:
        self.hits = self.misses = self.bytes_read = self.rounds = 0
        self.prefetched = self.prefetch_hits = self.prefetch_bytes = 0
        self.read_seconds = 0.0


@dataclass
class Staging:
    """Bytes of expert reads a node holds outside its slots (in flight, or read and waiting for a
    slot): now, and the most at once since the last reset. Touched on the MLX thread only."""

    now: int = 0
    peak: int = 0

    def add(self, n: int) -> None:
        self.now += n
        self.peak = max(self.peak, self.now)

    def reset(self) -> None:
        self.peak = self.now


@dataclass(frozen=True)
class Part:
    """One byte range of one expert's tensor: (file, offset, nbytes)."""

    file: str
    offset: int
    nbytes: int


def read_parts(parts: Sequence[Part]) -> bytearray:
    """The bytes of `parts`, concatenated (each file opened once); any failure is an ExpertReadError
    naming the file."""
    out = bytearray(sum(p.nbytes for p in parts))
    view, at = memoryview(out), 0
    fds: dict[str, int] = {}
    try:
        for p in parts:
            try:
                fd = fds.get(p.file)
                if fd is None:
                    fd = fds[p.file] = os.open(p.file, os.O_RDONLY)
                got = 0
                while got < p.nbytes:
                    n = os.preadv(fd, [view[at + got : at + p.nbytes]], p.offset + got)
                    if n <= 0:
                        raise ExpertReadError(
                            f"short read of expert weights from {p.file}: {got} of {p.nbytes} "
                            f"bytes at offset {p.offset}"
                        )
                    got += n
            except OSError as exc:
                raise ExpertReadError(
                    f"cannot read expert weights from {p.file}: {exc.strerror}"
                ) from exc
            at += p.nbytes
    finally:
        for fd in fds.values():
            os.close(fd)
    return out


class LayerCache:
    """The slots of one layer: which local expert sits where, and how a missing one gets in.

    Args:
        slots: per shard tensor, its (C, ...) parameter's bytes as a writable (C, nbytes) uint8 view,
            in the order `parts_of` lists an expert's byte ranges.
        parts_of: local index -> the byte ranges of that expert, one per slot tensor.
        resident: local index in each slot, initially.
        pinned: local indices never evicted while others can be.
        pool: where reads run (None: on the caller's thread, when they are waited for).
        staging: the node's count of bytes read and not yet in a slot (shared by its layers).
    """

    def __init__(
        self,
        layer: int,
        n_local: int,
        slots: list[np.ndarray],
        parts_of: Callable[[int], list[Part]],
        resident: Sequence[int],
        pinned: Sequence[int],
        stats: CacheStats,
        pool: ThreadPoolExecutor | None = None,
        staging: Staging | None = None,
    ):
        self.layer = layer
        self._views = slots
        self._parts_of = parts_of
        self.capacity = len(resident)
        assert 1 <= self.capacity <= n_local and all(v.shape[0] == self.capacity for v in slots)
        self.slot_of = np.full(n_local, -1, dtype=np.int64)
        self.owner = np.asarray(resident, dtype=np.int64)
        self.slot_of[self.owner] = np.arange(self.capacity)
        self._pinned = np.zeros(n_local, dtype=bool)
        self._pinned[list(pinned)] = True
        self._freq = np.zeros(n_local)
        self._last = np.zeros(n_local)
        self._clock = 0
        self._crc: dict[int, int] = {}
        self.stats = stats
        stats.capacity, stats.local = self.capacity, n_local
        self._pool = pool
        self._reader: mx.array | None = (
            None  # the last output computed from the slots, maybe unevaluated
        )
        self.expert_nbytes = sum(v.shape[1] for v in slots)  # one expert's bytes, all its tensors
        # reads started and not yet copied into a slot: local index -> its bytes (a Future), and which
        # of them a prefetch started
        self._staged: dict[int, Future] = {}
        self._prefetched: set[int] = set()
        self.staging = staging if staging is not None else Staging()

    def reading(self, y: mx.array) -> None:
        """`y` was computed from the slots as they are: it is evaluated before a slot changes."""
        self._reader = y

    def fingerprint(self, digests: dict[int, int]) -> None:
        """crc32 of every local expert's bytes, taken at load: a miss whose bytes differ fails."""
        self._crc = dict(digests)

    def fetch(self, experts: Sequence[int]) -> None:
        """Start reading those of `experts` that are neither resident nor on their way."""
        for e in experts:
            e = int(e)
            if self.slot_of[e] < 0 and e not in self._staged:
                self._staged[e] = self._start(e)

    def prefetch(self, candidates: Sequence[int], depth: int) -> None:
        """Start reading the first `depth` of `candidates` (local indices, likeliest first) that are
        neither resident nor on their way: the layer's routing is not known yet, so a read that
        turns out unneeded is dropped."""
        picks = [e for e in candidates if self.slot_of[e] < 0 and e not in self._staged][:depth]
        for e in picks:
            self._staged[e] = self._start(e)
            self._prefetched.add(e)
        self.stats.prefetched += len(picks)
        self.stats.prefetch_bytes += len(picks) * self.expert_nbytes

    def drop_staged(self) -> None:
        """Forget reads that no call took (a prefetch the routing did not select): bounded staging."""
        for fut in self._staged.values():
            fut.cancel()
        self.staging.now -= len(self._staged) * self.expert_nbytes
        self._staged.clear()
        self._prefetched.clear()

    def ensure(self, need: Sequence[int]) -> np.ndarray:
        """Make the local experts `need` (at most C) resident; -> slot_of (local index -> slot, -1)."""
        need = list(need)
        assert len(need) <= self.capacity, (len(need), self.capacity)
        self._clock += 1
        self._freq[need] += 1
        self._last[need] = self._clock
        missing = [e for e in need if self.slot_of[e] < 0]
        self.stats.hits += len(need) - len(missing)
        if not missing:
            return self.slot_of
        self.fetch(missing)  # those not started by `fetch` or `prefetch` yet
        victims = self._victims(len(missing), protect=set(need))
        t0 = time.perf_counter()
        if self._reader is not None:
            mx.eval(self._reader)  # its slots are about to change under it
            self._reader = None
        for e, slot in zip(missing, victims):
            fut = self._staged.pop(e)
            self.staging.now -= self.expert_nbytes
            if (
                fut.cancel()
            ):  # no reader has taken it up yet: reading it here is sooner than a hand-off
                blob = self._read(e)
            else:
                blob = fut.result()  # raises the read's ExpertReadError
                if e in self._prefetched:
                    self.stats.prefetch_hits += 1
            self._prefetched.discard(e)
            at = 0
            for v in self._views:
                n = v.shape[1]
                v[slot] = np.frombuffer(blob, dtype=np.uint8, count=n, offset=at)
                at += n
            self.slot_of[self.owner[slot]] = -1
            self.owner[slot] = e
            self.slot_of[e] = slot
        self.stats.read_seconds += time.perf_counter() - t0
        self.stats.misses += len(missing)
        self.stats.bytes_read += len(missing) * self.expert_nbytes
        return self.slot_of

    def _start(self, e: int) -> Future:
        self.staging.add(self.expert_nbytes)
        if self._pool is not None:
            return self._pool.submit(self._read, e)
        fut: Future = Future()  # no pool: read now, on this thread
        try:
            fut.set_result(self._read(e))
        except ExpertReadError as exc:
            fut.set_exception(exc)
        return fut

    def _read(self, e: int) -> bytearray:
        parts = self._parts_of(e)
        blob = read_parts(parts)
        want = self._crc.get(e)
        if want is not None and zlib.crc32(blob) != want:
            files = sorted({p.file for p in parts})
            raise ExpertReadError(
                f"expert weights changed on disk since the load (checksum mismatch) in "
                f"{', '.join(files)} (layer {self.layer})"
            )
        return blob

    def _victims(self, n: int, protect: set[int]) -> list[int]:
        """The n slots to overwrite: free ones are none (all slots hold an expert); lowest score
        first, pinned experts only when nothing else is left."""
        owners = self.owner
        age = self._clock - self._last[owners]
        score = self._freq[owners] * _DECAY ** (age / _HALF)
        order = np.lexsort(
            (np.arange(self.capacity), score, self._pinned[owners])
        )  # unpinned, coldest first
        out = [int(s) for s in order if int(owners[s]) not in protect]
        return out[:n]


def choose_resident(
    capacity: int, heat: np.ndarray | None, tokens: int = 0
) -> tuple[list[int], list[int]]:
    """(local experts resident at load, pinned ones) from `heat`, the profile's selections per local
    expert over `tokens` tokens: the hottest resident, pinned when selected by more than half of the
    tokens (seed 000), at most half the slots; without a profile the first C, none pinned."""
    if heat is None or not np.any(heat):
        return list(range(capacity)), []
    order = sorted(range(len(heat)), key=lambda e: (-heat[e], e))
    pinned = [e for e in order if tokens and heat[e] > tokens / 2][: capacity // 2]
    return sorted(order[:capacity]), pinned


_POOL: ThreadPoolExecutor | None = None


def read_pool() -> ThreadPoolExecutor:
    """The node's one pool of miss reads (preads release the GIL), made on first use."""
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="expert-read")
    return _POOL
