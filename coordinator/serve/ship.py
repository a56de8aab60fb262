"""The coordinator's Ship service: each node's shard, read by byte range from the one checkpoint.

A node asks for the blobs its cache lacks (node/ship.py); they stream back in chunks of at most
`chunk_bytes`, each with its crc32, the last one with the blob's sha256 as the checkpoint holds it
(coordinator/serve/digests.py hashes each blob once per checkpoint and keeps it). gRPC's HTTP/2 flow
control holds the handler at `yield` while a node's window is full, so the coordinator holds per
node one chunk being read plus what the window admits — never a whole tensor (measured by
`moe-cluster bench ship`). Each stream runs on a thread of the server's pool (pread and zlib release
the GIL), so several nodes are served at once.

Without TLS the bytes themselves take a plain TCP data channel beside the service (`DataChannel`):
the kernel sends each blob's byte range straight from the checkpoint file (`os.sendfile`), with no
message framing, copy or checksum in Python. Each blob is preceded by its digests (`send_blobs`): the
node checks every piece against them as it arrives and records the sha256. Measured with
`moe-cluster bench ship` on this 2-vCPU VM over loopback, gRPC chunks reached 0.11–0.22 of raw TCP.
A data connection presents a token that only the authenticated Catalog call hands out; with TLS
configured the channel is TLS too (the same certificates; Python then reads and encrypts each
piece, no sendfile).
"""

from __future__ import annotations

import hmac
import json
import ssl
import logging
import os
import secrets
import socket
import struct
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import grpc

from ...common.auth import authorized, server_credentials, ssl_server_context
from ...node import catalog as node_catalog
from ...node.catalog import Catalog, source_ranges
from ...node.checkpoint import Checkpoint
from ...node.describe import ModelDescription, describe
from ...node.ship import BLOB_HEADER, DATA_ERROR
from ...proto import CHANNEL_OPTIONS, convert
from ...proto import ship_pb2_grpc as spb_grpc
from .digests import AHEAD, Digests
from .placement import fmt_bytes

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 1 << 20  # 1 MiB: large enough that per-message cost is small next to the copy
MAX_CHUNK_BYTES = 4 << 20


@dataclass
class NodeTransfer:
    """What one node has been sent: the coordinator's progress line and the tests' byte count."""

    node: str
    total: int = 0  # bytes asked for, all Fetch calls together
    sent: int = 0  # bytes sent
    started: float = field(default_factory=time.monotonic)
    last_report: float = 0.0

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.started, 1e-6)
        rate = self.sent / elapsed
        eta = (self.total - self.sent) / rate if rate > 0 else float("inf")
        return (
            f"ship {self.node}: {fmt_bytes(self.sent)} of {fmt_bytes(self.total)} "
            f"({100 * self.sent / max(self.total, 1):.0f}%), {fmt_bytes(rate)}/s, ETA {eta:.1f}s"
        )


