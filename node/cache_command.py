"""`moe-cluster cache ls|rm|verify`: the shards in a node's cache, removed or hashed again."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from .cache import MANIFEST, Manifest, default_cache_dir, exclusive, verified_blobs
from .catalog import CacheError

_SHARD_DIR = re.compile(r"^[0-9a-f]{16}$")


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
    with exclusive(root, "is in use by a node agent; verify it while the node is stopped"):
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
