"""Keep transformers' import structure on disk, so a process does not rebuild it at every start.

mlx-lm imports transformers for its tokenizer (every node, the coordinator, every bench worker), and
`import transformers` builds its lazy module's map by reading and parsing every file under
transformers/models (1,667 files: ~1.1 s of the ~2 s a process spends importing mlx-lm on 2 vCPUs).
The map is a pure function of those files, which only pip changes in an installed transformers, so
it is cached per transformers version, install path and the scanned folder's modification time
(one file per version and Python, its other entries dropped as they go stale); an editable
transformers, whose files change under one version, is never cached. The first process builds and
stores the map, later ones load it (~10 ms). Any surprise (another transformers whose internals
differ, an unreadable, corrupt or foreign cache file, no usable home) leaves the import as
transformers wrote it: the cache only ever skips work, never changes a result.

`install()` must run before transformers is imported: the `moe-cluster` entry point calls it at its
import (node and coordinator processes, `spawn` children that re-import it), as do the fork
server's preload (node/preimport.py), node/prefork.py's children and the test suite's conftest.
It costs an entry in sys.meta_path; the cache is opened only when transformers is imported."""

from __future__ import annotations

import io
import json
import os
import pickle
import sys
import tempfile
import threading
from pathlib import Path

from . import cache_home

_MODULE = "transformers.utils.import_utils"
_FUNCTION = "define_import_structure"
_PARAMETERS = ["module_path", "prefix"]  # transformers 5.x; any other signature is not wrapped
# what this process's cache did: structures loaded from the file, and built by transformers
stats = {"loaded": 0, "built": 0}


def cache_dir() -> Path | None:
    """The project's cache_home(), or None where it is not an absolute path (a relative
    $XDG_CACHE_HOME) or there is no home to put it in."""
    try:
        home = cache_home()
    except RuntimeError:  # Path.home(): no HOME and no passwd entry
        return None
    return home if home.is_absolute() else None


class _Plain(pickle.Unpickler):
    """Loads what the cache stores (dicts, sets, frozensets, strings) and nothing that names a
    class or function, so a file someone else wrote cannot run code here."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"the cache holds no {module}.{name}")


def _loads(blob: bytes):
    return _Plain(io.BytesIO(blob)).load()


class _Cache:
    """Maps (folder, prefix, folder mtime) to the structure transformers built for it, pickled."""

    def __init__(self, path: Path):
        self.path = path
        self.entries: dict | None = None  # read at transformers' first call
        self.lock = threading.Lock()  # transformers may be imported by two threads of a process

    def _load(self) -> dict:
        if self.entries is None:
            try:
                entries = _loads(self.path.read_bytes())
                self.entries = entries if isinstance(entries, dict) else {}
            except Exception:  # missing (first start), truncated, foreign: rebuilt
                self.entries = {}
        return self.entries

    def wrap(self, build):
        raw = getattr(build, "__wrapped__", build)  # under its lru_cache: a fresh build each call

        def define_import_structure(module_path, prefix=None, *args, **kwargs):
            if args or kwargs:  # a call this cache does not know: transformers' own answer
                return build(module_path, prefix, *args, **kwargs)
            key = (os.path.realpath(str(module_path)), prefix, _stamp(module_path))
            with self.lock:
                blob = self._load().get(key)
            if blob is not None:
                try:
                    value = _loads(blob)  # a fresh copy: transformers updates what it gets
                    stats["loaded"] += 1
                    return value
                except Exception:
                    pass
            value = build(module_path, prefix)
            stats["built"] += 1
            try:
                blob = pickle.dumps(value)
                with self.lock:
                    self._store(key, blob)
            except Exception:  # a cache that cannot be written costs the next process the scan
                pass
            return value

        define_import_structure.__wrapped__ = raw
        for name in ("cache_clear", "cache_info"):  # lru_cache's, for whoever calls them
            if hasattr(build, name):
                setattr(define_import_structure, name, getattr(build, name))
        return define_import_structure

    def _store(self, key: tuple, blob: bytes) -> None:
        entries = self._load()
        for old in [k for k in entries if not isinstance(k, tuple) or k[:2] == key[:2]]:
            del entries[old]  # the same folder at another time: stale
        entries[key] = blob
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=self.path.name, suffix=".tmp", dir=self.path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                pickle.dump(entries, f)
            os.replace(tmp, self.path)  # processes starting together never read half a file
        except BaseException:
            os.unlink(tmp)
            raise


def _stamp(module_path) -> int:
    """The scanned folder's modification time: a model folder added or removed changes it."""
    path = str(module_path)
    try:
        return os.stat(path if os.path.isdir(path) else os.path.dirname(path)).st_mtime_ns
    except OSError:
        return 0


def _cache_for_this_transformers() -> _Cache | None:
    """The cache of the installed transformers' version, or None: no version, an editable install,
    no usable cache folder."""
    try:
        from importlib.metadata import distribution

        dist = distribution("transformers")
        direct = json.loads(dist.read_text("direct_url.json") or "{}")
        if direct.get("dir_info", {}).get("editable"):
            return None
        version = dist.version
    except Exception:  # not installed, or metadata unreadable
        return None
    folder = cache_dir()
    if folder is None:
        return None
    return _Cache(
        folder / f"transformers-{version}-py{sys.version_info[0]}{sys.version_info[1]}.pkl"
    )


class _Finder:
    """Wraps transformers' import_utils as it is imported, before transformers/__init__.py uses
    it. Stays in sys.meta_path (removing itself while another thread walks the list could make
    that thread skip a finder); after its one use it answers None at once."""

    def __init__(self):
        self.done = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _MODULE or self.done:
            return None
        self.done = True
        from importlib.machinery import PathFinder

        spec = PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):  # on this spec's own loader: its get_source etc. stay as they are
            run(module)
            build = getattr(module, _FUNCTION, None)
            if callable(build) and _signature(build) == _PARAMETERS:
                cache = _cache_for_this_transformers()
                if cache is not None:
                    setattr(module, _FUNCTION, cache.wrap(build))

        spec.loader.exec_module = exec_module
        return spec


def _signature(fn) -> list[str] | None:
    import inspect

    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


def install() -> bool:
    """Serve transformers' import structure from the cache in this process; True where it will
    try. False where transformers is imported already (nothing to do) or this is installed."""
    if "transformers" in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return False
    sys.meta_path.insert(0, _Finder())
    return True