class Shipper(spb_grpc.ShipServicer):
    """Serves the blobs of one checkpoint (each call on a thread of the server's pool)."""

    def __init__(
        self,
        model: ModelDescription | Checkpoint,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_rate: float = 0.0,
        report: Callable[[str], None] | None = None,
        catalog: Catalog | None = None,
        data_channel: bool = True,
        digest_dir: Path | None = None,
    ):
        desc = model if isinstance(model, ModelDescription) else None
        ckpt = desc.checkpoint if desc else model
        self.catalog = catalog or Catalog.of(desc or describe(ckpt))
        self.fingerprint = self.catalog.fingerprint
        self.ranges = source_ranges(ckpt, self.catalog)
        # each blob's sha256 and piece digests, kept in `digest_dir` across runs (None: this run only)
        self.digests = Digests(
            self.ranges, self.fingerprint, digest_dir, piece_bytes=node_catalog.PIECE_BYTES
        )
        self.catalog_bytes = json.dumps(self.catalog.to_json()).encode()
        self.chunk_bytes = chunk_bytes
        self.max_rate = max_rate  # bytes per second per node; 0: as fast as the network goes
        self.transfers: dict[str, NodeTransfer] = {}
        self._report = report or (lambda line: print(line, file=sys.stderr, flush=True))
        self.data_channel = (
            data_channel  # False: every byte over gRPC Fetch (tests of its chunk checks)
        )
        self.data: DataChannel | None = None  # started by start_server when the service has no TLS
        self.data_token = secrets.token_hex(16)

    def bytes_sent(self) -> dict[str, int]:
        return {n: t.sent for n, t in self.transfers.items()}

    def Catalog(self, request, context):
        if request.fingerprint != self.fingerprint:
            context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"this coordinator ships model {self.fingerprint[:16]}, "
                f"not {request.fingerprint[:16]}",
            )
        return convert.catalog_reply_to_proto(
            self.catalog_bytes,
            self.data.port if self.data else 0,
            self.data_token if self.data else "",
        )

    def refusal(
        self, fingerprint: str, blobs, first_offset: int
    ) -> tuple[grpc.StatusCode, str] | None:
        """Why a request for `blobs` cannot be served (code, message), or None."""
        if fingerprint != self.fingerprint:
            return (
                grpc.StatusCode.NOT_FOUND,
                f"this coordinator ships model {self.fingerprint[:16]}, not {fingerprint[:16]}",
            )
        unknown = [b for b in blobs if b not in self.ranges]
        if unknown:
            return (
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(unknown)} unknown blobs, e.g. {unknown[0][:200]!r}",
            )
        if first_offset < 0 or (
            first_offset and (not blobs or first_offset >= self.ranges[blobs[0]][2])
        ):
            return (
                grpc.StatusCode.INVALID_ARGUMENT,
                f"first_offset {first_offset} is not inside the blob",
            )
        return None

    def _transfer(self, name: str, blobs, first_offset: int) -> NodeTransfer:
        t = self.transfers.setdefault(name, NodeTransfer(name))
        t.total += sum(self.ranges[b][2] for b in blobs) - first_offset
        return t

    def _sent(self, t: NodeTransfer, k: int, sent_here: int, t0: float) -> None:
        """Count `k` more bytes for `t`: the progress line once a second, and the rate limit."""
        t.sent += k
        now = time.monotonic()
        if now - t.last_report >= 1.0:
            t.last_report = now
            self._report(t.line())
        if self.max_rate:
            ahead = sent_here / self.max_rate - (now - t0)
            if ahead > 0:
                time.sleep(ahead)

    def _done(self, t: NodeTransfer, name: str) -> None:
        self._report(
            t.line()
            if t.sent < t.total
            else f"ship {name}: sent {t.sent} bytes in {time.monotonic() - t.started:.2f}s"
        )

    def send_blobs(self, conn: socket.socket, name: str, blobs, first_offset: int) -> None:
        """The data channel's answer, per blob: the bytes that follow (8 bytes, little-endian), its
        digests (`blob_header`), then those bytes, sent by the kernel from the checkpoint file. Raises
        OSError when the node goes away."""
        t = self._transfer(name, blobs, first_offset)
        t0, sent_here = time.monotonic(), 0
        piece = (
            self.chunk_bytes if self.max_rate else DATA_PIECE_BYTES
        )  # a rate limit wants small steps
        for i, blob in enumerate(blobs):
            path, start, n = self.ranges[blob]
            off = first_offset if i == 0 else 0
            self.digests.start(blob, blobs[i + 1 : i + 1 + AHEAD])
            try:
                digest = self.digests.get(blob)
                f = open(path, "rb")
            except Exception as exc:  # noqa: BLE001 - the checkpoint moved, went away or changed; the service stopping
                why = _why(exc)
                logger.error("ship %s: cannot read %s: %s", name, path, why)
                conn.sendall(
                    struct.pack("<Q", DATA_ERROR)
                    + f"the coordinator cannot read {path}: {why}".encode()[:4000]
                    + b"\n"
                )
                return
            conn.sendall(struct.pack("<Q", n - off) + blob_header(digest))
            with f:
                while off < n:
                    if isinstance(conn, ssl.SSLSocket):  # encrypted here: read the piece, send it
                        data = os.pread(
                            f.fileno(), min(piece, n - off, MAX_CHUNK_BYTES), start + off
                        )
                        conn.sendall(data)
                        k = len(data)
                    else:  # socket.sendfile: os.sendfile, waiting within the socket's timeout when the node is slow
                        k = conn.sendfile(f, start + off, min(piece, n - off))
                    if k == 0:  # the node then sees a short blob and says so
                        raise OSError(
                            f"{path}: short read at byte {start + off}: the checkpoint changed while shipping"
                        )
                    off += k
                    sent_here += k
                    self._sent(t, k, sent_here, t0)
        self._done(t, name)

    def Fetch(self, request, context):
        request = convert.fetch_request_from_proto(request)
        why = self.refusal(request.fingerprint, request.blobs, request.first_offset)
        if why:
            context.abort(*why)
        chunk = min(request.chunk_bytes or self.chunk_bytes, MAX_CHUNK_BYTES)
        name = request.node or context.peer()
        t = self._transfer(name, request.blobs, request.first_offset)
        t0, sent_here = time.monotonic(), 0
        for i, blob in enumerate(request.blobs):
            path, start, n = self.ranges[blob]
            off = request.first_offset if i == 0 else 0
            self.digests.start(blob, request.blobs[i + 1 : i + 1 + AHEAD])
            try:
                sha256 = self.digests.get(blob).sha256
                fd = os.open(path, os.O_RDONLY)
            except Exception as exc:  # noqa: BLE001 - the checkpoint moved, went away or changed; the service stopping
                logger.error("ship %s: cannot read %s: %s", name, path, _why(exc))
                context.abort(
                    grpc.StatusCode.UNAVAILABLE, f"the coordinator cannot read {path}: {_why(exc)}"
                )
            try:
                while True:
                    if not context.is_active():  # the node went away: stop reading for it
                        return
                    k = min(chunk, n - off)
                    try:
                        data = os.pread(fd, k, start + off)
                    except OSError as exc:
                        context.abort(
                            grpc.StatusCode.UNAVAILABLE,
                            f"the coordinator cannot read {path}: {exc.strerror or exc}",
                        )
                    if len(data) != k:
                        context.abort(
                            grpc.StatusCode.DATA_LOSS,
                            f"{path}: short read at byte {start + off}: "
                            "the checkpoint changed while shipping",
                        )
                    last = off + k >= n
                    yield convert.chunk_to_proto(
                        blob, off, data, zlib.crc32(data), last, sha256 if last else ""
                    )
                    off += k
                    sent_here += k
                    self._sent(t, k, sent_here, t0)
                    if last:
                        break
            finally:
                os.close(fd)
        self._done(t, name)


