"""A node fills its shard cache from the coordinator's Ship service (coordinator/serve/ship.py).

Runs on the node's worker thread during Load, with a blocking gRPC channel: ask for the catalog,
verify what the cache holds, refuse before any byte is sent if the disk is too small, then fetch
the missing blobs in one stream. Every piece is checked as it arrives — against the coordinator's
digest of that piece of its checkpoint on the data channel, against the chunk's crc32 on the gRPC
stream — and one that does not match is asked for again from its offset (the stream restarts
there); each blob's sha256, for the manifest, is the one the coordinator computed from its
checkpoint. A dead coordinator is a one-line error within the keepalive timeout, never a hang.
"""

from __future__ import annotations

import json
import logging
import socket
import struct
import sys
import time
import zlib
from pathlib import Path
from typing import Callable, Iterator, Sequence

import grpc

from ..common.auth import call_metadata, channel_credentials, ssl_client_context
from ..proto import CHANNEL_OPTIONS, convert
from ..proto import ship_pb2_grpc as spb_grpc
from ..proto.errors import UnavailableError
from ..proto.placement import Placement
from ..proto.records import FetchSpec, ShipSource
from .cache import ShardCache
from . import catalog as catalog_mod
from .catalog import CacheError, Catalog, piece_hasher
from .shard_layout import CachedCheckpoint

logger = logging.getLogger(__name__)

RPC_TIMEOUT_S = 30.0
MAX_RESTARTS = 5  # corrupt chunks tolerated per fill before giving up


def peer_host(peer: str) -> str:
    """The host of a gRPC peer string ("ipv4:10.0.0.1:5432", "ipv6:[::1]:5432")."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv6":
        return rest.rsplit(":", 1)[0]
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    return "127.0.0.1"


def fill_cache(
    source: ShipSource,
    address: str,
    *,
    cache_dir: Path,
    secret: str,
    tls,
    node: str,
    placement: Placement | None,
    rank: int,
    world_size: int,
    progress: Callable[[int, int, str], None],
) -> CachedCheckpoint:
    """Make this node's shard complete in `cache_dir` and open it; returns the checkpoint view."""
    creds = channel_credentials(tls.ca, tls.cert, tls.key) if tls else None
    channel = (
        grpc.secure_channel(address, creds, options=CHANNEL_OPTIONS)
        if creds
        else grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    )
    md = call_metadata(secret)
    try:
        stub = spb_grpc.ShipStub(channel)
        try:
            reply = stub.Catalog(
                convert.catalog_request_to_proto(source.fingerprint),
                metadata=md,
                timeout=RPC_TIMEOUT_S,
            )
        except grpc.RpcError as exc:
            raise UnavailableError(
                f"cannot get the model's catalog from the coordinator at {address}: "
                f"{exc.code().name}: {exc.details()}"
            ) from None
        try:
            catalog = Catalog.from_json(
                json.loads(convert.catalog_reply_from_proto(reply)), f"catalog from {address}"
            )
        except json.JSONDecodeError as exc:
            raise CacheError(f"catalog from {address} is not JSON ({exc})") from None
        if catalog.fingerprint != source.fingerprint:
            raise CacheError(
                f"the coordinator at {address} sent a catalog for {catalog.fingerprint[:16]}, "
                f"not {source.fingerprint[:16]}"
            )
        fetch = fetcher(
            stub, md, reply, source.fingerprint, node, address, tls, catalog.blob_nbytes()
        )
        moe_layers = {l: n for l, (n, _) in catalog.layers.items()}
        placement = placement or Placement.even(moe_layers, world_size)
        placement.check(moe_layers)
        local = {l: placement.layers[l][rank] for l in moe_layers}
        cache = ShardCache(cache_dir, catalog, local)
        try:
            with cache.locked():
                return _fill(cache, fetch, progress)
        except OSError as exc:  # a cache folder we cannot write, a disk that filled up meanwhile
            raise CacheError(
                f"cache {cache.root}: {exc.strerror or exc}"
                + (f" ({exc.filename})" if getattr(exc, "filename", None) else "")
            ) from None
    finally:
        channel.close()


