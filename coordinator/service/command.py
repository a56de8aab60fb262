"""`moe-cluster service install|uninstall|status node|coordinator`: a node agent or the coordinator
as a service of this machine's supervisor (launchd on macOS, systemd elsewhere; units.py writes
them), restarted after a failure and started at login or boot.

The node's service runs `moe-cluster node --secret-file FILE [node options]`; the coordinator's
runs `moe-cluster supervise cluster.yaml` (supervise.py: it restarts `up` at once and holds the
API's port meanwhile; the system restarts the supervisor). `--print` shows the file and changes
nothing. The secret is read from a file when the service starts, never written into the service.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from ...proto.errors import UserError
from . import units
from .units import PLATFORMS, ROLES, Service


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="service_command", required=True, metavar="ACTION")
    for action, text in (
        ("install", "write the service and start it (now, at login and at boot)"),
        ("uninstall", "stop the service and remove it"),
        ("status", "whether the service runs, and where its log is"),
    ):
        a = sub.add_parser(action, help=text)
        a.add_argument("role", choices=ROLES)
        a.add_argument(
            "--platform",
            choices=PLATFORMS,
            default=None,
            help="launchd or systemd (default: this system's)",
        )
        if action != "install":
            continue
        a.add_argument("--print", action="store_true", help="show the file; install nothing")
        a.add_argument(
            "--secret-file",
            default=None,
            help="node: the file holding the cluster secret (read when the node starts)",
        )
        a.add_argument("--file", default=None, help="coordinator: the cluster.yaml it serves")
        for flag, kwargs in NODE_OPTIONS:
            a.add_argument(flag, **kwargs, help=f"node: `moe-cluster node {flag}`")


# the options of `moe-cluster node` a service passes on (node/agent.py reads them)
NODE_OPTIONS = (
    ("--name", {}),
    ("--host", {}),
    ("--port", {"type": int}),
    ("--advertise", {}),
    ("--cluster", {}),
    ("--interface", {"action": "append"}),
    ("--no-mdns", {"action": "store_true"}),
    ("--memory", {"type": int}),
    ("--cache-dir", {}),
    ("--tls-cert", {}),
    ("--tls-key", {}),
    ("--tls-ca", {}),
)


def node_argv(args) -> list[str]:
    """The node options given to `install`, as `moe-cluster node` takes them (files absolute: a
    service starts in another folder)."""
    out = []
    for flag, kwargs in NODE_OPTIONS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value in (None, False, []):
            continue
        if flag in ("--cache-dir", "--tls-cert", "--tls-key", "--tls-ca"):
            value = str(Path(value).expanduser().resolve())
        if kwargs.get("action") == "store_true":
            out.append(flag)
        elif kwargs.get("action") == "append":
            out += [x for v in value for x in (flag, v)]
        else:
            out += [flag, str(value)]
    return out


def platform_of(choice: str | None) -> str:
    return choice or ("launchd" if sys.platform == "darwin" else "systemd")


def service_for(args, home: Path) -> Service:
    """The service `install` writes, from its arguments; UserError naming what is missing."""
    cli = (sys.executable, "-m", "moe_cluster.coordinator.cli")
    system = os.geteuid() == 0 and platform_of(args.platform) == "systemd"
    log = str(units.log_path(args.role, home))
    if args.role == "node":
        if args.file:
            raise UserError(
                "--file is the coordinator's (cluster.yaml); a node takes --secret-file"
            )
        if not args.secret_file:
            raise UserError(
                "service install node needs --secret-file FILE: a service reads the cluster secret "
                "from a file, never from its own text or environment"
            )
        secret = Path(args.secret_file).expanduser().resolve()
        if not secret.is_file():
            raise UserError(f"--secret-file {secret}: no such file")
        argv = (*cli, "node", "--secret-file", str(secret), *node_argv(args))
        return Service("node", argv, str(home), log, system)
    if args.secret_file or node_argv(args):
        raise UserError(
            "the coordinator's service takes --file cluster.yaml alone (the file says the rest; "
            "its secret is the file's secret.file)"
        )
    if not args.file:
        raise UserError("service install coordinator needs --file cluster.yaml")
    path = Path(args.file).expanduser().resolve()
    check_config(path)
    argv = (*cli, "supervise", str(path))
    return Service("coordinator", argv, str(path.parent), log, system)


def check_config(path: Path) -> None:
    """A cluster.yaml a service can run: valid, and its secrets in files (a service has no
    environment of the user's to read them from)."""
    from ..serve.config import ConfigError, load_config

    c = load_config(path)
    if c.launch == "remote" and not c.secret.file:
        raise ConfigError(
            f"{path}: secret: a service reads the cluster secret from a file: set secret.file "
            "(the same secret as the nodes' --secret-file)"
        )
    if c.api.api_key_env:
        raise ConfigError(
            f"{path}: api.api_key_env: a service reads the API key from a file: "
            "use api.api_key_file"
        )


def text_of(s: Service, platform: str) -> bytes:
    return units.plist(s) if platform == "launchd" else units.unit(s).encode()


def path_of(role: str, platform: str, home: Path, system: bool) -> Path:
    if platform == "launchd":
        return units.plist_path(role, home)
    config_home = Path(os.environ["XDG_CONFIG_HOME"]) if os.environ.get("XDG_CONFIG_HOME") else None
    return units.unit_path(role, home, system, config_home)


def _run(cmd: list[str], check: bool = True) -> int:
    """Run the platform's tool; a missing tool is the user's to know about, not a traceback."""
    if shutil.which(cmd[0]) is None:
        raise UserError(
            f"{cmd[0]} is not on this machine: the service file is written, but nothing loaded it"
        )
    r = subprocess.run(cmd)
    if check and r.returncode != 0:
        raise UserError(f"`{' '.join(cmd)}` failed (status {r.returncode})")
    return r.returncode


def _systemctl(system: bool) -> list[str]:
    return ["systemctl"] if system else ["systemctl", "--user"]


def _domain() -> str:
    return f"gui/{os.getuid()}"


def install(args, home: Path) -> int:
    platform = platform_of(args.platform)
    s = service_for(args, home)
    text = text_of(s, platform)
    if args.print:
        sys.stdout.write(text.decode())
        return 0
    path = path_of(s.role, platform, home, s.system)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text)
    print(f"wrote {path}")
    if platform == "launchd":
        Path(s.log).parent.mkdir(parents=True, exist_ok=True)
        _run(["launchctl", "bootout", f"{_domain()}/{units.label(s.role)}"], check=False)
        _run(["launchctl", "bootstrap", _domain(), str(path)])
        print(f"started {units.label(s.role)}; its log: {s.log}")
        return 0
    ctl = _systemctl(s.system)
    _run([*ctl, "daemon-reload"])
    _run([*ctl, "enable", "--now", units.unit_name(s.role)])
    journal = "journalctl" + ("" if s.system else " --user") + f" -u {units.unit_name(s.role)}"
    print(f"started {units.unit_name(s.role)}; its log: `{journal}`")
    if not s.system:
        print("at boot, before anyone logs in, too: `loginctl enable-linger` (once)")
    return 0