DATA_PIECE_BYTES = (
    8 << 20
)  # bytes per sendfile call (progress and the node's liveness between calls)


def _why(exc: BaseException) -> str:
    """One line saying why, for a node: an OSError's own words, else its kind."""
    if isinstance(exc, OSError):
        return str(exc.strerror or exc)
    return (
        f"{type(exc).__name__}: {exc}"
        if str(exc)
        else f"{type(exc).__name__} (the Ship service is stopping?)"
    )


def blob_header(d) -> bytes:
    """What precedes a blob's bytes on the data channel: its sha256 (32 bytes), its piece size and
    piece count (4 bytes each), then each piece's digest (8 bytes each, little-endian); all
    little-endian, pieces counted from the blob's first byte."""
    return BLOB_HEADER.pack(bytes.fromhex(d.sha256), d.piece_bytes, len(d.pieces)) + struct.pack(
        f"<{len(d.pieces)}Q", *d.pieces
    )


MAX_REQUEST_LINE = 1 << 20  # a data request names blobs; a longer line is refused


class DataChannel:
    """The plain-TCP data channel: a node sends one JSON line {token, fingerprint, node, blobs,
    first_offset}; the answer is b"+" and the blobs (Shipper.send_blobs: per blob the bytes that follow,
    8 bytes little-endian, its digests (`blob_header`), then those bytes; DATA_ERROR for a length means
    one line saying why follows), or b"-" and one line saying why not. One thread per connection, at
    most MAX_STREAMS at once."""

    def __init__(self, shipper: Shipper, host: str, tls=None):
        self._shipper = shipper
        self._tls = ssl_server_context(tls.cert, tls.key, tls.ca) if tls else None
        self._sock = socket.create_server(
            (host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET
        )
        self.port = self._sock.getsockname()[1]
        self._slots = threading.BoundedSemaphore(MAX_STREAMS)
        self._closed = False
        threading.Thread(target=self._accept, name="ship-data", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._sock.accept()
            except OSError:  # closed
                return
            if not self._slots.acquire(blocking=False):
                self._refuse(conn, f"more than {MAX_STREAMS} transfers at once")
                conn.close()
                continue
            threading.Thread(
                target=self._serve, args=(conn, peer), name="ship-data-conn", daemon=True
            ).start()

    @staticmethod
    def _refuse(conn: socket.socket, why: str) -> None:
        try:
            conn.sendall(b"-" + why.encode()[:4000].replace(b"\n", b" ") + b"\n")
        except OSError:
            pass

    def _serve(self, conn: socket.socket, peer) -> None:
        try:
            conn.settimeout(60.0)
            if self._tls is not None:
                try:
                    conn = self._tls.wrap_socket(conn, server_side=True)
                except (
                    OSError,
                    ssl.SSLError,
                ) as exc:  # plaintext, or a certificate the CA did not sign
                    logger.warning("refused a data connection from %s: TLS: %s", peer[0], exc)
                    conn.close()
                    return
            with conn:
                line = conn.makefile("rb").readline(MAX_REQUEST_LINE + 1)
                try:
                    req = json.loads(line)
                    token, fp, blobs = (
                        str(req["token"]),
                        str(req["fingerprint"]),
                        [str(b) for b in req["blobs"]],
                    )
                    first, node = (
                        int(req.get("first_offset", 0)),
                        str(req.get("node") or f"{peer[0]}:{peer[1]}"),
                    )
                except (ValueError, KeyError, TypeError):
                    return self._refuse(
                        conn, "a data request is one JSON line with token, fingerprint and blobs"
                    )
                if not hmac.compare_digest(token.encode(), self._shipper.data_token.encode()):
                    logger.warning("refused a data connection from %s: wrong token", peer[0])
                    return self._refuse(
                        conn,
                        "wrong data token (ask the Ship service's Catalog, with the cluster secret)",
                    )
                why = self._shipper.refusal(fp, blobs, first)
                if why:
                    return self._refuse(conn, why[1])
                if first % self._shipper.digests.piece_bytes:
                    return self._refuse(
                        conn,
                        f"first_offset {first} is not a multiple of the piece size "
                        f"{self._shipper.digests.piece_bytes}",
                    )
                conn.sendall(b"+")
                self._shipper.send_blobs(conn, node, blobs, first)
        except (
            OSError
        ) as exc:  # the node went away or said nothing in time, or the checkpoint changed under us
            logger.info("ship data channel from %s ended: %s", peer[0], exc.strerror or exc)
        finally:
            self._slots.release()

    def close(self) -> None:
        self._closed = True
        try:  # wakes the accepting thread (close alone leaves its accept() listening, on Linux)
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


class _SecretCheck(grpc.ServerInterceptor):
    """envoy/auth.py's rule (the cluster secret in the call metadata, compared in constant time) for
    this blocking server: a call without it is aborted before any handler runs, so it gets no data."""

    def __init__(self, secret: str):
        from ...proto.errors import UserError

        if not secret:
            raise UserError("the cluster secret is empty")
        self._secret = secret

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or authorized(details.invocation_metadata, self._secret):
            return handler
        logger.warning("refused %s: missing or wrong cluster secret", details.method)

        def deny(request, context):
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                f"{details.method}: missing or wrong cluster secret",
            )

        kw = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny, **kw)
        return grpc.unary_unary_rpc_method_handler(deny, **kw)


