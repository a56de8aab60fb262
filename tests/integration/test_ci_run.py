"""`.ci/run` fails with a clear message, instead of letting a test skip, when it cannot install
the browser the dashboard test needs (here: an apt-get that fails, on a PATH without chromium)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

CI_RUN = Path(__file__).resolve().parents[2] / ".ci" / "run"


def _bin(tmp_path: Path, apt_get: str) -> Path:
    """A PATH of only what .ci/run needs before its tests, an apt-get that does `apt_get`, no chromium."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for tool in ("bash", "sh", "timeout", "dirname", "env"):
        (bin_ / tool).symlink_to(shutil.which(tool))
    (bin_ / "apt-get").write_text(f"#!{shutil.which('sh')}\n{apt_get}\n")
    (bin_ / "apt-get").chmod(0o755)
    return bin_


@pytest.mark.parametrize(
    "apt_get, needle",
    [
        (
            "echo 'E: Unable to locate package chromium' >&2; exit 100",
            "chromium could not be installed",
        ),
        ("exit 0", "no 'chromium' is on PATH"),
    ],
)
def test_ci_fails_with_a_clear_message_when_chromium_cannot_be_had(tmp_path, apt_get, needle):
    bin_ = _bin(tmp_path, apt_get)
    r = subprocess.run(
        [str(bin_ / "bash"), str(CI_RUN)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PATH": str(bin_)},
    )
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "ci: FAILED: " in r.stderr and needle in r.stderr, r.stderr
    if "exit 100" in apt_get:
        assert "E: Unable to locate package chromium" in r.stderr  # apt-get's own output is kept
    assert "passed" not in r.stdout  # it stopped before the tests


@pytest.mark.parametrize("failing", ["venv", "pip", "pytest"])
def test_ci_fails_when_a_step_of_the_test_command_fails(tmp_path, failing):
    """A copy of .ci/run in a tree of stand-ins (python3, pip, the venv's python, ruff; a chromium
    on PATH): the step that fails ends the script with its status, and no later step runs, even
    with a `.venv` left from an earlier run."""
    (tmp_path / ".ci").mkdir()
    shutil.copy(CI_RUN, tmp_path / ".ci" / "run")
    log = tmp_path / "ran"
    bin_ = _bin(tmp_path, "exit 1")
    venv = tmp_path / ".venv" / "bin"
    venv.mkdir(parents=True)
    for step, path in (
        ("venv", bin_ / "python3"),
        ("chromium", bin_ / "chromium"),
        ("pip", venv / "pip"),
        ("pytest", venv / "python"),
        ("ruff", venv / "ruff"),
    ):
        code = 3 if step == failing else 0
        path.write_text(f"#!{shutil.which('sh')}\necho {step} >> {log}\nexit {code}\n")
        path.chmod(0o755)
    r = subprocess.run(
        [str(bin_ / "bash"), str(tmp_path / ".ci" / "run")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PATH": str(bin_)},
    )
    steps = ["venv", "pip", "pytest"]
    assert r.returncode == 3, (r.returncode, r.stderr)
    assert log.read_text().split() == steps[: steps.index(failing) + 1], log.read_text()
