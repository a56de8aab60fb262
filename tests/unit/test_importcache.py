"""common/importcache.py: transformers' import structure comes from the cache, equal to a fresh
build, and a broken cache costs only the scan."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

CHILD = """
import json, sys
from moe_cluster.common import importcache
assert importcache.install()
from transformers import AutoTokenizer, PreTrainedTokenizerFast
import transformers.utils.import_utils as iu
from pathlib import Path
import transformers
models = Path(transformers.__file__).parent / "models"
fresh = iu.define_import_structure.__wrapped__(models, "models")  # the function under lru_cache
cached = iu.define_import_structure(models, prefix="models")
print(json.dumps({"stats": importcache.stats, "equal": fresh == cached,
                  "entries": sum(len(v) for v in cached.values()),
                  "tokenizer": AutoTokenizer.__name__}))
"""


def _child(cache_home) -> dict:
    env = dict(os.environ, XDG_CACHE_HOME=str(cache_home), TRANSFORMERS_VERBOSITY="error")
    r = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_the_next_process_loads_what_the_first_built_equal_to_a_fresh_build_and_survives_a_bad_file(
    tmp_path,
):
    first = _child(tmp_path)
    assert first["stats"]["built"] >= 1 and first["equal"] and first["entries"] > 1000
    (path,) = (tmp_path / "moe-cluster").glob("transformers-*.pkl")
    second = _child(tmp_path)
    # every structure transformers asked for came from the file, and matches what it would build
    assert second["stats"]["built"] == 0 and second["stats"]["loaded"] >= 2, second
    assert second["equal"] and second["entries"] == first["entries"]
    assert second["tokenizer"] == "AutoTokenizer"
    path.write_bytes(b"not a pickle")  # a torn or foreign file: the scan again, and a good file
    third = _child(tmp_path)
    assert third["stats"]["built"] >= 1 and third["equal"]
    assert path.read_bytes() != b"not a pickle"  # and stored again for the next one


def test_install_does_nothing_once_transformers_is_imported(tmp_path):
    code = (
        "import transformers\nfrom moe_cluster.common import importcache\n"
        "print(importcache.install())"
    )
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path), TRANSFORMERS_VERBOSITY="error")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.stdout.strip() == "False", r.stderr[-2000:]


def test_a_folder_that_changed_is_scanned_again(tmp_path):
    """The key holds the scanned folder's modification time: a model folder added or removed in
    place is not served the old map (an editable transformers is never cached at all)."""
    from moe_cluster.common.importcache import _Cache

    models = tmp_path / "models"
    models.mkdir()
    calls = []

    def build(path, prefix=None, **extra):
        calls.append(path)
        return {frozenset(): {p.stem: {p.stem.title()} for p in sorted(models.iterdir())}}

    define = _Cache(tmp_path / "cache.pkl").wrap(build)
    first = define(models, "models")
    assert define(models, "models") == first and len(calls) == 1
    again = _Cache(tmp_path / "cache.pkl").wrap(build)  # the next process: read from the file
    assert again(models, "models") == first and len(calls) == 1
    (models / "newfamily.py").write_text("")
    os.utime(models, ns=(0, models.stat().st_mtime_ns + 10**9))  # coarse clocks: move it on
    changed = again(models, "models")
    assert len(calls) == 2 and "newfamily" in changed[frozenset()]
    stored = pickle.loads((tmp_path / "cache.pkl").read_bytes())
    assert len(stored) == 1, stored.keys()  # the folder's stale entry went with the new one
    # a call the cache does not know goes to transformers' own function, as it is
    assert again(models, "models", extra=True) == changed and len(calls) == 3


def test_a_cache_file_that_names_code_is_not_run(tmp_path):
    """The cache loads plain data only: a file someone else wrote that names a function (here
    os.getcwd, harmless) is read as no cache at all, and the structure is built."""
    from moe_cluster.common.importcache import _Cache, _stamp

    key = (os.path.realpath(tmp_path), None, _stamp(tmp_path))  # the entry define looks up
    cache = tmp_path / "cache.pkl"
    calls = []
    for outer in (
        {key: pickle.dumps(os.getcwd)},  # the entry names a function
        {key: pickle.dumps({}), "x": os.getcwd},  # the file itself does
    ):
        cache.write_bytes(pickle.dumps(outer))
        define = _Cache(cache).wrap(lambda path, prefix=None: calls.append(1) or {"built": 1})
        assert define(tmp_path, None) == {"built": 1}
    assert len(calls) == 2