MAX_STREAMS = 64  # nodes served at once (one thread each while its stream runs)


def start_server(
    shipper: Shipper, host: str, port: int, secret: str, tls=None
) -> tuple[grpc.Server, int]:
    """The Ship service behind the cluster secret (and TLS when cluster.yaml has it); returns the
    started server and its port. A blocking server, not grpc.aio: measured on this 2-vCPU VM, a bare
    stream of 1 MiB messages ran at 450 MB/s from an aio handler and 520–970 MB/s from a blocking one,
    and reading and crc32 need no hop to a thread pool here."""
    from ...proto.errors import UserError

    server = grpc.server(
        ThreadPoolExecutor(MAX_STREAMS, thread_name_prefix="ship"),
        interceptors=[_SecretCheck(secret)],
        options=CHANNEL_OPTIONS,
    )
    spb_grpc.add_ShipServicer_to_server(shipper, server)
    address = f"{host}:{port}"
    bound = (
        server.add_secure_port(address, server_credentials(tls.cert, tls.key, tls.ca))
        if tls
        else server.add_insecure_port(address)
    )
    if bound == 0:
        raise UserError(f"ship: cannot listen on {address}")
    if shipper.data_channel:
        try:
            shipper.data = DataChannel(shipper, host, tls)
        except OSError as exc:
            raise UserError(
                f"ship: cannot open the data channel on {host}: {exc.strerror or exc}"
            ) from None
    stop = server.stop

    def stop_all(grace):  # the data channel and the hashing end with the service
        if shipper.data is not None:
            shipper.data.close()
        shipper.digests.close()
        return stop(grace)

    server.stop = stop_all
    server.start()
    return server, bound
