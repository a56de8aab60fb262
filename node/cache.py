"""A node's shard cache: prepacked file sets the coordinator shipped, loaded by byte range.

A shard lives in `<cache dir>/<fingerprint[:16]>/`: `replicated.safetensors` (every weight that is not
a routed expert), one `layer-LLLL-<experts digest>.safetensors` per MoE layer holding this node's
experts stacked `(E_local, ...)` per expert tensor, `config.json`, and `manifest.json` (the model's
catalog, the placement, and the sha256 of every blob). A blob is the unit of shipping and of repair:
one replicated tensor, or one expert's slice of one expert tensor — so a placement change fetches
only the experts a node lacks, and a flipped byte costs one blob.

The node opens a shard as a `Checkpoint` (`CachedCheckpoint`) whose tensors keep the checkpoint's
names and shapes, so `node/moe/load.py` loads it exactly as it loads the checkpoint itself.
File names come from this module, never from a manifest or the coordinator: a node writes only
inside its cache directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import xxhash

from ..common import cache_home
from ..proto.errors import UserError
from .checkpoint import _DTYPES, Checkpoint, TensorInfo, read_config
from .describe import Group, ModelDescription

logger = logging.getLogger(__name__)

FORMAT = 1
MANIFEST = "manifest.json"
STAMPS = (
    "verified.json"  # per file: its stat when its blobs last matched the manifest (verified_blobs)
)
PROGRESS_BYTES = 16 << 20  # an interrupted fill resumes a blob from its last multiple of this
PIECE_BYTES = 4 << 20  # the unit of the source's piece digests (coordinator/serve/digests.py)
REPLICATED = "replicated.safetensors"
_FILE_NAME = re.compile(r"^(replicated|layer-\d{4}-[0-9a-f]{12})\.safetensors$")
_SHARD_DIR = re.compile(r"^[0-9a-f]{16}$")
SHA256_HEX = re.compile(
    r"[0-9a-f]{64}"
)  # a blob's sha256 as manifests and digests write it (fullmatch)
_ALIGN = 64  # bytes: tensor data starts aligned, so mmap'd reads are too


class CacheError(UserError):
    """A cache directory, manifest or catalog that cannot be used, with the reason."""


def default_cache_dir() -> Path:
    """Where a node keeps its shards: cache_home()/shards."""
    return cache_home() / "shards"


def piece_hasher():
    """The digest of one piece of a blob, as the coordinator computes it from its checkpoint and the
    node checks it on arrival, a part at a time (`update`, then `intdigest`; the node hashes each
    part as it lands, while it is in the CPU's cache): xxh3-64, ~30 GB/s on one core (sha256: ~2)."""
    return xxhash.xxh3_64()


def fingerprint(ckpt: Checkpoint) -> str:
    """sha256 of config.json and every safetensors header: changes when any weight's name, dtype,
    shape or place changes, costs no weight reads (a re-quantized or retrained checkpoint with the
    same headers is caught by the per-blob sha256 instead, when a node next loads). Taken from the
    bytes the Checkpoint read when it opened: nothing is read again."""
    h = hashlib.sha256()
    h.update(ckpt.config_bytes)
    for name in sorted({t.file.name for t in ckpt.tensors.values()}):
        h.update(name.encode() + b"\0" + ckpt.headers[name])
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# The catalog: what a model is made of, as blobs


@dataclass(frozen=True)
class Catalog:
    """The model as the coordinator describes it to a node: fingerprint, config, tensors by role."""

    fingerprint: str
    config_text: str
    replicated: tuple[tuple[str, str, tuple[int, ...]], ...]  # (key, dtype, shape)
    layers: dict[int, tuple[int, tuple[Group, ...]]]  # MoE layer -> (experts, groups)

    def to_json(self) -> dict:
        return {
            "fingerprint": self.fingerprint,
            "config": self.config_text,
            "replicated": [[k, d, list(s)] for k, d, s in self.replicated],
            "layers": {
                str(l): {
                    "experts": n,
                    "groups": [
                        {
                            "key": g.key,
                            "dtype": g.dtype,
                            "shape": list(g.shape),
                            "stacked": g.stacked,
                            "per": g.per,
                        }
                        for g in groups
                    ],
                }
                for l, (n, groups) in sorted(self.layers.items())
            },
        }

    @classmethod
    def of(cls, desc: ModelDescription) -> "Catalog":
        """The catalog of a described checkpoint (its headers and the node's own MoE rule)."""
        desc.require_moe()
        ckpt = desc.checkpoint
        layers = {}
        grouped: set[str] = set()
        for m in desc.moe:
            if m.layout_error:
                raise CacheError(m.layout_error)
            layers[m.layer] = (m.num_experts, m.groups)
            for g in m.groups:
                grouped.update({g.key} if g.stacked else {g.blob(e) for e in range(m.num_experts)})
        replicated = tuple(
            (k, t.dtype, t.shape) for k, t in sorted(ckpt.tensors.items()) if k not in grouped
        )
        return cls(fingerprint(ckpt), ckpt.config_bytes.decode(), replicated, layers)

    @classmethod
    def from_json(cls, d, where: str) -> "Catalog":
        """Strict: a catalog decides file contents, so every field is checked and a bad one named."""
        try:
            fp, config = d["fingerprint"], d["config"]
            if not (isinstance(fp, str) and re.fullmatch(r"[0-9a-f]{64}", fp)) or not isinstance(
                config, str
            ):
                raise ValueError("fingerprint must be 64 hex digits and config a string")
            replicated = tuple((_s(k), _dtype(dt), _shape(s)) for k, dt, s in d["replicated"])
            layers = {}
            for l, v in d["layers"].items():
                n = int(v["experts"])
                groups = tuple(
                    Group(
                        _s(g["key"]),
                        _dtype(g["dtype"]),
                        _shape(g["shape"]),
                        bool(g["stacked"]),
                        int(g["per"]),
                    )
                    for g in v["groups"]
                )
                if n < 1 or not groups:
                    raise ValueError(f"layer {l} has {n} experts and {len(groups)} expert tensors")
                for g in groups:
                    if g.stacked and (g.per < 1 or not g.shape or g.shape[0] != n * g.per):
                        raise ValueError(
                            f"{g.key}: leading dimension {g.shape[:1]} is not {n} experts × {g.per}"
                        )
                    if not g.stacked and "{e}" not in g.key:
                        raise ValueError(f"{g.key}: a per-expert tensor name needs {{e}}")
                layers[int(l)] = (n, groups)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CacheError(f"{where}: malformed catalog ({type(exc).__name__}: {exc})") from None
        return cls(fp, config, replicated, layers)

    def blob_nbytes(self) -> dict[str, int]:
        """{blob id: bytes} of every blob of the model."""
        out = {k: math.prod(s) * _DTYPES[d][2] for k, d, s in self.replicated}
        for n, groups in self.layers.values():
            for g in groups:
                out.update({g.blob(e): g.expert_nbytes() for e in range(n)})
        return out


def _s(x) -> str:
    if not isinstance(x, str) or not x or len(x) > 1000:
        raise ValueError(f"{x!r} is not a tensor name")
    return x


def _dtype(x) -> str:
    if x not in _DTYPES:
        raise ValueError(f"unknown dtype {x!r}")
    return x


def _shape(x) -> tuple[int, ...]:
    if not isinstance(x, list) or not all(isinstance(i, int) and 0 <= i < 1 << 40 for i in x):
        raise ValueError(f"{x!r} is not a shape")
    return tuple(x)


def source_ranges(ckpt: Checkpoint, catalog: Catalog) -> dict[str, tuple[Path, int, int]]:
    """{blob id: (file, start, bytes)} in the checkpoint: where the coordinator reads each blob."""
    out = {
        k: (ckpt.tensors[k].file, ckpt.tensors[k].start, ckpt.tensors[k].nbytes)
        for k, _, _ in catalog.replicated
    }
    for n, groups in catalog.layers.values():
        for g in groups:
            nb = g.expert_nbytes()
            for e in range(n):
                if g.stacked:
                    t = ckpt.tensors[g.key]
                    out[g.blob(e)] = (t.file, t.start + e * nb, nb)
                else:
                    t = ckpt.tensors[g.key.format(e=e)]
                    out[g.blob(e)] = (t.file, t.start, t.nbytes)
    return out


# ---------------------------------------------------------------------------------------------
# The file set of one shard


@dataclass(frozen=True)
class Slot:
    """One tensor of a cached file: its bytes are `blobs` in order, from `offset`."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute, bytes
    blobs: tuple[str, ...]


@dataclass(frozen=True)
class FileSet:
    """One cached file: its header bytes and where each tensor goes."""

    name: str
    header: bytes  # 8-byte length + JSON, padded
    slots: tuple[Slot, ...]
    size: int  # bytes, header included

    def blob_offsets(self, sizes: dict[str, int]) -> dict[str, int]:
        out = {}
        for s in self.slots:
            at = s.offset
            for b in s.blobs:
                out[b] = at
                at += sizes[b]
        return out


def _fileset(
    name: str, tensors: list[tuple[str, str, tuple[int, ...], tuple[str, ...]]], meta: dict
) -> FileSet:
    entries, at = {}, 0
    for tname, dtype, shape, _ in tensors:
        n = math.prod(shape) * _DTYPES[dtype][2]
        entries[tname] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + n]}
        at += -(-n // _ALIGN) * _ALIGN if n else 0
        entries[tname]["data_offsets"][1] = entries[tname]["data_offsets"][0] + n
    head = json.dumps({"__metadata__": meta, **entries}, separators=(",", ":")).encode()
    head += b" " * (-(len(head) + 8) % _ALIGN)
    base = 8 + len(head)
    slots = tuple(
        Slot(tname, dtype, shape, base + entries[tname]["data_offsets"][0], blobs)
        for tname, dtype, shape, blobs in tensors
    )
    return FileSet(name, struct.pack("<Q", len(head)) + head, slots, base + at)


def _layer_name(layer: int, local: Sequence[int]) -> str:
    digest = hashlib.sha256(",".join(map(str, local)).encode()).hexdigest()[:12]
    return f"layer-{layer:04d}-{digest}.safetensors"


def layout(catalog: Catalog, local: dict[int, Sequence[int]]) -> list[FileSet]:
    """The files of a shard holding experts `local` ({MoE layer: experts}) of `catalog`."""
    files = [
        _fileset(
            REPLICATED,
            [(k, d, s, (k,)) for k, d, s in catalog.replicated],
            {"format": "moe-cluster"},
        )
    ]
    for layer, (n, groups) in sorted(catalog.layers.items()):
        experts = sorted(local.get(layer, ()))
        if any(not 0 <= e < n for e in experts):
            raise CacheError(f"layer {layer}: experts {experts} out of range 0..{n - 1}")
        if not experts:
            continue
        tensors = []
        for g in groups:
            shape = (len(experts) * g.expert_shape()[0],) + g.expert_shape()[1:]
            tname = g.key if g.stacked else g.key.replace("{e}", "*")
            tensors.append((tname, g.dtype, shape, tuple(g.blob(e) for e in experts)))
        files.append(
            _fileset(
                _layer_name(layer, experts),
                tensors,
                {"format": "moe-cluster", "experts": ",".join(map(str, experts))},
            )
        )
    return files


# ---------------------------------------------------------------------------------------------
# A shard directory: manifest, verification, filling


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
        with _exclusive(
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


class CachedCheckpoint(Checkpoint):
    """A shard directory seen as the checkpoint it came from: the same tensor names and shapes;
    expert tensors hold only this node's experts (reading another one is an error)."""

    def __init__(self, root: Path, catalog: Catalog, local: dict[int, tuple[int, ...]]):
        self.path = root
        self.config = read_config(root)
        self.tensors = {}
        sizes = catalog.blob_nbytes()
        files = {fs.name: fs for fs in layout(catalog, local)}
        rep = files[REPLICATED]
        for s in rep.slots:
            self.tensors[s.name] = TensorInfo(
                s.name, root / REPLICATED, s.dtype, s.shape, s.offset, s.offset + sizes[s.blobs[0]]
            )
        for layer, (n, groups) in catalog.layers.items():
            experts = local.get(layer, ())
            fs = files.get(_layer_name(layer, experts)) if experts else None
            offsets = fs.blob_offsets(sizes) if fs else {}
            path = root / fs.name if fs else root / REPLICATED
            for g in groups:
                if g.stacked:
                    start = offsets[g.blob(experts[0])] if experts else 0
                    full = math.prod(g.shape) * _DTYPES[g.dtype][2]
                    self.tensors[g.key] = TensorInfo(
                        g.key,
                        path,
                        g.dtype,
                        g.shape,
                        start,
                        start + full,
                        held=tuple(experts),
                        per=g.per,
                    )
                    continue
                for e in range(n):
                    key = g.key.format(e=e)
                    if e in experts:
                        at = offsets[g.blob(e)]
                        self.tensors[key] = TensorInfo(
                            key, path, g.dtype, g.shape, at, at + g.expert_nbytes()
                        )
                    else:
                        self.tensors[key] = TensorInfo(
                            key,
                            path,
                            g.dtype,
                            g.shape,
                            0,
                            g.expert_nbytes(),
                            held=(),
                            per=g.shape[0] if g.shape else 1,
                        )


# ---------------------------------------------------------------------------------------------
# `moe-cluster cache ls|rm`


@dataclass(frozen=True)
class CachedShard:
    name: str  # the directory, = fingerprint[:16]
    model_type: str
    bytes: int
    experts: int  # experts held, over all layers
    state: str  # "complete", "partial" or the reason it is unusable


def list_shards(cache_dir: Path) -> list[CachedShard]:
    out = []
    if not Path(cache_dir).is_dir():
        return out
    for d in sorted(Path(cache_dir).iterdir()):
        if not (d.is_dir() and _SHARD_DIR.match(d.name)):
            continue
        size = sum(p.stat().st_size for p in d.iterdir() if p.is_file())
        try:
            m = Manifest.read(d / MANIFEST)
            state = "complete" if not (d / "journal").exists() else "partial"
            mt = json.loads(m.catalog.config_text).get("model_type", "?")
            experts = sum(len(v) for v in m.local.values())
        except CacheError as exc:
            state, mt, experts = (
                ("partial" if (d / "journal").exists() else f"unusable: {exc}"),
                "?",
                0,
            )
        except json.JSONDecodeError:
            state, mt, experts = "unusable: config is not JSON", "?", 0
        out.append(CachedShard(d.name, mt, size, experts, state))
    return out


def remove_shard(cache_dir: Path, name: str) -> Path:
    if not _SHARD_DIR.match(name):
        raise CacheError(
            f"{name!r} is not a cached shard name (16 hex digits, as `cache ls` shows)"
        )
    d = Path(cache_dir) / name
    if not d.is_dir():
        raise CacheError(f"no cached shard {name} in {cache_dir}")
    shutil.rmtree(d)
    return d


@contextlib.contextmanager
def _exclusive(root: Path, busy: str):
    """The shard's lock (`.lock`), held by whoever writes its files; CacheError "<root> <busy>" when
    another process holds it."""
    import fcntl

    with open(root / ".lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CacheError(f"{root} {busy}") from None
        yield


def verify_shard(cache_dir: Path, name: str) -> tuple[int, list[str]]:
    """Hash every blob of a cached shard against its manifest, whatever its files' stamps say (a
    warm start trusts unchanged files): (blobs that match, blobs that do not). A file with a bad
    blob loses its stamp, so the node's next load fetches that blob again."""
    if not _SHARD_DIR.match(name):
        raise CacheError(
            f"{name!r} is not a cached shard name (16 hex digits, as `cache ls` shows)"
        )
    root = Path(cache_dir) / name
    if not (root / MANIFEST).is_file():
        raise CacheError(f"no complete cached shard {name} in {cache_dir}")
    manifest = Manifest.read(root / MANIFEST)
    with _exclusive(root, "is in use by a node agent; verify it while the node is stopped"):
        good = verified_blobs(root, manifest, full=True)
    return len(good), sorted(b for b in manifest.sha256 if b not in good)


def cache_main(args) -> int:
    """`moe-cluster cache ls|rm|verify`."""
    cache_dir = Path(args.cache_dir).expanduser() if args.cache_dir else default_cache_dir()
    if args.cache_command == "verify":
        names = args.names or [s.name for s in list_shards(cache_dir) if s.state == "complete"]
        if not names:
            print(f"{cache_dir}: no complete cached shards")
        failed = 0
        for name in names:
            ok, bad = verify_shard(cache_dir, name)
            failed += bool(bad)
            print(
                f"{name}: {ok} blobs match their sha256"
                + (
                    f", {len(bad)} do not (first {bad[0]}); the node's next load fetches them again"
                    if bad
                    else ""
                )
            )
        return 1 if failed else 0
    if args.cache_command == "ls":
        shards = list_shards(cache_dir)
        if not shards:
            print(f"{cache_dir}: no cached shards")
        for s in shards:
            print(
                f"{s.name}  {s.model_type:<12} {s.bytes / 1e6:10.1f} MB  {s.experts:5d} experts  {s.state}"
            )
        return 0
    for name in args.names:
        print(f"removed {remove_shard(cache_dir, name)}")
    return 0
