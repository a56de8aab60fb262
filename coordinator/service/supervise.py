"""`moe-cluster supervise FILE`: run `moe-cluster up FILE`, and start it again whenever it dies,
holding the API's socket meanwhile.

The socket is bound here once (or taken from a systemd socket unit) and handed to each `up` as
systemd hands sockets (serve/listen.py): while `up` is down, a client's connection waits in the
socket's backlog instead of being refused, and the next `up` answers it (503 with Retry-After while
it adopts the loaded nodes, then the API). An `up` that ends with status 0 was asked to stop
(`down`, the dashboard, SIGTERM): the supervisor ends too. Any other end (a crash, an out-of-memory
kill, `kill -9`) starts a new `up` after a delay that doubles while runs keep failing fast
(RESTART_S up to RESTART_MAX_S), back to RESTART_S after a run that lasted STEADY_S. SIGTERM or
Ctrl-C to the supervisor reach `up`, and the supervisor ends once it has. A service unit
(`moe-cluster service install coordinator`) runs this, so that launchd or systemd restarts the
supervisor itself, which has nothing to crash on.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

from ..serve.config import load_config
from ..serve.listen import LISTEN_FDS_START, api_socket

logger = logging.getLogger(__name__)

RESTART_S = 0.5  # seconds before the first restart
RESTART_MAX_S = 30.0
STEADY_S = 60.0  # a run this long resets the delay


def up_command(args) -> list[str]:
    """The `up` this supervisor runs: the same file and options, the same verbosity."""
    cmd = [sys.executable, "-m", "moe_cluster.coordinator.cli"]
    cmd += ["-v"] * args.verbose + ["up", args.file]
    if args.model:
        cmd += ["--model", args.model]
    if args.api_port is not None:
        cmd += ["--api-port", str(args.api_port)]
    if args.log_dir:
        cmd += ["--log-dir", args.log_dir]
    return cmd


def next_delay(delay: float, ran_s: float) -> float:
    """The delay before the restart after a run of `ran_s` seconds that followed `delay`."""
    return RESTART_S if ran_s >= STEADY_S else min(max(2 * delay, RESTART_S), RESTART_MAX_S)


def main(args) -> int:
    c = load_config(args.file, model=args.model)
    host, port = c.api.host, c.api.port if args.api_port is None else args.api_port
    sock, passed = api_socket(host, port)
    where = sock.getsockname()
    print(
        f"moe-cluster supervise: holding {where[0]}:{where[1]}"
        + (" (passed by the system)" if passed else "")
        + f"; running `up {args.file}`",
        file=sys.stderr,
        flush=True,
    )
    stopping = False
    child: subprocess.Popen | None = None

    def stop(signum, frame) -> None:
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    os.environ["LISTEN_FDS"] = "1"  # read by `up` alone, with LISTEN_PID naming it (listen.py)
    fd = sock.fileno()

    def hand_over() -> None:  # in the child, before exec: the socket at fd 3, for this pid
        if fd != LISTEN_FDS_START:
            os.dup2(fd, LISTEN_FDS_START)  # the copy is inheritable; `fd` closes at exec
        else:
            os.set_inheritable(fd, True)
        os.environ["LISTEN_PID"] = str(os.getpid())

    delay, restarts = 0.0, 0
    while True:
        started = time.monotonic()
        # every other descriptor of this process closes at exec (Python opens them so)
        child = subprocess.Popen(up_command(args), close_fds=False, preexec_fn=hand_over)
        code = child.wait()
        while code is None:  # pragma: no cover - wait() returns once the child has ended
            code = child.wait()
        ran = time.monotonic() - started
        if code == 0 or stopping:
            print(
                f"moe-cluster supervise: up ended (status {code}) after {restarts} restarts",
                file=sys.stderr,
                flush=True,
            )
            return 0 if stopping or code == 0 else code
        delay = next_delay(delay, ran)
        restarts += 1
        how = f"signal {-code}" if code < 0 else f"status {code}"
        print(
            f"moe-cluster supervise: up died ({how}) after {ran:.1f}s; restart {restarts} "
            f"in {delay:.1f}s",
            file=sys.stderr,
            flush=True,
        )
        deadline = time.monotonic() + delay
        while not stopping and time.monotonic() < deadline:
            time.sleep(min(0.1, max(deadline - time.monotonic(), 0)))
        if stopping:
            return 0
