"""TCP ports: free ones for clusters launched on one machine, and a clear line for a taken one."""

from __future__ import annotations


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct TCP ports free on `host` right now (for clusters launched on one machine)."""
    import socket

    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def check_port_free(host: str, port: int, hint: str = "") -> None:
    """Raise a one-line OSError if `host:port` cannot be listened on (0: any port, always fine)."""
    import socket

    if port == 0:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise OSError(
                f"cannot listen on {host}:{port}: {exc.strerror}" + (f" ({hint})" if hint else "")
            ) from None
