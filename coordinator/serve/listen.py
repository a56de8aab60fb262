"""The API's listening socket: the one a supervisor holds across the coordinator's restarts, or one
bound here.

A supervisor passes it as systemd passes sockets (sd_listen_fds(3)): the first at file descriptor 3,
`LISTEN_FDS` the count and `LISTEN_PID` the pid it is for, so a socket unit works as well as
`moe-cluster supervise` (coordinator/service/supervise.py). Held by the supervisor, the socket
outlives the coordinator: a client that connects while it is down waits in the backlog and is
answered by the next one (a 503 with Retry-After while it adopts its nodes, then the API), instead
of being refused.
"""

from __future__ import annotations

import os
import socket

LISTEN_FDS_START = 3  # SD_LISTEN_FDS_START
_ENV = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")


def inherited() -> socket.socket | None:
    """The listening socket passed to this process, or None. The variables are removed either way:
    they are for this process, not for the nodes it starts."""
    env = {k: os.environ.pop(k, None) for k in _ENV}
    if env["LISTEN_PID"] != str(os.getpid()) or not (env["LISTEN_FDS"] or "").isdigit():
        return None
    if int(env["LISTEN_FDS"]) < 1:
        return None
    sock = socket.socket(fileno=LISTEN_FDS_START)
    if sock.type != socket.SOCK_STREAM:
        raise OSError(f"the socket passed at fd {LISTEN_FDS_START} is not a TCP socket")
    os.set_inheritable(sock.fileno(), False)
    sock.setblocking(False)
    return sock


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (0: any free port); OSError (the port's in use) as
    socket.create_server raises it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=128)
    sock.setblocking(False)
    return sock


def api_socket(host: str, port: int) -> tuple[socket.socket, bool]:
    """(the socket the API serves, whether a supervisor passed it)."""
    sock = inherited()
    return (sock, True) if sock is not None else (bind(host, port), False)