def uninstall(args, home: Path) -> int:
    platform = platform_of(args.platform)
    system = os.geteuid() == 0 and platform == "systemd"
    path = path_of(args.role, platform, home, system)
    if platform == "launchd":
        _run(["launchctl", "bootout", f"{_domain()}/{units.label(args.role)}"], check=False)
    else:
        _run([*_systemctl(system), "disable", "--now", units.unit_name(args.role)], check=False)
    if path.exists():
        path.unlink()
        print(f"removed {path}")
    else:
        print(f"no service file at {path}")
    if platform == "systemd":
        _run([*_systemctl(system), "daemon-reload"], check=False)
    return 0


def status(args, home: Path) -> int:
    platform = platform_of(args.platform)
    system = os.geteuid() == 0 and platform == "systemd"
    path = path_of(args.role, platform, home, system)
    if not path.exists():
        print(f"{args.role}: not installed (no {path})")
        return 3  # as `systemctl status` says of a unit that is not loaded
    print(f"{args.role}: {path}")
    if platform == "launchd":
        print(f"log: {units.log_path(args.role, home)}")
        return _run(["launchctl", "print", f"{_domain()}/{units.label(args.role)}"], check=False)
    return _run(
        [*_systemctl(system), "status", "--no-pager", units.unit_name(args.role)], check=False
    )


def main(args) -> int:
    home = Path.home()
    action = {"install": install, "uninstall": uninstall, "status": status}
    return action[args.service_command](args, home)
