"""The envoy's end of its node's link (proto/envoy_link.py's messages), driven by the event loop:
reads the node's requests as they arrive, answers, and hands the node the peers' data channels."""

from __future__ import annotations

import array
import os
import socket

from ..proto import envoy_link as messages


class EnvoyLink:
    """The envoy's end (non-blocking): the socket pair's end its node passed it as `fd`."""

    def __init__(self, fd: int):
        self._sock = socket.socket(fileno=fd)
        self._sock.setblocking(False)
        self._data = b""

    def fileno(self) -> int:
        return self._sock.fileno()

    def read(self) -> list[tuple[int, bytes]] | None:
        """Messages that arrived, as (kind, body); None once the node closed its end."""
        try:
            chunk = self._sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            return None
        if not chunk:
            return None
        out, self._data = messages.split(self._data + chunk if self._data else chunk)
        return out

    def _send(self, message: bytes, fds: list[int] = ()) -> None:
        """Write one message whole (they are small, and the node reads its link at every request
        and while it waits on a step), with `fds` riding along."""
        self._sock.setblocking(True)
        try:
            rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
            sent = self._sock.sendmsg([message], rights)
            if sent < len(message):
                self._sock.sendall(message[sent:])
        except OSError:
            pass  # the node is gone; the envoy notices on its next read
        finally:
            self._sock.setblocking(False)

    def ready(self, port: int) -> None:
        self._send(messages.ready(os.getpid(), port))

    def begun(self) -> None:
        self._send(messages.message(messages.BEGUN))

    def fail(self, why: str) -> None:
        self._send(messages.text(messages.FAIL, why))

    def channel(self, rank: int, sock: socket.socket, extra: bytes) -> None:
        """Hand `rank`'s data channel to the node: a copy of its descriptor rides with the message,
        with `extra`, the bytes read past the handshake."""
        self._send(messages.peer(messages.CHANNEL, rank, extra), [sock.fileno()])

    def lost(self, rank: int, why: str) -> None:
        self._send(messages.peer(messages.LOST, rank, why.encode()))

    def close(self) -> None:
        self._sock.close()
