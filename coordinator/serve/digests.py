"""The coordinator's digests of the blobs it ships: each blob's sha256 (what a node's manifest records
and `cache verify` checks) and the xxh3-64 of each of its pieces (what a node checks every piece
against as it arrives, asking again from a piece that fails).

They are the source's digests, read from the checkpoint itself, so a node's manifest states what the
coordinator's file holds — not merely what arrived. Each blob is hashed once per checkpoint, on a
small pool of threads a couple of blobs ahead of the stream that needs it (hashlib and xxhash release
the GIL), and kept in `<cache>/moe-cluster/digests/<fingerprint[:16]>.jsonl`, one line per blob with
the stat of its file when it was hashed; a line whose file has changed since is hashed again. A
second `up`, another node, or a changed placement then ships with no hashing on either side.

Why here and not on the node: hashing every received byte with sha256 (~2 GB/s per core) beside a
network that moves 2–3 GB/s capped a node at ~0.45 of raw TCP on loopback on a 2-vCPU VM (`moe-cluster
bench ship`); xxh3 runs at ~30 GB/s. A blob is read in PIECE_BYTES pieces into one buffer (one per
blob being hashed), so hashing holds at most `workers` pieces of memory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ...common import cache_home
from ...node.catalog import SHA256_HEX, piece_hasher

logger = logging.getLogger(__name__)

AHEAD = 2  # blobs hashed ahead of the one being sent, per stream


def default_digest_dir() -> Path:
    """cache_home()/digests: beside a node's shards when the coordinator is a node too."""
    return cache_home() / "digests"


@dataclass(frozen=True)
class BlobDigest:
    sha256: str  # hex, of the whole blob
    piece_bytes: int
    pieces: tuple[
        int, ...
    ]  # piece_hasher's digest of bytes [i * piece_bytes, (i + 1) * piece_bytes)
    stat: tuple[int, ...] = ()  # its file's _file_key when it was hashed


def _file_key(path: Path) -> list[int]:
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ino]


