"""The text of a service: a launchd agent (macOS) or a systemd unit (Linux), pure functions.

Both restart the process when it fails (a crash, an out-of-memory kill, `kill -9`) but not when it
was asked to stop (exit status 0: `moe-cluster down`, a node's Shutdown), start it at login (and at
boot, for a systemd unit of the system or of a user with lingering on), and keep its output where
the platform keeps logs (~/Library/Logs/moe-cluster on macOS, the journal on Linux). The cluster
secret is never in them: the node reads it from `--secret-file`, the coordinator from cluster.yaml's
`secret.file` (command.py refuses a service that would need it in its environment).
"""

from __future__ import annotations

import plistlib
import shlex
from dataclasses import dataclass
from pathlib import Path

ROLES = ("node", "coordinator")
PLATFORMS = ("launchd", "systemd")
RESTART_S = 2  # seconds the system waits before starting a failed service again


@dataclass(frozen=True)
class Service:
    """One service as this machine runs it."""

    role: str  # ROLES
    argv: tuple[str, ...]  # the command, absolute paths
    workdir: str  # absolute
    log: str = ""  # launchd: the file its output goes to
    system: bool = False  # systemd: a unit of the system (root), else of the user

    @property
    def description(self) -> str:
        what = "node agent" if self.role == "node" else "coordinator (supervised `up`)"
        return f"moe-cluster {what}"


def label(role: str) -> str:
    """launchd's label, and the plist's name."""
    return f"org.moe-cluster.{role}"


def unit_name(role: str) -> str:
    return f"moe-cluster-{role}.service"


def unit_path(role: str, home: Path, system: bool, config_home: Path | None = None) -> Path:
    if system:
        return Path("/etc/systemd/system") / unit_name(role)
    return (config_home or home / ".config") / "systemd" / "user" / unit_name(role)


def plist_path(role: str, home: Path) -> Path:
    return home / "Library" / "LaunchAgents" / f"{label(role)}.plist"


def log_path(role: str, home: Path) -> Path:
    return home / "Library" / "Logs" / "moe-cluster" / f"{role}.log"


def plist(s: Service) -> bytes:
    """The launchd agent: started at login (RunAtLoad), again whenever it exits other than with
    status 0 (KeepAlive.SuccessfulExit false), not more often than every RESTART_S seconds."""
    return plistlib.dumps(
        {
            "Label": label(s.role),
            "ProgramArguments": list(s.argv),
            "WorkingDirectory": s.workdir,
            "RunAtLoad": True,
            "KeepAlive": {"SuccessfulExit": False},
            "ThrottleInterval": RESTART_S,
            # Background jobs have their CPU and I/O throttled: a node serves interactive requests
            "ProcessType": "Interactive",
            "EnvironmentVariables": {"PYTHONUNBUFFERED": "1"},
            "StandardOutPath": s.log,
            "StandardErrorPath": s.log,
        },
        sort_keys=False,
    )


def unit(s: Service) -> str:
    """The systemd unit: restarted on failure (a non-zero status or a signal other than a stop's),
    enabled at login (a user's: default.target) or at boot (the system's: multi-user.target)."""
    return "\n".join(
        [
            f"# `moe-cluster service install {s.role}` wrote this; "
            f"`moe-cluster service uninstall {s.role}` removes it",
            "[Unit]",
            f"Description={s.description}",
            "Wants=network-online.target",
            "After=network-online.target",
            "",
            "[Service]",
            "Type=simple",
            f"ExecStart={exec_line(s.argv)}",
            f"WorkingDirectory={_escape(s.workdir)}",
            "Environment=PYTHONUNBUFFERED=1",
            "Restart=on-failure",
            f"RestartSec={RESTART_S}",
            "TimeoutStopSec=30",
            "",
            "[Install]",
            f"WantedBy={'multi-user.target' if s.system else 'default.target'}",
            "",
        ]
    )


def exec_line(argv: tuple[str, ...]) -> str:
    """argv as systemd reads ExecStart: quoted words, '%' and '$' doubled (its specifiers)."""
    return " ".join(_escape(shlex.quote(a)) for a in argv)


def _escape(text: str) -> str:
    return text.replace("%", "%%").replace("$", "$$")


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """A unit's sections and keys as systemd reads them (a key may repeat); for tests and
    `service status`. Raises ValueError naming the line that is neither a section, a key nor a
    comment."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for i, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, sep, value = line.partition("=")
        if not sep or current is None or not key.strip():
            raise ValueError(f"line {i}: {raw!r} is not a section, a key=value or a comment")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def exec_argv(value: str) -> list[str]:
    """ExecStart's words back (the inverse of exec_line)."""
    return [w.replace("%%", "%").replace("$$", "$") for w in shlex.split(value)]
