"""The install's one C module (node/collective/_sum.c) is optional: without a C compiler `pip`
builds the package anyway, and the all-reduce's sum then runs in numpy, the same bytes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np

from moe_cluster.node.collective.reduce import reduce_sum

ROOT = Path(__file__).resolve().parents[2]
_LEFT_OUT = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.so", "*.egg-info", "runs")


def test_without_a_c_compiler_the_install_goes_on_and_numpy_sums(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=_LEFT_OUT)
    # CC=/bin/false: the compiler setuptools calls fails, as where none is installed
    env = {**os.environ, "CC": "/bin/false"}
    r = subprocess.run(
        # -v: pip shows the build's own output only when asked
        [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation"]
        + ["-w", "dist", "."],
        cwd=src,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert 'building extension "moe_cluster.node.collective._sum" failed' in r.stdout + r.stderr
    (wheel,) = (src / "dist").glob("moe_cluster-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.endswith((".so", ".pyd"))], names
    assert "moe_cluster/node/collective/reduce.py" in names

    site = tmp_path / "site"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", site, wheel],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    parts = [np.arange(6151, dtype=np.uint16) + 0x3F00, np.full(6151, 0x3F80, np.uint16)]
    code = (
        # the suite's own install is editable: its finder would import this checkout's package
        "import sys; sys.meta_path[:] = [f for f in sys.meta_path if '__editable__' not in "
        "getattr(f, '__module__', '')]; "
        "import numpy as np; from moe_cluster.node.collective import reduce; "
        "assert reduce.BUILT is None and reduce.Reducer().native is None, reduce.BUILT; "
        "assert reduce.__file__.startswith(sys.argv[1]); "
        "assert 'node/collective/_sum.c was not built' in reduce.unbuilt_note(); "
        "a, b = np.load(sys.argv[2]); sys.stdout.write(reduce.reduce_sum([a, b], 'bfloat16').tobytes().hex())"
    )
    np.save(tmp_path / "parts.npy", np.stack(parts))
    r = subprocess.run(
        [sys.executable, "-c", code, str(site), str(tmp_path / "parts.npy")],
        env={**env, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    # the same bytes as this process's sum (the C module's, where the suite's install built it)
    assert bytes.fromhex(r.stdout) == reduce_sum(parts, "bfloat16").tobytes()