def _fill(cache: ShardCache, fetch, progress) -> CachedCheckpoint:
    """Verify, plan, refuse a short disk, fetch, open: under the shard's lock."""
    t0 = time.monotonic()
    plan = cache.scan()
    cache.check_disk(plan)
    print(
        f"cache {cache.root}: {len(cache.have) + len(cache.journal)} blobs verified in {time.monotonic() - t0:.2f}s "
        f"({cache.checked['hashed']} hashed, {cache.checked['trusted']} in files unchanged since hashed); "
        f"fetching {len(plan.fetch)} blobs ({plan.fetch_bytes} bytes), copying {plan.copy_bytes} bytes locally",
        file=sys.stderr,
        flush=True,
    )
    t1 = time.monotonic()
    last = [0.0]

    def report(done: int, total: int) -> None:
        progress(done, total, "ship")
        now = time.monotonic()
        if now - last[0] >= 1.0 or done >= total:
            last[0] = now
            rate = done / max(now - t1, 1e-6)
            # the node's own terminal/log shows its transfer, whatever the log level
            print(
                f"fetched {done} of {total} bytes ({100 * done / max(total, 1):.0f}%), {rate / 1e6:.1f} MB/s, "
                f"ETA {(total - done) / rate if rate else 0.0:.1f}s",
                file=sys.stderr,
                flush=True,
            )

    if plan.resume_offset:
        print(
            f"resuming {plan.fetch[0]} at byte {plan.resume_offset} (an interrupted fill wrote that much)",
            file=sys.stderr,
            flush=True,
        )
    cache.fill(plan, fetch, report)
    if plan.fetch:
        logger.info("fetched %d bytes in %.2fs", plan.fetch_bytes, time.monotonic() - t1)
    return cache.open()


def fetcher(
    stub, md, reply, fingerprint: str, node: str, address: str, tls, sizes: dict[str, int]
) -> Callable[[Sequence[str], int], Iterator[tuple[str, int, bytes, str | None]]]:
    """How this node takes the bytes: the Catalog reply's plain-TCP data channel when it names one
    (on the Ship service's host; TLS with the cluster's certificates when it has them), else the
    gRPC Fetch stream. `sizes`: every blob's bytes, from the catalog."""
    port, token = convert.data_channel_from_proto(reply)
    if port:
        host = address.rsplit(":", 1)[0].strip("[]")
        ctx = ssl_client_context(tls.ca, tls.cert, tls.key) if tls else None
        # blobs[0] from `first` (rounded down to a piece), a piece at a time, each checked against
        # the coordinator's digest of it (a piece that fails is asked for again); a dead
        # coordinator is one line within RPC_TIMEOUT_S
        return lambda blobs, first: _restarting(
            lambda todo, at: _fetch_tcp_once(
                host, port, token, fingerprint, node, todo, sizes, at, ctx
            ),
            blobs,
            first - first % catalog_mod.PIECE_BYTES,
            f"the coordinator's data channel at {host}:{port}",
        )
    return lambda blobs, first: _fetch(stub, md, fingerprint, node, blobs, address, first)


DATA_ERROR = (
    1 << 64
) - 1  # a blob length that means: one line saying why follows (coordinator/serve/ship.py)
BLOB_HEADER = struct.Struct(
    "<32sII"
)  # before a blob's bytes: its sha256, piece bytes, pieces (coordinator/serve/ship.py blob_header)
MAX_PIECE_BYTES = (
    16 << 20
)  # a larger piece in a blob header is refused (receive buffers are pieces)


