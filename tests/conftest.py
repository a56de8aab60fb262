"""Shared fixtures: demo checkpoints made once per session, and a runner for the real CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe_cluster.common import importcache

importcache.install()  # before any test module imports mlx_lm: see common/importcache.py

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# float32 is held to |Δlogit| <= 1e-4 against stock: a GPU must compute it in float32, not in the TF32
# MLX uses by default on CUDA (and on M5's NAX), 10 bits of mantissa. Node processes the
# tests start inherit it.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

# tests/<folder>/... -> the marker every test there gets (the markers are listed in pyproject.toml)
FOLDER_MARKERS = {
    "unit": "unit",
    "integration": "integration",
    "cluster": "cluster",
    "families": "integration",
}

ARCHS = (
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "deepseek_v3",
    "dbrx",
    "gpt_oss",
    "qwen3_next",
)

# bfloat16 keeps 8 significant bits: a value in [2^e, 2^(e+1)) is a multiple of 2^(e-7) (its ulp),
# and each rounding errs by half of that. Two bf16 runs of one checkpoint that sum the experts in
# another order (the cluster: float32 partial sums, one rounding; stock: a rounding per term) differ
# by a few such roundings per layer in the hidden state, which reach the logits at about the same
# relative size, and the logits are rounded to bf16 themselves. 8 ulps of the largest logit bounds
# that for these 2-4-layer models (measured: 0 or 1 ulp) and is far below what one wrong expert or
# a wrong token does (an error of the logits' own size).
BF16_ULPS = 8


def bf16_logit_bound(logits) -> float:
    """BF16_ULPS bfloat16 ulps at the magnitude of the largest |logit| of `logits`."""
    import math

    import numpy as np

    top = float(np.max(np.abs(np.asarray(logits, dtype=np.float32))))
    return BF16_ULPS * 2.0 ** (math.floor(math.log2(top)) - 7)


def pytest_collection_modifyitems(config, items):
    """Mark each test by its folder, so `-m "not cluster"` and the like select by kind."""
    tests = Path(__file__).resolve().parent
    for item in items:
        try:
            folder = Path(item.fspath).resolve().relative_to(tests).parts[0]
        except ValueError:
            continue
        marker = FOLDER_MARKERS.get(folder)
        if marker is not None:
            item.add_marker(marker)


def cli(
    *args: str, timeout: float = 300, env: dict | None = None, input: str | None = None
) -> subprocess.CompletedProcess:
    """Run `moe-cluster ARGS...` in a subprocess, as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "moe_cluster.coordinator.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        input=input,
    )


def cli_in_process(*args: str) -> subprocess.CompletedProcess:
    """`moe-cluster ARGS...` through the CLI's own parser and handler in this process (no
    interpreter to start: for pure commands such as `plan`, called dozens of times): its exit
    code, stdout and stderr as `cli` returns them."""
    import contextlib
    import io

    from moe_cluster.coordinator import cli as entry

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = entry.main(list(args))
        except SystemExit as exc:  # argparse's own errors and --help
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    return subprocess.CompletedProcess(["moe-cluster", *args], code, out.getvalue(), err.getvalue())


def assert_one_line_error(r: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit code 2, one line on stderr that names the problem, no traceback."""
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def require(missing: str | None, install: str) -> None:
    """Go on where what a test needs is here (`missing` None). Else skip, saying what is missing and
    what to install; under CI=true fail with that one line instead: CI runs every test, and a skip
    would leave it untested there. Every test that needs a tool (root, network namespaces, g++,
    chromium, the C module) asks here, directly or through `pytest.mark.needs(missing, install)`."""
    if missing is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and {missing}: {install}", pytrace=False)
    pytest.skip(f"{missing}: {install}")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """`pytest.mark.needs(missing, install)`: `require` before the test's fixtures start anything."""
    for mark in item.iter_markers("needs"):
        require(*mark.args)


def native_sum():
    """node/collective/_sum.c's module, for a test that needs it (the install builds it where it
    finds a C compiler)."""
    from moe_cluster.node.collective import reduce

    if reduce.BUILT is None:
        require(
            "node/collective/_sum.c was not built by the install",
            "install a C compiler (apt-get install gcc) and run pip install -e . again",
        )
    return reduce.BUILT


@pytest.fixture(scope="session")
def make_ckpt(tmp_path_factory):
    """make_ckpt(arch, layout="mlx", dtype="float32", quantize=None, **spec) -> checkpoint folder (cached)."""
    from moe_cluster.node.demo.archs import ARCHS as SPECS
    from moe_cluster.node.demo.make import DemoSpec, make_checkpoint

    cache: dict = {}

    def make(
        arch: str, layout: str = "mlx", dtype: str = "float32", quantize: int | None = None, **kw
    ) -> Path:
        key = (arch, layout, dtype, quantize, tuple(sorted(kw.items())))
        if key not in cache:
            kw.setdefault("layers", max(2, SPECS[arch].min_layers))
            kw.setdefault("shard_bytes", 300_000)  # several files even for tiny models
            spec = DemoSpec(arch, dtype=dtype, quantize=quantize, layout=layout, **kw)
            out = tmp_path_factory.mktemp(f"{arch}-{layout}-{dtype}-{quantize or 'noq'}")
            make_checkpoint(spec, out)
            cache[key] = out
        return cache[key]

    return make


@pytest.fixture(scope="session")
def reference():
    """reference(path, prompt_ids, max_tokens) -> (tokens, logits) of stock mlx-lm, cached."""
    from moe_cluster.coordinator.dev.simulate import reference as ref
    from moe_cluster.proto.records import Sampling

    cache: dict = {}

    def get(path: Path, prompt: tuple[int, ...], max_tokens: int = 32):
        key = (str(path), prompt, max_tokens)
        if key not in cache:
            cache[key] = ref(str(path), list(prompt), Sampling(max_tokens=max_tokens), ())
        return cache[key]

    return get
