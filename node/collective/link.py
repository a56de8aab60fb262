"""The node's end of its envoy link: a Unix socket pair carrying proto/envoy_link.py's messages,
and the peers' data channels' descriptors the envoy hands over on it (SCM_RIGHTS)."""

from __future__ import annotations

import array
import socket
import struct
import threading

from ...proto import envoy_link as messages
from ...proto.errors import ErrorKind, MoeClusterError

_FDS = socket.CMSG_SPACE(16 * 4)  # room for the descriptors a read may carry


class LinkError(MoeClusterError):
    """The other end of the link is gone or broke the protocol."""

    kind = ErrorKind.UNAVAILABLE


class NodeLink:
    """The node's end (blocking): owns the socket pair, whose other end its envoy child inherits."""

    def __init__(self):
        self._sock, self.child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._buf = bytearray(1 << 16)
        self._pending = b""
        self._fds: list[int] = []  # descriptors received (CHANNEL's), in order, not yet taken
        self._timeout: float | None = None
        self._send_lock = threading.Lock()  # abort() comes from another thread than begin

    def child_started(self) -> None:
        """The child holds its end now: drop ours, so its exit reads as EOF here."""
        self.child_sock.close()

    def _send(self, message: bytes) -> None:
        try:
            with self._send_lock:
                self._sock.sendall(message)
        except OSError as exc:
            raise LinkError(f"envoy link is closed ({exc})") from exc

    def _set_timeout(self, timeout: float | None) -> None:
        """A kernel receive timeout (SO_RCVTIMEO) on the blocking socket: one syscall per recv,
        where Python's own socket timeout polls first."""
        if timeout == self._timeout:
            return
        sec = 0.0 if timeout is None else max(timeout, 1e-3)
        tv = struct.pack("@ll", int(sec), int((sec - int(sec)) * 1e6))  # struct timeval; 0 = none
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        self._timeout = timeout

    def recv(self, timeout: float | None) -> tuple[int, bytes]:
        """-> (kind, body) of the next message; LinkError on EOF or after `timeout` seconds."""
        self._set_timeout(timeout)
        while True:
            message = self._parsed()
            if message is not None:
                return message
            try:
                got = self._read(0)
            except (BlockingIOError, socket.timeout):  # EAGAIN: SO_RCVTIMEO expired
                raise LinkError(f"envoy did not answer within {timeout:.1f} s") from None
            except InterruptedError:
                continue
            except OSError as exc:
                raise LinkError(f"envoy link failed ({exc})") from exc
            if got == 0:
                raise LinkError("envoy closed the link (it exited)")

    def _parsed(self) -> tuple[int, bytes] | None:
        """The next whole message read so far, taken off the pending bytes."""
        start = messages.LENGTH.size
        while len(self._pending) >= start:
            data = self._pending
            end = start + messages.LENGTH.unpack_from(data)[0]
            if len(data) < end:
                break
            self._pending = data[end:]
            if end > start:  # an empty message has no kind: skipped
                return data[start], data[start:end]
        return None

    def _read(self, flags: int) -> int:
        """One read into the pending bytes, keeping any descriptors that came with it."""
        got, ancillary, _, _ = self._sock.recvmsg_into([self._buf], _FDS, flags)
        for level, kind, cdata in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(cdata[: len(cdata) - len(cdata) % fds.itemsize])
                self._fds.extend(fds)
        if got:
            chunk = bytes(self._buf[:got])
            self._pending = self._pending + chunk if self._pending else chunk
        return got

    def messages(self) -> list[tuple[int, bytes]]:
        """Every whole message that has arrived, without waiting; LinkError on EOF."""
        out = []
        while True:
            message = self._parsed()
            if message is not None:
                out.append(message)
                continue
            try:
                got = self._read(socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return out
            except OSError as exc:
                raise LinkError(f"envoy link failed ({exc})") from exc
            if got == 0:
                raise LinkError("envoy closed the link (it exited)")

    def fileno(self) -> int:
        return self._sock.fileno()

    def take_fd(self) -> int:
        """The descriptor a CHANNEL message carried (they come in the messages' order)."""
        if not self._fds:
            raise LinkError("envoy sent a channel without its socket")
        return self._fds.pop(0)

    def begin(self, request_id: str) -> None:
        self._send(messages.text(messages.BEGIN, request_id))

    def abort(self, request_id: str) -> None:
        self._send(messages.text(messages.ABORT, request_id))

    def broken(self, rank: int, why: str) -> None:
        """This node dropped its channel to `rank`: the envoy ends the peer's stream and redials."""
        self._send(messages.peer(messages.BROKEN, rank, why.encode()))

    def close(self) -> None:
        try:
            self._send(messages.message(messages.CLOSE))
        except LinkError:
            pass
        self._sock.close()
        try:
            self.child_sock.close()
        except OSError:
            pass