class _Buffers:
    """Receive buffers, each reused once nobody else holds it (the cache's writer thread drops a piece
    after writing it). A fresh 4 MB bytearray per piece paid its zeroing and page faults
    every time: without them the receiver took 2 GB at 841 MB/s instead of 430 (10 Gbit/s link,
    hashing off, this 2-vCPU VM)."""

    _KEEP = 16  # more than the cache's writer keeps in flight

    def __init__(self):
        self._ring: list[bytearray] = []

    def take(self, n: int) -> bytearray:
        for buf in self._ring:
            # held only by the ring, this loop and the call's argument: nobody reads it any more
            if len(buf) == n and sys.getrefcount(buf) == 3:
                return buf
        buf = bytearray(n)
        if len(self._ring) < self._KEEP:
            self._ring.append(buf)
        return buf


def _recv_exact(
    sock: socket.socket, n: int, what: str, where: str, buffers: _Buffers | None = None, hasher=None
) -> bytearray:
    """`n` bytes from `sock`, in a buffer nobody else holds (the cache writes it later); `hasher` is
    updated with each part as it lands (hashing the whole piece afterwards read it back from memory:
    12 GB/s instead of 30 on this VM, 14% of the receiver's time)."""
    buf = buffers.take(n) if buffers is not None else bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        try:
            k = sock.recv_into(view[got:])
        except OSError as exc:  # timeout included
            raise UnavailableError(
                f"shipping from the coordinator's data channel at {where} stopped in {what}: "
                f"{exc.strerror or exc}"
            ) from None
        if not k:
            raise UnavailableError(
                f"shipping from the coordinator's data channel at {where} stopped in {what} "
                f"(connection closed after {got} of {n} bytes)"
            )
        if hasher is not None:
            hasher.update(view[got : got + k])
        got += k
    return buf


class _Corrupt(Exception):
    """A piece that does not match its check (`why`): the stream restarts at (blob, offset)."""

    def __init__(self, blob: str, offset: int, why: str):
        super().__init__(blob, offset, why)
        self.blob, self.offset, self.why = blob, offset, why


def _restarting(
    once: Callable[[tuple[str, ...], int], Iterator[tuple[str, int, bytes, str | None]]],
    blobs: Sequence[str],
    first_offset: int,
    where: str,
) -> Iterator[tuple[str, int, bytes, str | None]]:
    """What `once(blobs, first_offset)` yields — (blob, offset, bytes, the blob's sha256 on its last
    piece else None) — asking again from a piece where it raises _Corrupt (the blobs done so far are
    not sent again), at most MAX_RESTARTS times per fill."""
    todo, first, restarts = list(blobs), first_offset, 0
    while todo:
        try:
            for item in once(tuple(todo), first):
                yield item
                if item[3] is not None:  # that blob is complete
                    todo.pop(0)
                    first = 0
            return
        except _Corrupt as bad:
            restarts += 1
            logger.warning(
                "piece of %s at %d arrived corrupt (%s); asking again from there",
                bad.blob,
                bad.offset,
                bad.why,
            )
            if restarts > MAX_RESTARTS:
                raise CacheError(f"{restarts} corrupt pieces from {where}; giving up") from None
            todo, first = todo[todo.index(bad.blob) :], bad.offset