class Digests:
    """Digests of the blobs `ranges` ({blob: (file, start, bytes)}) of the checkpoint `fingerprint`,
    computed on demand and kept in `folder` (None: in memory only)."""

    def __init__(
        self,
        ranges: dict[str, tuple[Path, int, int]],
        fingerprint: str,
        folder: Path | None,
        *,
        piece_bytes: int,
        workers: int | None = None,
    ):
        self.ranges = ranges
        self.piece_bytes = piece_bytes
        self.hashed_bytes = 0  # read and hashed by this process (the tests and the bench count it)
        self._pool = ThreadPoolExecutor(
            workers or max(1, min(4, (os.cpu_count() or 2) // 2)), thread_name_prefix="digest"
        )
        self._futures: dict[str, Future] = {}
        self._lock = threading.Lock()
        self.path = Path(folder) / f"{fingerprint[:16]}.jsonl" if folder else None
        if self.path is not None:
            self._load()

    def _load(self) -> None:
        """The digests a previous run kept, for files unchanged since (a torn or stale line is skipped)."""
        try:
            lines = self.path.read_text().splitlines()
        except FileNotFoundError:
            return
        except OSError as exc:
            logger.warning(
                "digests %s: cannot read (%s); blobs are hashed again",
                self.path,
                exc.strerror or exc,
            )
            return
        stats: dict[Path, list[int] | None] = {}
        kept: dict[str, str] = {}  # blob -> its latest valid line
        for line in lines:
            try:
                d = json.loads(line)
                blob, span = str(d["blob"]), [int(x) for x in d["range"]]
                digest = BlobDigest(
                    str(d["sha256"]),
                    int(d["piece_bytes"]),
                    tuple(int(p, 16) for p in d["pieces"]),
                    tuple(int(x) for x in d["stat"]),
                )
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
            if (
                blob not in self.ranges
                or digest.piece_bytes != self.piece_bytes
                or not SHA256_HEX.fullmatch(digest.sha256)
            ):
                continue
            path, start, n = self.ranges[blob]
            if path not in stats:
                try:
                    stats[path] = tuple(_file_key(path))
                except OSError:
                    stats[path] = None
            # the same file as it was, and the same bytes of it (another version may place a blob elsewhere)
            if (
                stats[path] != digest.stat
                or span != [start, n]
                or len(digest.pieces) != math.ceil(n / self.piece_bytes)
            ):
                continue
            done: Future = Future()
            done.set_result(digest)
            self._futures[blob] = done
            kept[blob] = line
        if len(lines) > 2 * len(kept) + 16:  # mostly stale or repeated lines: keep the file small
            try:
                tmp = self.path.with_suffix(".tmp")
                tmp.write_text("".join(line + "\n" for line in kept.values()))
                os.replace(tmp, self.path)
            except OSError as exc:
                logger.warning("digests %s: cannot compact (%s)", self.path, exc.strerror or exc)

    def known(self) -> int:
        """Blobs whose digests are at hand (kept or computed)."""
        with self._lock:
            return sum(
                f.done() and not f.cancelled() and f.exception() is None
                for f in self._futures.values()
            )

    def start(self, blob: str, then=()) -> None:
        """Start hashing `blob`, then the first AHEAD of `then` (the ones its stream sends next), in
        that order: the blob being sent is never queued behind its own look-ahead."""
        self._future(blob)
        for b in then[:AHEAD]:
            self._future(b)

    def get(self, blob: str) -> BlobDigest:
        """The digests of `blob`, hashing it now if nobody has; a digest whose file has changed since
        is hashed again. OSError when the file cannot be read or changes while it is read (asked
        again, it is hashed again)."""
        for _ in range(2):
            fut = self._future(blob)
            try:
                digest = fut.result()
                if tuple(_file_key(self.ranges[blob][0])) == digest.stat:
                    return digest
                logger.warning(
                    "digests: %s changed since %s was hashed; hashing it again",
                    self.ranges[blob][0],
                    blob,
                )
            except OSError:
                self._drop(blob, fut)
                raise
            self._drop(blob, fut)
        raise OSError("the file keeps changing while it is shipped")

    def _drop(self, blob: str, fut: Future) -> None:
        with self._lock:
            if self._futures.get(blob) is fut:
                del self._futures[blob]

    def _future(self, blob: str) -> Future:
        with self._lock:
            fut = self._futures.get(blob)
            if fut is None:
                fut = self._futures[blob] = self._pool.submit(self._hash, blob)
            return fut

    def _hash(self, blob: str) -> BlobDigest:
        path, start, n = self.ranges[blob]
        before = _file_key(path)
        sha, piece, pieces = hashlib.sha256(), piece_hasher(), []
        buf = bytearray(min(self.piece_bytes, n) or 1)
        view = memoryview(buf)
        fd = os.open(path, os.O_RDONLY)
        try:
            off = 0
            while off < n:
                k = min(self.piece_bytes, n - off)
                got = os.preadv(fd, [view[:k]], start + off)
                if got != k:
                    raise OSError(f"short read at byte {start + off}: the file changed")
                sha.update(view[:k])
                piece.reset()
                piece.update(view[:k])
                pieces.append(piece.intdigest())
                off += k
        finally:
            os.close(fd)
        if _file_key(path) != before:
            raise OSError("the file changed while it was hashed")
        digest = BlobDigest(sha.hexdigest(), self.piece_bytes, tuple(pieces), tuple(before))
        with self._lock:
            self.hashed_bytes += n
            self._keep(blob, digest)
        return digest

    def _keep(self, blob: str, digest: BlobDigest) -> None:
        """Append one line (under the lock); a folder we cannot write keeps the digests in memory."""
        if self.path is None:
            return
        _, start, n = self.ranges[blob]
        line = json.dumps(
            {
                "blob": blob,
                "range": [start, n],
                "sha256": digest.sha256,
                "piece_bytes": digest.piece_bytes,
                "pieces": [f"{p:016x}" for p in digest.pieces],
                "stat": list(digest.stat),
            }
        )
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(line + "\n")
        except OSError as exc:
            logger.warning(
                "digests: cannot keep them in %s (%s); this run keeps them in memory",
                self.path,
                exc.strerror or exc,
            )
            self.path = None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
