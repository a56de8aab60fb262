"""TCP ports: free ones for clusters launched on one machine, and a clear line for a taken one."""

from __future__ import annotations


# Where the kernel takes the local ports of outgoing connections, when it cannot say: IANA's
# dynamic range (macOS and the BSDs use it)
_EPHEMERAL_DEFAULT = (49152, 65535)
_LOWEST = 20000  # below: the ports services are configured on


def ephemeral_range() -> tuple[int, int]:
    """The ports this machine gives outgoing connections (Linux: ip_local_port_range)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return _EPHEMERAL_DEFAULT


def free_ports(
    n: int, host: str = "127.0.0.1", ephemeral: tuple[int, int] | None = None
) -> list[int]:
    """`n` distinct TCP ports free on `host` right now (for clusters launched on one machine).

    They are listened on later (a node's server, an envoy's, seconds after), so they are drawn
    outside the range the kernel gives outgoing connections: any of the cluster's own connections
    made meanwhile could otherwise take one as its local port, and its listener then fails to bind.
    Where that range leaves no room, the kernel picks (port 0)."""
    import random
    import socket

    lo, hi = ephemeral or ephemeral_range()
    pool = [p for p in range(_LOWEST, 65536) if not lo <= p <= hi]
    random.shuffle(pool)
    socks, ports = [], []
    try:
        for port in pool:
            if len(ports) == n:
                break
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind((host, port))
            except OSError:
                s.close()
                continue
            socks.append(s)
            ports.append(port)
        while len(ports) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
        return ports
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


def default_ip() -> str:
    """This host's address on its default route (127.0.0.1 where it has none)."""
    import socket

    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(
            ("10.255.255.255", 1)
        )  # no packet is sent: this only picks the outgoing interface
        return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"
    finally:
        s.close()