def _fetch_tcp_once(
    host: str,
    port: int,
    token: str,
    fingerprint: str,
    node: str,
    blobs: Sequence[str],
    sizes: dict[str, int],
    first_offset: int,
    tls_context,
) -> Iterator[tuple[str, int, bytes, str | None]]:
    """One data connection: yields checked pieces until the blobs end; _Corrupt at a bad piece."""
    where = f"{host}:{port}"
    try:
        sock = socket.create_connection((host, port), timeout=RPC_TIMEOUT_S)
        if tls_context is not None:
            sock = tls_context.wrap_socket(sock, server_hostname=host)
    except OSError as exc:  # ssl.SSLError included
        raise UnavailableError(
            f"cannot open the coordinator's data channel at {where}: {exc.strerror or exc}"
        ) from None
    buffers, hasher = _Buffers(), piece_hasher()
    with sock:
        request = {
            "token": token,
            "fingerprint": fingerprint,
            "node": node,
            "blobs": list(blobs),
            "first_offset": first_offset,
        }
        sock.sendall(json.dumps(request).encode() + b"\n")
        if _recv_exact(sock, 1, "its answer", where) != b"+":
            why = sock.makefile("rb").readline(4096).decode(errors="replace").strip()
            raise UnavailableError(f"the coordinator's data channel at {where} refused: {why}")
        for i, blob in enumerate(blobs):
            (n,) = struct.unpack("<Q", _recv_exact(sock, 8, f"the length of {blob}", where))
            if n == DATA_ERROR:
                why = sock.makefile("rb").readline(4096).decode(errors="replace").strip()
                raise UnavailableError(
                    f"shipping from the coordinator's data channel at {where} stopped: {why}"
                )
            off = first_offset if i == 0 else 0
            end = off + n
            if end != sizes[blob]:
                raise CacheError(
                    f"the coordinator's data channel at {where} sends {n} bytes of blob {blob!r} from byte "
                    f"{off}; the catalog gives it {sizes[blob]}"
                )
            sha, piece, count = BLOB_HEADER.unpack(
                _recv_exact(sock, BLOB_HEADER.size, f"the digests of {blob}", where)
            )
            if not 0 < piece <= MAX_PIECE_BYTES or off % piece or count != -(-end // piece):
                raise CacheError(
                    f"the coordinator's data channel at {where} sent blob {blob!r} with digests that do "
                    f"not fit it ({count} pieces of {piece} bytes for bytes {off}..{end})"
                )
            digests = struct.unpack(
                f"<{count}Q", _recv_exact(sock, 8 * count, f"the digests of {blob}", where)
            )
            if off == end:  # an empty blob: nothing follows its header
                yield blob, off, bytearray(), sha.hex()
            while off < end:
                hasher.reset()
                data = _recv_exact(sock, min(piece, end - off), blob, where, buffers, hasher)
                if hasher.intdigest() != digests[off // piece]:
                    raise _Corrupt(blob, off, "its digest differs from the coordinator's")
                yield blob, off, data, (sha.hex() if off + len(data) >= end else None)
                off += len(data)


def _fetch(
    stub, md, fingerprint: str, node: str, blobs: Sequence[str], address: str, first_offset: int = 0
) -> Iterator[tuple[str, int, bytes, str | None]]:
    """Chunks of `blobs` in order, blobs[0] from `first_offset`, as the data channel's fetcher yields them, over
    the gRPC Fetch stream; a corrupt chunk restarts the stream at that chunk."""
    return _restarting(
        lambda todo, first: _fetch_once(stub, md, fingerprint, node, todo, address, first),
        blobs,
        first_offset,
        f"the coordinator at {address}",
    )


def _fetch_once(
    stub, md, fingerprint: str, node: str, blobs: tuple[str, ...], address: str, first_offset: int
) -> Iterator[tuple[str, int, bytes, str | None]]:
    """One Fetch stream: yields checked chunks until the blobs end; _Corrupt at a bad one."""
    call = stub.Fetch(
        convert.fetch_request_to_proto(FetchSpec(fingerprint, blobs, node, first_offset)),
        metadata=md,
    )
    try:
        for msg in call:
            c = convert.chunk_from_proto(msg)
            if zlib.crc32(c.data) != c.crc32:
                raise _Corrupt(c.blob, c.offset, "crc32")
            yield c.blob, c.offset, c.data, (c.sha256 if c.last else None)
    except grpc.RpcError as exc:
        raise UnavailableError(
            f"shipping from the coordinator at {address} stopped: "
            f"{exc.code().name}: {exc.details()}"
        ) from None
    finally:
        call.cancel()  # a no-op once the stream has ended; else the coordinator stops sending
