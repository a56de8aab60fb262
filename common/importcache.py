"""Keep transformers' import structure on disk, so a process does not rebuild it at every start.

mlx-lm imports transformers for its tokenizer (every node, the coordinator, every bench worker), and
`import transformers` builds its lazy module's map by reading and parsing every file under
transformers/models (1,667 files: ~1.1 s of the ~2 s a process spends importing mlx-lm on 2 vCPUs).
The map is a pure function of those files, so it is cached per transformers version, install path
and the scanned folder's modification time: the first process builds and stores it, later ones
load it (~10 ms). Any surprise (another transformers whose internals differ, an unreadable or
corrupt cache, a read-only home) leaves the import as transformers wrote it; the cache only ever
skips work, never changes a result.

`install()` must run before transformers is imported: the `moe-cluster` entry point calls it at its
import (node and coordinator processes, `spawn` children, which re-import it), as do the fork
server's preload (node/preimport.py) and the test suite's conftest."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import pickle
import sys
from pathlib import Path

_MODULE = "transformers.utils.import_utils"
_FUNCTION = "define_import_structure"
# what this process's cache did: structures loaded from the file, and built by transformers
stats = {"loaded": 0, "built": 0}


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moe-cluster"


def _version() -> str | None:
    try:
        from importlib.metadata import version

        return version("transformers")
    except Exception:  # not installed, or metadata unreadable: no cache
        return None


class _Cache:
    """Maps (folder, prefix) to the pickled structure transformers built for it, in one file."""

    def __init__(self, path: Path):
        self.path = path
        self.entries: dict | None = None  # read at transformers' first call, not at install()

    def _load(self) -> dict:
        if self.entries is None:
            try:
                with open(self.path, "rb") as f:
                    entries = pickle.load(f)
                self.entries = entries if isinstance(entries, dict) else {}
            except Exception:  # missing (first start), truncated or unreadable: rebuilt
                self.entries = {}
        return self.entries

    def wrap(self, build):
        def define_import_structure(module_path, prefix=None):
            key = (os.path.realpath(str(module_path)), prefix, _stamp(module_path))
            blob = self._load().get(key)
            if blob is not None:
                try:
                    value = pickle.loads(blob)  # a fresh copy: transformers updates what it gets
                    stats["loaded"] += 1
                    return value
                except Exception:
                    pass
            value = build(module_path, prefix)
            stats["built"] += 1
            try:
                self.entries[key] = pickle.dumps(value)
                self._store()
            except Exception:  # a cache that cannot be written costs the next process the scan
                pass
            return value

        define_import_structure.__wrapped__ = build
        return define_import_structure

    def _store(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            pickle.dump(self.entries, f)
        os.replace(tmp, self.path)  # processes starting together never read half a file


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps transformers' import_utils as it is imported: before transformers/__init__.py uses it."""

    def __init__(self, cache: _Cache):
        self.cache = cache

    def find_spec(self, fullname, path, target=None):
        if fullname != _MODULE:
            return None
        _remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, cache = spec.loader, self.cache
        run = loader.exec_module

        def exec_module(module):  # on this spec's own loader: its get_source etc. stay as they are
            run(module)
            build = getattr(module, _FUNCTION, None)
            if callable(build):
                setattr(module, _FUNCTION, cache.wrap(build))

        loader.exec_module = exec_module
        return spec


def _stamp(module_path) -> int:
    """The scanned folder's modification time: a model file added or removed in place (an editable
    transformers, a partial upgrade that kept the version) changes it, and so the key."""
    path = str(module_path)
    try:
        return os.stat(path if os.path.isdir(path) else os.path.dirname(path)).st_mtime_ns
    except OSError:
        return 0


def _remove(finder) -> None:
    try:
        sys.meta_path.remove(finder)
    except ValueError:
        pass


def install() -> bool:
    """Serve transformers' import structure from the cache in this process; True where it will.
    False where transformers is imported already or not installed (nothing to do)."""
    if "transformers" in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return False
    version = _version()
    if version is None:
        return False
    cache = _Cache(
        cache_dir() / f"transformers-{version}-py{sys.version_info[0]}{sys.version_info[1]}.pkl"
    )
    sys.meta_path.insert(0, _Finder(cache))
    return True
