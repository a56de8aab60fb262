"""A node's shard cache: prepacked file sets the coordinator shipped, loaded by byte range.

A shard lives in `<cache dir>/<fingerprint[:16]>/`: `replicated.safetensors` (every weight that is not
a routed expert), one `layer-LLLL-<experts digest>.safetensors` per MoE layer holding this node's
experts stacked `(E_local, ...)` per expert tensor, `config.json`, and `manifest.json` (the model's
catalog, the placement, and the sha256 of every blob). A blob is the unit of shipping and of repair:
one replicated tensor, or one expert's slice of one expert tensor — so a placement change fetches
only the experts a node lacks, and a flipped byte costs one blob.

This module keeps a shard directory: its manifest, the verification of what is on disk, and the
fill. The catalog is catalog.py's; the files, their names and the shard opened as a `Checkpoint`
(`CachedCheckpoint`, whose tensors keep the checkpoint's names and shapes, so `node/moe/load.py`
loads it exactly as it loads the checkpoint itself) are shard_layout.py's; `moe-cluster cache` is
cache_command.py's. File names never come from a manifest or the coordinator: a node writes only
inside its cache directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

from ..common import cache_home
from .catalog import SHA256_HEX, CacheError, Catalog
from .shard_layout import CachedCheckpoint, FileSet, layout

logger = logging.getLogger(__name__)

FORMAT = 1
MANIFEST = "manifest.json"
STAMPS = (
    "verified.json"  # per file: its stat when its blobs last matched the manifest (verified_blobs)
)
PROGRESS_BYTES = 16 << 20  # an interrupted fill resumes a blob from its last multiple of this
_FILE_NAME = re.compile(r"^(replicated|layer-\d{4}-[0-9a-f]{12})\.safetensors$")


def default_cache_dir() -> Path:
    """Where a node keeps its shards: cache_home()/shards."""
    return cache_home() / "shards"


@dataclass
class Manifest:
    catalog: Catalog
    local: dict[int, tuple[int, ...]]  # MoE layer -> experts held
    sha256: dict[str, str]  # blob id -> hex digest

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "catalog": self.catalog.to_json(),
            "placement": {str(l): list(v) for l, v in sorted(self.local.items())},
            "sha256": dict(sorted(self.sha256.items())),
        }

    @classmethod
    def read(cls, path: Path) -> "Manifest":
        try:
            d = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CacheError(f"{path}: unreadable manifest ({exc})") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise CacheError(f"{path}: not a format-{FORMAT} manifest")
        catalog = Catalog.from_json(d.get("catalog"), str(path))
        try:
            local = {int(l): tuple(int(e) for e in v) for l, v in d["placement"].items()}
            sha = {str(k): str(v) for k, v in d["sha256"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CacheError(f"{path}: malformed placement or sha256 ({exc})") from None
        return cls(catalog, local, sha)


def shard_dir(cache_dir: Path, fp: str) -> Path:
    return Path(cache_dir) / fp[:16]


def _inside(root: Path, name: str) -> Path:
    """root/name, refusing any name that would leave root (whatever a manifest says)."""
    if not _FILE_NAME.match(name):
        raise CacheError(f"refusing file name {name!r} in {root}: not one this cache writes")
    p = (root / name).resolve()
    if p.parent != root.resolve():
        raise CacheError(f"refusing {name!r}: it resolves outside {root}")
    return p


def _sha(f, offset: int, n: int) -> str:
    h = hashlib.sha256()
    f.seek(offset)
    left = n
    while left:
        b = f.read(min(left, 8 << 20))
        if not b:
            break
        h.update(b)
        left -= len(b)
    return h.hexdigest()


@dataclass(frozen=True)
class Have:
    """A verified copy of a blob already on disk."""

    path: Path
    offset: int
    sha256: str


def _stat_key(st: os.stat_result) -> list[int]:
    """What changes when a file's bytes may have: any write moves its ctime (which no tool sets back)."""
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def read_stamps(root: Path) -> dict[str, list[int]]:
    """{file name: stat key when each of its blobs last matched the manifest's sha256} of a shard."""
    try:
        stamps = json.loads((root / STAMPS).read_text())
        return {str(k): [int(x) for x in v] for k, v in stamps.items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


def write_stamps(root: Path, names: Iterable[str], drop: Iterable[str] = ()) -> None:
    """Record that the files `names` match the manifest as they are now (their blobs just hashed),
    and forget the files `drop` (found not to)."""
    stamps = read_stamps(root)
    for name in drop:
        stamps.pop(name, None)
    for name in names:
        stamps[name] = _stat_key(_inside(root, name).stat())
    tmp = root / (STAMPS + ".tmp")
    tmp.write_text(json.dumps(stamps) + "\n")
    os.replace(tmp, root / STAMPS)


def verified_blobs(
    root: Path, manifest: Manifest, *, full: bool = False, counts: dict[str, int] | None = None
) -> dict[str, Have]:
    """Every blob of a shard whose bytes on disk match the manifest's sha256 (a flipped byte drops it).
    A file unchanged since its blobs were last hashed (same size, mtime, ctime and inode: `STAMPS`) is
    trusted without reading it, so a warm start costs what mapping the files does; any write to a
    file, however it leaves its mtime, moves its ctime and gets it hashed again. `full`: hash all;
    `counts` gets {"hashed", "trusted"}: blobs read and hashed, blobs of unchanged files."""
    counts = counts if counts is not None else {}
    counts.update(hashed=0, trusted=0)
    sizes = manifest.catalog.blob_nbytes()
    stamps = {} if full else read_stamps(root)
    out, hashed, bad = {}, [], []
    for fs in layout(manifest.catalog, manifest.local):
        path = _inside(root, fs.name)
        st = path.stat() if path.is_file() else None
        if st is None or st.st_size != fs.size:
            continue
        offsets = fs.blob_offsets(sizes)
        if stamps.get(fs.name) == _stat_key(st) and all(manifest.sha256.get(b) for b in offsets):
            out.update(
                {blob: Have(path, at, manifest.sha256[blob]) for blob, at in offsets.items()}
            )
            counts["trusted"] += len(offsets)
            continue
        good = True
        with open(path, "rb") as f:
            if f.read(len(fs.header)) != fs.header:
                bad.append(fs.name)
                continue
            for blob, at in offsets.items():
                want = manifest.sha256.get(blob)
                counts["hashed"] += bool(want)
                if want and _sha(f, at, sizes[blob]) == want:
                    out[blob] = Have(path, at, want)
                else:
                    good = False
                    if want:
                        logger.warning(
                            "cache %s: blob %s fails its sha256; it is fetched again",
                            path.name,
                            blob,
                        )
        (hashed if good else bad).append(fs.name)
    if hashed or bad:
        try:
            write_stamps(root, hashed, drop=bad)
        except OSError as exc:  # a read-only cache still loads; it is hashed again next time
            logger.warning("cache %s: cannot record its verified files (%s)", root.name, exc)
    return out


@dataclass(frozen=True)
class Plan:
    """What filling a shard takes: the blobs to fetch, and the bytes of disk the new files need."""

    fetch: tuple[str, ...]
    fetch_bytes: int
    disk_bytes: int  # new files written in full (blobs already held are copied locally)
    copy_bytes: int
    resume_offset: int = (
        0  # fetch[0] is resumed from this byte (an interrupted fill wrote that much)
    )


class ShardCache:
    """One shard directory of a node's cache: plan, fill, and open for loading."""

    def __init__(self, cache_dir: Path, catalog: Catalog, local: dict[int, Sequence[int]]):
        self.cache_dir = Path(cache_dir)
        self.root = shard_dir(self.cache_dir, catalog.fingerprint)
        self.catalog = catalog
        self.local = {l: tuple(sorted(v)) for l, v in local.items() if l in catalog.layers}
        self.files = layout(catalog, self.local)
        self.sizes = catalog.blob_nbytes()
        self.have: dict[str, Have] = {}
        self.journal: dict[str, str] = {}
        self.checked = {
            "hashed": 0,
            "trusted": 0,
        }  # by the last scan: blobs hashed, and trusted unchanged
        self.progress: dict[str, int] = {}  # blob -> bytes of it an interrupted fill made durable

    @contextlib.contextmanager
    def locked(self):
        """Held while filling and opening: two agents given the same cache folder would write the
        same files; the second is refused in one line instead."""
        self.root.mkdir(parents=True, exist_ok=True)
        with exclusive(
            self.root, "is in use by another node agent (give each agent its own --cache-dir)"
        ):
            yield

    def scan(self) -> Plan:
        """Verify what is on disk (manifest and journal of an interrupted fill) and plan the rest."""
        self.root.mkdir(parents=True, exist_ok=True)
        m = self.root / MANIFEST
        old = None
        if m.exists():
            try:
                old = Manifest.read(m)
                if old.catalog.fingerprint != self.catalog.fingerprint:
                    raise CacheError(
                        f"{m}: fingerprint {old.catalog.fingerprint[:16]} is not the model's"
                    )
            except CacheError as exc:
                logger.warning("%s; the shard is fetched again", exc)
                old = None
        self.checked = {"hashed": 0, "trusted": 0}
        self.have = verified_blobs(self.root, old, counts=self.checked) if old else {}
        self.journal = self._read_journal()
        wanted = [b for fs in self.files for s in fs.slots for b in s.blobs]
        fetch = [b for b in wanted if b not in self.have and b not in self.journal]
        # a blob the interrupted fill was in the middle of goes first, from where it stopped
        started = [b for b in fetch if self.progress.get(b)]
        resume = self.progress[started[0]] if started else 0
        if started:
            fetch.remove(started[0])
            fetch.insert(0, started[0])
        new_files = [fs for fs in self.files if not self._complete(fs)]
        return Plan(
            tuple(fetch),
            sum(self.sizes[b] for b in fetch) - resume,
            sum(fs.size for fs in new_files),
            sum(
                self.sizes[b]
                for fs in new_files
                for s in fs.slots
                for b in s.blobs
                if b in self.have
            ),
            resume,
        )

    def _complete(self, fs: FileSet) -> bool:
        return all(
            self.have.get(b) is not None and self.have[b].path.name == fs.name
            for s in fs.slots
            for b in s.blobs
        )

    def _read_journal(self) -> dict[str, str]:
        """{blob: sha256} written into `.partial` files by a fill that was interrupted; each is
        checked again before it is trusted. Also sets `progress`: {blob: bytes} of blobs it was in
        the middle of ("@bytes" lines, each written only after those bytes were fsynced)."""
        out: dict[str, str] = {}
        self.progress = {}
        j = self.root / "journal"
        if not j.exists():
            return out
        offsets = {fs.name: (fs, fs.blob_offsets(self.sizes)) for fs in self.files}
        for line in j.read_text(errors="replace").splitlines():
            parts = line.split("\t")
            if len(parts) != 3 or parts[0] not in offsets:
                continue
            name, blob, sha = parts
            fs, at = offsets[name]
            partial = _inside(self.root, name).with_name(name + ".partial")
            if not (blob in at and partial.is_file() and partial.stat().st_size == fs.size):
                continue
            if sha.startswith("@"):
                if sha[1:].isdigit() and 0 < int(sha[1:]) < self.sizes[blob]:
                    self.progress[blob] = max(self.progress.get(blob, 0), int(sha[1:]))
                continue
            with open(partial, "rb") as f:
                if _sha(f, at[blob], self.sizes[blob]) == sha:
                    out[blob] = sha
        for blob in out:
            self.progress.pop(blob, None)
        return out

    def check_disk(self, plan: Plan) -> None:
        free = shutil.disk_usage(self.root).free
        if plan.disk_bytes > free:
            raise CacheError(
                f"not enough free disk in {self.cache_dir}: the shard needs {plan.disk_bytes} bytes "
                f"({plan.disk_bytes / 1e9:.2f} GB), {free} bytes ({free / 1e9:.2f} GB) are free"
            )

    def fill(
        self,
        plan: Plan,
        fetch: Callable[[Sequence[str], int], Iterator[tuple[str, int, bytes, str | None]]],
        progress: Callable[[int, int], None] = lambda done, total: None,
    ) -> dict[str, str]:
        """Write every file of the shard: blobs held are copied, the others fetched.

        `fetch(blobs, first_offset)` yields (blob, offset within it, bytes, on the blob's last chunk
        its sha256 at the source else None), in order, blobs[0] from `first_offset` or before it
        (plan.resume_offset: the bytes before it are on disk from an interrupted fill), each chunk
        already checked against the source's digest of it (node/ship.py).
        Returns {blob: sha256} of the shard, as its manifest records it.
        """
        sha: dict[str, str] = {b: h.sha256 for b, h in self.have.items()} | self.journal
        handles = {}
        targets: dict[str, tuple[object, int]] = {}
        journal = open(self.root / "journal", "a")
        try:
            for fs in self.files:
                if self._complete(fs):
                    continue
                partial = _inside(self.root, fs.name).with_name(fs.name + ".partial")
                f = open(
                    partial,
                    "r+b" if partial.exists() and partial.stat().st_size == fs.size else "w+b",
                )
                f.truncate(fs.size)
                f.seek(0)
                f.write(fs.header)
                handles[fs.name] = f
                for blob, at in fs.blob_offsets(self.sizes).items():
                    if blob in self.journal:
                        continue
                    targets[blob] = (f, at)
                    h = self.have.get(blob)
                    if h is not None:  # held in another file (an older placement): copy locally
                        _copy(h, f, at, self.sizes[blob], blob)
                        journal.write(f"{fs.name}\t{blob}\t{h.sha256}\n")
            journal.flush()
            self._receive(plan, fetch, targets, handles, journal, sha, progress)
            for name, f in handles.items():
                f.flush()
                os.fsync(f.fileno())
        finally:
            journal.close()
            for f in handles.values():
                f.close()
        for name in handles:
            final = _inside(self.root, name)
            os.replace(final.with_name(name + ".partial"), final)
        manifest = Manifest(
            self.catalog,
            self.local,
            {b: sha[b] for fs in self.files for s in fs.slots for b in s.blobs},
        )
        tmp = self.root / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest.to_json()) + "\n")
        os.replace(tmp, self.root / MANIFEST)
        keep = {fs.name for fs in self.files} | {MANIFEST, STAMPS, "config.json", ".lock"}
        for p in self.root.iterdir():  # files of an older placement, journals, partials
            if p.name not in keep and p.is_file():
                p.unlink()
        (self.root / "config.json").write_text(self.catalog.config_text)
        # the files just written were checked piece by piece against the source's digests on the way
        # in: the next scan trusts them while they stay as they are (the others were stamped by the scan)
        write_stamps(self.root, handles)
        return manifest.sha256

    def _receive(
        self, plan: Plan, fetch, targets, handles, journal, sha: dict[str, str], progress
    ) -> None:
        """Fetch plan.fetch: writes run on one owned thread, a few chunks behind the network."""
        from concurrent.futures import ThreadPoolExecutor

        sizes = self.sizes
        marked: dict[str, int] = {}  # blob -> bytes of it last journaled as durable

        def absorb(blob: str, off: int, data: bytes, source_sha: str | None) -> None:
            f, at = targets[blob]
            last = source_sha is not None
            os.pwrite(f.fileno(), data, at + off)
            end = off + len(data)
            if not last and end - marked.setdefault(blob, off) >= PROGRESS_BYTES:
                # an interrupted fill resumes from here: the bytes are made durable before the
                # journal says so, so a crash cannot leave a claimed range unwritten
                os.fsync(f.fileno())
                journal.write(f"{_name_of(targets, blob, handles)}\t{blob}\t@{end}\n")
                journal.flush()
                marked[blob] = end
            if last:
                sha[blob] = source_sha
                journal.write(f"{_name_of(targets, blob, handles)}\t{blob}\t{source_sha}\n")
                journal.flush()

        done, total = 0, plan.fetch_bytes
        pending = []
        with ThreadPoolExecutor(1, thread_name_prefix="cache-write") as writer:
            try:
                for blob, off, data, source_sha in fetch(list(plan.fetch), plan.resume_offset):
                    if blob not in targets:
                        raise CacheError(
                            f"the coordinator sent blob {blob!r}, which was not asked for"
                        )
                    last = source_sha is not None
                    if off + len(data) > sizes[blob] or (last and off + len(data) != sizes[blob]):
                        raise CacheError(
                            f"blob {blob!r}: chunk at {off} ({len(data)} bytes) does not fit its "
                            f"{sizes[blob]} bytes"
                        )
                    if last and not SHA256_HEX.fullmatch(source_sha):
                        raise CacheError(
                            f"blob {blob!r}: the coordinator sent {source_sha[:80]!r} for its sha256"
                        )
                    pending.append(writer.submit(absorb, blob, off, data, source_sha))
                    while len(pending) > 8 or (
                        pending and pending[0].done()
                    ):  # bounded: 8 chunks in flight
                        pending.pop(0).result()
                    done += len(data)
                    progress(min(done, total), total)
            finally:
                for fut in pending:
                    fut.result()  # what was received is written and journaled, even when the stream broke
        missing = [b for b in plan.fetch if b not in sha]
        if missing:
            raise CacheError(
                f"the coordinator's stream ended without {len(missing)} blobs (first {missing[0]!r})"
            )

    def open(self) -> "CachedCheckpoint":
        return CachedCheckpoint(self.root, self.catalog, self.local)


def _copy(h: Have, f, at: int, n: int, blob: str) -> None:
    """Copy a held blob into file `f` at `at`, 8 MB at a time, checking its sha256 on the way."""
    digest = hashlib.sha256()
    with open(h.path, "rb") as src:
        done = 0
        while done < n:
            data = os.pread(src.fileno(), min(8 << 20, n - done), h.offset + done)
            if not data:
                raise CacheError(f"{h.path}: blob {blob} ends early while copying")
            digest.update(data)
            os.pwrite(f.fileno(), data, at + done)
            done += len(data)
    if digest.hexdigest() != h.sha256:
        raise CacheError(f"{h.path}: blob {blob} changed on disk while copying")


def _name_of(targets, blob, handles) -> str:
    f = targets[blob][0]
    return next(n for n, h in handles.items() if h is f)


@contextlib.contextmanager
def exclusive(root: Path, busy: str):
    """The shard's lock (`.lock`), held by whoever writes its files; CacheError "<root> <busy>" when
    another process holds it."""
    import fcntl

    with open(root / ".lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CacheError(f"{root} {busy}") from None
        yield
